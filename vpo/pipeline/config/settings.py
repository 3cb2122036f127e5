"""From a loaded pipeline to one run's trainer: its VPOConfig keyword arguments, its batch, its LoRA.

:func:`vpo_config_kwargs` is the one mapping from a pipeline's arm to the :class:`vpo.trainer.VPOConfig`
that trains a run: every declared setting as the pipeline resolved it (the arm's value, else the
trainer's, else the declared default), the rollout multiplier applied, and what the pipeline sets
itself (:data:`~vpo.pipeline.config.fields.RESERVED`). :func:`arm_batch` is TRL's batch rule
(:func:`vpo.trl_batch.trl_batch`) for one arm on the world size the run will train on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vpo.trl_batch import Batch, trl_batch

if TYPE_CHECKING:
    from vpo.pipeline.config.layout import ArmRun
    from vpo.pipeline.config.schema import ArmConfig, PipelineConfig

__all__ = ["Zero", "accelerate_processes", "accelerate_settings", "arm_batch", "deepspeed_zero", "distributed_type",
           "peft_config", "run_nodes", "vpo_config_kwargs", "world_size"]


def accelerate_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The mapping in ``trainer.accelerate_config`` (empty: no such setting, or the file cannot be read)."""
    import yaml

    if not cfg.trainer.accelerate_config:
        return {}
    try:
        data = yaml.safe_load(cfg.resolve_path(cfg.trainer.accelerate_config).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Zero:
    """DeepSpeed ZeRO of an accelerate config: its stage and whether it offloads the optimizer / parameters."""

    stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False


def deepspeed_zero(cfg: PipelineConfig, acc: Mapping[str, Any], path: Path) -> Zero:
    """The :class:`Zero` of the DEEPSPEED accelerate config ``acc`` (read from ``path``): its
    ``deepspeed_config`` keys, overridden by the ``zero_optimization`` of its ``deepspeed_config_file``
    (looked for beside the pipeline's file, beside ``path``, then as written). A missing file is a
    :class:`ValueError` naming it."""
    ds = acc.get("deepspeed_config") or {}
    stage = ds.get("zero_stage")
    off_opt, off_par = ds.get("offload_optimizer_device"), ds.get("offload_param_device")
    if ds.get("deepspeed_config_file"):
        ds_path = Path(str(ds["deepspeed_config_file"]))
        for cand in (cfg.resolve_path(ds_path), path.parent / ds_path.name, ds_path.expanduser().resolve()):
            if cand.is_file():
                zero = (json.loads(cand.read_text()).get("zero_optimization") or {})
                stage = zero.get("stage", stage)
                off_opt = (zero.get("offload_optimizer") or {}).get("device", off_opt)
                off_par = (zero.get("offload_param") or {}).get("device", off_par)
                break
        else:
            raise ValueError(f"its deepspeed_config_file {ds['deepspeed_config_file']!r} does not exist")
    return Zero(int(stage or 0), off_opt in ("cpu", "nvme"), off_par in ("cpu", "nvme"))


def _accelerate_int(cfg: PipelineConfig, key: str) -> int | None:
    """A positive integer ``key`` of ``trainer.accelerate_config`` (None: no such file setting, or it names
    none or cannot be read)."""
    value = accelerate_settings(cfg).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def accelerate_processes(cfg: PipelineConfig) -> int | None:
    """Processes one node of a run starts: ``num_processes`` of ``trainer.accelerate_config`` over its
    ``num_machines`` (accelerate counts all machines' processes; None: no file, or it names none)."""
    total = _accelerate_int(cfg, "num_processes")
    return None if total is None else max(1, total // (_accelerate_int(cfg, "num_machines") or 1))


def run_nodes(cfg: PipelineConfig) -> int:
    """Machines one training run spans: ``execution.nodes``, else the accelerate config's ``num_machines``,
    else 1."""
    return cfg.execution.nodes or _accelerate_int(cfg, "num_machines") or 1


def distributed_type(cfg: PipelineConfig) -> str:
    """``distributed_type`` of ``trainer.accelerate_config`` in capitals (DEEPSPEED, FSDP, MULTI_GPU, ...);
    ``NO`` without one."""
    return str(accelerate_settings(cfg).get("distributed_type") or "NO").upper()


def world_size(cfg: PipelineConfig) -> int:
    """Processes one run trains on: the accelerate config's processes per node times the run's nodes with
    ``trainer.accelerate_config`` (1 per node when it names none), else ``WORLD_SIZE`` (torchrun), else 1."""
    if cfg.trainer.accelerate_config:
        return (accelerate_processes(cfg) or 1) * run_nodes(cfg)
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
