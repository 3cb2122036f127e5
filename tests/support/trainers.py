"""Shared pieces for trainer tests: a toy vector reward, its dataset and a locally built tiny model.

Also runnable as a script under ``torchrun`` (see tests/test_trainer.py): each rank trains two
steps and writes the global advantage vectors it computed to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vpo.rewards import VectorReward

CHARSET = "abcdxyz<>/_0123456789 \n:#"


class LetterReward(VectorReward):
    """d=3: answer contains 'a' / 'b' / 'c'. A row with ``n_dims`` < 3 lacks the last dimensions."""

    names = ("has_a", "has_b", "has_c")

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        out = np.array([[float(ch in a) for ch in "abc"] for a in answers], dtype=np.float64)
        out[:, ~self.present(row)] = np.nan
        return out

    def present(self, row: Mapping[str, Any]) -> np.ndarray:
        return np.arange(3) < int(row.get("n_dims", 3))

    def parse(self, completion: str, m: int) -> list[str]:
        """Answers are '#'-separated (an untrained model emits '#' often enough to give sets)."""
        return [p.strip() for p in completion.split("#") if p.strip()][:m]


def toy_dataset(n: int = 8) -> Any:
    from datasets import Dataset

    return Dataset.from_list([{"id": f"p{i}", "prompt": f"q{i}:", "n_dims": 2 + i % 2} for i in range(n)])


def tiny_model_dir(tmp: Path) -> Path:
    from vpo.tiny import build_tiny_model

    return build_tiny_model(tmp / "tiny", CHARSET, seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2)


def config(out: Path, **overrides: Any) -> Any:
    from vpo.trainer import VPOConfig

    kw: dict[str, Any] = {
        "output_dir": str(out), "bf16": False, "use_cpu": True, "gradient_checkpointing": False, "report_to": "none",
        "save_strategy": "no", "logging_steps": 1, "dataloader_pin_memory": False, "per_device_train_batch_size": 8,
        "num_generations": 4, "max_completion_length": 12, "max_steps": 2, "learning_rate": 5e-3, "seed": 3,
        "estimator": "vpo", "num_answers": 2, "num_weights": 16, "temperature": 1.0, "disable_tqdm": True,
        "truncated_scores_zero": False,  # an untrained model rarely emits EOS within 12 tokens
    }
    kw.update(overrides)
    return VPOConfig(**kw)


def _dist_main(model_dir: str, out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vpo.trainer import VPOTrainer

    torch.manual_seed(0)
    rank = int(os.environ.get("RANK", "0"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = config(Path(out_dir) / "trainer", per_device_train_batch_size=4, num_generations=4, max_steps=2)
    seen: list[dict[str, Any]] = []

    class Recording(VPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            seen.append({"advantages": self.last_advantages.tolist(),
                         "sets": self._vpo_sets.nan_to_num(-1).tolist(),
                         "local_rows": out["vpo_row_id"].tolist(), "world": self.accelerator.num_processes,
                         "prompt_ids": self._vpo_prompt_ids})
            return out

    trainer = Recording(model=model, reward=LetterReward(), args=cfg, train_dataset=toy_dataset(8),
                        processing_class=tok)
    trainer.train()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    _dist_main(sys.argv[1], sys.argv[2])
