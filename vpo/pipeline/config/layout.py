"""Where every file of a run lives: the one owner of the run folder layout and the run-id format.

A *variant* is a pipeline with or without its ``quick:`` preset (``route``, ``route-quick``). Its run
folder is ``<storage.runs_dir>/<variant>/``::

    data/        <split>.parquet, validation.json                       stage data
    rewards/     reference.parquet, validation.json                     stage rewards
    base/        model + tokenizer files, summary.json                  stage base
    arms/<arm>-s<seed>/                                                  stage train, one folder per run
                 model/, adapter/ (LoRA), metrics.json, history.json, live/, tensorboard/, progress.json,
                 trainer/ (resume checkpoints; deleted once the run is finished)
    eval/        metrics.json, summary.json, curves.json, table.md,    stage evaluate
                 best_at_k.png, vectors/<run id>.npy
    search/      table.md, curves.json, ... , checkpoints/ (resume)    stage search
    registry.json                                                        stage register
    logs/        <time>-<command>.log: the full log of each `vpo run` / `vpo stage`
    .lock, .locks/                                                       vpo.pipeline.engine.locking

Every stage output folder also holds ``stage.json``: the record of the settings, code and inputs
that produced it (:mod:`vpo.pipeline.engine.state`). Paths are absolute for a loaded config
(:meth:`RunLayout.of`) or relative to the repository for ``dvc.yaml`` (:meth:`RunLayout.relative`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vpo.pipeline.config.names import run_id

if TYPE_CHECKING:
    from vpo.pipeline.config.schema import ArmConfig, PipelineConfig

__all__ = ["STATE_FILE", "ArmRun", "RunLayout", "arm_runs"]

STATE_FILE = "stage.json"


@dataclass(frozen=True)
class ArmRun:
    """One training run: an enabled arm with one of its seeds."""

    arm: ArmConfig
    seed: int

    @property
    def rid(self) -> str:
        """The run id, ``<arm>-s<seed>``."""
        return run_id(self.arm.name, self.seed)


def arm_runs(cfg: PipelineConfig) -> list[ArmRun]:
    """Every enabled arm and seed, in config order."""
    return [ArmRun(arm, seed) for arm in cfg.enabled_arms for seed in arm.seeds]


@dataclass(frozen=True)
class RunLayout:
    """Every path of one variant's run folder."""

    root: Path
    variant: str

    @classmethod
    def of(cls, cfg: PipelineConfig) -> RunLayout:
        """The layout of a loaded config, absolute (``storage.runs_dir`` resolved against the config file)."""
        return cls(cfg.resolve_path(cfg.storage.runs_dir) / cfg.variant, cfg.variant)

    @classmethod
    def relative(cls, cfg: PipelineConfig) -> RunLayout:
        """The same layout relative to the config file's folder (the repository), for ``dvc.yaml``."""
        return cls(Path(cfg.storage.runs_dir) / cfg.variant, cfg.variant)

    # -- stage outputs -------------------------------------------------------------------------
    @property
    def data(self) -> Path:
        return self.root / "data"

    def data_file(self, split: str) -> Path:
        return self.data / f"{split}.parquet"

    @property
    def rewards(self) -> Path:
        return self.root / "rewards"

    @property
    def rewards_file(self) -> Path:
        return self.rewards / "reference.parquet"

    @property
    def base(self) -> Path:
        return self.root / "base"

    @property
    def base_summary(self) -> Path:
        return self.base / "summary.json"

    @property
    def arms(self) -> Path:
        return self.root / "arms"

    def arm(self, rid: str) -> Path:
        """An arm run's folder (``arms/<arm>-s<seed>``)."""
        return self.arms / rid

    def arm_model(self, rid: str) -> Path:
        return self.arm(rid) / "model"

    def arm_adapter(self, rid: str) -> Path:
        """The LoRA adapter of a run trained with ``trainer.lora`` and ``save_adapter`` (``model/`` is
        the merged model)."""
        return self.arm(rid) / "adapter"

    def arm_metrics(self, rid: str) -> Path:
        return self.arm(rid) / "metrics.json"

    def arm_history(self, rid: str) -> Path:
        return self.arm(rid) / "history.json"

    def arm_progress(self, rid: str) -> Path:
        """Written at every logging step while the run trains (the flow polls it)."""
        return self.arm(rid) / "progress.json"

    def arm_live(self, rid: str) -> Path:
        """DVCLive's folder of the run (training curves for ``dvc plots``)."""
        return self.arm(rid) / "live"

    def arm_tensorboard(self, rid: str) -> Path:
        """TensorBoard event files of the run (``trainer.report_to: [tensorboard]``)."""
        return self.arm(rid) / "tensorboard"

    def arm_trainer(self, rid: str) -> Path:
        """The HF Trainer's output folder: resume checkpoints while the run trains."""
        return self.arm(rid) / "trainer"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def eval_metrics(self) -> Path:
        return self.eval / "metrics.json"

    @property
    def eval_summary(self) -> Path:
        """A small flat metrics file (a few numbers per arm) for ``dvc metrics show``."""
        return self.eval / "summary.json"

    @property
    def eval_curves(self) -> Path:
        return self.eval / "curves.json"

    @property
    def eval_table(self) -> Path:
        return self.eval / "table.md"

    @property
    def eval_plot(self) -> Path:
        return self.eval / "best_at_k.png"

    @property
    def eval_learning_plot(self) -> Path:
        """Training curves of every arm (mean over seeds), drawn from the runs' history.json."""
        return self.eval / "learning_curves.png"

    def eval_vectors(self, rid: str) -> Path:
        """The evaluation's reward vectors of one policy, (problems, chains, m, d)."""
        return self.eval / "vectors" / f"{rid}.npy"

    @property
    def search(self) -> Path:
        return self.root / "search"

    @property
    def search_table(self) -> Path:
        return self.search / "table.md"

    @property
    def search_plot(self) -> Path:
        return self.search / "curves.png"

    @property
    def search_checkpoints(self) -> Path:
        return self.search / "checkpoints"

    @property
    def registry_json(self) -> Path:
        return self.root / "registry.json"

    def model_cache(self, name: str) -> Path:
        """A model imported once for every variant of the runs folder (``<runs_dir>/models/<name>``;
        e.g. a GGUF file converted to a Hugging Face folder)."""
        return self.root.parent / "models" / name

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log_file(self, command: str, stamp: str) -> Path:
        """The full log of one ``vpo`` command (``<stamp>-run.log``, ``<stamp>-stage-train@vpo-s0.log``):
        everything the console shows plus library logging, warnings and every training log record."""
        return self.logs / f"{stamp}-{command}.log"

    def outputs(self, stage: str, rid: str | None = None) -> list[Path]:
        """The paths a stage produces (its DVC outs); ``rid`` for the per-run train stage."""
        if stage == "train":
            if rid is None:
                raise ValueError("the train stage's outputs belong to one run id")
            return [self.arm(rid)]
        table = {"data": [self.data], "rewards": [self.rewards], "base": [self.base], "evaluate": [self.eval],
                 "search": [self.search], "register": [self.registry_json]}
        if stage not in table:
            raise KeyError(f"unknown stage {stage!r}")
        return table[stage]

    def state_file(self, stage: str, rid: str | None = None) -> Path:
        """Where the record of what produced a stage's output is kept: inside its output folder, so
        it travels with the output (``dvc pull`` restores both)."""
        out = self.outputs(stage, rid)[0]
        if out.suffix:
            raise ValueError(f"stage {stage!r} writes a single file and keeps no state record")
        return out / STATE_FILE
