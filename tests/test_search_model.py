"""ModelProposer on a real (tiny, randomly initialised) local checkpoint through vpo.generation.

Checks the plumbing the lead relies on: a checkpoint folder in, one completion per prompt out,
reproducible for a seed, and a search that resumes to the same result with real sampling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vpo.rewards import VectorReward
from vpo.search import ModelProposer, run_search_batch
from vpo.tasks import Task

pytest.importorskip("torch")
pytest.importorskip("vpo.generation")
pytest.importorskip("vpo.tiny")

ALPHABET = "abc"


class FirstCharReward(VectorReward):
    """Two dims: the answer starts with 'a'; the answer is short (<= 4 chars)."""

    names = ("starts_a", "short")

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        return np.array([[float(a.startswith("a")), float(len(a) <= 4)] for a in answers]).reshape(-1, 2)

    def parse(self, completion: str, m: int) -> list[str]:
        # a random model rarely closes tags: take whitespace-free chunks as the m answers
        return [c for c in completion.split() if c][:m]


class TinyTask(Task):
    name = "tiny-first-char"

    def __init__(self) -> None:
        self.reward = FirstCharReward()

    def load(self, split: str) -> list[dict[str, Any]]:
        return [{"id": f"q{i}", "prompt": f"say a{i}"} for i in range(2)]

    def format_prompt(self, row: Mapping[str, Any], m: int) -> str:
        return f"{row['prompt']} x{m}:"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vpo.tiny import build_tiny_model

    charset = "abc say0123456789x: "
    out = tmp_path_factory.mktemp("tiny") / "policy"
    return build_tiny_model(
        out,
        charset,
        seed=0,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def test_model_proposer_is_seeded(tiny_checkpoint: Path) -> None:
    prop = ModelProposer(str(tiny_checkpoint), max_new_tokens=16, temperature=1.0)
    prompts = ["say a0 x3:", "say a1 x3:"]
    a = prop.propose(prompts, seed=3)
    assert len(a) == 2 and all(isinstance(x, str) for x in a)
    assert prop.propose(prompts, seed=3) == a
    assert any(prop.propose(prompts, seed=s) != a for s in (4, 5, 6))
    prop.close()
    assert ModelProposer(str(tiny_checkpoint), max_new_tokens=16).propose(prompts, seed=3) == a


class _Crash(RuntimeError):
    pass


class _CrashAfter:
    def __init__(self, inner: ModelProposer, calls: int) -> None:
        self.inner, self.left = inner, calls

    def propose(self, prompts: Sequence[Any], seed: int) -> list[str]:
        if self.left == 0:
            raise _Crash
        self.left -= 1
        return self.inner.propose(prompts, seed)


def test_search_with_model_resumes_identically(tiny_checkpoint: Path, tmp_path: Path) -> None:
    task = TinyTask()
    rows = task.load("test")
    kw: dict[str, Any] = {
        "iterations": 5,
        "m": 3,
        "seed": 1,
        "checkpoint_every": 2,
        "stop_when_solved": False,
    }
    prop = ModelProposer(str(tiny_checkpoint), max_new_tokens=16, temperature=1.0)
    ref = run_search_batch(rows, task, prop, **kw)
    assert all(r.candidates > 0 for r in ref)  # the random model's text does yield candidates
    ckpt = tmp_path / "ck.json"
    with pytest.raises(_Crash):
        run_search_batch(rows, task, _CrashAfter(prop, 3), checkpoint_path=ckpt, **kw)
    got = run_search_batch(rows, task, prop, checkpoint_path=ckpt, **kw)
    assert [r.to_dict(include_database=True) for r in got] == [r.to_dict(include_database=True) for r in ref]
