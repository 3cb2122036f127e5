"""What a retrain flow run will do, resolved from the config and the stage table before any work.

The steps are :func:`vpo.pipeline.graph.plan`'s (the stages ``dvc.yaml`` declares, in order); each
runs as ``dvc repro --single-item <variant>-<label>`` when DVC manages the pipeline (the repository's
own ``pipelines.yaml`` with a current ``dvc.yaml``), else as the ``vpo stage`` CLI. Overrides
(``--set`` / the flow's ``overrides`` parameter) change settings that ``dvc.yaml``'s stages read from
``params.yaml``, so a run with overrides uses the CLI (and says so).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vpo.pipeline.config import PipelineConfig, load_pipeline
from vpo.pipeline.graph import plan
from vpo.pipeline.layout import RunLayout

__all__ = ["Plan", "StageStep", "artifact_slug", "make_plan"]


@dataclass(frozen=True)
class StageStep:
    """One stage task: its label, its DVC stage name, the ``vpo stage`` arguments and its outputs."""

    label: str
    dvc_stage: str
    argv: tuple[str, ...]
    outputs: tuple[str, ...]
    run_id: str | None = None


@dataclass(frozen=True)
class Plan:
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


def _dvc_yaml_stages(path: Path) -> set[str]:
    """Stage names declared in a dvc.yaml (``name`` and ``name@key`` for dict-valued ``foreach``)."""
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    names: set[str] = set()
    for name, body in (data.get("stages") or {}).items():
        foreach = body.get("foreach") if isinstance(body, dict) else None
        if isinstance(foreach, dict):
            names.update(f"{name}@{key}" for key in foreach)
        elif isinstance(foreach, list):
            names.update(f"{name}@{i}" for i in range(len(foreach)))
        else:
            names.add(name)
    return names


def make_plan(pipeline: str = "route", quick: bool = False, config: str | os.PathLike[str] = "pipelines.yaml",
              overrides: dict[str, Any] | None = None) -> Plan:
    """Load the pipeline (one clear ConfigError on a bad file or override) and decide DVC vs CLI mode."""
    config_path = Path(config).expanduser().resolve()
    overrides = dict(overrides or {})
    cfg: PipelineConfig = load_pipeline(pipeline, config_path, quick=quick, overrides=overrides)
    repo = config_path.parent
    layout = RunLayout.of(cfg)
    steps = []
    for step in plan(cfg):
        if not step.stage.in_dvc:
            continue
        argv = ["stage", step.stage.name, *cfg.cli_args()]
        if step.run is not None:
            argv += ["--arm", step.run.arm.name, "--seed", str(step.run.seed)]
        steps.append(StageStep(step.label, step.dvc_name(cfg.variant), tuple(argv),
                               tuple(str(p) for p in layout.outputs(step.stage.name, step.rid)), step.rid))
    dvc_yaml = repo / "dvc.yaml"
    use_dvc, note = False, "no dvc.yaml stages for this pipeline: stages run as `vpo stage`"
    if config_path.name == "pipelines.yaml" and dvc_yaml.is_file() and (repo / ".dvc").is_dir():
        declared = _dvc_yaml_stages(dvc_yaml)
        wanted = [s.dvc_stage for s in steps]
        missing = [name for name in wanted if name not in declared]
        if len(missing) < len(wanted) and missing:
            raise RuntimeError(
                f"{dvc_yaml} is stale for pipeline {cfg.name!r}: it lacks stages {missing}; "
                f"run `vpo dvc` and commit dvc.yaml and params.yaml"
            )
        if not missing and overrides:
            note = ("overrides " + ", ".join(f"{k}={v!r}" for k, v in overrides.items()) + " change settings "
                    "that dvc.yaml's stages read from params.yaml: stages run as `vpo stage --set ...`")
        elif not missing:
            use_dvc, note = True, "DVC stages (`dvc repro --single-item`): DVC's lock decides what re-runs"
    remote = cfg.resolve_url(cfg.storage.dvc_remote) if cfg.storage.dvc_remote else None
    return Plan(
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
    )
