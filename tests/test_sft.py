"""Supervised base stage: label masking, a short real run (loss falls, samples parse), seeding."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from vpo.generation import load_policy, sample
from vpo.sft import SFT_METRICS_FILE, default_threads, make_batch, train_sft
from vpo.tasks.route import RouteTask, route_charset
from vpo.tiny import build_char_tokenizer

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: the tiny model gains nothing from more, and shared cores thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_make_batch_masks_prompt_and_padding() -> None:
    tok = build_char_tokenizer(route_charset())
    prompts, comps = ["S.\n?1>", "S\n?3>"], ["<r_1>RD</r_1>", "<r_1>R</r_1>"]
    batch = make_batch(tok, prompts, comps)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == mask.shape == (2, 1 + 6 + 13 + 1)
    # row 0: <bos> + 6 prompt chars masked, 13 completion chars + eos trained, no padding
    assert (labels[0, :7] == -100).all() and (labels[0, 7:] == ids[0, 7:]).all()
    assert labels[0, -1] == tok.eos_token_id and mask[0].all()
    # row 1: 1 + 5 masked, 12 + eos trained, then one right-padding position out of the loss
    assert (labels[1, :6] == -100).all() and labels[1, 18] == tok.eos_token_id
    assert mask[1, 19] == 0 and labels[1, 19] == -100 and ids[1, 19] == tok.pad_token_id
    for i in range(2):
        assert tok.decode(ids[i][labels[i] != -100], skip_special_tokens=True) == comps[i]
        assert tok.decode(ids[i][: 1 + len(prompts[i])], skip_special_tokens=True) == prompts[i]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    # interior walls only: the thresholds below were set for this short 1-layer run on those grids
    # (on the default grids, walls on the border too, 30 of 34 answers were clean move strings);
    # the answer format, not wall reading, is what this module checks
    task = RouteTask(n_train=200, n_test=10, seed=0, border_walls=False, n_walls=(0, 3))
    out = train_sft(
        task,
        tmp_path_factory.mktemp("sft") / "base",
        steps=120,
        batch_size=16,
        lr=3e-3,
        seed=0,
        m=3,
        model_size=SMALL,
        progress=False,
        threads=1,
    )
    return task, out


@pytest.mark.slow
def test_short_run_loss_falls_and_checkpoint_loads(trained) -> None:
    _task, out = trained
    metrics = json.loads((out / SFT_METRICS_FILE).read_text())
    assert metrics["steps"] == 120 and len(metrics["losses"]) == 120
    assert metrics["final_loss"] < 0.5 * metrics["initial_loss"], metrics
    assert metrics["time_s"] > 0 and metrics["parameters"] > 0
    assert not (out / "_init").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(set(route_charset())) + 4


def test_samples_parse_in_both_formats(trained) -> None:
    task, out = trained
    model, tok = load_policy(out)
    rows = task.load("test")
    for m in (1, 3):
        comps = sample(
            model,
            tok,
            [task.format_prompt(r, m) for r in rows],
            n=4,
            max_new_tokens=30 if m == 1 else 80,
            temperature=1.0,
            seed=0,
        )
        flat = [c for cs in comps for c in cs]
        # a short run already writes the tagged format: the first answer parses
        assert sum(c.startswith("<r_1>") and bool(task.reward.parse(c, m)) for c in flat) >= 0.8 * len(flat)
        if m == 1:
            assert sum(len(task.reward.parse(c, 1)) == 1 for c in flat) >= 0.8 * len(flat)
        moves = [a for c in flat for a in task.reward.parse(c, m)]
        assert sum(set(a) <= set("UDLR") for a in moves) >= 0.9 * len(moves)


def test_same_seed_same_losses(tmp_path) -> None:
    task = RouteTask(n_train=20, n_test=2, seed=0)
    kw = {"steps": 4, "batch_size": 4, "lr": 1e-3, "model_size": SMALL, "progress": False, "threads": 1}
    before = torch.get_num_threads()
    a = json.loads((train_sft(task, tmp_path / "a", seed=1, **kw) / SFT_METRICS_FILE).read_text())["losses"]
    b = json.loads((train_sft(task, tmp_path / "b", seed=1, **kw) / SFT_METRICS_FILE).read_text())["losses"]
    c = json.loads((train_sft(task, tmp_path / "c", seed=2, **kw) / SFT_METRICS_FILE).read_text())["losses"]
    assert a == b and a != c
    with pytest.raises(TypeError):
        train_sft(object(), tmp_path / "d", **kw)  # type: ignore[arg-type]
    # steps=0 saves the untrained starting model, loadable like any base
    zero = train_sft(task, tmp_path / "zero", steps=0, model_size=SMALL, progress=False, threads=1)
    info = json.loads((zero / SFT_METRICS_FILE).read_text())
    assert info["steps"] == 0 and info["final_loss"] is None
    assert AutoModelForCausalLM.from_pretrained(zero).config.vocab_size == len(set(route_charset())) + 4
    assert torch.get_num_threads() == before, "the thread setting is restored"


def test_default_threads_respects_env(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert default_threads() == 2
