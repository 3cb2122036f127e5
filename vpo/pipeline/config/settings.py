"""From a loaded pipeline to one run's trainer: its VPOConfig keyword arguments, its batch, its LoRA.

:func:`vpo_config_kwargs` is the one mapping from a pipeline's arm to the :class:`vpo.trainer.VPOConfig`
that trains a run: every declared setting as the pipeline resolved it (the arm's value, else the
trainer's, else the declared default), the rollout multiplier applied, and what the pipeline sets
itself (:data:`~vpo.pipeline.config.fields.RESERVED`). :func:`arm_batch` is TRL's batch rule
(:func:`vpo.trl_batch.trl_batch`) for one arm on the world size the run will train on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vpo.trl_batch import Batch, trl_batch

if TYPE_CHECKING:
    from vpo.pipeline.config.layout import ArmRun
    from vpo.pipeline.config.schema import ArmConfig, PipelineConfig

__all__ = ["accelerate_processes", "arm_batch", "peft_config", "vpo_config_kwargs", "world_size"]


def accelerate_processes(cfg: PipelineConfig) -> int | None:
    """``num_processes`` of ``trainer.accelerate_config`` (None: no such file setting, or it names none or
    cannot be read)."""
    import yaml

    if not cfg.trainer.accelerate_config:
        return None
    try:
        data = yaml.safe_load(cfg.resolve_path(cfg.trainer.accelerate_config).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    value = data.get("num_processes") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def world_size(cfg: PipelineConfig) -> int:
    """Processes one run trains on: the accelerate config's ``num_processes`` with
    ``trainer.accelerate_config`` (1 when it names none), else ``WORLD_SIZE`` (torchrun), else 1."""
    if cfg.trainer.accelerate_config:
        return accelerate_processes(cfg) or 1
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def arm_batch(cfg: PipelineConfig, arm: ArmConfig, world: int | None = None) -> Batch:
    """The batch of one run of ``arm`` on ``world`` processes (default :func:`world_size`), its rollout
    multiplier applied; a :class:`ValueError` names the arm and the settings when TRL's rule does not hold."""
    mult = arm.rollout_multiplier
    return trl_batch(per_device_train_batch_size=arm.per_device_train_batch_size * mult,
                     num_generations=arm.rollouts_per_prompt,
                     world_size=world_size(cfg) if world is None else world,
                     gradient_accumulation_steps=arm.gradient_accumulation_steps,
                     generation_batch_size=None if arm.generation_batch_size is None
                     else arm.generation_batch_size * mult,
                     steps_per_generation=arm.steps_per_generation, num_iterations=arm.num_iterations,
                     where=f"arm {arm.name!r}" + (f" (x{mult} rollout_multiplier)" if mult != 1 else ""))


def vpo_config_kwargs(cfg: PipelineConfig, run: ArmRun, output_dir: Path, *, cuda: bool,
                      progress: bool = True) -> dict[str, Any]:
    """Keyword arguments of the :class:`VPOConfig` that trains ``run``: the arm's resolved values
    (:meth:`~vpo.pipeline.config.schema.ArmConfig.vpo_values`), the rollout multiplier applied, and what
    the pipeline sets itself."""
    arm = run.arm
    kwargs = arm.vpo_values()
    mult = arm.rollout_multiplier
    kwargs["estimator"] = arm.estimator
    kwargs["num_generations"] = arm.rollouts_per_prompt
    kwargs["per_device_train_batch_size"] = arm.per_device_train_batch_size * mult
    if arm.generation_batch_size is not None:
        kwargs["generation_batch_size"] = arm.generation_batch_size * mult
    trackers = [t for t in cfg.trainer.report_to if t != "dvclive"]
    kwargs.update(output_dir=str(output_dir), seed=run.seed, data_seed=run.seed, report_to=trackers or "none",
                  use_cpu=not cuda, disable_tqdm=not progress)
    return kwargs


def peft_config(cfg: PipelineConfig) -> Any:
    """The ``peft.LoraConfig`` of ``trainer.lora`` (None without one)."""
    lora = cfg.trainer.lora
    if lora is None:
        return None
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
