"""What a retrain flow run will do, resolved from the config and the stage table before any work.

The steps are :func:`vpo.pipeline.steps.steps_of`'s (the stages ``dvc.yaml`` declares, in order), in
groups (:meth:`FlowRun.groups`): the arm x seed training runs form one group that runs side by side
(at most :attr:`FlowRun.max_parallel` at once, each in a slot of its own threads and GPUs, see
:mod:`vpo.pipeline.engine.execution`); every other stage is a group of its own. When DVC manages the
pipeline (the repository's own ``pipelines.yaml`` with a current ``dvc.yaml``) a lone stage runs as
``dvc repro --single-item <variant>-<label>``, and the training runs as the commands ``dvc.yaml``
gives them, recorded afterwards with ``dvc commit`` (two ``dvc repro`` in one repository wait for
each other's lock); otherwise every stage runs as the ``vpo stage`` CLI. Overrides (``--set`` / the
flow's ``overrides`` parameter) change settings that ``dvc.yaml``'s stages read from ``params.yaml``,
so a run with overrides uses the CLI (and says so).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vpo.pipeline.config import PipelineConfig, load_pipeline
from vpo.pipeline.config.layout import RunLayout
from vpo.pipeline.dvc.params import settings_digest, variant_settings
from vpo.pipeline.dvc.record import declared_stages
from vpo.pipeline.engine.console import command
from vpo.pipeline.engine.execution import Slot, concurrency
from vpo.pipeline.steps import steps_of

__all__ = ["FlowRun", "StageStep", "artifact_slug", "flow_run"]


@dataclass(frozen=True)
class StageStep:
    """One stage task: its label, its DVC stage name, the ``vpo stage`` arguments and its outputs."""

    label: str
    dvc_stage: str
    argv: tuple[str, ...]
    outputs: tuple[str, ...]
    run_id: str | None = None
    variant_argv: tuple[str, ...] = ()
    arm: str | None = None
    seed: int | None = None

    @property
    def per_run(self) -> bool:
        """A training run (independent of the other training runs)."""
        return self.run_id is not None


@dataclass(frozen=True)
class FlowRun:
    """What a flow run will do, resolved from the config before any work starts."""

    pipeline: str
    quick: bool
    config: Path
    repo: Path
    variant: str
    run_dir: Path
    use_dvc: bool
    steps: tuple[StageStep, ...]
    remote_url: str | None
    remote_name: str
    registry_url: str
    register_argv: tuple[str, ...]
    overrides: dict[str, Any] = field(default_factory=dict)
    mode_note: str = ""
    max_parallel: int = 1
    slots: tuple[Slot, ...] = ()
    parallel_note: str = ""
    settings_digest: str = ""

    def groups(self) -> list[list[StageStep]]:
        """The steps in run order: consecutive training runs together (run side by side), every
        other stage alone."""
        out: list[list[StageStep]] = []
        for step in self.steps:
            if step.per_run and out and out[-1][-1].per_run:
                out[-1].append(step)
            else:
                out.append([step])
        return out

    @property
    def dvc_targets(self) -> list[str]:
        """The DVC stage names of this variant (push targets)."""
        return [s.dvc_stage for s in self.steps]

    def missing_targets(self) -> list[str]:
        """The DVC stages whose outputs are not in the workspace but are recorded in ``dvc.lock``: what
        ``dvc pull`` can restore (outputs that are here stay as they are; ``dvc repro`` decides whether
        they are current; a stage DVC never recorded has nothing to pull)."""
        lock = self.repo / "dvc.lock"
        recorded = set((yaml.safe_load(lock.read_text(encoding="utf-8")) or {}).get("stages") or {}) \
            if lock.is_file() else set()
        return [s.dvc_stage for s in self.steps
                if s.dvc_stage in recorded and not all(Path(p).exists() for p in s.outputs)]


def artifact_slug(text: str) -> str:
    """Artifact-key-safe form of ``text``: lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return re.sub(r"-{2,}", "-", slug) or "vpo"


def flow_run(pipeline: str = "route", quick: bool = False, config: str | os.PathLike[str] = "pipelines.yaml",
              overrides: dict[str, Any] | None = None) -> FlowRun:
    """Load the pipeline (one clear ConfigError on a bad file or override) and decide DVC vs CLI mode."""
    config_path = Path(config).expanduser().resolve()
    overrides = dict(overrides or {})
    cfg: PipelineConfig = load_pipeline(pipeline, config_path, quick=quick, overrides=overrides)
    repo = config_path.parent
    layout = RunLayout.of(cfg)
    steps = []
    for step in steps_of(cfg):
        if not step.stage.in_dvc:
            continue
        argv = ["stage", step.stage.name, *cfg.cli_args()]
        variant_argv = ["stage", step.stage.name, "--variant", cfg.variant, "--config", str(config_path)]
        if step.run is not None:
            run_args = ["--arm", step.run.arm.name, "--seed", str(step.run.seed)]
            argv += run_args
            variant_argv += run_args
        steps.append(StageStep(step.label, step.dvc_name(cfg.variant), tuple(argv),
                               tuple(str(p) for p in layout.outputs(step.stage.name, step.rid)), step.rid,
                               tuple(variant_argv), step.run.arm.name if step.run else None,
                               step.run.seed if step.run else None))
    dvc_yaml = repo / "dvc.yaml"
    use_dvc, note = False, "no dvc.yaml stages for this pipeline: stages run as `vpo stage`"
    if config_path.name == "pipelines.yaml" and dvc_yaml.is_file() and (repo / ".dvc").is_dir():
        declared = declared_stages(dvc_yaml)
        wanted = [s.dvc_stage for s in steps]
        missing = [name for name in wanted if name not in declared]
        if len(missing) < len(wanted) and missing:
            raise RuntimeError(
                f"{dvc_yaml} is stale for pipeline {cfg.name!r}: it lacks stages {missing}; "
                f"run `{command('dvc')}` and commit dvc.yaml and params.yaml"
            )
        if not missing and overrides:
            note = ("overrides " + ", ".join(f"{k}={v!r}" for k, v in overrides.items()) + " change settings "
                    "that dvc.yaml's stages read from params.yaml: stages run as `vpo stage --set ...`")
        elif not missing:
            use_dvc, note = True, "DVC stages (`dvc repro --single-item`): DVC's lock decides what re-runs"
    remote = cfg.resolve_url(cfg.storage.dvc_remote) if cfg.storage.dvc_remote else None
    n_runs = sum(1 for s in steps if s.per_run)
    ex = concurrency(cfg, max(1, n_runs))
    return FlowRun(
        pipeline=cfg.name,
        quick=cfg.quick,
        config=config_path,
        repo=repo,
        variant=cfg.variant,
        run_dir=layout.root,
        use_dvc=use_dvc,
        steps=tuple(steps),
        remote_url=remote,
        remote_name=cfg.storage.dvc_remote_name,
        registry_url=cfg.resolve_url(cfg.storage.registry),
        register_argv=("stage", "register", *cfg.cli_args()),
        overrides=overrides,
        mode_note=note,
        max_parallel=ex.max_parallel,
        slots=tuple(ex.slots()),
        parallel_note=f"{n_runs} training runs, {ex.max_parallel} at once ({ex.reason})",
        settings_digest=settings_digest(variant_settings(cfg)),
    )
