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
    for r in report["arms"]:
        assert r["m"] == (3 if r["arm"] == "vpo" else 1)
        for key in ("seconds_per_step", "tokens_per_second", "peak_memory", "plan_peak", "plan_over_measured",
                    "plan_seconds_per_step"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (r["arm"], key, r[key])
        assert r["generated_tokens_per_step"] == 2 * 2 * 6 * r["m"]
        assert r["peak_memory_kind"].startswith("peak RSS")
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
