"""Parse rate: measured by the warm-up (strict tags), watched by the trainer (warn, then fail fast)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.trainers import LetterReward, config, tiny_model_dir, toy_dataset
from vpo.sft import SFT_METRICS_FILE, LoraSettings, measure_parse_rate, parse_stats, train_sft
from vpo.tasks.phrase import PhraseTask
from vpo.tasks.route import RouteTask
from vpo.trainer import LowParseRateWarning, ParseRateError, VPOTrainer

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_parse_stats_counts_tagged_complete_and_distinct_sets() -> None:
    task = PhraseTask(n_train=2, n_test=2)
    comps = [["<answer_1>a!</answer_1><answer_2>b!</answer_2><answer_3>c!</answer_3>",
              "<answer_1>a!</answer_1><answer_2>A!</answer_2><answer_3>c!</answer_3>",  # a repeat
              "<answer_1>a!</answer_1>",
              "a! b! c!"]]  # no tags: a lenient single-answer parse would take it, the format check does not
    st = parse_stats(task, comps, 3)
    assert st == {"m": 3, "completions": 4, "parse_rate": 0.75, "complete_rate": 0.5, "distinct_rate": 0.25}
    one = parse_stats(task, [["<answer_1>x</answer_1>", "x"]], 1)
    assert one["parse_rate"] == one["complete_rate"] == one["distinct_rate"] == 0.5
    with pytest.raises(ValueError):
        parse_stats(task, [], 1)


def _fake(max_unparsed: int, min_rate: float) -> Any:
    return SimpleNamespace(state=SimpleNamespace(global_step=0),
                           args=SimpleNamespace(max_unparsed_steps=max_unparsed, min_parse_rate=min_rate,
                                                num_answers=3),
                           unparsed_streak=0, low_parse_steps=[])


def test_parse_rate_check_warns_and_fails_after_consecutive_zero_steps() -> None:
    fake = _fake(3, 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, rate in enumerate([0.0, 0.0, 0.6, 0.0, 0.0], start=1):
            fake.state.global_step = step - 1
            VPOTrainer._check_parse_rate(fake, rate)  # a non-zero step resets the streak
        assert [w.category for w in caught] == [LowParseRateWarning] * 4
        assert "min_parse_rate=0.5" in str(caught[0].message)
        assert fake.low_parse_steps == [(1, 0.0), (2, 0.0), (4, 0.0), (5, 0.0)]
        fake.state.global_step = 5
        with pytest.raises(ParseRateError, match="max_unparsed_steps=3"):
            VPOTrainer._check_parse_rate(fake, 0.0)
    off = _fake(0, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(10):
            VPOTrainer._check_parse_rate(off, 0.0)  # both checks disabled: neither warns nor raises


def test_config_validates_parse_rate_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min_parse_rate"):
        config(tmp_path, min_parse_rate=1.5)
    with pytest.raises(ValueError, match="max_unparsed_steps"):
        config(tmp_path, max_unparsed_steps=-1)


class NeverParses(LetterReward):
    def parse(self, completion: str, m: int) -> list[str]:
        return []


@pytest.mark.slow
def test_trainer_fails_fast_when_nothing_parses(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model_dir(tmp_path)
    torch.manual_seed(0)
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    trainer = VPOTrainer(model=model, reward=NeverParses(), args=config(tmp_path / "t", max_steps=5,
                                                                        max_unparsed_steps=2),
                         train_dataset=toy_dataset(8), processing_class=tok)
    with pytest.warns(LowParseRateWarning, match="only 0%"), pytest.raises(ParseRateError, match="2 consecutive"):
        trainer.train()
    assert trainer.state.global_step == 1  # the second all-unparsed batch stopped training
    # the same reward with the check off trains to the end, warning at every step
    trainer = VPOTrainer(model=model, reward=NeverParses(), args=config(tmp_path / "u", max_steps=3,
                                                                        max_unparsed_steps=0),
                         train_dataset=toy_dataset(8), processing_class=tok)
    with pytest.warns(LowParseRateWarning):
        trainer.train()
    assert trainer.state.global_step == 3 and [s for s, _ in trainer.low_parse_steps] == [1, 2, 3]


@pytest.mark.slow
def test_sft_reports_parse_rate_before_and_after_and_merges_lora(tmp_path: Path) -> None:
    task = RouteTask(n_train=50, n_test=4, seed=0, border_walls=False, n_walls=(0, 3))
    base = train_sft(task, tmp_path / "base", steps=0, model_size=SMALL, progress=False, threads=1)
    out = train_sft(task, tmp_path / "lora", steps=40, batch_size=8, lr=2e-2, seed=1, init_dir=base,
                    lora=LoraSettings(r=4, alpha=8), eval_rows=3, eval_samples=3, eval_max_new_tokens=40,
                    progress=False, threads=1)
    metrics = json.loads((out / SFT_METRICS_FILE).read_text())
    assert metrics["lora"]["r"] == 4 and metrics["parse_eval"]["rows"] == 3
    assert set(metrics["parse_before"]) == set(metrics["parse_after"]) == {"1", "3"}
    # the stored "after" is what sampling the saved folder gives (same seed, same prompts)
    from vpo.generation import load_policy

    model, tok = load_policy(out)
    again = measure_parse_rate(model, tok, task, task.load("test")[:3], (1, 3), n=3, max_new_tokens=40, seed=1)
    assert again == metrics["parse_after"]
    # LoRA was merged: a plain model folder whose weights moved, not an adapter
    assert not (out / "adapter_config.json").exists()
    before, _ = load_policy(base)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before.get_parameter(n))]
    assert moved and all("proj" in n for n in moved), moved
    assert metrics["final_loss"] < metrics["initial_loss"]  # the adapters learned (the format itself
    # is too much for a random 1-layer model in 40 steps; the SmolLM2 test checks the parse rate rises)
