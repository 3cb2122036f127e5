"""Per-device memory and throughput plan of one GRPO/VPO optimizer step, before any model is loaded.

Pure functions on plain numbers: the model's shape (from its ``config.json``), the trainer settings
under TRL's ``GRPOConfig`` names, LoRA, the distributed setup (ZeRO stage or FSDP, world size) and the
device. :func:`plan_step` returns every term in bytes per device, the three phases of a step and the
peak; :func:`check` raises :class:`PlanError` naming the setting to change when the peak does not fit.

What the terms model (TRL 1.16, transformers 5, torch 2.x):

* **weights**: parameters in the dtype they are loaded in (``from_pretrained`` keeps the checkpoint's
  dtype). ZeRO-3 and FSDP shard them over the world and gather about two layers at a time; FSDP with
  mixed precision keeps fp32 shards (accelerate upcasts them). LoRA adds fp32 adapters (peft upcasts
  adapters on a bf16/fp16 base) and freezes the base.
* **gradients**: one per trainable parameter in the parameter dtype (fp32 shards under FSDP);
  ZeRO-2/3 and FSDP shard them; DeepSpeed's bf16 optimizer adds an fp32 gradient partition.
* **optimizer**: AdamW's two moments in the parameter dtype (torch keeps them in the dtype of the
  parameter: bf16 weights give bf16 moments and no master copy); DeepSpeed with bf16 keeps fp32
  master weights and fp32 moments, sharded from ZeRO-1 on. 8-bit AdamW: 2 bytes per parameter.
* **activations** of one micro-batch (``per_device_train_batch_size`` sequences of prompt +
  completion tokens): per token and layer the tensors autograd saves in a Llama/Qwen2 decoder
  layer with SDPA attention (q, repeated k and v, the attention output twice, four MLP tensors of
  the intermediate size, two RMSNorms of 12 bytes per hidden unit), or with gradient checkpointing
  the layer's input alone plus one layer recomputed; plus the attention mask and the backward
  pass's working set.
* **logits**: TRL 1.16 never materialises the (tokens x vocabulary) logits in training: its fused
  LM head (``add_fused_lm_head``) projects 4,096-token x 32,768-column tiles and folds them into a
  running log-sum-exp. The term is that tile buffer, the fp32 temporaries of the tile on devices
  without Triton (CPU), the fp32 gradient of the hidden states and, when the LM head trains, its
  fp32 gradient accumulator. On CUDA only completion positions are projected; elsewhere all.
* **kv_cache**: transformers ``generate`` over the local generation batch (``per_device_train_batch_size
  x steps_per_generation`` prompts x their completions) plus one layer of prefill; with vLLM colocated
  instead, ``vllm_gpu_memory_utilization`` of the device is reserved (released while training only
  with ``vllm_enable_sleep_mode``). ZeRO-3 gathers the whole model for transformers generation.
* **runtime**: the CUDA context, cuBLAS workspaces and NCCL buffers (not counted by
  ``torch.cuda.max_memory_allocated``); on CPU the trainer's own allocations beyond the model.

A step has three phases and the plan's peak is the largest: generation (weights, optimizer state,
KV cache), a training micro-step (weights, optimizer state, activations, logits and the gradients
that exist when the backward pass starts: all of them once they persist across micro-steps or in
a distributed wrapper's buffers, else only the LM head's; or, if larger, every gradient at the
backward's end) and the optimizer step (weights, gradients, optimizer state and its temporaries). Throughput: FLOPs per
optimizer step, 2 N per token generated or scored, 6 N per trained token (8 N with gradient
checkpointing, about 4 N with LoRA), plus attention; step time at a stated FLOP/s and utilisation,
with transformers generation bounded by reading the weights once per decoded token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vpo.memory.shapes import Device, GiB, LoraShape, MiB, ModelShape, Parallel, TrainSettings

__all__ = ["CPU_RUNTIME", "CUDA_RUNTIME", "DECODE_FLOOR_PER_LAYER", "TIGHT", "MemoryPlan", "PlanError", "check",
           "format_bytes", "format_plan", "format_seconds", "plan_step"]

TOKEN_TILE = 4096
"""Rows per tile of TRL's fused LM head (``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``)."""
VOCAB_TILE = 32768
"""Vocabulary columns per tile of TRL's fused LM head (``_CHUNKED_LOGPROB_CHUNK_SIZE``)."""
TORCH_TILE_TEMPS = 10
"""fp32 tile-sized temporaries the fused head's torch fallback (no Triton: CPU) holds at once in its
backward pass (measured alone on CPU: about 4 in the forward, 10-11 in the backward for 760-2,000 rows)."""
CUDA_RUNTIME = int(1.0 * GiB)
"""CUDA context + cuBLAS workspaces + NCCL buffers per GPU process (outside the caching allocator)."""
CPU_RUNTIME = int(270 * MiB)
"""TRL's trainer, the dataset, OpenMP and allocator arenas on CPU beyond the model's tensors: peak RSS
of a training run whose tensors are negligible (benchmarks/memory_plan.py, case ``runtime``: 267-268 MiB)."""
DECODE_FLOOR_PER_LAYER = {"transformers": 1.0e-3, "vllm": 1.0e-4}
"""Seconds per decoded token per layer below which generation does not go on a GPU, however small the
model: kernel launches and Python in eager transformers ``generate`` (about 25 ms per step for a
24-layer model), CUDA graphs in vLLM. An assumption, not a measurement made here."""
TIGHT = 0.9
"""A plan above this fraction of the device memory fits but is flagged ``tight``."""


class PlanError(ValueError):
    """The plan does not fit the device: the message names the setting to change."""


# --------------------------------------------------------------------------------------------- plan


@dataclass
class MemoryPlan:
    """Bytes per device for each term (:attr:`components`), per phase (:attr:`phases`), the peak
    with the runtime added, the device, FLOPs and seconds per optimizer step, and notes."""

    model: ModelShape
    settings: TrainSettings
    parallel: Parallel
    device: Device
    lora: LoraShape | None
    components: dict[str, int]
    phases: dict[str, dict[str, int]]
    runtime: int
    trainable: int
    generation_batch_size: int
    steps_per_generation: int
    flops: dict[str, float]
    seconds: dict[str, float]
    notes: list[str] = field(default_factory=list)
    utilisation: float = 0.35

    @property
    def phase_totals(self) -> dict[str, int]:
        return {name: sum(parts.values()) for name, parts in self.phases.items()}

    @property
    def peak_phase(self) -> str:
        totals = self.phase_totals
        return max(totals, key=lambda k: totals[k])

    @property
    def peak(self) -> int:
        """Largest phase plus the runtime: what must fit the device."""
        return self.phase_totals[self.peak_phase] + self.runtime

    @property
    def allocated_peak(self) -> int:
        """The peak without the runtime (comparable with ``torch.cuda.max_memory_allocated``)."""
        return self.phase_totals[self.peak_phase]

    @property
    def fits(self) -> bool:
        return self.peak <= self.device.memory

    @property
    def above_available(self) -> bool:
        """Fits the device but not the memory free at the moment (CPU: RAM other processes hold)."""
        return self.device.available is not None and self.peak > self.device.available

    @property
    def verdict(self) -> str:
        if not self.fits:
            return "does not fit"
        return "fits (tight)" if self.peak > TIGHT * self.device.memory else "fits"

    @property
    def prompts_per_step(self) -> int:
        """Prompts per optimizer step, over all processes."""
        seqs = self.settings.per_device_train_batch_size * self.parallel.world_size \
            * self.settings.gradient_accumulation_steps
        return seqs // (self.settings.num_generations * self.settings.num_iterations) or 1

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())


def _optimizer_bytes_per_param(s: TrainSettings, p: Parallel, trainable_dtype_bytes: int) -> tuple[float, float, str]:
    """(bytes of optimizer state per trainable parameter, bytes of extra fp32 gradient partition per
    parameter, description), before sharding."""
    name = s.optim.lower()
    eight_bit = "8bit" in name
    if p.deepspeed:
        if trainable_dtype_bytes == 4 and not (s.bf16 or s.fp16):
            return 8.0, 0.0, "fp32 AdamW moments (DeepSpeed)"
        return 12.0, 4.0, "fp32 master weights + fp32 AdamW moments (DeepSpeed mixed precision)"
    if name.startswith("sgd"):
        return 0.0, 0.0, "SGD (no state)"
    if eight_bit:
        return 2.0, 0.0, "8-bit AdamW moments"
    return 2.0 * trainable_dtype_bytes, 0.0, ("fp32" if trainable_dtype_bytes == 4 else "bf16") + " AdamW moments"


def plan_step(model: ModelShape, settings: TrainSettings, *, parallel: Parallel | None = None,
              device: Device, lora: LoraShape | None = None, train_mfu: float = 0.35,
              generation_mfu: float = 0.35) -> MemoryPlan:
    """Memory per device and time of one optimizer step (see the module docstring for each term)."""
    p = parallel or Parallel()
    s = settings
    world = p.world_size
    batch = s.batch(world)
    gen_batch, steps_per_gen = batch.completions_per_round, batch.steps_per_generation
    notes: list[str] = []
    pb, cb = s.param_bytes, s.compute_bytes
    n_all = model.parameters
    h, v, layers = model.hidden_size, model.vocab_size, model.num_layers
    shard_params = p.zero_stage == 3 or p.fsdp
    fsdp_fp32 = p.fsdp and (s.bf16 or s.fp16)

    # weights and trainable parameters
    if lora is not None:
        adapters = lora.parameters(model)
        trainable, train_bytes = adapters, 4
        base = n_all * pb / (world if shard_params else 1)
        weights = base + adapters * 4
    else:
        trainable = n_all
        train_bytes = 4 if fsdp_fp32 else pb
        weights = n_all * train_bytes / (world if shard_params else 1)
    gathered = 0.0
    if shard_params:
        gathered = 2 * model.layer_parameters * pb  # the layer computing and the one prefetched
        gathered += model.vocab_size * h * pb if not model.tie_word_embeddings else 0
    if p.offload_params:
        weights, notes = 0.0, notes + ["parameters offloaded to CPU: only gathered layers are on the device"]
    reference = 0.0
    if s.beta > 0 and lora is None:
        reference = n_all * pb / (world if shard_params else 1)
        notes.append(f"beta={s.beta}: a reference model copy (LoRA would reuse the base with adapters off)")

    # gradients and optimizer state
    opt_per, extra_grad, opt_desc = _optimizer_bytes_per_param(s, p, train_bytes)
    grad_shard = world if (p.zero_stage >= 2 or p.fsdp) else 1
    opt_shard = world if (p.zero_stage >= 1 or p.fsdp) else 1
    gradients = trainable * train_bytes / grad_shard + trainable * extra_grad / opt_shard
    optimizer = 0.0 if p.offload_optimizer else trainable * opt_per / opt_shard
    if p.deepspeed and p.zero_stage == 2:
        gradients += min(trainable, 5e8) * train_bytes / world  # reduce bucket
    if lora is None and pb == 2 and not p.deepspeed and not fsdp_fp32 and not s.optim.lower().startswith("sgd"):
        notes.append("16-bit weights without fp32 master copies: updates smaller than bf16's resolution "
                     "(about 0.4% of a weight) are lost; use DeepSpeed/FSDP mixed precision, fp32 weights or LoRA")
    opt_temp = 0.0
    if not p.deepspeed and "fused" not in s.optim.lower() and not s.optim.lower().startswith("sgd"):
        opt_temp = trainable * train_bytes / (world if p.fsdp else 1)  # foreach AdamW: one sqrt copy

    # one training micro-step: activations and the fused LM head
    b, seq = s.per_device_train_batch_size, s.sequence_length
    tokens = b * seq
    per_layer = model.activation_bytes_per_token_layer(cb)
    mask = b * seq * seq * (1 if device.is_cuda else 4)
    if s.gradient_checkpointing:
        activations = layers * tokens * h * cb + tokens * per_layer
    else:
        activations = layers * tokens * per_layer
    activations += tokens * 12 * h + mask + tokens * per_layer + 2 * tokens * h * 4  # final norm, mask, backward
    rows = b * s.max_completion_length if device.is_cuda else b * (seq - 1)
    tile_rows, tile_cols = min(rows, TOKEN_TILE), min(v, VOCAB_TILE)
    head_cb = 4 if s.cast_lm_head_to_fp32 else cb
    logits = tile_rows * tile_cols * (head_cb + (0 if device.is_cuda else 4 * TORCH_TILE_TEMPS))
    logits += rows * h * (head_cb + 4)  # the flattened hidden states and their fp32 gradient
    head_grad = 0.0
    if lora is None:
        logits += v * h * 4  # fp32 gradient accumulator of the LM head weight
        head_grad = v * h * train_bytes  # the LM head's (tied: the embedding's) own gradient

    # generation: transformers generate on the local generation batch, or vLLM's reserved share
    local_gen = gen_batch // world
    kv_cache = 0.0
    vllm = 0.0
    gen_extra = 0.0
    if s.use_vllm and s.vllm_mode == "colocate":
        vllm = s.vllm_gpu_memory_utilization * device.memory
    elif s.use_vllm:
        notes.append("vLLM server mode: generation runs on other GPUs (not planned here)")
    else:
        kv_cache = local_gen * seq * model.kv_bytes_per_token(pb)
        prefill = local_gen * s.max_prompt_length
        kv_cache += prefill * (3 * model.intermediate_size + 5 * model.q_dim + 4 * h) * pb  # one layer's prefill
        kv_cache += local_gen * s.max_prompt_length ** 2 * (1 if device.is_cuda else 4)
        kv_cache += local_gen * v * 4 * 3  # last-token logits, their softmax and the sampling
        if p.zero_stage == 3 and s.ds3_gather_for_generation:
            gen_extra = n_all * pb - weights if lora is None else n_all * pb * (1 - 1 / world)
            notes.append("ZeRO-3 gathers the whole model for transformers generation (ds3_gather_for_generation)")
    grads_during_generation = steps_per_gen * s.num_iterations < s.gradient_accumulation_steps
    # A backward pass allocates gradients as it goes: when the LM head's tiles peak (its start) only the
    # head's gradient exists, unless earlier micro-steps' gradients persist (accumulation) or the
    # distributed wrapper keeps gradient buffers; at its end every gradient and one layer's working set.
    persistent = s.gradient_accumulation_steps > 1 or world > 1 or p.deepspeed or p.fsdp
    start = activations + logits + (gradients if persistent else head_grad)
    end = gradients + tokens * per_layer
    train_parts = ({"gradients": int(gradients if persistent else head_grad), "activations": int(activations),
                    "logits": int(logits)} if start >= end
                   else {"gradients": int(gradients), "activations": int(tokens * per_layer)})

    components = {"weights": int(weights + gathered), "reference model": int(reference),
                  "gradients": int(gradients), "optimizer": int(optimizer), "activations": int(activations),
                  "logits": int(logits), "kv cache": int(kv_cache + gen_extra), "vllm": int(vllm)}
    static = {"weights": int(weights), "reference model": int(reference), "optimizer": int(optimizer)}
    phases = {
        "generation": {**static, "kv cache": int(kv_cache + gen_extra), "vllm": int(vllm),
                       "gradients": int(gradients) if grads_during_generation else 0},
        "training": {**static, "gathered layers": int(gathered), **train_parts,
                     "vllm": 0 if s.vllm_enable_sleep_mode else int(vllm)},
        "optimizer step": {**static, "gradients": int(gradients), "optimizer temporaries": int(opt_temp),
                           "vllm": 0 if s.vllm_enable_sleep_mode else int(vllm)},
    }
    runtime = CUDA_RUNTIME if device.is_cuda else CPU_RUNTIME
    notes.insert(0, f"optimizer: {opt_desc}; {trainable:,} trainable of {n_all:,} parameters")

    flops, seconds = _throughput(model, s, p, device, lora, gen_batch, steps_per_gen, train_mfu, generation_mfu)
    return MemoryPlan(model=model, settings=s, parallel=p, device=device, lora=lora, components=components, phases=phases,
                runtime=runtime, trainable=trainable, generation_batch_size=gen_batch,
                steps_per_generation=steps_per_gen, flops=flops, seconds=seconds, notes=notes, utilisation=train_mfu)


def _decode_seconds(model: ModelShape, s: TrainSettings, device: Device, sequences: float) -> float:
    """Memory-bound time to decode ``sequences`` completions on one device: each decode step reads the
    weights once and the KV cache of every sequence in flight, and takes at least
    :data:`DECODE_FLOOR_PER_LAYER` per layer on a GPU. transformers decodes the whole local
    generation batch at once; vLLM as many as its KV budget (its memory share minus its weights) holds."""
    assert device.bandwidth
    weight_bytes = model.parameters * s.param_bytes
    kv_token = model.kv_bytes_per_token(s.param_bytes)
    seq = s.sequence_length
    if s.use_vllm and s.vllm_mode == "colocate":
        budget = s.vllm_gpu_memory_utilization * device.memory - weight_bytes
        concurrent = max(1.0, min(sequences, budget / (seq * kv_token))) if budget > 0 else 1.0
    else:
        concurrent = max(1.0, sequences)
    waves = math.ceil(sequences / concurrent)
    ctx = s.max_prompt_length + s.max_completion_length / 2
    per_step = (weight_bytes + concurrent * ctx * kv_token) / device.bandwidth
    if device.is_cuda:
        engine = "vllm" if s.use_vllm else "transformers"
        per_step = max(per_step, DECODE_FLOOR_PER_LAYER[engine] * model.num_layers)
    return waves * s.max_completion_length * per_step


def _throughput(model: ModelShape, s: TrainSettings, p: Parallel, device: Device, lora: LoraShape | None,
                gen_batch: int, steps_per_gen: int, train_mfu: float, gen_mfu: float) -> tuple[dict[str, float],
                                                                                                dict[str, float]]:
    """FLOPs per optimizer step over all processes (generation, training, extra scoring passes) and
    the seconds per step on ``device`` x world size."""
    world = p.world_size
    trained = s.per_device_train_batch_size * world * s.gradient_accumulation_steps  # sequences per step
    generated = trained / s.num_iterations
    pl, cl = s.max_prompt_length, s.max_completion_length
    # generation: prefill the prompt, then one token at a time attending to the growing context
    gen_flops = generated * (pl * model.forward_flops_per_token(pl / 2, lm_head=False)
                             + cl * model.forward_flops_per_token(pl + cl / 2))
    head_rows = cl if device.is_cuda else pl + cl - 1
    fwd = trained * ((pl + cl) * model.forward_flops_per_token((pl + cl) / 2, lm_head=False)
                     + head_rows * 2.0 * model.vocab_size * model.hidden_size)
    backward = 1.0 if lora is not None else 2.0  # LoRA: input gradients only (adapter weights are negligible)
    passes = 1.0 + backward + (1.0 if s.gradient_checkpointing else 0.0)
    train_flops = fwd * passes
    extra = 0.0
    generate_every = steps_per_gen * s.num_iterations
    if s.gradient_accumulation_steps % generate_every or s.use_vllm:
        extra += fwd / s.num_iterations  # old log-probs recomputed once per generation
    if s.beta > 0:
        extra += fwd / s.num_iterations  # reference model log-probs
    flops = {"generation": gen_flops, "training": train_flops, "scoring": extra}
    seconds: dict[str, float] = {}
    if device.flops:
        total = device.flops * world
        decode = gen_flops / (total * gen_mfu)
        if device.bandwidth:
            decode = max(decode, _decode_seconds(model, s, device, generated / world))
        seconds = {"generation": decode, "training": (train_flops + extra) / (total * train_mfu)}
    return flops, seconds


# ---------------------------------------------------------------------------------------- checking


def _advice(plan: MemoryPlan, prefix: str) -> str:
    """The setting to change for the largest movable term of the peak phase."""
    s, p = plan.settings, plan.parallel
    parts = plan.phases[plan.peak_phase]
    order = sorted(parts, key=lambda k: parts[k], reverse=True)
    b = f"{prefix}per_device_train_batch_size (now {s.per_device_train_batch_size})"
    for name in order:
        if name == "activations":
            if not s.gradient_checkpointing:
                return f"lower {b} or set {prefix}gradient_checkpointing: true"
            return (f"lower {b} (raise {prefix}gradient_accumulation_steps to keep the batch) or "
                    f"{prefix}max_completion_length (now {s.max_completion_length})")
        if name == "logits":
            return f"lower {b}"
        if name == "kv cache":
            local = plan.generation_batch_size // p.world_size
            return (f"lower the generation batch ({local} sequences per process: {prefix}steps_per_generation, now "
                    f"{plan.steps_per_generation}) or {prefix}max_completion_length (now {s.max_completion_length}), "
                    f"or generate with vLLM ({prefix}use_vllm: true)")
        if name == "vllm":
            return (f"lower {prefix}vllm_gpu_memory_utilization (now {s.vllm_gpu_memory_utilization}) or set "
                    f"{prefix}vllm_enable_sleep_mode: true")
        if name in ("weights", "gradients", "optimizer", "reference model", "optimizer temporaries"):
            if plan.lora is None:
                shard = "ZeRO-3" if p.zero_stage < 3 else "more processes"
                return (f"train LoRA adapters ({prefix}lora) or shard the model with {shard} "
                        f"({prefix}accelerate_config: infra/accelerate/deepspeed_zero3.yaml)")
            return "use a device with more memory or a smaller model (the frozen base alone does not fit)"
    return f"lower {b}"


def check(plan: MemoryPlan, *, label: str = "", prefix: str = "") -> MemoryPlan:
    """Return ``plan`` if it fits its device, else raise :class:`PlanError` with the peak, the device
    memory, the largest terms and the setting to change (``prefix`` is prepended to setting names)."""
    if plan.fits:
        return plan
    parts = plan.phases[plan.peak_phase]
    top = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3] if v)
    raise PlanError(f"{label + ': ' if label else ''}the memory plan needs {format_bytes(plan.peak)} per device in the "
                    f"{plan.peak_phase} phase ({top}) but {plan.device.name} has {format_bytes(plan.device.memory)}; "
                    f"{_advice(plan, prefix)}")


# --------------------------------------------------------------------------------------- reporting


def format_bytes(n: float) -> str:
    """``12.3 GiB`` / ``456 MiB``."""
    return f"{n / GiB:.1f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


def format_seconds(sec: float) -> str:
    return f"{sec:.2f} s" if sec < 60 else f"{sec / 60:.1f} min"


def format_plan(plan: MemoryPlan, label: str = "") -> str:
    """A readable block: settings, per-term bytes per device, phases, peak vs device, throughput."""
    s, p, m = plan.settings, plan.parallel, plan.model
    n = m.parameters
    count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    lines = [(f"{label or m.name}: {m.name or m.model_type} ({count} parameters, {s.param_dtype}"
              f"{', bf16 autocast' if s.bf16 else ''}), {p.describe()} on {plan.device.name}")]
    lora = f", LoRA r={plan.lora.r} on {len(plan.lora.target_modules)} projections" if plan.lora else ""
    seqs = "sequence" if s.per_device_train_batch_size == 1 else "sequences"
    lines.append(f"  batch: {s.per_device_train_batch_size} {seqs} per micro-step x {s.gradient_accumulation_steps} "
                 f"accumulation x {p.world_size} process{'es' if p.world_size != 1 else ''} = {plan.prompts_per_step} prompts x {s.num_generations} "
                 f"generations per optimizer step; generation batch {plan.generation_batch_size} "
                 f"({plan.steps_per_generation} micro-step{'s' if plan.steps_per_generation != 1 else ''} per round); tokens {s.max_prompt_length} prompt + "
                 f"{s.max_completion_length} completion; gradient checkpointing "
                 f"{'on' if s.gradient_checkpointing else 'off'}{lora}")
    lines.append("  per device:")
    for name, value in plan.components.items():
        if value:
            lines.append(f"    {name:<18}{format_bytes(value):>12}")
    lines.append(f"    {'runtime':<18}{format_bytes(plan.runtime):>12}")
    totals = plan.phase_totals
    lines.append("  phases: " + ", ".join(f"{k} {format_bytes(v + plan.runtime)}" for k, v in totals.items()))
    share = plan.peak / plan.device.memory
    avail = plan.device.available
    now = f", {format_bytes(avail)} available now" if avail is not None else ""
    lines.append(f"  peak: {format_bytes(plan.peak)} ({plan.peak_phase}) of {format_bytes(plan.device.memory)}{now} "
                 f"({share:.0%}): {plan.verdict}" + ("; more than is free now" if plan.above_available else ""))
    tf = sum(plan.flops.values())
    if plan.seconds:
        per = plan.device.flops or 0
        fl, sec = plan.flops, plan.seconds
        lines.append(f"  compute: {tf / 1e12:.1f} TFLOP per optimizer step (generation {fl['generation'] / 1e12:.1f}, "
                     f"training {fl['training'] / 1e12:.1f}, scoring {fl['scoring'] / 1e12:.1f}); at "
                     f"{per / 1e12:.3g} TFLOP/s x {p.world_size} and {plan.utilisation:.0%} utilisation: about "
                     f"{format_seconds(plan.step_seconds)} per step (generation {format_seconds(sec['generation'])}"
                     f", training {format_seconds(plan.seconds['training'])}; estimated)")
    else:
        lines.append(f"  compute: {tf / 1e12:.2f} TFLOP per optimizer step (no FLOP/s known for this device)")
    lines.extend(f"  note: {n}" for n in plan.notes)
    return "\n".join(lines)


