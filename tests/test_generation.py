"""The sampling helper: shapes, seeding, greedy left-padding invariance, eos handling, backends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vpo.generation import generate_batch, load_policy, sample, vllm_available
from vpo.tasks.route import route_charset
from vpo.tiny import build_char_tokenizer, build_tiny_model

SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
PROMPTS = ["S...aa\n?1>", "S.\n..\nbE\n?3>", "S\n?1>"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: the tiny model gains nothing from more, and shared cores thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gen") / "m", route_charset(), seed=0, **SMALL)


def test_shapes_seeding_and_rng_isolation(tiny) -> None:
    model, tok = load_policy(tiny)
    state = torch.get_rng_state()
    a = sample(model, tok, PROMPTS, n=4, max_new_tokens=12, temperature=1.0, seed=7)
    assert torch.equal(state, torch.get_rng_state()), "the global RNG must not move"
    assert len(a) == len(PROMPTS) and all(len(x) == 4 for x in a)
    assert all(isinstance(s, str) and len(s) <= 12 for x in a for s in x)
    assert a == sample(model, tok, PROMPTS, n=4, max_new_tokens=12, temperature=1.0, seed=7)
    assert a != sample(model, tok, PROMPTS, n=4, max_new_tokens=12, temperature=1.0, seed=8)
    # a random model samples different completions for one prompt
    assert len(set(a[0])) > 1
    # loading by path gives the same samples as the loaded model
    assert a == sample(str(tiny), None, PROMPTS, n=4, max_new_tokens=12, temperature=1.0, seed=7)
    assert sample(model, tok, [], n=2) == []


def test_greedy_is_deterministic_and_padding_invariant(tiny) -> None:
    model, tok = load_policy(tiny)
    batched = sample(model, tok, PROMPTS, n=2, max_new_tokens=10, temperature=0.0, seed=0)
    for prompt, outs in zip(PROMPTS, batched, strict=True):
        assert outs[0] == outs[1]
        alone = sample(model, tok, [prompt], n=1, max_new_tokens=10, temperature=0.0, seed=123)
        assert alone[0][0] == outs[0], "left padding must not change a greedy completion"


class _FakeModel:
    """Returns fixed sequences, to check how completions are cut and masked."""

    training = False
    device = torch.device("cpu")

    def __init__(self, tails: list[list[int]]) -> None:
        self.tails = tails

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self

    def generate(self, input_ids, attention_mask, **kw):
        assert kw["num_return_sequences"] == 1 and kw["use_cache"]
        tails = torch.tensor(self.tails)
        return torch.cat([input_ids, tails], dim=1)


def test_completions_stop_at_first_eos() -> None:
    tok = build_char_tokenizer(route_charset())
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    tails = [ids("RD") + [eos] + ids("UU"), ids("RRD") + [eos, pad], ids("LLLLL")]
    gen = generate_batch(_FakeModel(tails), tok, ["S\n?1>", "S.\n?1>", "S..\n?1>"], n=1, max_new_tokens=5)
    assert gen.texts == ["RD", "RRD", "LLLLL"]
    assert gen.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert gen.prompt_mask.tolist()[0][:2] == [0, 0] and gen.prompt_ids.shape[0] == 3


def test_backend_errors(tiny) -> None:
    with pytest.raises(ValueError):
        sample(tiny, None, PROMPTS, backend="nope")
    model, tok = load_policy(tiny)
    tok.padding_side = "right"
    with pytest.raises(ValueError):
        generate_batch(model, tok, PROMPTS)
    if not vllm_available():
        with pytest.raises(RuntimeError, match="vllm"):
            sample(tiny, None, PROMPTS, backend="vllm")
    with pytest.raises(ValueError):
        generate_batch(SimpleNamespace(), tok, PROMPTS, n=0)
