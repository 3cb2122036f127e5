"""Every VPOConfig setting a pipeline may give, declared once: one line for its type, bounds and
default, TRL's help (first sentence) under it.

:class:`VPOConfigFields` is the schema of ``trainer:`` and of each arm (:class:`TrainerConfig` and
:class:`ArmConfig` subclass it): TRL's ``GRPOConfig`` fields, transformers' ``TrainingArguments``
among them (https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOConfig), in the dataclass's order,
then the estimator's own (:class:`vpo.trainer_fields.VPOFields`). A default is TRL's unless
:func:`~vpo.trainer_fields.ours` gives the pipeline's with its reason (:data:`DEFAULTS`); bounds are
what the pipeline needs of a value; a string TRL accepts only a few values of is a ``Literal``. The
fields VPOConfig has and a config may not set are :data:`RESERVED` (the pipeline sets them) and
:data:`OWNED` (the pipeline declares them itself, with its own meaning).

Loading ``pipelines.yaml`` reads this file and never imports TRL. A test holds it against the
installed VPOConfig (:mod:`vpo.pipeline.config.drift`): a field TRL adds, drops or changes fails it
with the line to write here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vpo.trainer_fields import OURS, Float, VPOFields, ours

__all__ = ["DEFAULTS", "OWNED", "RESERVED", "TRL_DOCS", "VPOConfigFields"]

TRL_DOCS = "https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOConfig"
"""Where TRL documents every GRPOConfig field (named in errors and in pipelines.yaml)."""

RESERVED: dict[str, str] = {
    "output_dir": "the pipeline writes checkpoints to runs/<variant>/arms/<run>/trainer",
    "seed": "set per run from arms.<name>.seeds",
    "data_seed": "set per run from arms.<name>.seeds",
    "use_cpu": "set from the machine (CUDA visible or not)",
    "disable_tqdm": "the console shows its own progress bar",
    "resume_from_checkpoint": "the train stage resumes from its newest intact checkpoint itself",
    "local_rank": "set by the launcher",
    "hub_token": "a secret: give it as HF_TOKEN in the environment, never in a file",
    "hub_strategy": "the trainer pushes nothing; push_to_hub uploads the final model at registration",
    "reward_weights": "VPOConfig takes the scalarisation as w_star",
    "peft_config": "set trainer.lora",
}
"""VPOConfig fields the pipeline sets itself (a config that sets one is an error saying why)."""

OWNED: dict[str, str] = {
    "estimator": "arms.<name>.estimator: each arm is one estimator",
    "report_to": "trainer.report_to: TRL's trackers plus dvclive",
    "push_to_hub": "trainer.push_to_hub: the register stage uploads, the trainer pushes nothing",
    "hub_model_id": "trainer.hub_model_id: a prefix, one Hub repo per run",
    "hub_private_repo": "trainer.hub_private_repo: private unless said otherwise",
}
"""VPOConfig fields the pipeline declares itself, with its own meaning (:mod:`vpo.pipeline.config.schema`)."""

LrSchedulerType = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
    "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
    "warmup_stable_decay", "greedy"
]

Optim = Literal[
    "adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused", "adafactor",
    "adamw_anyprecision", "adamw_torch_4bit", "adamw_torch_8bit", "ademamix", "sgd", "adagrad",
    "adamw_bnb_8bit", "adamw_8bit", "ademamix_8bit", "lion_8bit", "lion_32bit", "paged_adamw_32bit",
    "paged_adamw_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit", "paged_lion_32bit",
    "paged_lion_8bit", "rmsprop", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit", "galore_adamw",
    "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise", "lomo", "adalomo", "grokadamw", "schedule_free_radam",
    "schedule_free_adamw", "schedule_free_sgd", "apollo_adamw", "apollo_adamw_layerwise", "stable_adamw"
]

LogLevel = Literal[
    "detail", "debug", "info", "warning", "error", "critical", "passive"
]

TrainSamplingStrategy = Literal[
    "random", "sequential", "group_by_length", "batch_rebalance"
]

DdpBackend = Literal[
    "nccl", "gloo", "mpi", "xccl", "hccl", "cncl", "mccl"
]

Debug = Literal[
    "underflow_overflow", "tpu_metrics_debug"
]


class _TRLFields(BaseModel):
    """TRL's settings: transformers' ``TrainingArguments`` and ``GRPOConfig``'s own, in the dataclass's order."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    per_device_train_batch_size: Annotated[int, Field(ge=1)] = 8
    """The batch size per device for training."""
    num_train_epochs: Float = 3.0
    """Total number of training epochs to perform."""
    max_steps: Annotated[int, Field(gt=0)] = ours(
        100, "the pipeline trains a fixed number of optimizer steps (TRL: -1, i.e. by epochs)")
    """Overrides `num_train_epochs`."""
    learning_rate: Annotated[Float, Field(gt=0)] = ours(5e-4, "sized for the embedded char model (TRL: 1e-6)")
    """The initial learning rate for AdamW."""
    lr_scheduler_type: LrSchedulerType = ours(
        "constant", "the paper trains at a constant learning rate (TRL: linear decay)")
    """The learning rate scheduler type to use."""
    lr_scheduler_kwargs: dict[str, Any] | str | None = None
    """Additional parameters for the lr_scheduler, such as {'num_cycles': 1} for cosine with hard..."""
    warmup_steps: Float = ours(0, "the paper uses no warm-up")
    """Number of steps for a linear warmup from 0 to `learning_rate`."""
    optim: Optim = "adamw_torch_fused"
    """The optimizer to use."""
    optim_args: str | None = None
    """Optional arguments supplied to optimizers such as AnyPrecisionAdamW, AdEMAMix, and GaLore."""
    weight_decay: Float = 0.0
    """Weight decay coefficient applied by the optimizer."""
    adam_beta1: Float = 0.9
    """The exponential decay rate for the first moment estimates (momentum) in Adam-based optimizers."""
    adam_beta2: Float = 0.999
    """The exponential decay rate for the second moment estimates (variance) in Adam-based optimizers."""
    adam_epsilon: Float = 1e-08
    """Epsilon value for numerical stability in Adam-based optimizers."""
    optim_target_modules: list[str] | str | None = None
    """The target modules to optimize."""
    gradient_accumulation_steps: Annotated[int, Field(ge=1)] = 1
    """Number of update steps to accumulate gradients before performing a backward/update pass."""
    average_tokens_across_devices: bool = True
    """Whether or not to average tokens across devices."""
    max_grad_norm: Float = 1.0
    """Maximum gradient norm for gradient clipping."""
    label_smoothing_factor: Float = 0.0
    """Label smoothing factor to prevent overconfidence."""
    bf16: bool | None = ours(False, "float32 unless asked (TRL: bf16 where supported); CPUs train in float32")
    """Whether to use bf16 (mixed) precision instead of 32-bit."""
    fp16: bool = False
    """Enable float16 (FP16) mixed precision training."""
    bf16_full_eval: bool = False
    """Use full BF16 precision for evaluation (not just mixed precision)."""
    fp16_full_eval: bool = False
    """Use full FP16 precision for evaluation (not just mixed precision)."""
    tf32: bool | None = None
    """Enable TF32 mode on Ampere and newer GPUs."""
    activation_checkpointing: bool | None = None
    """Enable activation checkpointing to trade compute for memory."""
    activation_checkpointing_kwargs: dict[str, Any] | str | None = None
    """Keyword arguments passed to `activation_checkpointing_enable()`."""
    gradient_checkpointing: bool = ours(False, "off: on CPU it only costs time (TRL: on); turn it on for big models")
    """Enable gradient checkpointing to trade compute for memory."""
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    """Deprecated alias of `activation_checkpointing_kwargs`, will be removed in v6."""
    torch_compile: bool = False
    """Compile the model using `torch.compile()` for faster training."""
    torch_compile_backend: str | None = None
    """Backend for `torch.compile()`."""
    torch_compile_mode: str | None = None
    """Compilation mode for `torch.compile()`."""
    use_liger_kernel: bool = False
    """Enable Liger Kernel optimizations: transformers patches the model's layers with Liger's..."""
    liger_kernel_config: dict[str, bool] | None = None
    """Configuration for Liger Kernel."""
    use_cache: bool = False
    """Whether or not to use cache for the model For training, this is usually not needed apart..."""
    neftune_noise_alpha: Float | None = None
    """If not None, activates NEFTune noise embeddings."""
    torch_empty_cache_steps: int | None = None
    """Number of steps to wait before calling `torch.<device>.empty_cache()`."""
    auto_find_batch_size: bool = False
    """Whether to find a training batch size that will fit into memory automatically through..."""
    logging_strategy: Literal["no", "steps", "epoch"] = "steps"
    """The logging strategy to adopt during training."""
    logging_steps: Annotated[Float, Field(gt=0)] = ours(
        1, "a log record (and a progress-bar update) every step (TRL: 10)")
    """Log every X updates steps."""
    logging_first_step: bool = False
    """Whether to log the first `global_step` or not."""
    log_on_each_node: bool = True
    """When doing a multinode distributed training, whether to log once per node or just once on..."""
    logging_nan_inf_filter: bool = True
    """Filter out NaN and Inf training and evaluation losses when logging."""
    include_num_input_tokens_seen: bool | str = "no"
    """Whether to track the number of input tokens seen."""
    log_level: LogLevel = "passive"
    """Logging level for the main process."""
    log_level_replica: LogLevel = "warning"
    """Logging level for replica processes in distributed training."""
    run_name: str | None = None
    """An optional descriptor for the run."""
    project: str = "huggingface"
    """The name of the project to use for logging."""
    trackio_space_id: str | None = None
    """Hugging Face Space id for live Gradio-based Trackio logging (read/write Bucket access)."""
    trackio_bucket_id: str | None = None
    """Optional HF Bucket id when using a Trackio Space; if unset, Trackio picks a default."""
    trackio_static_space_id: Literal[False] | str | None = None
    """Static read-only Trackio Space over the Bucket (stable model-card links)."""
    eval_strategy: Literal["no", "steps", "epoch"] = "no"
    """When to run evaluation."""
    eval_steps: Float | None = None
    """Number of update steps between evaluations if `eval_strategy='steps'`."""
    eval_delay: Float = 0
    """Number of epochs or steps to wait for before the first evaluation can be performed,..."""
    per_device_eval_batch_size: int = 8
    """The batch size per device (GPU/TPU core/CPU) for evaluation."""
    prediction_loss_only: bool = False
    """When performing evaluation and generating predictions, only returns the loss."""
    eval_on_start: bool = False
    """Whether to run through the entire `evaluation` step at the very beginning of training as a..."""
    eval_do_concat_batches: bool = True
    """Whether to recursively concat inputs/losses/labels/predictions across batches."""
    eval_use_gather_object: bool = False
    """Whether to run recursively gather object in a nested list/tuple/dictionary of objects from..."""
    eval_accumulation_steps: int | None = None
    """Number of predictions steps to accumulate the output tensors for, before moving the results..."""
    include_for_metrics: list[str] = []
    """Include additional data in the `compute_metrics` function."""
    batch_eval_metrics: bool = False
    """Break eval metrics calculation into batches to save memory."""
    save_only_model: bool = False
    """Save only model weights, not optimizer/scheduler/RNG state."""
    save_strategy: Literal["no", "steps", "epoch", "best"] = "steps"
    """The checkpoint save strategy to adopt during training."""
    save_steps: Annotated[Float, Field(gt=0)] = ours(25, "resume checkpoints every 25 steps (TRL: 500)")
    """Save checkpoint every X updates steps."""
    save_on_each_node: bool = False
    """When doing multi-node distributed training, whether to save models and checkpoints on each..."""
    save_total_limit: Annotated[int, Field(ge=1)] | None = ours(
        2, "resume checkpoints kept while a run trains; all are deleted once it finished")
    """Maximum number of checkpoints to keep."""
    enable_jit_checkpoint: bool = False
    """Enable JIT checkpointing on SIGTERM signal for graceful termination on preemptible workloads."""
    hub_always_push: bool = False
    """Unless `True`, the Trainer will skip pushes if the previous one wasn't finished yet."""
    hub_revision: str | None = None
    """The revision to use when pushing to the Hub."""
    load_best_model_at_end: bool = False
    """Load the best checkpoint at the end of training."""
    metric_for_best_model: str | None = None
    """Metric to use for comparing models when `load_best_model_at_end=True`."""
    greater_is_better: bool | None = None
    """Whether higher metric values are better."""
    ignore_data_skip: bool = False
    """When resuming training, skip fast-forwarding through the dataset to reach the previous state."""
    restore_callback_states_from_checkpoint: bool = False
    """Whether to restore the callback states from the checkpoint."""
    full_determinism: bool = False
    """Whether to call enable_full_determinism instead of set_seed for reproducibility in..."""
    accelerator_config: dict[str, Any] | str | None = None
    """Configuration for the internal Accelerate integration."""
    parallelism_config: None = None
    """Parallelism configuration for the training run."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch if it is not divisible by the batch size."""
    dataloader_num_workers: int = 0
    """Number of subprocesses to use for data loading (PyTorch only)."""
    dataloader_pin_memory: bool = ours(False, "pinning helps only with CUDA and warns on CPU")
    """Whether or not to pin memory for DataLoader."""
    dataloader_persistent_workers: bool = False
    """If True, the data loader will not shut down the worker processes after a dataset has been..."""
    dataloader_prefetch_factor: int | None = None
    """Number of batches loaded in advance by each worker."""
    dataloader_multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = None
    """The multiprocessing start method to use for data loading workers ('fork', 'spawn', or..."""
    dataloader_in_order: bool = True
    """If True (default), the data loader yields batches in the order workers were dispatched."""
    remove_unused_columns: bool | None = False
    """Whether to only keep the column 'prompt' in the dataset."""
    label_names: list[str] | None = None
    """The list of keys in your dictionary of inputs that correspond to the labels."""
    train_sampling_strategy: TrainSamplingStrategy = "random"
    """Sampler for training: 'random' (default), 'sequential', 'group_by_length', or 'batch_rebalance'."""
    length_column_name: str = "length"
    """Column name for precomputed lengths."""
    ddp_find_unused_parameters: bool | None = None
    """When using distributed training, the value of the flag `find_unused_parameters` passed to..."""
    ddp_bucket_cap_mb: int | None = None
    """When using distributed training, the value of the flag `bucket_cap_mb` passed to..."""
    ddp_broadcast_buffers: bool | None = None
    """When using distributed training, the value of the flag `broadcast_buffers` passed to..."""
    ddp_static_graph: bool | None = None
    """When using distributed training, the value of the flag `static_graph` passed to..."""
    ddp_backend: DdpBackend | None = None
    """The backend to use for distributed training."""
    ddp_timeout: int = 1800
    """The timeout for `torch.distributed.init_process_group` calls (in seconds)."""
    fsdp: str | None = None
    """Enable PyTorch Fully Sharded Data Parallel (FSDP) for distributed training."""
    fsdp_config: dict[str, Any] | str | None = None
    """Tuning for FSDP (used only when `fsdp` is enabled)."""
    deepspeed: dict[str, Any] | str | None = None
    """Enable DeepSpeed integration."""
    debug: list[Debug] | str = ""
    """Enable one or more debug features."""
    skip_memory_metrics: bool = True
    """Whether to skip adding memory profiler reports to metrics."""
    do_train: bool = False
    """Whether to run training."""
    do_eval: bool = False
    """Whether to run evaluation."""
    do_predict: bool = False
    """Whether to run predictions on the test set."""
    model_init_kwargs: dict[str, Any] | str | None = None
    """Keyword arguments for `transformers.AutoModelForCausalLM.from_pretrained`, used when the..."""
    trust_remote_code: bool = False
    """Whether to allow loading models and tokenizers that ship custom Python code from the Hub."""
    router_aux_loss_coef: Float | None = None
    """Coefficient of the load-balancing auxiliary loss for Mixture-of-Experts (MoE) models, added..."""
    disable_dropout: bool = False
    """Whether to disable dropout in the model."""
    cast_lm_head_to_fp32: bool = False
    """Whether to cast the language modeling head of the policy and reference models to float32."""
    num_generations: Annotated[int, Field(ge=2)] | None = 8
    """Number of generations to sample."""
    num_generations_eval: int | None = None
    """Number of generations to sample during evaluation."""
    max_completion_length: Annotated[int, Field(gt=0)] | None = ours(
        64, "short answers (TRL: 512); num_answers answers need about num_answers times more")
    """Maximum length of the generated completion."""
    ds3_gather_for_generation: bool = True
    """This setting applies to DeepSpeed ZeRO-3."""
    shuffle_dataset: bool | None = True
    """Whether to shuffle the training dataset."""
    pad_to_multiple_of: int | str | None = "auto"
    """If set, the prompts ids and completions ids will be padded to a multiple of this value."""
    generation_batch_size: Annotated[int, Field(ge=1)] | None = None
    """Batch size to use for generation."""
    steps_per_generation: Annotated[int, Field(ge=1)] | None = None
    """Number of steps per generation."""
    temperature: Annotated[Float, Field(gt=0)] = 1.0
    """Temperature for sampling."""
    top_p: Float = 1.0
    """Float that controls the cumulative probability of the top tokens to consider."""
    top_k: int = 0
    """Number of highest probability vocabulary tokens to keep for top-k-filtering."""
    min_p: Float | None = None
    """Minimum token probability, which will be scaled by the probability of the most likely token."""
    generation_kwargs: dict[str, Any] | str | None = None
    """Additional keyword arguments to pass to `GenerationConfig` (if using transformers) or..."""
    chat_template_kwargs: dict[str, Any] | str | None = None
    """Additional keyword arguments to pass to the `apply_chat_template` function when generating..."""
    repetition_penalty: Float = 1.0
    """Float that penalizes new tokens based on whether they appear in the prompt and the generated..."""
    cache_implementation: str | None = None
    """Implementation of the cache method for faster generation when use_vllm is set to False."""
    use_vllm: bool = False
    """Whether to use vLLM for generating completions."""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """Mode to use for vLLM integration when `use_vllm` is set to `True`."""
    vllm_model_impl: str = "vllm"
    """Model implementation to use for vLLM."""
    vllm_enable_sleep_mode: bool = False
    """Enable vLLM sleep mode to offload weights/cache during the optimizer step."""
    vllm_structured_outputs_regex: str | None = None
    """Regex for vLLM structured outputs."""
    vllm_server_base_url: str | None = None
    """Base URL for the vLLM server (e.g., 'http://localhost:8000')."""
    vllm_server_host: str = "0.0.0.0"
    """Host of the vLLM server to connect to."""
    vllm_server_port: int = 8000
    """Port of the vLLM server to connect to."""
    vllm_server_timeout: Float = 240.0
    """Total timeout duration in seconds to wait for the vLLM server to be up."""
    vllm_group_port: int = 51216
    """Port number for the weight update group."""
    vllm_gpu_memory_utilization: Float = 0.3
    """Control the GPU memory utilization for vLLM."""
    vllm_max_model_length: int | None = None
    """Context window for vLLM."""
    vllm_tensor_parallel_size: int = 1
    """Control the tensor parallel size for vLLM."""
    beta: Annotated[Float, Field(ge=0)] = 0.0
    """KL coefficient."""
    num_iterations: Annotated[int, Field(ge=1)] = 1
    """Number of iterations per batch (denoted as μ in the algorithm)."""
    epsilon: Float = 0.2
    """Epsilon value for clipping."""
    delta: Float | None = None
    """Enables the upper clipping bound in two-sided GRPO loss when set to a float."""
    epsilon_high: Float | None = None
    """Upper-bound epsilon value for clipping."""
    sapo_temperature_neg: Float = 1.05
    """Temperature for tokens with non-positive advantage scores used in the `sapo` loss function."""
    sapo_temperature_pos: Float = 1.0
    """Temperature for tokens with positive advantage scores used in the `sapo` loss function."""
    vespo_k_pos: Float = 2.0
    """k parameter for positive advantages, it is the power exponent in the VESPO loss."""
    vespo_lambda_pos: Float = 3.0
    """lambda parameter for positive advantages, it is the decay factor in the VESPO loss."""
    vespo_k_neg: Float = 3.0
    """k parameter for negative advantages, it is the power exponent in the VESPO loss."""
    vespo_lambda_neg: Float = 2.0
    """lambda parameter for negative advantages, it is the exponential decay factor in the VESPO loss."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Controls whether importance sampling ratios are computed at the `'token'` or `'sequence'` level."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """Method to aggregate multiple reward functions."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Specifies the scaling strategy for rewards."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """Specifies the loss formulation to use."""
    mask_truncated_completions: bool = False
    """When enabled, truncated completions are excluded from the loss calculation, preventing them..."""
    sync_ref_model: bool = False
    """Whether to synchronize the reference model with the active model every..."""
    ref_model_mixup_alpha: Float = 0.6
    """α parameter from the TR-DPO paper, which controls the mix between the current policy and the..."""
    ref_model_sync_steps: int = 512
    """τ parameter from the TR-DPO paper, which determines how frequently the current policy is..."""
    top_entropy_quantile: Float = 1.0
    """ρ parameter from Beyond the 80/20 Rule."""
    entropy_coef: Float = 0.0
    """Coefficient of the entropy regularization term in the loss."""
    use_adaptive_entropy: bool = False
    """Whether to use adaptive entropy control, introduced in Skywork-OR1..."""
    entropy_coef_min: Float = 0.0
    """Lower bound for the entropy coefficient when using adaptive entropy control."""
    entropy_coef_max: Float = 1.0
    """Upper bound for the entropy coefficient when using adaptive entropy control."""
    entropy_coef_delta: Float = 0.005
    """Step size for adjusting the entropy coefficient during adaptive entropy control."""
    entropy_target: Float = 0.2
    """Target mean per-token entropy (nats) for adaptive entropy control."""
    max_tool_calling_iterations: int | None = None
    """Maximum number of tool-calling turns when training an agent."""
    vllm_importance_sampling_correction: bool = True
    """Whether to apply Importance Sampling (IS) to correct for the mismatch between vLLM..."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """Specifies how Importance Sampling (IS) is performed when..."""
    vllm_importance_sampling_clip_max: Float | None = 3.0
    """Importance sampling upper bound C_max used by `vllm_importance_sampling_mode`."""
    vllm_importance_sampling_clip_min: Float | None = None
    """Importance sampling lower bound C_min used by `vllm_importance_sampling_mode`."""
    off_policy_mask_threshold: Float | None = None
    """Threshold for off-policy sequence masking."""
    use_bias_correction_kl: bool = True
    """Whether to multiply the KL term by the importance sampling ratio, so that the KL gradient..."""
    log_completions: bool = False
    """Whether to log a sample of (prompt, completion) pairs every `logging_steps` steps."""
    log_multimodal: bool = True
    """Whether to log multimodal content (images, videos, etc.) together with completions."""
    num_completions_to_print: int | None = None
    """Number of completions to print with `rich`."""
    log_unique_prompts: bool = False
    """Whether to log unique prompts."""
    log_completions_hub_repo: str | None = None
    """Hugging Face Hub repository to save the completions."""
    use_transformers_continuous_batching: bool = False
    """Whether to use transformers' continuous batching engine for generating completions."""
    transformers_continuous_batching_config: dict[str, Any] | str | None = None
    """Keyword arguments for `transformers.generation.ContinuousBatchingConfig`."""
    use_transformers_paged: bool = False
    """Deprecated."""
    vllm_importance_sampling_cap: Float | None = None
    """Deprecated, use `vllm_importance_sampling_clip_max` instead."""


class VPOConfigFields(VPOFields, _TRLFields):
    """Every VPOConfig field a pipeline may set: TRL's, then the estimator's (pydantic puts the fields of
    the last base first)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)


DEFAULTS: dict[str, tuple[Any, str]] = {
    name: (f.default, f.json_schema_extra[OURS]) for name, f in VPOConfigFields.model_fields.items()
    if isinstance(f.json_schema_extra, dict) and OURS in f.json_schema_extra}
"""The defaults the pipeline chose itself, and why (read from the ``ours(...)`` lines): every run's record
names them, even when a pipeline does not set them."""
