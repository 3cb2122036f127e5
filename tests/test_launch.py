"""`trainer.accelerate_config` reaches the launcher: the train stage runs itself under
`accelerate launch --config_file` (here 2 CPU processes with gloo, the same path a multi-GPU
DeepSpeed/FSDP config takes), both ranks train, rank 0 publishes, the parent records the output;
the batch the stage states on the console (TRL's semantics on the launch's world size) is the batch
the trainer consumed."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import yaml

from tests.support.faults import RUN_NAME, copy_prepared, prepared_run, run_vpo


@pytest.mark.slow
@pytest.mark.integration
def test_train_stage_runs_under_accelerate_launch(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
                                                  ) -> None:
    config = copy_prepared(prepared_run(tmp_path_factory.getbasetemp()), tmp_path / "work")
    with socket.socket() as sock:  # gloo with port 0 hangs here: pick a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    accel = config.parent / "cpu2.yaml"
    # MULTI_GPU with use_cpu: accelerate launches the processes through torchrun and each trains on CPU
    # (gloo); with distributed_type MULTI_CPU it would start one process unless MPI is configured
    accel.write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2,
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
    # stated: quick route, per_device_train_batch_size 8, G 4, 2 processes -> 16 completions = 4 prompts
    stated = re.search(r"vpo-s0: batch (\d+) prompts x 4 rollouts = (\d+) completions per optimizer step \(2 "
                       r"processes x 8 per device x 1 accumulation\)", proc.stdout)
    assert stated, proc.stdout[-3000:]
    prompts, completions = int(stated.group(1)), int(stated.group(2))
    assert (completions, prompts) == (16, 4)
    batch = json.loads((arm / "metrics.json").read_text())["batch"]
    assert (batch["world_size"], batch["prompts_per_optimizer_step"]) == (2, prompts)
    # consumed: the prompt groups the trainer generated and scored (gathered over both ranks)
    measured = batch["measured"]
    assert measured["optimizer_steps"] == 2 and measured["generation_rounds"] == 2
    assert measured["prompts_generated"] / measured["optimizer_steps"] == prompts
    state = json.loads((arm / "stage.json").read_text())
    assert state["params"]["trainer"]["accelerate_config"] == "cpu2.yaml" and "model/model.safetensors" in state["files"]
    assert not (arm / "trainer").exists()
