"""Registry test material: a small model folder and metrics shaped like the pipeline's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def make_checkpoint(root: Path, *, seed: int = 0, weights_size: int = 4096) -> Path:
    """A small but complete HF-style model folder (config, weights, tokenizer, a run-specific file)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    (root / "model.safetensors").write_bytes(hashlib.sha256(str(seed).encode()).digest() * (weights_size // 32))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (root / "training_args.bin").write_bytes(f"args of {root}".encode())
    return root


def metrics(best: dict[int, float], diversity: float = 1.0) -> dict:
    """Metrics shaped like the pipeline's: training summary and one arm run's evaluation."""
    return {"train": {"max_steps": 4}, "eval": {"best_at_k": {str(k): v for k, v in best.items()},
                                                 "pass_at_k": {str(k): v / 2 for k, v in best.items()},
                                                 "reward_diversity": diversity}}
