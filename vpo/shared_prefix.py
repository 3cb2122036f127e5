"""One forward pass per distinct prompt: the G rollouts of a GRPO group share their prompt, so its
keys and values are computed once and reused by every rollout, in generation and in the loss.

TRL scores each completion with a forward pass over ``prompt + completion`` and generates each
rollout from its own copy of the prompt, so a prompt of P tokens is processed G times (and G times
again in the backward pass). Here the prompt rows are grouped by their (padded) token ids, the
distinct prompts run once with a KV cache, the cache is indexed out to every row (an index copy,
differentiable), and only the completion tokens run per row. The result is the same computation:
same positions, same attention masks, same log-probabilities and gradients (tested against TRL's
own path), with about ``(P/G + C) / (P + C)`` of the token work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vpo.decoding import decode, group_prompts

__all__ = ["SharedPrefixMixin", "group_prompts", "group_shuffle", "shared_prefix_generate", "shared_prefix_logps",
           "trim_completion_padding"]

# per-completion-token fields of TRL's batch (B, C): cut together with the completion's padding
_PER_TOKEN = ("completion_ids", "completion_mask", "tool_mask", "old_per_token_logps", "ref_per_token_logps",
              "sampling_per_token_logps", "importance_sampling_ratio", "advantages")


def _prefix_cache(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """The KV cache of ``ids`` (distinct prompts without their last token); None when the model's
    cache cannot be indexed per row."""
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "past_key_values", None)
    return cache if hasattr(cache, "batch_select_indices") else None


def shared_prefix_logps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                        *, compute_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities (and entropies) of the last ``logits_to_keep`` tokens of each row,
    as TRL's ``_get_per_token_logps_and_entropies`` computes them with its fused LM head
    (``model(..., labels=..., fused_lm_head=True)``), running each distinct prompt once.

    The prompt part is everything before the last ``logits_to_keep`` tokens; its last token is run
    per row with the completion, so its prediction of the first completion token comes out of the
    same fused head.
    """
    p = input_ids.size(1) - logits_to_keep
    if p < 2:
        raise ValueError("shared_prefix_logps needs prompts of at least 2 tokens")
    firsts, rows = group_prompts(input_ids[:, :p], attention_mask[:, :p])
    rows = rows.to(input_ids.device)
    cache = _prefix_cache(model, input_ids[firsts, : p - 1], attention_mask[firsts, : p - 1])
    if cache is None:
        raise ValueError(f"{type(model).__name__} returns no per-row KV cache; shared prompts need one")
    cache.batch_select_indices(rows)
    tail = input_ids[:, p - 1:]
    labels = tail.masked_fill(attention_mask[:, p - 1:] == 0, -100)
    labels[:, 0] = -100
    out = model(input_ids=tail, attention_mask=attention_mask, past_key_values=cache, labels=labels,
                fused_lm_head=True)
    logps = out.log_probs[:, -logits_to_keep:]
    entropy = out.entropy[:, -logits_to_keep:] if compute_entropy else None
    return logps, entropy


@contextmanager
def shared_prefix_generate(model: Any) -> Iterator[None]:
    """While active, ``model.generate(input_ids=..., attention_mask=...)`` decodes with
    :func:`vpo.decoding.decode`: each distinct prompt is prefilled once and every row continues from a copy
    of its prompt's cache (same tokens greedy, same distribution sampled)."""
    original = model.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        if args or "custom_generate" in kwargs or kwargs.get("past_key_values") is not None:
            return original(*args, **kwargs)
        return original(custom_generate=decode, **kwargs)

    model.generate = generate
    try:
        yield
    finally:
        del model.generate


def group_shuffle(batch: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``shuffle_sequence_dict`` by whole prompt groups: the groups come in a random order
    (``torch.randperm``, the global generator TRL's shuffle uses), each group's rows stay together,
    so a micro-batch holds whole groups and their prompt runs once in it."""
    _, rows = group_prompts(batch["prompt_ids"], batch["prompt_mask"])
    order = torch.randperm(int(rows.max()) + 1)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    permutation = torch.argsort(rank[rows], stable=True)

    def permute(v: Any) -> Any:
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        if isinstance(v, torch.Tensor):
            return v[permutation]
        return [v[i] for i in permutation.tolist()]

    return {key: permute(val) for key, val in batch.items()}


def trim_completion_padding(inputs: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch without the trailing completion columns none of its rows uses: completions are padded to
    the longest of the whole generation round, a micro-batch (one prompt group) often ends earlier. The
    padding is masked out of every loss, so the loss and its gradients are the same and the forward and
    backward passes shorter."""
    mask = inputs["completion_mask"]
    width = mask.size(1)
    used = mask.any(0).nonzero()
    keep = int(used.max()) + 1 if used.numel() else 1
    if keep >= width:
        return inputs
    out = dict(inputs)
    for key in _PER_TOKEN:
        value = inputs.get(key)
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.size(1) == width:
            out[key] = value[:, :keep]
    return out


@contextmanager
def _grouped_shuffle() -> Iterator[None]:
    """While active, TRL's GRPOTrainer shuffles its generation batch by prompt groups."""
    import trl.trainer.grpo_trainer as grpo

    original = grpo.shuffle_sequence_dict
    grpo.shuffle_sequence_dict = group_shuffle
    try:
        yield
    finally:
        grpo.shuffle_sequence_dict = original


_PLAIN_TEXT_ONLY = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class SharedPrefixMixin:
    """For a subclass of TRL's ``GRPOTrainer``: generation and log-probabilities run each distinct
    prompt once (:func:`shared_prefix_generate`, :func:`shared_prefix_logps`) when
    ``args.share_prompt_prefix`` is true and the setting allows it; otherwise TRL's own path.

    The loss of a micro-batch runs without the completion columns none of its rows uses
    (:func:`trim_completion_padding`).

    Within one optimizer step the order of micro-batches does not change the gradient, so when a
    generation round feeds exactly one optimizer step (``steps_per_generation`` equals
    ``gradient_accumulation_steps`` and ``num_iterations`` is 1) the round is shuffled by whole prompt
    groups (:func:`group_shuffle`) instead of by rows, so that each micro-batch shares its prompts.

    TRL's path is kept for: vLLM or continuous-batching generation (they share prefixes themselves),
    gradient checkpointing (no cache in a checkpointed forward), several processes (a DDP/FSDP/
    DeepSpeed-wrapped model must see one forward per backward), multimodal inputs and MoE aux losses.
    """

    def _share_prefix(self) -> bool:
        args = self.args  # type: ignore[attr-defined]
        return (bool(getattr(args, "share_prompt_prefix", False)) and not args.gradient_checkpointing
                and self.accelerator.num_processes == 1)  # type: ignore[attr-defined]

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **multimodal: Any) -> Any:
        if (not self._share_prefix() or compute_aux_loss or any(multimodal.get(k) is not None for k in _PLAIN_TEXT_ONLY)
                or input_ids.size(1) - logits_to_keep < 2):
            return super()._get_per_token_logps_and_entropies(  # type: ignore[misc]
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), size):
            with self.accelerator.autocast():  # type: ignore[attr-defined]
                lp, ent = shared_prefix_logps(model, input_ids[start:start + size],
                                              attention_mask[start:start + size], logits_to_keep,
                                              compute_entropy=compute_entropy)
            logps.append(lp)
            if ent is not None:
                entropies.append(ent)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        if self._share_prefix():
            inputs = trim_completion_padding(inputs)
        return super()._compute_loss(model, inputs)  # type: ignore[misc]

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        args = self.args  # type: ignore[attr-defined]
        if (self._share_prefix() and self.model.training and self.num_iterations == 1  # type: ignore[attr-defined]
                and args.steps_per_generation == args.gradient_accumulation_steps):
            with _grouped_shuffle():
                return super()._prepare_inputs(generation_batch)  # type: ignore[misc]
        return super()._prepare_inputs(generation_batch)  # type: ignore[misc]

    def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if (not self._share_prefix() or self.use_vllm  # type: ignore[attr-defined]
                or getattr(self, "use_transformers_continuous_batching", False)):
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)  # type: ignore[misc]
        target = self.accelerator.unwrap_model(self.model_wrapped)  # type: ignore[attr-defined]
        with shared_prefix_generate(target):
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)  # type: ignore[misc]
