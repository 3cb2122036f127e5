"""Time the main job with its training runs one after another and side by side, from fresh clones.

    .venv/bin/python benchmarks/parallel_arms.py            # the main job (`make run`'s `vpo run`)
    .venv/bin/python benchmarks/parallel_arms.py --quick    # the quick preset (`make quick`)

For each mode it clones the repository's committed HEAD into a fresh folder (the checkout's ``.venv``
linked in, so both modes use the same installation and neither pays for `make install`), then runs
``bin/vpo run`` there and times it:

* ``sequential``: ``--set execution.max_parallel=1``;
* ``default``: the derived default (on a 2-core CPU machine with four arms: two at once);
* ``all_cores`` (only with ``--all-cores``): one at a time, each run and search on every core
  (``execution.threads_per_stage`` = the cores): what one at a time costs when it gives up the rule
  that a run's thread count never depends on ``max_parallel``.

One after the other, never at the same time; run it on a quiet machine (other jobs on the cores
make both numbers meaningless). Each training run uses the same number of torch threads in both
modes, and so does each arm's search (vpo/pipeline/engine/execution.py), so their results must be identical:
the script compares every arm's weights (sha256), the evaluation metrics of every policy (without
their wall times) and the search results, and prints both evaluation tables, each stage's time, the
two wall times and their ratio (the target is at most 0.65). ``all_cores`` runs its stages with
another thread count, so its results may differ in the last bits: the script says whether they do
and does not fail on it. ``--out FILE`` also writes the results as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vpo.pipeline.engine.execution import Machine

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sequential": ["--set", "execution.max_parallel=1"], "default": []}


def _clone(dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    venv = ROOT / ".venv"
    if not venv.is_dir():
        raise SystemExit(f"{venv} is missing: run `make install` first")
    (dest / ".venv").symlink_to(venv, target_is_directory=True)


def _run(folder: Path, args: list[str], log: Path) -> float:
    """``bin/vpo run ARGS`` in ``folder``; its wall time in seconds (output to ``log``)."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(["bin/vpo", "run", *args], cwd=folder, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"`bin/vpo run {' '.join(args)}` failed in {folder} (exit {proc.returncode}); see {log}")
    return seconds


def _weights(run: Path) -> dict[str, str]:
    return {p.parent.parent.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run / "arms").glob("*/model/model.safetensors"))}


def _metrics(run: Path) -> dict[str, Any]:
    """Every policy's evaluation metrics without its wall time (``seconds``)."""
    runs = json.loads((run / "eval" / "metrics.json").read_text())["runs"]
    return {rid: {k: v for k, v in m.items() if k != "seconds"} for rid, m in runs.items()}


def _stage_seconds(log: Path) -> dict[str, int]:
    """``{"base": 329, "train@vpo-s0": 200, ...}`` from the console's ``[vpo] X: done in N s`` lines."""
    out = {}
    for line in log.read_text().splitlines():
        m = re.match(r"\[vpo\] (\S+): done in (\d+) s", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the quick preset (make quick) instead of the main job")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/vpo-parallel-arms"), help="where the clones go")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--all-cores", action="store_true",
                    help="also time one at a time with every core per run (execution.threads_per_stage = cores)")
    args = ap.parse_args(argv)
    cores = Machine.detect().cores
    modes = dict(MODES)
    if args.all_cores:
        modes["all_cores"] = ["--set", "execution.max_parallel=1", "--set", f"execution.threads_per_stage={cores}"]
    variant = "route-quick" if args.quick else "route"
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"variant": variant, "machine": f"{platform.machine()}, {cores} cores",
                               "git": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                                     text=True, check=False).stdout.strip(), "modes": {}}
    for mode, extra in modes.items():
        folder = args.workdir / mode
        _clone(folder)
        log = args.workdir / f"{mode}.log"
        run_args = [*(["--quick"] if args.quick else []), *extra]
        print(f"{mode}: bin/vpo run {' '.join(run_args)} in {folder} ...", flush=True)
        seconds = _run(folder, run_args, log)
        run = folder / "runs" / variant
        at_once = next((ln.split("[vpo] ", 1)[1] for ln in log.read_text().splitlines() if "training runs, " in ln),
                       "training runs one after another")
        results["modes"][mode] = {"seconds": round(seconds, 1), "parallelism": at_once, "log": str(log),
                                  "stages": _stage_seconds(log), "weights": _weights(run), "metrics": _metrics(run),
                                  "search": json.loads((run / "search" / "results.json").read_text()),
                                  "table": (run / "eval" / "table.md").read_text(),
                                  "search_table": (run / "search" / "table.md").read_text()}
        print(f"{mode}: {seconds:.1f} s ({at_once})", flush=True)
    seq, par = results["modes"]["sequential"], results["modes"]["default"]
    results["ratio"] = round(par["seconds"] / seq["seconds"], 3)
    results["identical_weights"] = seq["weights"] == par["weights"]
    results["identical_metrics"] = seq["metrics"] == par["metrics"]
    results["identical_search"] = seq["search"] == par["search"]
    for mode in modes:
        r = results["modes"][mode]
        print(f"\n## {mode}: evaluation table\n\n{r['table']}\n## {mode}: search table\n\n{r['search_table']}")
    print("| stage | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes))
    for stage in seq["stages"]:
        print(f"| {stage} | " + " | ".join(f"{results['modes'][m]['stages'].get(stage, '')} s" for m in modes) + " |")
    print(f"\nsequential {seq['seconds']:.1f} s, default {par['seconds']:.1f} s: ratio {results['ratio']:.2f} "
          f"(target <= 0.65); weights identical: {results['identical_weights']}; evaluation identical: "
          f"{results['identical_metrics']}; search identical: {results['identical_search']}")
    if "all_cores" in results["modes"]:
        every = results["modes"]["all_cores"]
        results["ratio_to_all_cores"] = round(par["seconds"] / every["seconds"], 3)
        results["all_cores_identical"] = {k: every[k] == seq[k] for k in ("weights", "metrics", "search")}
        print(f"all_cores (one at a time, {cores} threads per run) {every['seconds']:.1f} s: default/all_cores "
              f"{results['ratio_to_all_cores']:.2f}; the same as sequential: {results['all_cores_identical']}")
    if args.out:
        slim = {**results, "modes": {m: {k: v for k, v in r.items() if k not in ("metrics", "search")}
                                     for m, r in results["modes"].items()}}
        args.out.write_text(json.dumps(slim, indent=2) + "\n")
    return 0 if results["identical_weights"] and results["identical_metrics"] and results["identical_search"] else 1


if __name__ == "__main__":
    sys.exit(main())
