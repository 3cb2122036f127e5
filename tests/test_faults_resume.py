"""Fault: a training stage SIGKILLed mid-run, inside a checkpoint save; the rerun resumes.

The killed run has a complete checkpoint-3, lost the work of steps 4-6 and left checkpoint-6 torn
(weights and optimizer written, no RNG state or trainer_state.json). Rerunning the same command must
skip the torn checkpoint, resume from checkpoint-3 (step 3, not 0: optimizer, scheduler, RNG and data
position restored) and end where an uninterrupted run with the same seed ends: the same advantages
at every step, the same per-step logs, the same final metrics and parameters.

Measured tolerance: bitwise equality (max |difference| 0.0) on CPU with one thread, once the VPO
weight generator's per-step call counter restarts with each step (before that fix the resumed run
drew other Dirichlet weights from step 3 on and its advantages differed by up to ~1).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support.faults import RUN_NAME, copy_prepared, prepared_run, start_wrapper, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # training processes killed mid-run and resumed

STEPS, SAVE_STEPS, KILL_IN_SAVE = 8, 3, 6
TOLERANCE = 0.0  # measured: resumed and uninterrupted runs are bitwise identical
TIMING_KEYS = ("runtime", "per_second", "step_time", "train_seconds", "total_flos")


def _train_args(steps: int = STEPS, save_steps: int = SAVE_STEPS) -> list[str]:
    return [
        "stage",
        "train",
        "--quick",
        "--config",
        "pipelines.yaml",
        "--arm",
        "vpo",
        "--seed",
        "0",
        "--set",
        f"trainer.max_steps={steps}",
        "--set",
        f"trainer.save_steps={save_steps}",
        "--set",
        "arms.vpo.max_completion_length=32",
    ]


def _advantages(record: Path) -> dict[int, list[float]]:
    """Last recorded advantages per step (a resumed run redoes the steps the killed one lost)."""
    out: dict[int, list[float]] = {}
    for line in record.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the SIGKILL
            continue
        out[rec["step"]] = rec["advantages"]
    return out


def _steps(record: Path) -> list[int]:
    return [json.loads(line)["step"] for line in record.read_text().splitlines() if line.endswith("}")]


def _step_logs(arm: Path) -> dict[int, dict[str, float]]:
    """Per-step training logs from history.json, timing fields dropped."""
    out = {}
    for rec in json.loads((arm / "history.json").read_text()):
        if "loss" in rec:
            out[rec["step"]] = {k: v for k, v in rec.items() if not any(t in k for t in TIMING_KEYS)}
    return out


def _max_diff(a: Any, b: Any) -> float:
    import numpy as np

    return float(
        np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)), initial=0.0)
    )


@pytest.mark.timeout(600)
def test_sigkill_mid_training_resumes_from_last_complete_checkpoint(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Kill inside the save of checkpoint-6, rerun: resume from 3, match an uninterrupted run."""
    from safetensors.torch import load_file

    from vpo.pipeline.engine.checkpoints import checkpoint_problem, latest_checkpoint

    prepared = prepared_run(tmp_path_factory.getbasetemp(), task="faulttoy")
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    copy_prepared(prepared, ref_dir)
    copy_prepared(prepared, run_dir)
    ref_rec, run_rec, marker = tmp_path / "ref.jsonl", tmp_path / "run.jsonl", tmp_path / "paused"
    # the uninterrupted reference and the run to kill start together (2 cores)
    ref = start_wrapper(_train_args(), ref_dir, tmp_path / "ref.log", record=ref_rec)
    victim = start_wrapper(
        _train_args(),
        run_dir,
        tmp_path / "victim.log",
        record=run_rec,
        pause_in_save=KILL_IN_SAVE,
        marker=marker,
    )
    wait_for(marker, victim, 300, tmp_path / "victim.log")
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(30) == -signal.SIGKILL

    arm = run_dir / "runs" / RUN_NAME / "arms" / "vpo-s0"
    trainer_dir = arm / "trainer"
    assert checkpoint_problem(trainer_dir / "checkpoint-3") is None
    assert checkpoint_problem(trainer_dir / f"checkpoint-{KILL_IN_SAVE}") is not None, (
        "checkpoint-6 should be torn"
    )
    assert (trainer_dir / f"checkpoint-{KILL_IN_SAVE}" / "model.safetensors").is_file()
    assert latest_checkpoint(trainer_dir) == trainer_dir / "checkpoint-3"
    assert not (arm / "metrics.json").exists() and not (arm / "model").exists(), (
        "a killed run published outputs"
    )
    assert _steps(run_rec) == list(range(KILL_IN_SAVE)), (
        "the victim should have run steps 0-5 before the kill"
    )

    resumed = start_wrapper(_train_args(), run_dir, tmp_path / "resume.log", record=run_rec)
    assert resumed.wait(300) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    assert ref.wait(300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    resume_log = (tmp_path / "resume.log").read_text()
    assert f"skipping damaged checkpoint {trainer_dir / f'checkpoint-{KILL_IN_SAVE}'}" in resume_log
    assert "resuming from checkpoint-3 (step 3 of 8)" in resume_log

    # resumed at step 3, not 0: the second process's first batch is step 3
    steps = _steps(run_rec)
    assert steps[KILL_IN_SAVE:] == list(range(3, STEPS)), steps
    metrics = json.loads((arm / "metrics.json").read_text())
    ref_arm = ref_dir / "runs" / RUN_NAME / "arms" / "vpo-s0"
    ref_metrics = json.loads((ref_arm / "metrics.json").read_text())
    assert metrics["resumed_from"] == "checkpoint-3" and ref_metrics["resumed_from"] is None
    history = json.loads((arm / "history.json").read_text())
    assert [r["step"] for r in history if "loss" in r] == list(range(1, STEPS + 1))
    assert not trainer_dir.exists(), "resume checkpoints (optimizer states) outlived the finished run"

    # same advantages at every step, same logs, metrics and parameters as the uninterrupted run
    adv, ref_adv = _advantages(run_rec), _advantages(ref_rec)
    assert sorted(adv) == sorted(ref_adv) == list(range(STEPS))
    assert any(_max_diff(ref_adv[s], 0.0) > 0 for s in ref_adv), (
        "advantages all zero: the check would be vacuous"
    )
    adv_diff = max(_max_diff(adv[s], ref_adv[s]) for s in ref_adv)
    logs, ref_logs = _step_logs(arm), _step_logs(ref_arm)
    assert sorted(logs) == sorted(ref_logs) == list(range(1, STEPS + 1))
    log_diff = max(_max_diff(logs[s][k], ref_logs[s][k]) for s in ref_logs for k in ref_logs[s])
    metric_diff = max(_max_diff(metrics["final"][k], ref_metrics["final"][k]) for k in ref_metrics["final"])
    params, ref_params = (
        load_file(str(arm / "model" / "model.safetensors")),
        load_file(str(ref_arm / "model" / "model.safetensors")),
    )
    assert sorted(params) == sorted(ref_params)
    param_diff = max(_max_diff(params[k], ref_params[k]) for k in ref_params)
    base = load_file(str(run_dir / "runs" / RUN_NAME / "base" / "model.safetensors"))
    assert max(_max_diff(ref_params[k], base[k]) for k in base) > 0, "training did not move the parameters"
    print(
        f"max |diff| resumed vs uninterrupted: advantages {adv_diff}, step logs {log_diff}, "
        f"final metrics {metric_diff}, parameters {param_diff}"
    )
    assert adv_diff <= TOLERANCE and log_diff <= TOLERANCE
    assert metric_diff <= TOLERANCE and param_diff <= TOLERANCE


@pytest.mark.timeout(600)
def test_kill_while_publishing_the_final_model_resumes_without_extra_steps(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Killed after its last checkpoint (step 8 of 8), while saving the final model: the rerun trains
    no step more, publishes checkpoint-8's weights, and they equal an uninterrupted run's."""
    from safetensors.torch import load_file

    args = _train_args(steps=8, save_steps=4)
    prepared = prepared_run(tmp_path_factory.getbasetemp(), task="faulttoy")
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    copy_prepared(prepared, ref_dir)
    copy_prepared(prepared, run_dir)
    run_rec, marker = tmp_path / "run.jsonl", tmp_path / "paused"
    ref = start_wrapper(args, ref_dir, tmp_path / "ref.log")
    victim = start_wrapper(args, run_dir, tmp_path / "victim.log", record=run_rec, pause_in_publish=True,
                           marker=marker)
    wait_for(marker, victim, 300, tmp_path / "victim.log")
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(30) == -signal.SIGKILL
    arm = run_dir / "runs" / RUN_NAME / "arms" / "vpo-s0"
    assert (arm / "trainer" / "checkpoint-8" / "trainer_state.json").is_file()
    assert not (arm / "model").exists()
    assert _steps(run_rec) == list(range(8))

    resumed = start_wrapper(args, run_dir, tmp_path / "resume.log", record=run_rec)
    assert resumed.wait(300) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    assert ref.wait(300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    assert "checkpoint-8 is at the requested 8 steps; publishing its weights" in (tmp_path / "resume.log").read_text()
    assert _steps(run_rec) == list(range(8)), "the rerun trained again"
    history = json.loads((arm / "history.json").read_text())
    assert [r["step"] for r in history if "loss" in r] == list(range(1, 9))
    metrics = json.loads((arm / "metrics.json").read_text())
    assert metrics["resumed_from"] == "checkpoint-8" and metrics["max_steps"] == 8
    ref_arm = ref_dir / "runs" / RUN_NAME / "arms" / "vpo-s0"
    params = load_file(str(arm / "model" / "model.safetensors"))
    ref_params = load_file(str(ref_arm / "model" / "model.safetensors"))
    assert sorted(params) == sorted(ref_params)
    assert max(_max_diff(params[k], ref_params[k]) for k in ref_params) <= TOLERANCE
    assert _step_logs(arm) == _step_logs(ref_arm)
