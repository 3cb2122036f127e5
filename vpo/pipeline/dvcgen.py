"""Generate ``dvc.yaml`` and ``params.yaml`` from ``pipelines.yaml`` and the stage table.

``vpo dvc`` rewrites both files; ``vpo dvc --check`` exits 1 when a committed one differs from what
``pipelines.yaml`` and :mod:`vpo.pipeline.graph` imply (a test runs the same check).

* ``params.yaml`` holds the fully resolved settings of each DVC-managed variant (``route``,
  ``route-quick``: the ``quick:`` preset merged, arms keyed by name). DVC stages read their settings
  from it, so ``dvc exp run -S route-quick.trainer.max_steps=8`` changes a run without rewriting the
  commented ``pipelines.yaml``; ``generated_from`` records which ``pipelines.yaml`` settings it was made
  from, and a stage refuses to run from a stale file.
* ``dvc.yaml`` has one stage per step of each variant's plan (``<variant>-<stage>``, the train stage as
  ``<variant>-train@<arm>-s<seed>``). Each command is ``bin/vpo stage NAME --variant V``: the launcher
  finds the project's interpreter whatever ``PATH`` holds. Deps are the stage's code files and its
  inputs' outputs, params its settings' keys (a train run only its own arm's). Outs are the stage's
  output folders, ``persist: true``: DVC never deletes them before a stage runs (the stage itself
  replaces an output atomically, resumes a matching checkpoint and discards other ones), so a ``dvc
  repro`` that meets a running ``vpo`` process's lock loses nothing.
* Metrics (each variant's small ``eval/summary.json``) and plots (best@k curves per arm, the best@k
  PNG, DVCLive training curves) are declared at top level.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from vpo.pipeline.config import (
    DEFAULT_PATH,
    PARAMS_FILE,
    PipelineConfig,
    load_pipeline,
    settings_digest,
    variant_settings,
)
from vpo.pipeline.graph import Step, plan
from vpo.pipeline.layout import RunLayout, arm_runs
from vpo.pipeline.state import CODE_ROOT

__all__ = ["DVC_PIPELINES", "LAUNCHER", "dvc_yaml_text", "generate", "main", "params_yaml_text", "variants"]

DVC_PIPELINES: tuple[str, ...] = ("route",)
"""Pipelines whose stages DVC manages (the embedded CPU default). Others run through ``vpo stage``."""

LAUNCHER = "bin/vpo"
"""The command dvc.yaml runs: a shell launcher that finds the project's Python without ``PATH``."""

_TRAIN_CURVES: tuple[tuple[str, str, str], ...] = (
    ("loss", "loss.tsv", "loss"),
    ("first-answer-reward", "vpo/scalar_first_answer.tsv", "scalar_first_answer"),
    ("best-in-set-reward", "vpo/scalar_best_in_set.tsv", "scalar_best_in_set"),
    ("reward-diversity", "vpo/reward_diversity.tsv", "reward_diversity"),
)
_EVAL_CURVES: tuple[tuple[str, str, str], ...] = (
    ("best-at-k", "best_at_k", "best@k (mean scalar reward of the best of k)"),
    ("expected-weighted-best-at-k", "expected_weighted_best_at_k", "E_w[best@k], w ~ Dirichlet"),
    ("pass-at-k", "pass_at_k", "pass@k"),
)
_DVC_HEADER = """\
# GENERATED from pipelines.yaml by `vpo dvc` -- edit pipelines.yaml, then regenerate (a test fails
# when this file is stale). Settings come from params.yaml (also generated).
#
# The DVC stage graph of the embedded default pipeline `route` and its quick preset. Every command
# is the `vpo stage` CLI through bin/vpo, so `dvc repro` works offline without Prefect and without an
# activated virtualenv; the Prefect flow runs the same stages with `dvc repro --single-item`. Reproduce:
#   dvc repro route-quick-evaluate     # quick preset (minutes on a CPU)
#   dvc repro route-evaluate           # the main job's stages
#   dvc exp run -S route-quick.trainer.max_steps=8 route-quick-evaluate    # an experiment
#   dvc metrics show; dvc plots show
"""
_PARAMS_HEADER = """\
# GENERATED from pipelines.yaml by `vpo dvc`: the resolved settings of each DVC-managed variant
# (quick presets merged, arms keyed by name). DVC stages read them from here, so an experiment can
# change one without touching pipelines.yaml:  dvc exp run -S route-quick.trainer.max_steps=8
# Edit pipelines.yaml for lasting changes and regenerate; generated_from makes stale files an error.
"""


def variants(config: str | Path = DEFAULT_PATH, pipelines: Sequence[str] = DVC_PIPELINES) -> list[PipelineConfig]:
    """The DVC-managed variants: each pipeline, and its quick preset when it has one."""
    raw = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
    out = []
    for name in pipelines:
        out.append(load_pipeline(name, config))
        if (raw["pipelines"][name] or {}).get("quick") is not None:
            out.append(load_pipeline(name, config, quick=True))
    return out


def _code_deps(cfg: PipelineConfig, step: Step) -> list[str]:
    from vpo.tasks import task_source_file

    files = list(step.stage.code_files)
    task_file = task_source_file(cfg.task.name)
    if task_file is not None:
        try:
            files.append(task_file.resolve().relative_to(CODE_ROOT).as_posix())
        except ValueError:
            pass
    return list(dict.fromkeys(files))


def _params(cfg: PipelineConfig, step: Step) -> list[dict[str, list[str]]]:
    keys = []
    for key in step.stage.params:
        keys.append(f"{cfg.variant}.arms.${{item.arm}}" if key == "arm" else f"{cfg.variant}.{key}")
    return [{PARAMS_FILE: keys}]


def _input_paths(cfg: PipelineConfig, layout: RunLayout, step: Step) -> list[str]:
    from vpo.pipeline.graph import stage as stage_named

    paths: list[str] = []
    for up in step.stage.inputs:
        if stage_named(up).per_run:
            paths += [p.as_posix() for r in arm_runs(cfg) for p in layout.outputs(up, r.rid)]
        else:
            paths += [p.as_posix() for p in layout.outputs(up)]
    return paths


def _variant(cfg: PipelineConfig) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """Stages, metrics and plots of one variant."""
    layout = RunLayout.relative(cfg)
    v = cfg.variant
    stages: dict[str, Any] = {}
    for step in plan(cfg):
        if not step.stage.in_dvc:
            continue
        name = f"{v}-{step.stage.name}"
        outs = [{p.as_posix(): {"persist": True}} for p in
                layout.outputs(step.stage.name, "${key}" if step.stage.per_run else None)]
        body = {"cmd": f"{LAUNCHER} stage {step.stage.name} --variant {v}",
                "deps": _code_deps(cfg, step) + _input_paths(cfg, layout, step),
                "params": _params(cfg, step), "outs": outs}
        if step.stage.per_run:
            if name in stages:
                continue
            body["cmd"] += " --arm ${item.arm} --seed ${item.seed}"
            stages[name] = {"foreach": {r.rid: {"arm": r.arm.name, "seed": r.seed} for r in arm_runs(cfg)},
                            "do": body}
        else:
            stages[name] = body
    metrics = [layout.eval_summary.as_posix()]
    plots: list[Any] = [
        {f"{v}-{pid}": {"template": "arms", "x": "k", "y": {layout.eval_curves.as_posix(): field},
                        "title": f"{v}: {title} per arm, held-out split"}}
        for pid, field, title in _EVAL_CURVES
    ]
    plots.append(layout.eval_plot.as_posix())
    plots += [
        {f"{v}-train-{pid}": {"x": "step",
                              "y": {(layout.arm_live(r.rid) / "plots" / "metrics" / tsv).as_posix(): field
                                    for r in arm_runs(cfg)},
                              "title": f"{v}: training {pid.replace('-', ' ')}"}}
        for pid, tsv, field in _TRAIN_CURVES
    ]
    return stages, metrics, plots


def generate(config: str | Path = DEFAULT_PATH, pipelines: Sequence[str] = DVC_PIPELINES) -> dict[str, Any]:
    """The dvc.yaml mapping for ``pipelines`` (full and quick variants) of the ``config`` file."""
    stages: dict[str, Any] = {}
    metrics: list[Any] = []
    plots: list[Any] = []
    for cfg in variants(config, pipelines):
        s, m, p = _variant(cfg)
        stages.update(s)
        metrics += m
        plots += p
    return {"stages": stages, "metrics": metrics, "plots": plots}


def dvc_yaml_text(config: str | Path = DEFAULT_PATH, pipelines: Sequence[str] = DVC_PIPELINES) -> str:
    """``dvc.yaml`` as text: the header comment plus :func:`generate` as block YAML."""
    body = yaml.safe_dump(generate(config, pipelines), sort_keys=False, default_flow_style=False, width=120)
    return _DVC_HEADER + body


def params_yaml_text(config: str | Path = DEFAULT_PATH, pipelines: Sequence[str] = DVC_PIPELINES) -> str:
    """``params.yaml`` as text: each variant's resolved settings and where they came from."""
    entries = {cfg.variant: variant_settings(cfg) for cfg in variants(config, pipelines)}
    data = {"generated_from": {v: settings_digest(e) for v, e in entries.items()}, **entries}
    return _PARAMS_HEADER + yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or ``--check``) ``dvc.yaml`` and ``params.yaml`` next to the config file."""
    ap = argparse.ArgumentParser(prog="vpo dvc", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=DEFAULT_PATH, help="pipelines.yaml to read")
    ap.add_argument("--check", action="store_true", help="exit 1 if a file differs instead of writing it")
    args = ap.parse_args(argv)
    folder = Path(args.config).resolve().parent
    files = {folder / "dvc.yaml": dvc_yaml_text(args.config), folder / PARAMS_FILE: params_yaml_text(args.config)}
    stale = []
    for path, text in files.items():
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        if current == text:
            continue
        if args.check:
            stale.append(path)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(map(str, stale))}; run `vpo dvc` and commit them", file=sys.stderr)
        return 1
    if args.check:
        print("dvc.yaml and params.yaml are up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
