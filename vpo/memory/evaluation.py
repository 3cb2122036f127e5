"""Per-device memory of the evaluation phase (the evaluate and search stages): one policy at a time,
sampled on one device, before any model is loaded.

Pure, like :mod:`vpo.memory.estimate`. Terms:

* **weights**: the policy's parameters in the dtype it is sampled in (one policy alive at a time: the
  stage frees each before the next loads).
* with **transformers** ``generate``: the KV cache of the sequences decoded at once (``batch_size``
  sequences: ``batch_size // n`` problems x their ``n`` rollouts, prompt + completion tokens each), one
  layer's prefill working set and attention scores, and the last position's logits (fp32, with their
  softmax and the sampling).
* with **vLLM**: ``gpu_memory_utilization`` of the device, reserved by the one engine alive (weights,
  KV cache, activations and its CUDA context inside it); the plan says how many sequences its KV budget
  holds at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vpo.memory.estimate import CPU_RUNTIME, CUDA_RUNTIME, TIGHT, PlanError, format_bytes
from vpo.memory.shapes import Device, ModelShape

__all__ = ["DTYPE_BYTES", "EvalPlan", "check_evaluation", "format_evaluation", "plan_evaluation"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class EvalPlan:
    """Bytes per device of sampling one policy (:attr:`components`), the peak with the runtime, and notes."""

    model: ModelShape
    device: Device
    dtype: str
    backend: str
    sequences: int
    prompt_tokens: int
    completion_tokens: int
    components: dict[str, int]
    runtime: int
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return sum(self.components.values()) + self.runtime

    @property
    def fits(self) -> bool:
        return self.peak <= self.device.memory

    @property
    def verdict(self) -> str:
        if not self.fits:
            return "does not fit"
        return "fits (tight)" if self.peak > TIGHT * self.device.memory else "fits"


def plan_evaluation(model: ModelShape, *, device: Device, dtype: str, prompt_tokens: int, completion_tokens: int,
                    rollouts: int, problems: int, backend: str = "transformers", batch_size: int = 256,
                    vllm_gpu_memory_utilization: float = 0.9) -> EvalPlan:
    """The plan of sampling ``rollouts`` completions per problem for ``problems`` problems with one policy
    (``batch_size``: sequences per ``generate`` call of :func:`vpo.generation.sample`)."""
    pb = DTYPE_BYTES.get(dtype, 4)
    weights = model.parameters * pb
    seq = prompt_tokens + completion_tokens
    kv_token = model.kv_bytes_per_token(pb)
    notes: list[str] = []
    runtime = CUDA_RUNTIME if device.is_cuda else CPU_RUNTIME
    if backend == "vllm":  # its share counts everything the engine's process holds on the device
        runtime = 0
        reserved = int(vllm_gpu_memory_utilization * device.memory)
        budget = reserved - weights
        concurrent = int(budget // (seq * kv_token)) if budget > 0 else 0
        total = rollouts * problems
        sequences = min(total, concurrent)
        wanted = f"{total:,} to sample" if problems < 10**9 else f"{rollouts} per problem"
        if budget <= 0:
            notes.append(f"vLLM's share ({format_bytes(reserved)}) does not hold the weights "
                         f"({format_bytes(weights)}): raise evaluation.vllm_gpu_memory_utilization")
        else:
            notes.append(f"vLLM's KV budget {format_bytes(budget)} holds {concurrent:,} sequences of {seq:,} tokens "
                         f"at once ({wanted})")
        components = {"vllm": reserved}
        return EvalPlan(model, device, dtype, backend, sequences, prompt_tokens, completion_tokens, components,
                        runtime, notes)
    per_call = max(1, batch_size // rollouts)
    prompts = min(problems, per_call)
    sequences = prompts * rollouts
    kv = sequences * seq * kv_token
    # the shared prompt of a problem's rollouts is prefilled once (vpo.shared_prefix)
    prefill = prompts * prompt_tokens * (3 * model.intermediate_size + 5 * model.q_dim + 4 * model.hidden_size) * pb
    prefill += prompts * prompt_tokens ** 2 * (1 if device.is_cuda else 4)
    logits = sequences * model.vocab_size * 4 * 3
    components = {"weights": weights, "kv cache": kv, "prefill": prefill, "logits": logits}
    notes.append(f"transformers generate: {prompts} problems x {rollouts} rollouts = {sequences} sequences at once")
    return EvalPlan(model, device, dtype, backend, sequences, prompt_tokens, completion_tokens, components, runtime,
                    notes)


def format_evaluation(plan: EvalPlan, label: str = "evaluation") -> str:
    """A readable block like :func:`vpo.memory.format_plan`'s."""
    lines = [(f"{label}: one policy at a time, {plan.dtype}, {plan.backend} on {plan.device.name}; tokens "
             f"{plan.prompt_tokens} prompt + {plan.completion_tokens} completion")]
    lines.append("  per device:")
    for name, value in plan.components.items():
        if value:
            lines.append(f"    {name:<18}{format_bytes(value):>12}")
    if plan.runtime:
        lines.append(f"    {'runtime':<18}{format_bytes(plan.runtime):>12}")
    share = plan.peak / plan.device.memory
    lines.append(f"  peak: {format_bytes(plan.peak)} of {format_bytes(plan.device.memory)} ({share:.0%}): "
                 f"{plan.verdict}")
    lines.extend(f"  note: {n}" for n in plan.notes)
    return "\n".join(lines)


def check_evaluation(plan: EvalPlan, *, label: str = "evaluation") -> EvalPlan:
    """Raise :class:`PlanError` naming what to change when the evaluation does not fit its device."""
    if plan.fits and not (plan.backend == "vllm" and plan.sequences < 1):
        return plan
    if plan.backend == "vllm":
        fix = ("lower evaluation.vllm_gpu_memory_utilization (its share of the GPU)" if not plan.fits else
               "raise evaluation.vllm_gpu_memory_utilization, or a device with more memory")
    else:
        fix = ("set evaluation.use_vllm (its paged KV cache decodes as many sequences as fit) or lower "
               "evaluation.n_samples / the completion length")
    raise PlanError(f"{label}: {format_bytes(plan.peak)} per device, more than {plan.device.name}'s "
                    f"{format_bytes(plan.device.memory)}: {fix}")
