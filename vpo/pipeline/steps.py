"""The stage table: every stage of a pipeline, what it reads and writes, in run order.

``vpo run``, the CLI's stage list and help, ``dvc.yaml`` (:mod:`vpo.pipeline.dvc.generate` renders it), the
Prefect flow's run and the benchmarks all read this table, so a stage is added or changed here and
nowhere else. ``params`` are keys of :meth:`PipelineConfig.settings` (``arm`` is the run's own arm);
``code`` lists the files whose content the output depends on (the task's own file is added): both feed
the stage's fingerprint (:mod:`vpo.pipeline.engine.state`) and its DVC deps.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vpo.pipeline.config import PipelineConfig
from vpo.pipeline.config.layout import ArmRun, arm_runs

if TYPE_CHECKING:
    from vpo.pipeline.engine.context import StageContext

__all__ = ["STAGES", "Stage", "Step", "stage", "steps_of"]

_LIB = ("vpo/rewards.py", "vpo/answers.py", "vpo/tasks/__init__.py")
_ADVANTAGES = ("vpo/advantages/__init__.py", "vpo/advantages/batching.py", "vpo/advantages/estimators.py",
               "vpo/advantages/registry.py", "vpo/advantages/weights.py")


@dataclass(frozen=True)
class Stage:
    """One stage: its function and what it depends on. The function is ``run`` of
    ``vpo/pipeline/stages/<name>.py`` unless given, imported when the stage runs (:meth:`call`):
    deciding that a stage is up to date imports no ML library."""

    name: str
    summary: str
    run: Callable[[StageContext], dict[str, Any]] | None = None
    inputs: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    code: tuple[str, ...] = ()
    per_run: bool = False
    cached: bool = True
    optional: bool = False
    in_dvc: bool = True
    volatile: tuple[str, ...] = ()
    scratch: tuple[str, ...] = ()
    models: bool = False

    # volatile: names in the output that downstream stages do not read (timings, logs, plots): left out
    # of the output's content digest, so a re-run with the same result does not re-run what follows.
    # scratch: resume state inside the output, deleted once the output is recorded.
    # models: the stage loads models (transformers, datasets): their own progress bars and console
    # handlers are switched off before it works.

    def call(self, ctx: StageContext) -> dict[str, Any]:
        """Run the stage's function on ``ctx``; returns its summary."""
        if self.models:
            from vpo.pipeline.engine.console import quiet_libraries

            quiet_libraries()
        run = self.run or importlib.import_module(f"vpo.pipeline.stages.{self.name}").run
        result: dict[str, Any] = run(ctx)
        return result

    @property
    def code_files(self) -> tuple[str, ...]:
        """The stage's module, the shared library files and its own dependencies."""
        return (f"vpo/pipeline/stages/{self.name}.py", *_LIB, *self.code)


STAGES: tuple[Stage, ...] = (
    Stage("data", "build the dataset version from the task, validate it (great_expectations), write parquet",
          params=("task", "dataset"), code=("vpo/pipeline/validation.py",), volatile=("validation.json",)),
    Stage("rewards", "score reference answers into reward vectors and validate them",
          inputs=("data",), params=("seed", "task", "dataset"), code=("vpo/pipeline/validation.py",),
          volatile=("validation.json",)),
    Stage("base", "the starting policy: the embedded model trained by SFT, or a hub/local model",
          params=("seed", "task", "model", "sft"), code=("vpo/sft.py", "vpo/tiny.py"),
          volatile=("summary.json", "sft_metrics.json"), models=True),
    Stage("train", "train one arm run (estimator x seed) from the base; resumes from checkpoints",
          inputs=("data", "rewards", "base"), params=("task", "trainer", "arm"),
          code=("vpo/pipeline/config/settings.py", "vpo/pipeline/config/fields.py", "vpo/trainer_fields.py",
                "vpo/pipeline/engine/checkpoints.py", "vpo/pipeline/engine/policy.py", "vpo/distributed_save.py",
                "vpo/trainer.py", *_ADVANTAGES, "vpo/metrics.py", "vpo/shared_prefix.py", "vpo/decoding.py"),
          per_run=True, volatile=("progress.json", "live", "tensorboard", "metrics.json", "history.json"),
          scratch=("trainer",), models=True),
    Stage("evaluate", "best@k, pass@k, E_w[best@k], diversity of the base and every arm run",
          inputs=("data", "base", "train"),
          params=("task", "arms", "trainer.max_completion_length", "trainer.model_init_kwargs", "evaluation"),
          code=("vpo/evaluate.py", "vpo/generation.py", "vpo/shared_prefix.py", "vpo/decoding.py", "vpo/metrics.py",
                "vpo/pipeline/engine/policy.py"),
          volatile=("metrics.json", "summary.json", "curves.json", "table.md", "best_at_k.png",
                    "learning_curves.png"), models=True),
    Stage("search", "evolutionary search (and best-of-k) with each arm's first-seed checkpoint",
          inputs=("data", "evaluate", "train"),
          params=("seed", "task", "arms", "trainer.max_completion_length", "trainer.model_init_kwargs",
                  "evaluation.split", "evaluation.max_problems", "evaluation.use_vllm", "search"),
          code=("vpo/search/__init__.py", "vpo/search/loop.py", "vpo/search/database.py", "vpo/search/proposer.py",
                "vpo/search/runner.py", "vpo/search/baselines.py", "vpo/search/curves.py", "vpo/generation.py",
                "vpo/shared_prefix.py", "vpo/decoding.py", "vpo/evaluate.py", "vpo/metrics.py",
                "vpo/pipeline/engine/policy.py"),
          optional=True, scratch=("checkpoints",), models=True),
    Stage("register", "register every arm checkpoint (content hash, lineage, metrics) in the registry",
          inputs=("train", "evaluate"), params=("storage",),
          code=("vpo/pipeline/registry/__init__.py", "vpo/pipeline/registry/entries.py",
                "vpo/pipeline/registry/store.py", "vpo/pipeline/registry/versions.py", "vpo/pipeline/registry/hub.py"),
          cached=False, in_dvc=False),
)


def stage(name: str) -> Stage:
    """The stage called ``name``; a KeyError lists the stages."""
    for s in STAGES:
        if s.name == name:
            return s
    raise KeyError(f"unknown stage {name!r}; stages: {', '.join(s.name for s in STAGES)}")


@dataclass(frozen=True)
class Step:
    """One stage instance of a pipeline's steps: a stage, and for the train stage one arm run."""

    stage: Stage
    run: ArmRun | None = None

    @property
    def label(self) -> str:
        """``data``, ``train@vpo-s0``: the step's name in logs, the flow and DVC stage names."""
        return f"{self.stage.name}@{self.run.rid}" if self.run else self.stage.name

    @property
    def rid(self) -> str | None:
        return self.run.rid if self.run else None

    def dvc_name(self, variant: str) -> str:
        """The step's DVC stage name: ``<variant>-<label>``."""
        return f"{variant}-{self.label}"


def search_enabled(cfg: PipelineConfig) -> bool:
    """Whether the pipeline defines an enabled search."""
    return cfg.search is not None and cfg.search.enabled


def steps_of(cfg: PipelineConfig, names: Sequence[str] | None = None, *, search: bool = True) -> list[Step]:
    """The steps to run for ``cfg``, in order: every stage (or only ``names``), one train step per arm
    run; the optional search stage only when enabled in the config and ``search`` is true."""
    wanted = set(names) if names is not None else None
    if wanted is not None:
        for n in wanted:
            stage(n)  # unknown names fail with the list of stages
    steps: list[Step] = []
    for s in STAGES:
        if wanted is not None and s.name not in wanted:
            continue
        if s.optional and wanted is None and not (search and search_enabled(cfg)):
            continue
        steps += [Step(s, r) for r in arm_runs(cfg)] if s.per_run else [Step(s)]
    return steps
