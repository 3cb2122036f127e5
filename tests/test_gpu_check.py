"""benchmarks/gpu_check.sh: stops with one line when something it needs is missing, and at tiny sizes on the
CPU runs every check and writes the JSON and markdown table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
CHECKS = ["step-short", "step-lora-ckpt", "train-only-code-qwen-1gpu-lora-vpo", "accelerate-fsdp2",
          "accelerate-deepspeed-zero2"]


def gpu_check(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run(["bash", str(SCRIPT), "--python", sys.executable, *args], capture_output=True, text=True,
                          check=False, cwd=REPO, env={**base, **(env or {})}, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_missing_wheel_folder_stops_with_one_line(tmp_path: Path) -> None:
    line = one_error_line(gpu_check("--cpu", "--tiny", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path)))
    assert line == (f"error: no wheel folder {tmp_path / 'none'}: build it with 'bash benchmarks/gpu_wheels.sh' "
                    "and copy it beside this script (or pass --no-wheels)")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "vpo-0.1.0-py3-none-any.whl").write_bytes(b"")
    line = one_error_line(gpu_check("--cpu", "--wheels", str(tmp_path / "w"), "--out", str(tmp_path)))
    assert line == f"error: no deepspeed wheel in {tmp_path / 'w'} (bash benchmarks/gpu_wheels.sh)"


def test_missing_base_package_stops_with_one_line(tmp_path: Path) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['peft'] = None  # as if not installed\n")
    line = one_error_line(gpu_check("--cpu", "--no-wheels", "--out", str(tmp_path), env={"PYTHONPATH": str(hide)}))
    assert line == "error: missing on this machine: peft (needs torch, transformers, accelerate, peft)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_no_gpu_without_cpu_flag_stops_with_one_line(tmp_path: Path) -> None:
    line = one_error_line(gpu_check("--no-wheels", "--out", str(tmp_path)))
    assert line == "error: no CUDA GPU visible to torch (run with --cpu --tiny on a CPU)"
    assert one_error_line(gpu_check("--bogus")) == "error: unknown option --bogus (see --help)"


def test_a_failing_check_fails_the_run_and_says_which(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    bad = gpu_check.Check("bad-shape", ("--device", "cpu", "--prompts", "3", "--generations", "2",
                                        "--micro-batch", "4"))
    result = gpu_check.run_check(bad, sys.executable, tmp_path, "cpu", timeout=300)
    assert result["status"] == "failed" and result["error"].endswith(
        "error: --micro-batch must divide --prompts x --generations"), result
    report = gpu_check.build_report([result], device="cpu", tiny=True, seconds=1.0, wheels=[], budget=480)
    assert not report["passed"] and report["matmul"] == "no matmul measured"
    table = gpu_check.markdown(report)
    assert "| bad-shape | - | failed: " in table and table.rstrip().endswith("1 check(s) FAILED.")


@pytest.mark.slow
def test_cpu_tiny_run_writes_json_and_markdown(tmp_path: Path) -> None:
    proc = gpu_check("--cpu", "--tiny", "--no-wheels", "--out", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict[str, Any] = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["mode"] == "cpu tiny" and report["passed"] and report["within_budget"]
    assert report["versions"]["torch"] == torch.__version__ and report["matmul"].startswith("float32 matmul")
    assert [c["name"] for c in report["checks"]] == CHECKS
    by = {c["name"]: c for c in report["checks"]}
    assert by["accelerate-deepspeed-zero2"]["status"] == "not run"
    assert by["accelerate-deepspeed-zero2"]["error"].startswith("GPU only")
    ran = [c for c in report["checks"] if c["status"] == "ok"]
    assert [c["name"] for c in ran] == CHECKS[:-1]
    for c in ran:
        assert (tmp_path / c["log"]).is_file() and c["seconds"] > 0
        for arm in c["report"]["arms"]:
            for key in ("seconds_per_step", "training_seconds", "peak_memory", "plan_peak"):
                assert arm[key] > 0, (c["name"], key)
            assert arm["achieved_tflops"]["training"] > 0 and arm["mfu"]["training"] > 0
            if arm["mode"] == "generate+train":
                assert arm["generation_seconds"] > 0 and arm["achieved_tflops"]["generation"] > 0
    preset = by["train-only-code-qwen-1gpu-lora-vpo"]["report"]
    assert preset["mode"] == "train-only" and preset["settings"]["lora_r"] == 32
    assert preset["arms"][0]["m"] == 3 and preset["arms"][0]["completion_tokens"] == 24
    assert preset["model"].startswith("Qwen2.5-Coder-1.5B-Instruct scaled to layers 1")
    fsdp = by["accelerate-fsdp2"]
    assert "accelerate.commands.launch --config_file infra/accelerate/fsdp.yaml" in fsdp["command"]
    assert fsdp["distributed_type"] == "NO" and "not FSDP" in fsdp["note"]  # said, not hidden
    table = (tmp_path / "gpu-check.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| ")]
    assert rows[0].startswith("| check | arm | shape | s/step | generation s | training s | training TFLOP/s | MFU")
    assert len(rows) == 1 + 2 + 1 + 1 + 1 + 1  # header, step-short (grpo, vpo), one arm each, the not-run row
    assert "| accelerate-deepspeed-zero2 | - | not run: " in table and table.rstrip().endswith("All checks passed.")
    assert table in proc.stdout
