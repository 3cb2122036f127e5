"""Tiny char-level tokenizer and Llama model: exact round trips, save/load, size, padding."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vpo.tasks.route import RouteTask, route_charset
from vpo.tiny import DEFAULT_SIZE, SPECIAL_TOKENS, build_char_tokenizer, build_tiny_model, count_parameters

SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def test_tokenizer_round_trips_every_prompt_and_answer() -> None:
    tok = build_char_tokenizer(route_charset())
    task = RouteTask(n_train=200, n_test=50)
    rng = random.Random(0)
    texts = []
    for row in task.load("train") + task.load("test"):
        for m in (1, 3):
            texts.append(task.format_prompt(row, m))
            texts.append(task.demonstration(row, m, rng))
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert len(ids) == len(text) + 1, "one token per character plus <bos>"
        assert tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok(text, add_special_tokens=False)["input_ids"] == ids[1:]


def test_tokenizer_vocab_and_specials() -> None:
    tok = build_char_tokenizer("ba\nab")
    assert len(tok) == len(SPECIAL_TOKENS) + 3
    assert tok.convert_ids_to_tokens(list(range(4))) == list(SPECIAL_TOKENS)
    assert (tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token) == SPECIAL_TOKENS
    assert tok.padding_side == "left"
    # characters outside the charset become <unk>
    assert tok("a?", add_special_tokens=False)["input_ids"][1] == tok.unk_token_id
    batch = tok(["a", "abab"], padding=True)
    assert batch["input_ids"][0][:3] == [tok.pad_token_id] * 3
    assert batch["attention_mask"][0] == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError):
        build_char_tokenizer("")


def test_build_save_and_reload(tmp_path) -> None:
    charset = route_charset()
    path = build_tiny_model(tmp_path / "tiny", charset, seed=1, **SMALL)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama"
    assert type(tok).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert model.config.vocab_size == len(tok) == len(set(charset)) + 4
    assert tok.padding_side == "left"
    text = "S...aa\n?3><r_1>RD</r_1>"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    info = json.loads((path / "tiny_build.json").read_text())
    assert info["parameters"] == count_parameters(model)
    # same seed -> same weights; reloaded weights equal the saved ones
    again = AutoModelForCausalLM.from_pretrained(
        build_tiny_model(tmp_path / "again", charset, seed=1, **SMALL)
    )
    other = AutoModelForCausalLM.from_pretrained(
        build_tiny_model(tmp_path / "other", charset, seed=2, **SMALL)
    )
    w = model.get_input_embeddings().weight
    assert torch.equal(w, again.get_input_embeddings().weight)
    assert not torch.equal(w, other.get_input_embeddings().weight)
    ids = tok([text], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_default_size_is_small_but_not_trivial(tmp_path) -> None:
    path = build_tiny_model(tmp_path / "default", route_charset())
    model = AutoModelForCausalLM.from_pretrained(path)
    n = count_parameters(model)
    assert 3e5 < n < 5e6, n
    assert model.config.hidden_size == DEFAULT_SIZE["hidden_size"]
    assert model.generation_config.top_k in (0, None)
