"""Running each distinct prompt once gives TRL's log-probabilities, entropies, gradients and samples."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from vpo.shared_prefix import group_prompts, shared_prefix_generate, shared_prefix_logps

G, P, C = 4, 9, 7


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _twins() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """Two models with the same weights, each with TRL's fused LM head (as GRPOTrainer adds it)."""
    a, b = _model(), _model(1)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    return a, b


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """3 prompts of different lengths (left-padded to P) x G rollouts, rows shuffled as TRL shuffles
    them; completions of random lengths, right-padded to C."""
    gen = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for length in (9, 6, 4):
        prompt = torch.randint(3, 100, (length,), generator=gen)
        for _ in range(G):
            ids.append(torch.cat([torch.zeros(P - length, dtype=torch.long), prompt]))
            mask.append(torch.cat([torch.zeros(P - length, dtype=torch.long), torch.ones(length, dtype=torch.long)]))
    perm = torch.randperm(len(ids), generator=gen)
    prompt_ids, prompt_mask = torch.stack(ids)[perm], torch.stack(mask)[perm]
    comp = torch.randint(3, 100, (len(ids), C), generator=gen)
    comp_mask = torch.ones_like(comp)
    for i in range(len(ids)):
        n = int(torch.randint(1, C + 1, (1,), generator=gen))
        comp_mask[i, n:] = 0
        comp[i, n:] = 0
    return prompt_ids, prompt_mask, comp, comp_mask


def _trl_logps(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What GRPOTrainer._get_per_token_logps_and_entropies computes (one chunk)."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-C] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -C:], out.entropy[:, -C:]


def test_group_prompts_finds_each_distinct_prompt_in_order() -> None:
    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [0, 5, 6], [1, 2, 3], [0, 0, 6]])
    mask = (ids != 0).long()
    firsts, rows = group_prompts(ids, mask)
    assert firsts.tolist() == [0, 1, 4]
    assert rows.tolist() == [0, 1, 0, 1, 2]
    same_ids_other_mask = mask.clone()
    same_ids_other_mask[2, 0] = 1  # a real token 0 is not padding
    assert len(group_prompts(ids, same_ids_other_mask)[0]) == 4


def test_logps_entropies_and_gradients_match_trl() -> None:
    trl_model, shared_model = _twins()
    prompt_ids, prompt_mask, comp, comp_mask = _batch()
    ids, mask = torch.cat([prompt_ids, comp], 1), torch.cat([prompt_mask, comp_mask], 1)
    a, ent_a = _trl_logps(trl_model, ids, mask)
    b, ent_b = shared_prefix_logps(shared_model, ids, mask, C, compute_entropy=True)
    real = comp_mask.bool()
    assert torch.allclose(a[real], b[real], atol=1e-5)
    assert torch.allclose(ent_a[real], ent_b[real], atol=1e-5)
    weights = torch.randn(a.shape, generator=torch.Generator().manual_seed(3))
    (a * weights * comp_mask).sum().backward()
    (b * weights * comp_mask).sum().backward()
    for (name, p1), p2 in zip(trl_model.named_parameters(), shared_model.parameters(), strict=True):
        assert p1.grad is not None and p2.grad is not None, name
        assert torch.allclose(p1.grad, p2.grad, atol=1e-5, rtol=1e-4), name
    assert max(float(p.grad.abs().max()) for p in trl_model.parameters()) > 1e-3  # gradients are not all zero


@pytest.mark.parametrize("sample", [False, True])
def test_generation_prefills_each_prompt_once(sample: bool) -> None:
    """Greedy tokens are transformers' own; sampled ones come from the same distribution by another random
    stream (tests/test_decoding.py checks the frequencies), so only their shape is compared here."""
    model = _model()
    prompt_ids, prompt_mask, _, _ = _batch(1)
    kwargs = {"max_new_tokens": 6, "do_sample": sample, "pad_token_id": 0}
    torch.manual_seed(7)
    plain = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
    calls: list[int] = []
    original_forward = model.forward

    def counting_forward(*args: object, **kw: object) -> object:
        calls.append(int(kw["input_ids"].shape[0]) if "input_ids" in kw else -1)  # type: ignore[union-attr]
        return original_forward(*args, **kw)

    model.forward = counting_forward  # type: ignore[method-assign]
    with shared_prefix_generate(model):
        torch.manual_seed(7)
        shared = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
    assert torch.equal(plain, shared) if not sample else plain.shape == shared.shape
    assert calls[0] == 3  # the prefill ran once per distinct prompt, not per row
    assert calls[1] == len(prompt_ids)  # then one token per row and step
    assert "generate" not in vars(model)  # the context left the model as it was


def test_too_short_prompt_is_refused() -> None:
    model = _twins()[0]
    ids = torch.randint(3, 100, (2, 5))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        shared_prefix_logps(model, ids, torch.ones_like(ids), 4)


def test_group_shuffle_keeps_groups_whole_and_rows_aligned() -> None:
    import trl.trainer.grpo_trainer as grpo

    from vpo.shared_prefix import _grouped_shuffle, group_shuffle

    prompt_ids, prompt_mask, comp, _ = _batch(2)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp,
             "tag": [f"row{i}" for i in range(len(comp))], "num_items_in_batch": torch.tensor(5)}
    torch.manual_seed(0)
    out = group_shuffle(batch)
    _, before = group_prompts(prompt_ids, prompt_mask)
    _, after = group_prompts(out["prompt_ids"], out["prompt_mask"])
    runs = [int(g) for i, g in enumerate(after.tolist()) if i == 0 or g != after[i - 1]]
    assert len(runs) == len(set(runs)) == 3  # each group is one contiguous block
    rows = [int(t[3:]) for t in out["tag"]]
    assert sorted(rows) == list(range(len(comp)))  # a permutation of the rows ...
    assert torch.equal(out["completion_ids"], comp[rows])  # ... applied to every field alike
    assert torch.equal(out["prompt_ids"], prompt_ids[rows])
    assert out["num_items_in_batch"] is batch["num_items_in_batch"]
    orders = set()
    for seed in range(8):
        torch.manual_seed(seed)
        shuffled = group_shuffle(batch)
        first_rows = group_prompts(shuffled["prompt_ids"], shuffled["prompt_mask"])[0]
        orders.add(tuple(before[[int(shuffled["tag"][i][3:]) for i in first_rows]].tolist()))  # which original group comes first, second, third
    assert len(orders) > 1  # the group order is random
    with _grouped_shuffle():  # TRL's trainer module looks the shuffle up by this name
        assert grpo.shuffle_sequence_dict is group_shuffle
    assert grpo.shuffle_sequence_dict is not group_shuffle


def test_trimmed_completion_padding_gives_the_same_loss_and_gradients() -> None:
    """A micro-batch whose rows all end early loses its unused completion columns, every per-token field
    alike; a masked token-mean loss over it and its gradients are unchanged."""
    from vpo.shared_prefix import trim_completion_padding

    full_model, trim_model = _twins()
    prompt_ids, prompt_mask, comp, comp_mask = _batch()
    comp_mask[:, 5:] = 0  # no row uses the last two columns
    comp = comp.masked_fill(comp_mask == 0, 0)
    advantages = torch.linspace(-1, 1, len(comp))
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp,
              "completion_mask": comp_mask, "advantages": advantages,
              "old_per_token_logps": torch.zeros(comp.shape), "num_items_in_batch": comp_mask.sum()}
    trimmed = trim_completion_padding(inputs)
    assert trimmed["completion_ids"].shape == trimmed["completion_mask"].shape == trimmed["old_per_token_logps"].shape
    assert trimmed["completion_ids"].size(1) == 5 and torch.equal(trimmed["completion_ids"], comp[:, :5])
    assert trimmed["prompt_ids"] is prompt_ids and trimmed["advantages"] is advantages  # (B,) fields untouched

    def loss(model: LlamaForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        width = batch["completion_ids"].size(1)
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logps, _ = shared_prefix_logps(model, ids, mask, width)
        token_mask = batch["completion_mask"]
        return -(logps * batch["advantages"][:, None] * token_mask).sum() / batch["num_items_in_batch"]

    a, b = loss(full_model, inputs), loss(trim_model, trimmed)
    a.backward()
    b.backward()
    assert torch.allclose(a, b, atol=1e-6)
    for (name, p1), p2 in zip(full_model.named_parameters(), trim_model.parameters()):
        assert p1.grad is not None and p2.grad is not None, name
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6, rtol=1e-4), name
    untouched = dict(inputs, completion_mask=comp_mask.clone())
    untouched["completion_mask"][0, -1] = 1  # one row uses the last column: nothing to cut
    assert trim_completion_padding(untouched) is untouched
