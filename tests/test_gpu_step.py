"""benchmarks/gpu_step.py at tiny sizes: both engines run GRPO and VPO steps and report positive numbers;
the manual engine runs where TRL cannot be imported (the GPU machines we may get have none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "smollm2-135m", "--layers", "1", "--hidden", "32", "--vocab", "128", "--prompts", "2",
        "--generations", "2", "--prompt-len", "8", "--completion-len", "6", "--steps", "1", "--warmup", "1",
        "--device", "cpu", "--threads", "1", "--isolate", "none"]

BLOCK_TRL = """
import runpy, sys
for name in ('trl', 'datasets', 'prefect', 'dvc'):
    sys.modules[name] = None  # what an uninstalled package looks like to import and find_spec
sys.argv = ['gpu_step.py', *sys.argv[1:]]
runpy.run_path(%r, run_name='__main__')
"""


def check_report(report: dict[str, Any], engine: str) -> None:
    assert report["engine"] == engine and report["parameters"] > 0
    assert [r["arm"] for r in report["arms"]] == ["grpo", "vpo"]
    assert report["matmul"]["dtype"] == "float32" and report["matmul"]["tflops"] > 0
    assert report["versions"]["torch"] and report["versions"]["transformers"] and report["versions"]["vpo"] == "0.1.0"
    for r in report["arms"]:
        assert r["m"] == (3 if r["arm"] == "vpo" else 1)
        for key in ("seconds_per_step", "tokens_per_second", "peak_memory", "plan_peak", "plan_over_measured",
                    "plan_seconds_per_step", "generation_seconds", "training_seconds", "generation_tokens_per_second"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (r["arm"], key, r[key])
        assert r["generation_seconds"] + r["scoring_seconds"] + r["training_seconds"] == pytest.approx(
            r["seconds_per_step"], rel=0.05, abs=0.01)
        for phase in ("generation", "training"):  # the plan's FLOPs of this step over its measured seconds
            assert r["achieved_tflops"][phase] == pytest.approx(
                r["flops_per_step"][phase] / r[f"{phase}_seconds"] / 1e12, rel=0.01)
            assert r["mfu"][phase] == pytest.approx(r["achieved_tflops"][phase] / report["matmul"]["tflops"],
                                                    rel=0.01, abs=1e-4)
        assert r["generated_tokens_per_step"] == 2 * 2 * 6 * r["m"] and r["mode"] == "generate+train"
        assert r["peak_memory_kind"].startswith("peak RSS")
        assert r["max_memory_allocated"] is None and r["max_memory_reserved"] is None  # CUDA only
    assert report["vpo_over_grpo_per_token"] > 0


@pytest.mark.slow
def test_manual_engine_runs_without_trl(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    script = BLOCK_TRL % str(REPO / "benchmarks" / "gpu_step.py")
    proc = subprocess.run([sys.executable, "-c", script, *TINY, "--engine", "auto", "--json", str(out)],
                          capture_output=True, text=True, check=False, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    check_report(report, "manual")  # auto fell back to the manual engine: TRL is not importable there
    assert "VPO / GRPO seconds per generated token" in proc.stderr


@pytest.mark.slow
def test_trl_engine_runs_the_same_steps(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_step
    finally:
        sys.path.pop(0)
    report = gpu_step.main([*TINY, "--engine", "trl", "--json", str(tmp_path / "r.json")])
    check_report(report, "trl")
    assert json.loads((tmp_path / "r.json").read_text())["arms"][0]["engine"] == "trl"


def test_runs_from_a_plain_checkout_without_vpo_installed() -> None:
    """`python benchmarks/gpu_step.py` imports the checkout's vpo even where vpo is not installed."""
    code = f"""
import importlib.util, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path[:] = [p for p in sys.path if p not in ("", {str(REPO)!r})]
assert importlib.util.find_spec("vpo") is None, "vpo is still importable without the checkout"
sys.argv = ["gpu_step.py", "--help"]
runpy.run_path({str(REPO / "benchmarks" / "gpu_step.py")!r}, run_name="__main__")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd="/",
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--train-only" in proc.stdout and "--preset" in proc.stdout


def test_preset_shape_reads_the_pipeline_file(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_step
    finally:
        sys.path.pop(0)
    shape = gpu_step.preset_shape("code-qwen-1gpu-lora", "grpo_x3")
    assert shape["arm"] == gpu_step.Arm("grpo_x3", "grpo", 1)
    assert (shape["generations"], shape["micro_batch"], shape["prompts"]) == (24, 3, 6)  # 3 x G, 3 x micro
    assert (shape["prompt_len"], shape["completion_total"], shape["lora_r"]) == (2048, 4096, 32)
    assert shape["gradient_checkpointing"] and Path(shape["model"]).name == "Qwen2.5-Coder-1.5B-Instruct.json"
    vpo = gpu_step.preset_shape("code-qwen-1gpu-lora", "vpo")
    assert vpo["arm"].m == 3 and (vpo["generations"], vpo["micro_batch"], vpo["prompts"]) == (8, 1, 6)
    bad = tmp_path / "p.yaml"
    bad.write_text("pipelines:\n  x:\n    model: {path_or_id: Qwen/Qwen2.5-0.5B-Instruct}\n"
                   "    arms: [{name: a, estimator: grpo}]\n    trainer: {num_generations: 4}\n")
    with pytest.raises(SystemExit, match="does not set trainer.per_device_train_batch_size, "
                                         "trainer.gradient_accumulation_steps"):
        gpu_step.preset_shape("x", None, bad)
    with pytest.raises(SystemExit, match="no enabled arm 'nope'"):
        gpu_step.preset_shape("code-qwen-1gpu-lora", "nope")


def test_train_only_at_a_preset_arms_shape(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_step
    finally:
        sys.path.pop(0)
    report = gpu_step.main(["--train-only", "--preset", "code-qwen-1gpu-lora", "--arm", "vpo", "--layers", "1",
                            "--hidden", "32", "--vocab", "128", "--prompts", "1", "--prompt-len", "12",
                            "--completion-total", "10", "--device", "cpu", "--threads", "1", "--engine", "manual",
                            "--steps", "1", "--warmup", "1", "--json", str(tmp_path / "r.json")])
    (arm,) = report["arms"]
    assert report["mode"] == "train-only" and report["preset"] == "code-qwen-1gpu-lora"
    assert (arm["arm"], arm["m"], arm["micro_batch"], arm["sequences_per_step"]) == ("vpo", 3, 1, 8)
    assert (arm["prompt_tokens"], arm["completion_tokens"]) == (12, 10)  # the command line over the preset
    assert report["settings"]["lora_r"] == 32 and report["settings"]["gradient_checkpointing"]
    assert arm["generation_seconds"] < arm["training_seconds"] and arm["generated_tokens_per_step"] == 0
    assert arm["flops_per_step"]["generation"] == 0 and arm["achieved_tflops"]["training"] > 0
    assert arm["plan_phase"] in ("training", "optimizer step") and arm["plan_peak"] > 0
