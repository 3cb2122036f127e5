"""A cheaper sampling loop for ``model.generate`` on CPU, plugged in through transformers' own
``generate(custom_generate=decode)``: same inputs, same processed next-token distribution, same output.

A torch profile of one generation round (SmolLM2-135M with LoRA adapters, 4 prompts x 8 rollouts x 48
tokens, one thread) put 41 % of its time in ``torch.cat`` (the dynamic KV cache grows every layer's keys
and values by one token per step: quadratic copying), 34 % in matmuls, 2/3 of them the adapters' small
ones, and ``torch.multinomial`` (one exponential draw per vocabulary entry) cost as much as the LM head.
This loop:

* prefills each distinct prompt once (the rollouts of a GRPO group share it) into a cache allocated for
  the whole round, which each step writes in place (no concatenation);
* lets a finished row leave the batch (transformers runs every row until the last one stops), copying the
  cache down only once a quarter of the rows has finished;
* draws each token by inverse CDF from one uniform number per row (``torch.rand``, the global generator
  as transformers uses it): exactly the distribution ``multinomial`` samples, from another random stream;
* runs LoRA adapters (peft) merged into a temporary copy of their weights: one matmul per layer instead
  of three; the model's own weights are not touched.

Greedy decoding returns transformers' tokens (to float rounding of the merged weights). Anything the loop
does not implement (beam search, stop strings, ``return_dict_in_generate``, multimodal inputs, an
encoder-decoder, logits processors that are not row-wise) runs transformers' own loop instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["decode", "group_prompts", "inverse_cdf_sample", "merged_lora"]

# logits processors that act on each row alone (so rows may leave the batch between steps)
_ROW_WISE = {
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor",
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor", "InfNanRemoveLogitsProcessor", "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor", "LogitNormalization", "ForcedEOSTokenLogitsProcessor",
}
_STOPS = {"MaxLengthCriteria", "EosTokenCriteria"}
_PER_ROW_INPUTS = {"input_ids", "attention_mask", "position_ids", "use_cache", "past_key_values", "logits_to_keep"}


def group_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct prompt, index of each row's distinct prompt), comparing the
    padded ids and masks exactly; order of first appearance."""
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first: dict[int, int] = {}
    for row, u in enumerate(inverse.tolist()):
        first.setdefault(u, row)
    order = sorted(first, key=first.__getitem__)  # distinct prompts in order of first appearance
    remap = torch.empty(len(order), dtype=torch.long)
    remap[torch.tensor(order)] = torch.arange(len(order))
    return torch.tensor([first[u] for u in order], dtype=torch.long), remap[inverse]


def inverse_cdf_sample(probs: torch.Tensor, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs`` (B, V), drawn with probability proportional to its entry: the first
    index whose cumulative sum (float64) exceeds ``u * total`` for a uniform ``u`` per row. A zero entry is
    never drawn."""
    cdf = probs.to(torch.float64).cumsum(-1)
    u = torch.rand(probs.size(0), 1, dtype=torch.float64, device=probs.device) if uniform is None else uniform
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    over = idx >= probs.size(1)  # u * total rounded up to total: the last token with mass
    if bool(over.any()):
        last = probs.size(1) - 1 - (probs[over].flip(-1) > 0).to(torch.int8).argmax(-1)
        idx[over] = last
    return idx


class _MergedLinear(nn.Module):
    """A LoRA layer's base linear with its active adapters folded into a copy of the weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def _mergeable(module: Any) -> bool:
    """A peft LoRA ``Linear`` with plain adapters (no DoRA or other variant, no adapter bias, inactive
    dropout) over an ``nn.Linear``, not merged already."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # peft not installed: nothing to merge
        return False
    if not isinstance(module, LoraLinear) or module.merged or module.disable_adapters:
        return False
    if not isinstance(module.get_base_layer(), nn.Linear) or module.fan_in_fan_out:
        return False
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        dropout = module.lora_dropout[name]
        if (name in getattr(module, "lora_variant", {}) or module.lora_bias.get(name, False)
                or (module.training and not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 0) > 0)):
            return False
    return True


@contextmanager
def merged_lora(model: nn.Module) -> Iterator[int]:
    """While active, every mergeable LoRA layer of ``model`` is replaced in its parent by one linear whose
    weight is ``W + sum of the active adapters' B A * scaling`` (peft's ``get_delta_weight``), computed
    into new tensors; the original modules (and their weights, bit for bit) are put back on exit. Yields
    how many layers were merged."""
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if not name or not _mergeable(module):
                continue
            base = module.get_base_layer()
            weight = base.weight.detach().clone()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight += module.get_delta_weight(adapter).to(weight.dtype)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            swaps.append((parent, child, module))
            setattr(parent, child, _MergedLinear(weight, None if base.bias is None else base.bias.detach()))
    try:
        yield len(swaps)
    finally:
        for parent, child, module in reversed(swaps):
            setattr(parent, child, module)


def _supported(model: Any, logits_processor: Any, stopping_criteria: Any, generation_config: Any,
               model_kwargs: dict[str, Any]) -> bool:
    """Whether :func:`decode` implements this call (else transformers' own loop runs)."""
    gc = generation_config
    if model.config.is_encoder_decoder or getattr(gc, "num_beams", 1) != 1 or gc.return_dict_in_generate:
        return False
    if getattr(gc, "_eos_token_tensor", None) is None and gc.eos_token_id is not None:
        return False
    if any(k not in _PER_ROW_INPUTS and v is not None and v is not False for k, v in model_kwargs.items()):
        return False  # multimodal inputs, inputs_embeds, token types, ...
    cache = model_kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length() > 0:
        return False  # continuing from a cache the caller filled
    if any(type(p).__name__ not in _ROW_WISE for p in logits_processor):
        return False
    return all(type(c).__name__ in _STOPS for c in stopping_criteria)


def _transformers_loop(model: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                       generation_config: Any, model_kwargs: dict[str, Any]) -> Any:
    """The decoding method ``generate`` would have run without ``custom_generate``."""
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    method = GENERATION_MODES_MAPPING[generation_config.get_generation_mode()]
    if "/" in method:  # a mode transformers moved to a Hub repository
        raise ValueError(f"generation mode {method!r} is not available through vpo.decoding.decode; call generate "
                         "without custom_generate")
    return getattr(type(model), method)(model, input_ids, logits_processor=logits_processor,
                                        stopping_criteria=stopping_criteria, generation_config=generation_config,
                                        **model_kwargs)


def _max_length(stopping_criteria: Any, generation_config: Any) -> int:
    for c in stopping_criteria:
        if type(c).__name__ == "MaxLengthCriteria":
            return int(c.max_length)
    return int(generation_config.max_length)


def _static_cache(model: Any, prefix: Any, rows: torch.Tensor, length: int) -> Any:
    """A StaticCache of ``length`` positions per row holding, for every row, its distinct prompt's keys and
    values from ``prefix`` (a filled DynamicCache over the distinct prompts)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    if len(cache.layers) != len(prefix.layers):
        raise ValueError("prefix and static cache disagree on the number of layers")
    for layer, src in zip(cache.layers, prefix.layers):
        keys, values = src.keys.index_select(0, rows), src.values.index_select(0, rows)
        layer.lazy_initialization(keys, values)
        layer.keys[:, :, : keys.size(2)] = keys
        layer.values[:, :, : values.size(2)] = values
        layer.cumulative_length.fill_(keys.size(2))
    return cache


def _keep_rows(cache: Any, keep: torch.Tensor) -> None:
    """Drop the finished rows from every layer of a StaticCache (one copy per layer)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, keep)
        layer.values = layer.values.index_select(0, keep)
        layer.batch_size = int(keep.numel())


@torch.no_grad()
def decode(model: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
           generation_config: Any, **model_kwargs: Any) -> torch.Tensor:
    """The decoding loop ``generate(custom_generate=decode)`` runs: sampling (``do_sample``) or greedy,
    returning the prompt plus the new tokens, finished rows padded with the pad token, as transformers'
    ``_sample`` returns them."""
    if not _supported(model, logits_processor, stopping_criteria, generation_config, model_kwargs):
        return _transformers_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  model_kwargs)
    from transformers import DynamicCache

    gc = generation_config
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    max_new = _max_length(stopping_criteria, gc) - prompt_len
    if max_new <= 0:
        return input_ids
    eos = gc._eos_token_tensor
    eos = None if eos is None else eos.to(device).flatten()
    pad = gc._pad_token_tensor
    pad_id = int(pad) if pad is not None else (int(eos[0]) if eos is not None else 0)
    total = prompt_len + max_new

    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    full_mask = torch.cat([mask, mask.new_ones(batch, max_new)], dim=1)  # later positions: causality masks them
    tokens = input_ids.new_full((batch, total), pad_id)
    tokens[:, :prompt_len] = input_ids
    firsts, rows = group_prompts(input_ids, mask)

    with merged_lora(model):
        prefix = DynamicCache(config=model.config)
        out = model(input_ids=input_ids[firsts], attention_mask=mask[firsts], position_ids=positions[firsts],
                    past_key_values=prefix, use_cache=True, logits_to_keep=1)
        rows = rows.to(device)
        logits = out.logits[:, -1].to(torch.float32).index_select(0, rows)
        cache = _static_cache(model, out.past_key_values, rows, total)
        del out, prefix
        active = torch.arange(batch, device=device)  # the original row of each row in the batch
        done = torch.zeros(batch, dtype=torch.bool, device=device)  # finished, still in the batch until compacted
        next_pos = positions[:, -1] + 1
        end = prompt_len
        for step in range(max_new):
            length = prompt_len + step
            scores = logits_processor(tokens[active, :length], logits)
            if gc.do_sample:
                nxt = inverse_cdf_sample(nn.functional.softmax(scores, dim=-1))
            else:
                nxt = scores.argmax(-1)
            nxt = nxt.masked_fill(done, pad_id)  # a finished row emits padding, as transformers' loop
            tokens[active, length] = nxt
            end = length + 1
            if eos is not None:
                done = done | torch.isin(nxt, eos)
            n_done = int(done.sum())
            if n_done == done.numel() or step + 1 == max_new:
                break
            if n_done * 4 >= done.numel():  # a quarter of the batch finished: those rows leave it
                keep = (~done).nonzero().squeeze(1)
                _keep_rows(cache, keep)
                active, nxt, next_pos, done = active[keep], nxt[keep], next_pos[keep], done[keep]
            logits = model(input_ids=nxt[:, None], attention_mask=full_mask.index_select(0, active),
                           position_ids=next_pos[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
            logits = logits.to(torch.float32)
            next_pos = next_pos + 1
    return _trim(tokens, end, pad_id, prompt_len, eos)


def _trim(tokens: torch.Tensor, end: int, pad_id: int, prompt_len: int, eos: torch.Tensor | None) -> torch.Tensor:
    """The first ``end`` columns, every row padded after its first end-of-sequence token."""
    out = tokens[:, :end].clone()
    if eos is not None and end > prompt_len:
        gen = out[:, prompt_len:]
        is_eos = torch.isin(gen, eos)
        after = (is_eos.cumsum(1) - is_eos.long()) > 0
        gen.masked_fill_(after, pad_id)
    return out
