"""Generate ``dvc.yaml`` from ``pipelines.yaml``: the DVC stage graph of the pipelines run under DVC.

``python -m flows.dvcgen`` rewrites ``dvc.yaml``; ``python -m flows.dvcgen --check`` exits 1 when the
committed file differs from what ``pipelines.yaml`` implies (a test runs the same check). Editing the
arms or seeds of a DVC-managed pipeline therefore means: edit ``pipelines.yaml``, regenerate.

For each pipeline in :data:`DVC_PIPELINES` two variants are emitted, the full one and its ``quick:``
preset, as stages named ``<variant>-<stage>`` (``route-data``, ``route-quick-train@vpo-s0``):

* every command is ``vpo stage NAME --pipeline P [--quick]`` (no Prefect, works offline);
* deps are the stage's code files and upstream outputs, params the ``pipelines.yaml`` keys the stage
  reads (for the quick variant also the matching keys of its ``quick:`` section);
* outs are whole stage folders (``data``, ``rewards``, ``base``, ``arms/<arm>-s<seed>``, ``eval``), all
  cached, so ``dvc pull`` restores a finished run and nothing re-runs; DVC deletes a stage's outs
  before re-running it, so a changed config never resumes from stale trainer checkpoints;
* training depends on the validated reward vectors (``rewards/``): the rewards stage is the second
  great_expectations gate, and ``dvc repro <variant>-evaluate`` runs the whole graph;
* metrics (``eval/metrics.json``, ``base.json``, per-arm ``metrics.json``) and plots (best@k, pass@k,
  E_w[best@k] per arm with the ``.dvc/plots/arms.json`` template, the best@k PNG, DVCLive training
  curves) are declared at top level over files inside those outs.

Imports nothing heavy: only :mod:`vpo.config` and PyYAML.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from vpo.config import PipelineConfig, load_pipeline

__all__ = [
    "DVC_PIPELINES",
    "STAGE_ORDER",
    "dvc_yaml_text",
    "generate",
    "stage_names",
    "variant_name",
]

DVC_PIPELINES: tuple[str, ...] = ("route",)
"""Pipelines whose stages DVC manages (the embedded CPU default). Others run through ``vpo stage``."""

STAGE_ORDER: tuple[str, ...] = ("data", "rewards", "base", "train", "evaluate")
PARAMS_FILE = "pipelines.yaml"

_COMMON_CODE = (
    "vpo/stages.py",
    "vpo/config.py",
    "vpo/storage.py",
    "vpo/tasks/__init__.py",
    "vpo/rewards.py",
    "vpo/answers.py",
)
_STAGE_CODE: dict[str, tuple[str, ...]] = {
    "data": ("vpo/validation.py",),
    "rewards": ("vpo/validation.py",),
    "base": ("vpo/sft.py", "vpo/tiny.py"),
    "train": ("vpo/train.py", "vpo/trainer.py", "vpo/advantages.py", "vpo/metrics.py"),
    "evaluate": ("vpo/evaluate.py", "vpo/generation.py", "vpo/metrics.py"),
}
_STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "data": ("task", "dataset"),
    "rewards": ("seed", "task", "dataset"),
    "base": ("seed", "task", "model", "sft"),
    "train": ("task", "arms", "trainer"),
    "evaluate": ("task", "arms", "trainer.max_completion_length", "evaluation"),
}
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
_HEADER = """\
# GENERATED from pipelines.yaml by `python -m flows.dvcgen` -- edit pipelines.yaml, then regenerate
# (a test fails when this file is stale).
#
# The DVC stage graph of the embedded default pipeline `route` and its quick preset. Every command
# is the plain `vpo stage` CLI, so `dvc repro` works offline without Prefect; the Prefect flow
# (flows/retrain.py) runs the same stages with `dvc repro --single-item`, and DVC's lock decides
# what re-runs. Reproduce:
#   dvc repro route-quick-evaluate     # quick preset (seconds to minutes on a CPU)
#   dvc repro route-evaluate           # full pipeline
#   dvc metrics show; dvc plots show --json
"""


def variant_name(pipeline: str, quick: bool) -> str:
    """``route`` or ``route-quick``: the run folder name and the DVC stage-name prefix."""
    return f"{pipeline}-quick" if quick else pipeline


def stage_names(cfg: PipelineConfig) -> list[tuple[str, str, list[str]]]:
    """(flow label, DVC stage name, ``vpo stage`` arguments) for every stage of ``cfg``, in run order."""
    v = variant_name(cfg.name, cfg.quick)
    quick = ["--quick"] if cfg.quick else []
    out: list[tuple[str, str, list[str]]] = []
    for stage in STAGE_ORDER:
        if stage == "train":
            for arm in cfg.enabled_arms:
                for seed in arm.seeds:
                    rid = f"{arm.name}-s{seed}"
                    out.append(
                        (
                            f"train@{rid}",
                            f"{v}-train@{rid}",
                            ["train", "--pipeline", cfg.name, *quick, "--arm", arm.name, "--seed", str(seed)],
                        )
                    )
        else:
            out.append((stage, f"{v}-{stage}", [stage, "--pipeline", cfg.name, *quick]))
    return out


def _code_deps(cfg: PipelineConfig, stage: str, repo: Path) -> list[str]:
    """The stage's code files: shared modules, the task's module (if it is a file) and stage modules."""
    task_module = f"vpo/tasks/{cfg.task.name}.py"
    task = [task_module] if (repo / task_module).is_file() else []
    return list(dict.fromkeys([*_COMMON_CODE, *task, *_STAGE_CODE[stage]]))


def _params(cfg: PipelineConfig, stage: str, quick_section: dict[str, Any]) -> list[dict[str, list[str]]]:
    """The ``pipelines.yaml`` keys the stage reads (plus their ``quick:`` overrides for the quick variant)."""
    keys = [f"pipelines.{cfg.name}.{k}" for k in _STAGE_PARAMS[stage]]
    if cfg.quick:
        keys += [
            f"pipelines.{cfg.name}.quick.{k}" for k in _STAGE_PARAMS[stage] if _has_key(quick_section, k)
        ]
    return [{PARAMS_FILE: keys}]


def _has_key(mapping: Any, dotted: str) -> bool:
    """Whether the dotted key path exists in nested mappings (DVC fails on params that do not)."""
    for part in dotted.split("."):
        if not isinstance(mapping, dict) or part not in mapping:
            return False
        mapping = mapping[part]
    return True


def _variant(
    cfg: PipelineConfig, repo: Path, quick_section: dict[str, Any]
) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """Stages, metrics and plots of one pipeline variant."""
    v = variant_name(cfg.name, cfg.quick)
    run = f"{cfg.storage.runs_dir.rstrip('/')}/{v}"
    flag = " --quick" if cfg.quick else ""
    runs = [(arm.name, seed, f"{arm.name}-s{seed}") for arm in cfg.enabled_arms for seed in arm.seeds]
    data_deps = [f"{run}/data"]

    def stage(name: str, deps: list[str], outs: list[str], cmd: str | None = None) -> dict[str, Any]:
        return {
            "cmd": cmd or f"vpo stage {name} --pipeline {cfg.name}{flag}",
            "deps": _code_deps(cfg, name, repo) + deps,
            "params": _params(cfg, name, quick_section),
            "outs": outs,
        }

    stages: dict[str, Any] = {
        f"{v}-data": stage("data", [], [f"{run}/data"]),
        f"{v}-rewards": stage("rewards", data_deps, [f"{run}/rewards"]),
        f"{v}-base": stage("base", [], [f"{run}/base", f"{run}/base.json"]),
        f"{v}-train": {
            "foreach": {rid: {"arm": arm, "seed": seed} for arm, seed, rid in runs},
            "do": stage(
                "train",
                [f"{run}/base", *data_deps, f"{run}/rewards"],
                [f"{run}/arms/${{key}}"],
                cmd=f"vpo stage train --pipeline {cfg.name}{flag} --arm ${{item.arm}} --seed ${{item.seed}}",
            ),
        },
        f"{v}-evaluate": stage(
            "evaluate",
            [f"{run}/base", *data_deps, *(f"{run}/arms/{rid}" for *_, rid in runs)],
            [f"{run}/eval"],
        ),
    }
    metrics = [
        f"{run}/eval/metrics.json",
        f"{run}/base.json",
        *(f"{run}/arms/{rid}/metrics.json" for *_, rid in runs),
    ]
    plots: list[Any] = [
        {
            f"{v}-{pid}": {
                "template": "arms",
                "x": "k",
                "y": {f"{run}/eval/curves.json": field},
                "title": f"{v}: {title} per arm, held-out split",
            }
        }
        for pid, field, title in _EVAL_CURVES
    ]
    plots.append(f"{run}/eval/best_at_k.png")
    plots += [
        {
            f"{v}-train-{pid}": {
                "x": "step",
                "y": {f"{run}/arms/{rid}/live/plots/metrics/{tsv}": field for *_, rid in runs},
                "title": f"{v}: training {pid.replace('-', ' ')}",
            }
        }
        for pid, tsv, field in _TRAIN_CURVES
    ]
    return stages, metrics, plots


def generate(config: str | Path = PARAMS_FILE, pipelines: Sequence[str] = DVC_PIPELINES) -> dict[str, Any]:
    """The dvc.yaml mapping for ``pipelines`` (full and quick variants) of the ``config`` file."""
    config = Path(config)
    repo = config.resolve().parent
    raw = yaml.safe_load(config.read_text(encoding="utf-8"))
    stages: dict[str, Any] = {}
    metrics: list[Any] = []
    plots: list[Any] = []
    for name in pipelines:
        quick_section = dict(raw["pipelines"][name].get("quick") or {})
        variants = [False, True] if quick_section else [False]
        for quick in variants:
            cfg = load_pipeline(name, config, quick=quick)
            s, m, p = _variant(cfg, repo, quick_section)
            stages.update(s)
            metrics += m
            plots += p
    return {"stages": stages, "metrics": metrics, "plots": plots}


def dvc_yaml_text(config: str | Path = PARAMS_FILE, pipelines: Sequence[str] = DVC_PIPELINES) -> str:
    """``dvc.yaml`` as text: the header comment plus :func:`generate` as block YAML."""
    body = yaml.safe_dump(generate(config, pipelines), sort_keys=False, default_flow_style=False, width=120)
    return _HEADER + body


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or ``--check``) ``dvc.yaml`` next to the config file."""
    ap = argparse.ArgumentParser(prog="python -m flows.dvcgen", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=PARAMS_FILE, help="pipelines.yaml to read")
    ap.add_argument("--output", default=None, help="dvc.yaml to write (default: next to --config)")
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs instead of writing it")
    args = ap.parse_args(argv)
    out = Path(args.output) if args.output else Path(args.config).resolve().parent / "dvc.yaml"
    text = dvc_yaml_text(args.config)
    if args.check:
        current = out.read_text(encoding="utf-8") if out.is_file() else ""
        if current != text:
            print(f"{out} is stale: run `python -m flows.dvcgen` and commit it", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
