"""The one mapping from pipeline settings to :class:`vpo.trainer.VPOConfig` (TRL's ``GRPOConfig`` plus
the estimator's fields) and to the launcher.

``trainer:`` and ``arms:`` in ``pipelines.yaml`` use VPOConfig's own field names, so most settings pass
through unchanged (:data:`DIRECT`). The others are pipeline-only and :data:`DERIVED` says what each one
does instead. A test fails when a schema field is in neither table, or when a direct name is not a
VPOConfig field, so no setting can be validated and then ignored.

Settings that need hardware (``use_vllm``, ``bf16``, ``accelerate_config``) are checked against the
machine before any work by :func:`check_hardware`: one error naming the setting, never silence.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from vpo.pipeline.config import PipelineConfig
from vpo.pipeline.errors import StageError
from vpo.pipeline.layout import ArmRun

__all__ = ["DERIVED", "DIRECT", "FIXED", "check_hardware", "vpo_config_kwargs"]

DIRECT: dict[str, tuple[str, ...]] = {
    "trainer": (
        "max_steps", "learning_rate", "beta", "temperature", "max_completion_length", "num_weights",
        "weight_alpha", "weight_sampler", "loss_type", "use_vllm", "vllm_mode", "vllm_server_base_url",
        "gradient_accumulation_steps", "logging_steps", "save_steps", "save_total_limit", "bf16",
        "truncated_scores_zero", "min_parse_rate", "max_unparsed_steps",
    ),
    "arms": ("estimator", "num_answers", "max_at_k_k", "scale_rewards", "multi_objective_aggregation"),
}
"""Schema fields passed to VPOConfig under the same name (an arm's value for the run's arm)."""

DERIVED: dict[str, str] = {
    "trainer.prompts_per_step": "per_device_train_batch_size = prompts_per_step x the arm's rollouts per prompt",
    "trainer.max_prompt_length": "the train stage checks every tokenized prompt against it (TRL 1.16 has no "
                                 "prompt limit) and names the first row that is longer",
    "trainer.report_to": "'dvclive' logs to the run's live/ folder (our callback, one folder per run); the "
                         "others go to VPOConfig.report_to",
    "trainer.accelerate_config": "the train stage re-runs itself under `accelerate launch --config_file`",
    "trainer.push_to_hub": "the register stage uploads each run's final model to the Hub (vpo.pipeline.hub) when a "
                           "Hugging Face token is available, and says it skipped when none is",
    "trainer.hub_model_id": "the Hub repo of a run: <hub_model_id>-<arm>-s<seed>",
    "trainer.hub_private_repo": "whether the register stage creates those Hub repos private",
    "arms.name": "the run id <name>-s<seed> and the run folder",
    "arms.seeds": "one run per seed: VPOConfig.seed and data_seed",
    "arms.enabled": "disabled arms are not trained, evaluated or registered",
    "arms.num_generations": "VPOConfig.num_generations = num_generations x rollout_multiplier",
    "arms.rollout_multiplier": "VPOConfig.num_generations = num_generations x rollout_multiplier",
    "arms.max_completion_length": "VPOConfig.max_completion_length for this arm (default: the trainer's)",
}
"""Pipeline-only schema fields and how each one acts."""

FIXED: dict[str, Any] = {
    "save_strategy": "steps",
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "gradient_checkpointing": False,
    "dataloader_pin_memory": False,
}
"""VPOConfig values the pipeline always sets (constant learning rate as in the paper; checkpoints by steps)."""


def vpo_config_kwargs(cfg: PipelineConfig, run: ArmRun, output_dir: Path, *, cuda: bool,
                      progress: bool = True) -> dict[str, Any]:
    """Keyword arguments of the :class:`VPOConfig` that trains ``run``."""
    tr, arm = cfg.trainer, run.arm
    kwargs: dict[str, Any] = {name: getattr(tr, name) for name in DIRECT["trainer"]}
    kwargs.update({name: getattr(arm, name) for name in DIRECT["arms"]})
    trackers = [t for t in tr.report_to if t != "dvclive"]
    kwargs.update(
        FIXED,
        output_dir=str(output_dir),
        per_device_train_batch_size=tr.prompts_per_step * arm.rollouts_per_prompt,
        num_generations=arm.rollouts_per_prompt,
        max_completion_length=arm.completion_length(tr),
        seed=run.seed,
        data_seed=run.seed,
        report_to=trackers or "none",
        use_cpu=not cuda,
        disable_tqdm=not progress,
    )
    return kwargs


def check_hardware(cfg: PipelineConfig, *, cuda: bool | None = None) -> None:
    """Fail with one :class:`StageError` naming the setting when the machine cannot honour it."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    tr = cfg.trainer
    where = f"pipeline {cfg.name!r}"
    if tr.use_vllm and importlib.util.find_spec("vllm") is None:
        raise StageError(f"{where}: trainer.use_vllm is true but vLLM is not installed (pip install 'vpo[vllm]', "
                         "GPU machines only); set trainer.use_vllm: false to generate with transformers")
    if tr.use_vllm and not cuda:
        raise StageError(f"{where}: trainer.use_vllm is true but no CUDA GPU is visible; vLLM generation needs "
                         "one (set trainer.use_vllm: false on CPU machines)")
    if cfg.evaluation.use_vllm and importlib.util.find_spec("vllm") is None:
        raise StageError(f"{where}: evaluation.use_vllm is true but vLLM is not installed (pip install "
                         "'vpo[vllm]', GPU machines only); set evaluation.use_vllm: false to sample with transformers")
    if cfg.evaluation.use_vllm and not cuda:
        raise StageError(f"{where}: evaluation.use_vllm is true but no CUDA GPU is visible (set it to false on CPU)")
    if tr.bf16 and not cuda:
        raise StageError(f"{where}: trainer.bf16 is true but no CUDA GPU is visible; CPU training runs in "
                         "float32 (set trainer.bf16: false)")
    if tr.accelerate_config and importlib.util.find_spec("accelerate") is None:
        raise StageError(f"{where}: trainer.accelerate_config is set but accelerate is not installed")
    if tr.accelerate_config and not Path(cfg.resolve_path(tr.accelerate_config)).is_file():
        raise StageError(f"{where}: trainer.accelerate_config {tr.accelerate_config!r} does not exist")
