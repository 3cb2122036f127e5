"""Generate ``dvc.yaml`` and ``params.yaml`` from ``pipelines.yaml`` and the stage table.

``vpo dvc`` rewrites both files; ``vpo dvc --check`` exits 1 when a committed one differs from what
``pipelines.yaml`` and :mod:`vpo.pipeline.steps` imply (a test runs the same check).

* Only the *declared* variants are in both files (:data:`DEFAULT_VARIANTS`: ``route-quick``; ``vpo dvc
  --add route`` declares the full main job): DVC reports on what is in use, never on dozens of stages
  of a variant nobody runs through it (``vpo run`` runs any variant without DVC).
* ``params.yaml`` holds what each declared variant sets (the ``quick:`` preset merged, arms keyed by
  name, the trainer's pipeline defaults; not the ~200 TRL defaults behind them), written so that DVC's
  own rewrite of one value (``dvc exp run -S route-quick.trainer.max_steps=8``) changes that line only:
  block style as DVC writes it, no nulls, no long strings (the description stays in ``pipelines.yaml``). DVC stages read their settings from it, so an experiment runs without rewriting
  the commented ``pipelines.yaml``; ``generated_from`` records which ``pipelines.yaml`` settings it was
  made from, and a stage refuses to run from a stale file.
* ``dvc.yaml`` has one stage per step of each variant's plan (``<variant>-<stage>``, the train stage as
  ``<variant>-train@<arm>-s<seed>``). Each command is ``bin/vpo stage NAME --variant V``: the launcher
  finds the project's interpreter whatever ``PATH`` holds. Deps are the stage's code files and its
  inputs' outputs, params its settings' keys that the variant sets (a train run only its own arm's).
  Outs are the stage's
  output folders, ``persist: true``: DVC never deletes them before a stage runs (the stage itself
  replaces an output atomically, resumes a matching checkpoint and discards other ones), so a ``dvc
  repro`` that meets a running ``vpo`` process's lock loses nothing.
* Metrics (each variant's small ``eval/summary.json``) and plots (best@k curves per arm, the best@k
  PNG, DVCLive training curves) are declared at top level, and so is each arm run's final model as a
  model artifact (``dvc artifacts get . route-quick-vpo-s0``; GTO versions and stages name it too).
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
    PipelineConfig,
    load_pipeline,
    load_yaml,
    pipeline_names,
    read_text,
)
from vpo.pipeline.config.layout import RunLayout, arm_runs
from vpo.pipeline.dvc.params import PARAMS_FILE, settings_digest, variant_settings
from vpo.pipeline.engine.console import command
from vpo.pipeline.engine.state import CODE_ROOT
from vpo.pipeline.steps import Step, steps_of

__all__ = ["DEFAULT_VARIANTS", "LAUNCHER", "declared_variants", "dvc_yaml_text", "generate", "main",
           "params_yaml_text", "variants"]

DEFAULT_VARIANTS: tuple[str, ...] = ("route-quick",)
"""The variants a fresh ``dvc.yaml`` declares: the embedded default's quick preset, which ``make quick``,
CI and the flow tests run. ``vpo dvc --add route`` declares the full main job too, ``--remove`` drops
one: ``dvc.yaml`` declares what is in use, so ``dvc status``, ``dvc metrics show`` and ``dvc exp show``
speak only of it. The choice is kept in ``params.yaml`` (its ``generated_from`` keys)."""

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
# The DVC stage graph of the declared variants of the embedded default pipeline `route` (`vpo dvc
# --add route` declares the full main job beside the quick preset). Every command is the `vpo stage`
# CLI through bin/vpo, so `dvc repro` works offline without Prefect and without an activated
# virtualenv; the Prefect flow runs the same stages with `dvc repro --single-item`. Reproduce:
#   dvc repro route-quick-evaluate     # quick preset (minutes on a CPU)
#   dvc exp run -S route-quick.trainer.max_steps=8 route-quick-evaluate    # an experiment
#   dvc metrics show; dvc plots show   # plots render offline (.dvc/plots/offline.html)
"""
_PARAMS_HEADER = """\
# GENERATED from pipelines.yaml by `vpo dvc`: what each DVC-managed variant sets (quick presets
# merged, arms keyed by name, the trainer's pipeline defaults; every other setting is TRL's or the
# schema's default). DVC stages read them from here, so an experiment can change one without
# touching pipelines.yaml:  dvc exp run -S route-quick.trainer.max_steps=8
# A setting the variant does not set yet is added with a +: -S +route-quick.trainer.top_p=0.9 (any
# GRPOConfig field; an arm's own value wins over the trainer's: +route-quick.arms.vpo.learning_rate=2e-4).
# Edit pipelines.yaml for lasting changes and regenerate; generated_from makes stale files an error.
"""


def declared_variants(config: str | Path = DEFAULT_PATH) -> list[str]:
    """The variants the ``params.yaml`` beside ``config`` was generated for (what ``dvc.yaml`` declares),
    else :data:`DEFAULT_VARIANTS`."""
    path = Path(config).resolve().parent / PARAMS_FILE
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return list(DEFAULT_VARIANTS)
    names = list((data.get("generated_from") or {}) if isinstance(data, dict) else [])
    return names or list(DEFAULT_VARIANTS)


def variants(config: str | Path = DEFAULT_PATH, names: Sequence[str] | None = None) -> list[PipelineConfig]:
    """The loaded configs of the variants ``names`` (default: :func:`declared_variants`), in the order
    of ``pipelines.yaml`` (full before quick). An unknown variant is a ValueError listing the known ones."""
    from vpo.pipeline.config.names import variant_name

    wanted = list(declared_variants(config) if names is None else names)
    pipeline_names(config)  # a file that is not valid YAML or not a pipelines file: one ConfigError
    raw = load_yaml(read_text(Path(config)))
    known = {}
    for name, body in (raw.get("pipelines") or {}).items():
        known[variant_name(name, False)] = (name, False)
        if (body or {}).get("quick") is not None:
            known[variant_name(name, True)] = (name, True)
    unknown = [v for v in wanted if v not in known]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; variants of {config}: {', '.join(known)}")
    return [load_pipeline(known[v][0], config, quick=known[v][1]) for v in known if v in wanted]


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
    """The stage's settings as keys of the variant's params.yaml entry: only keys the entry has (DVC
    refuses a missing one; a setting left at its default is code, hashed as a dependency)."""
    entry = variant_settings(cfg)
    keys = []
    for key in step.stage.params:
        if key == "arm":  # the run's own arm: what it sets (its seeds are under runs.<arm>)
            keys.append(f"{cfg.variant}.arms.${{item.arm}}")
            continue
        node: Any = entry
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            keys.append(f"{cfg.variant}.{key}")
        if key == "arms" and "runs" in entry:  # every arm, and which runs it has
            keys.append(f"{cfg.variant}.runs")
    return [{PARAMS_FILE: keys}]


def _input_paths(cfg: PipelineConfig, layout: RunLayout, step: Step) -> list[str]:
    from vpo.pipeline.steps import stage as stage_named

    paths: list[str] = []
    for up in step.stage.inputs:
        if stage_named(up).per_run:
            paths += [p.as_posix() for r in arm_runs(cfg) for p in layout.outputs(up, r.rid)]
        else:
            paths += [p.as_posix() for p in layout.outputs(up)]
    return paths


def _artifacts(cfg: PipelineConfig, layout: RunLayout) -> dict[str, Any]:
    """One DVC model artifact per arm run: its final model folder (``dvc artifacts get . NAME``; GTO
    versions and stages name it too). ``meta`` says where the run's metrics, lineage and git revision
    are recorded: values that change with every run would make this generated file stale."""
    from vpo.pipeline.registry.entries import artifact_name
    from vpo.pipeline.steps import stage

    train = stage("train")
    out = {}
    for r in arm_runs(cfg):
        out[artifact_name(cfg.variant, r.rid)] = {
            "path": layout.arm_model(r.rid).as_posix(), "type": "model",
            "desc": f"{cfg.variant}: the {r.arm.name} arm ({r.arm.estimator} advantages, num_answers {r.arm.num_answers}), "
                    f"seed {r.seed}: final model of `dvc repro {Step(train, r).dvc_name(cfg.variant)}`",
            "labels": list(dict.fromkeys([cfg.name, r.arm.name, r.arm.estimator])),
            "meta": {"metrics": {"file": layout.eval_metrics.as_posix(), "key": f"runs.{r.rid}",
                                 "train": layout.arm_metrics(r.rid).as_posix()},
                     "lineage": {"stage": Step(train, r).dvc_name(cfg.variant), "base": layout.base.as_posix(),
                                 "data": layout.data.as_posix(), "registry": cfg.storage.registry},
                     "git_rev": "the commit a GTO version tag <name>@vX.Y.Z points at (`gto show <name>`)"}}
    return out


def _variant(cfg: PipelineConfig) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """Stages, metrics and plots of one variant."""
    layout = RunLayout.relative(cfg)
    v = cfg.variant
    stages: dict[str, Any] = {}
    for step in steps_of(cfg):
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
        {f"{v}-train-{pid}": {"template": "runs", "x": "step",
                              "y": {(layout.arm_live(r.rid) / "plots" / "metrics" / tsv).as_posix(): field
                                    for r in arm_runs(cfg)},
                              "title": f"{v}: training {pid.replace('-', ' ')}"}}
        for pid, tsv, field in _TRAIN_CURVES
    ]
    return stages, metrics, plots


def generate(config: str | Path = DEFAULT_PATH, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The dvc.yaml mapping for the variants ``names`` (default: the declared ones) of ``config``."""
    stages: dict[str, Any] = {}
    metrics: list[Any] = []
    plots: list[Any] = []
    artifacts: dict[str, Any] = {}
    for cfg in variants(config, names):
        s, m, p = _variant(cfg)
        stages.update(s)
        metrics += m
        plots += p
        artifacts.update(_artifacts(cfg, RunLayout.relative(cfg)))
    return {"stages": stages, "metrics": metrics, "plots": plots, "artifacts": artifacts}


def dvc_yaml_text(config: str | Path = DEFAULT_PATH, names: Sequence[str] | None = None) -> str:
    """``dvc.yaml`` as text: the header comment plus :func:`generate` as block YAML."""
    body = yaml.safe_dump(generate(config, names), sort_keys=False, default_flow_style=False, width=120)
    return _DVC_HEADER + body


def params_yaml_text(config: str | Path = DEFAULT_PATH, names: Sequence[str] | None = None) -> str:
    """``params.yaml`` as text: what each declared variant sets, and where it came from. Block style
    throughout (lists too) and no line wrapping: exactly the layout DVC's own YAML round trip (``dvc exp
    run -S``) writes back, so an experiment's diff is the changed line."""
    entries = {cfg.variant: variant_settings(cfg) for cfg in variants(config, names)}
    data = {"generated_from": {v: settings_digest(e) for v, e in entries.items()}, **entries}
    return _PARAMS_HEADER + yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=10_000,
                                           allow_unicode=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or ``--check``) ``dvc.yaml`` and ``params.yaml`` next to the config file."""
    ap = argparse.ArgumentParser(prog="vpo dvc", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=DEFAULT_PATH, help="pipelines.yaml to read")
    ap.add_argument("--check", action="store_true", help="exit 1 if a file differs instead of writing it")
    ap.add_argument("--add", action="append", default=[], metavar="VARIANT",
                    help="declare this variant too (e.g. route: the full main job)")
    ap.add_argument("--remove", action="append", default=[], metavar="VARIANT", help="stop declaring this variant")
    args = ap.parse_args(argv)
    folder = Path(args.config).resolve().parent
    names = [v for v in declared_variants(args.config) if v not in args.remove]
    names += [v for v in args.add if v not in names]
    if not names:
        print("error: no variant left to declare", file=sys.stderr)
        return 2
    try:
        files = {folder / "dvc.yaml": dvc_yaml_text(args.config, names),
                 folder / PARAMS_FILE: params_yaml_text(args.config, names)}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
        print(f"stale: {', '.join(map(str, stale))}; run `{command('dvc')}` and commit them", file=sys.stderr)
        return 1
    if args.check:
        print(f"dvc.yaml and params.yaml are up to date (variants: {', '.join(names)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
