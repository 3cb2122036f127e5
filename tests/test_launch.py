"""`trainer.accelerate_config` reaches the launcher: the train stage runs itself under
`accelerate launch --config_file` (here 2 CPU processes with gloo, the same path a multi-GPU
DeepSpeed/FSDP config takes), both ranks train, rank 0 publishes, the parent records the output."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from tests.test_faults_support import RUN_NAME, copy_prepared, prepared_run, run_vpo


@pytest.mark.slow
@pytest.mark.integration
def test_train_stage_runs_under_accelerate_launch(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
                                                  ) -> None:
    config = copy_prepared(prepared_run(tmp_path_factory.getbasetemp()), tmp_path / "work")
    with socket.socket() as sock:  # gloo with port 0 hangs here: pick a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    accel = config.parent / "cpu2.yaml"
    accel.write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2,
        "num_machines": 1, "machine_rank": 0, "main_process_ip": "127.0.0.1", "main_process_port": port,
        "use_cpu": True, "mixed_precision": "no", "rdzv_backend": "static", "same_network": True}))
    proc = run_vpo(["stage", "train", "--quick", "--config", "pipelines.yaml", "--arm", "vpo", "--seed", "0",
                    "--set", "trainer.accelerate_config=cpu2.yaml", "--set", "trainer.max_steps=2",
                    "--set", "arms.vpo.max_completion_length=32"], config.parent, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vpo-s0: launching `accelerate launch --config_file cpu2.yaml`" in proc.stdout
    arm = config.parent / "runs" / RUN_NAME / "arms" / "vpo-s0"
    history = [r for r in json.loads((arm / "history.json").read_text()) if "loss" in r]
    assert [r["step"] for r in history] == [1, 2]
    state = json.loads((arm / "stage.json").read_text())
    assert state["params"]["trainer"]["accelerate_config"] == "cpu2.yaml" and "model/model.safetensors" in state["files"]
    assert not (arm / "trainer").exists()
