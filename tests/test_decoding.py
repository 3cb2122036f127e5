"""The cheaper decoding loop generates what transformers' own loop generates: greedy tokens identical, sampled
tokens from the same distribution (within sampling error), the model left as it was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from scipy import stats
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from vpo.decoding import decode, inverse_cdf_sample, merged_lora
from vpo.pipeline.engine.execution import torch_threads

V, EOS, PAD = 41, 1, 0


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with torch_threads(1):  # a small model gains nothing from more, and shared cores thrash
        yield


def _model(lora: bool = True) -> torch.nn.Module:
    """A small Llama (peft LoRA adapters with non-zero B on four projections when ``lora``)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=PAD,
                      eos_token_id=EOS, bos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj",
                                                                                      "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    return peft_model


def _prompts(copies: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 9, 6 and 4 tokens, left-padded, each repeated ``copies`` times (a GRPO group)."""
    gen = torch.Generator().manual_seed(1)
    ids, mask = [], []
    for length in (9, 6, 4):
        prompt = torch.randint(3, V, (length,), generator=gen)
        for _ in range(copies):
            ids.append(torch.cat([torch.full((9 - length,), PAD), prompt]))
            mask.append(torch.cat([torch.zeros(9 - length, dtype=torch.long), torch.ones(length, dtype=torch.long)]))
    return torch.stack(ids), torch.stack(mask)


def _config(eos: int | None, **kw: object) -> GenerationConfig:
    return GenerationConfig(pad_token_id=PAD, eos_token_id=eos, **kw)


@pytest.fixture()
def fast_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch size of every cache the fast loop allocated: proof that it ran, not transformers' loop."""
    import vpo.decoding

    sizes: list[int] = []
    original = vpo.decoding._static_cache

    def spy(model: object, prefix: object, rows: torch.Tensor, length: int) -> object:
        sizes.append(int(rows.numel()))
        return original(model, prefix, rows, length)

    monkeypatch.setattr(vpo.decoding, "_static_cache", spy)
    return sizes


def test_greedy_tokens_are_transformers_tokens_with_rows_finishing_at_different_steps(fast_runs: list[int]) -> None:
    model = _model()
    ids, mask = _prompts(copies=1)
    greedy = {"max_new_tokens": 24, "do_sample": False}
    free = model.generate(input_ids=ids, attention_mask=mask, generation_config=_config(None, **greedy))
    # an end token each row reaches at a different step: rows leave the batch one by one
    new = free[:, ids.size(1):]
    stop = next(int(t) for t in new[0, 2:].tolist() if bool((new[1:] == t).any()) is False)
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=_config(stop, **greedy))
    ours = model.generate(input_ids=ids, attention_mask=mask, generation_config=_config(stop, **greedy),
                          custom_generate=decode)
    assert torch.equal(ref, ours)
    assert bool((ours[:, ids.size(1):] == stop).any(1).sum() == 1)  # one row stopped early, the others ran on
    for eos in (EOS, None):  # and the plain cases: the default end token, no end token
        cfg = _config(eos, **greedy)
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg),
                           model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                                          custom_generate=decode))
    assert fast_runs == [3, 3, 3]


def test_the_model_is_left_as_it_was() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    ids, mask = _prompts()
    with merged_lora(model) as merged:
        assert merged == 8  # 4 projections x 2 layers, each one linear now
        assert not any("lora_A" in n for n, _ in model.named_modules())
    model.generate(input_ids=ids, attention_mask=mask, generation_config=_config(EOS, max_new_tokens=5, do_sample=True),
                   custom_generate=decode)
    assert dict(model.named_modules()) == modules  # the very same modules, back in place
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_inverse_cdf_sampling_draws_each_token_with_its_probability() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(20_000, 1)
    torch.manual_seed(0)
    draws = inverse_cdf_sample(probs)
    counts = torch.bincount(draws, minlength=6)
    assert counts[[0, 2, 5]].sum() == 0  # a zero-probability token is never drawn
    assert stats.chisquare(counts[[1, 3, 4]].numpy(), 20_000 * probs[0, [1, 3, 4]].numpy()).pvalue > 1e-3
    # a uniform that rounds up to the total still lands on a token with mass, never past the end
    edge = inverse_cdf_sample(probs[:2], uniform=torch.ones(2, 1, dtype=torch.float64))
    assert edge.tolist() == [4, 4]


@pytest.mark.parametrize("processors", [{}, {"temperature": 0.7, "top_k": 6}, {"top_p": 0.8}])
def test_sampled_tokens_follow_transformers_distribution(processors: dict[str, float], fast_runs: list[int]) -> None:
    """Many rollouts of each prompt, sampled by transformers' loop and by ours: the frequencies of the first
    token and of the first two tokens agree within sampling error (chi-square test of homogeneity)."""
    model = _model()
    ids, mask = _prompts(copies=600)
    cfg = _config(EOS, max_new_tokens=2, do_sample=True, **processors)
    torch.manual_seed(0)
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.size(1):]
    torch.manual_seed(1)
    ours = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, custom_generate=decode)
    ours = ours[:, ids.size(1):]
    assert ours.shape == ref.shape and fast_runs == [1800]
    for group in range(3):
        rows = slice(group * 600, (group + 1) * 600)
        for width in (1, 2):
            a = [tuple(r) for r in ref[rows, :width].tolist()]
            b = [tuple(r) for r in ours[rows, :width].tolist()]
            seen = sorted(set(a) | set(b))
            table = [[a.count(s) for s in seen], [b.count(s) for s in seen]]
            keep = [i for i, s in enumerate(seen) if table[0][i] + table[1][i] >= 5]  # the test's validity
            rare = [i for i in range(len(seen)) if i not in keep]
            lumped = [sum(row[i] for i in rare) for row in table]  # the rare outcomes as one, if any
            table = [[row[i] for i in keep] + ([r] if sum(lumped) else []) for row, r in zip(table, lumped)]
            assert stats.chi2_contingency(table).pvalue > 1e-3, (group, width, processors)
        if "top_k" in processors:  # never a token outside the processed distribution's support
            logits = model(input_ids=ids[rows][:1], attention_mask=mask[rows][:1]).logits[0, -1]
            allowed = set(logits.topk(int(processors["top_k"])).indices.tolist())
            assert set(ours[rows, 0].tolist()) <= allowed


@pytest.mark.parametrize("kwargs", [{"num_beams": 2}, {"return_dict_in_generate": True, "output_scores": True}])
def test_what_the_loop_does_not_implement_runs_transformers_loop(kwargs: dict[str, object],
                                                                 fast_runs: list[int]) -> None:
    model = _model(lora=False)
    ids, mask = _prompts(copies=2)
    cfg = _config(EOS, max_new_tokens=6, do_sample=False, **kwargs)
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    ours = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, custom_generate=decode)
    if isinstance(ref, torch.Tensor):
        assert torch.equal(ref, ours)
    else:
        assert torch.equal(ref.sequences, ours.sequences)
    assert fast_runs == []
