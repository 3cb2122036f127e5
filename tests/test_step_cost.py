"""benchmarks/step_cost.py's arithmetic, without a model: the FLOP model of a decoder layer stack and
the phase table set against both matmul ceilings (float32 and bfloat16)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("step_cost", REPO / "benchmarks" / "step_cost.py")
assert _spec is not None and _spec.loader is not None
step_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_cost)


def test_flop_model_counts_every_projection_the_head_and_attention() -> None:
    cfg = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                          num_hidden_layers=3, vocab_size=10)
    fm = step_cost.flop_model(cfg)
    # q 8x8, k and v 8x4 each, o 8x8, gate/up/down 8x16 each, 2 FLOPs per multiply-add, 3 layers
    assert fm["layers"] == 2.0 * 3 * (64 + 2 * 32 + 64 + 3 * 128)
    assert fm["lm_head"] == 2.0 * 10 * 8 and fm["attn_per_ctx"] == 4.0 * 3 * 8
    assert step_cost.forward_flops(fm, 5, 15, 1) == fm["layers"] * 5 + fm["attn_per_ctx"] * 15 + fm["lm_head"]


def test_the_table_sets_each_phase_against_both_ceilings() -> None:
    step = {"step_cpu": 10.0, "step_wall": 12.0, "cpu": {"generate": 4.0, "logp_forward": 2.0, "backward": 3.0},
            "wall": {"generate": 5.0}, "flops": {"generate": 80e9, "generate_useful": 40e9, "backward": 60e9},
            "counts": {"completion_tokens": 500}}
    text = step_cost.summarise({"steps": [step]}, {"float32": 100.0, "bfloat16": 400.0})
    lines = text.splitlines()
    assert lines[0].endswith("| of float32 ceiling | of bfloat16 ceiling |")
    assert all(line.count("|") == lines[0].count("|") for line in lines[:9] if line.startswith("|"))
    assert "| generate | 4.00 | 5.00 | 80.0 (40.0) | 20.0 | 20% | 5% |" in lines
    assert "| logp_forward | 2.00 | 0.00 | - | - | - | - |" in lines
    assert "| other | 1.00 |" in text  # the step's CPU the phases do not account for
    assert "| **step** | 10.00 | 12.00 | 140.0 (40.0) | 14.0 (useful 4.0) | 14% (useful 4%) | 4% (useful 1%) |" in lines
    assert "500 completion tokens per step (median)" in text

