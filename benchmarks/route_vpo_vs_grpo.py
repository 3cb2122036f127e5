"""VPO vs GRPO on the embedded route task over several RL seeds.

Runs the `route` pipeline's stages (data, rewards, base, train, evaluate) with the arms' seeds
overridden, then prints the table of best@k and E_w[best@k] per arm (mean ± std over seeds),
reward-space diversity and how many runs collapsed to one strategy, and writes it next to the plot.

    python benchmarks/route_vpo_vs_grpo.py --seeds 0 1 2 [--quick] [--runs-dir runs/bench]

Stages whose outputs answer the same settings, code and inputs are skipped (each says so), so a
rerun with one more seed trains only the new runs, and ``--stages evaluate search`` re-evaluates and
searches an earlier run's checkpoints without retraining.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

from vpo.pipeline.cli import parse_overrides
from vpo.pipeline.config import load_pipeline
from vpo.pipeline.config.layout import RunLayout
from vpo.pipeline.runner import run_all
from vpo.pipeline.steps import STAGES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pipeline", default="route")
    ap.add_argument("--config", default="pipelines.yaml")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs-dir", default="runs/bench", help="where this benchmark's run folder goes")
    ap.add_argument("--fresh", action="store_true", help="delete an earlier benchmark run folder first")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    names = [s.name for s in STAGES if s.name != "register"]
    ap.add_argument("--stages", nargs="+", default=names, choices=names,
                    help="stages to run (search: evolutionary search with each arm's first-seed checkpoint)")
    args = ap.parse_args()

    base = load_pipeline(args.pipeline, args.config, quick=args.quick)
    overrides: dict[str, object] = {"storage.runs_dir": args.runs_dir}
    for arm in base.arms:
        overrides[f"arms.{arm.name}.seeds"] = list(args.seeds)
    overrides.update(parse_overrides(args.set))
    cfg = load_pipeline(args.pipeline, args.config, quick=args.quick, overrides=overrides)
    layout = RunLayout.of(cfg)
    if args.fresh:
        shutil.rmtree(layout.root, ignore_errors=True)
    t0 = time.time()
    run_all(cfg, stages=args.stages)
    minutes = (time.time() - t0) / 60
    out = layout.eval
    metrics = json.loads(layout.eval_metrics.read_text())
    table = layout.eval_table.read_text()
    stages_arg = "" if args.stages == ap.get_default("stages") else " --stages " + " ".join(args.stages)
    report = (f"# route: VPO vs GRPO, RL seeds {args.seeds}\n\n"
              f"command: `python benchmarks/route_vpo_vs_grpo.py --seeds {' '.join(map(str, args.seeds))}"
              f"{' --quick' if args.quick else ''}{stages_arg}`  \n"
              f"held-out problems: {metrics['n_problems']}, candidates per problem: {metrics['n_samples']}, "
              f"wall time: {minutes:.1f} min\n\n{table}\n![best@k]({layout.eval_plot.resolve()})\n")
    search_table = layout.search_table
    if "search" in args.stages and search_table.is_file():
        report += "\n## Search (first seed of each arm)\n\n" + search_table.read_text()
    (out / "benchmark.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
