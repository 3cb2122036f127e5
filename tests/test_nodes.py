"""One training run over two nodes, on one machine: each "node" is its own `vpo stage train` process in
its own copy of the prepared run folder (no shared disk), started with VPO_NODE_RANK / VPO_MAIN_ADDR /
VPO_MAIN_PORT the way a work-pool flow run, a pod of the k8s indexed Job or a Slurm task starts it; the
two join over gloo on 127.0.0.1 and train 2 steps with one CPU process each. Their weights must equal a
one-node run with two processes and the same seed. Also: how a node's role is read, the rendezvous that
times out (one line naming address and port) and a node killed mid-run (one line naming it and the
command that resumes)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.support.faults import (
    RUN_NAME,
    VPO,
    copy_prepared,
    load_cfg,
    prepared_run,
    run_vpo,
    vpo_env,
    write_pipelines,
)

ARM = Path("runs") / RUN_NAME / "arms" / "vpo-s0"


def _free_port() -> int:
    with socket.socket() as sock:  # gloo with port 0 hangs: pick a free port
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _accelerate(folder: Path, name: str, processes: int, machines: int = 1) -> str:
    """An accelerate config of CPU processes launched through torchrun (MULTI_GPU + use_cpu: gloo)."""
    (folder / name).write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": processes,
        "num_machines": machines, "machine_rank": 0, "main_process_ip": "127.0.0.1", "main_process_port": _free_port(),
        "use_cpu": True, "mixed_precision": "no", "rdzv_backend": "static", "same_network": True}))
    return name


def _train_args(accel: str, *extra: str, steps: int = 2) -> list[str]:
    return ["stage", "train", "--quick", "--config", "pipelines.yaml", "--arm", "vpo", "--seed", "0",
            "--set", f"trainer.accelerate_config={accel}", "--set", f"trainer.max_steps={steps}",
            "--set", "arms.vpo.max_completion_length=32", *extra]


def _start_node(folder: Path, args: list[str], rank: int, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = vpo_env({"VPO_NODE_RANK": str(rank), "VPO_MAIN_ADDR": "127.0.0.1", "VPO_MAIN_PORT": str(port)})
    with open(log, "wb") as out:
        return subprocess.Popen([str(VPO), *args], cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    from vpo.pipeline.engine.processes import kill_group

    for proc in procs:
        if proc.poll() is None:
            kill_group(proc)


def _weights(folder: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return load_file(str(folder / ARM / "model" / "model.safetensors"))


# --------------------------------------------------------------------------- the node's role


def test_node_role_reads_rank_address_and_port_from_the_environment(tmp_path: Path) -> None:
    from vpo.pipeline.config.settings import world_size
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.engine.nodes import node_role

    config = write_pipelines(tmp_path)
    _accelerate(tmp_path, "two.yaml", processes=16, machines=2)  # accelerate counts both machines' processes
    cfg = load_cfg(config, **{"trainer.accelerate_config": "two.yaml"})
    assert world_size(cfg) == 16
    role = node_role(cfg, {"JOB_COMPLETION_INDEX": "1", "VPO_MAIN_ADDR": "vpo-train-0.vpo-train", "VPO_MAIN_PORT": "29600"})
    assert role is not None and (role.rank, role.nodes, role.per_node, role.world) == (1, 2, 8, 16)
    assert role.describe().startswith("node 1 of 2 (ranks 8-15 of 16, node rank from JOB_COMPLETION_INDEX); "
                                      "rank 0 is node 0 at vpo-train-0.vpo-train:29600")
    args = role.launch_args()
    assert args[args.index("--machine_rank") + 1] == "1" and args[args.index("--num_processes") + 1] == "16"
    # execution.nodes scales a one-machine config: its num_processes are one node's
    _accelerate(tmp_path, "one.yaml", processes=8)
    cfg3 = load_cfg(config, **{"trainer.accelerate_config": "one.yaml", "execution.nodes": 3})
    assert world_size(cfg3) == 24
    assert node_role(load_cfg(config, **{"trainer.accelerate_config": "one.yaml"}), {}) is None  # one node
    with pytest.raises(StageError, match=r"this node's rank is not set; start each node with VPO_NODE_RANK=0..2"):
        node_role(cfg3, {})
    with pytest.raises(StageError, match=r"VPO_NODE_RANK='3' is not a node rank 0..2"):
        node_role(cfg3, {"VPO_NODE_RANK": "3"})
    with pytest.raises(StageError, match=r"needs trainer.accelerate_config"):
        node_role(load_cfg(config, **{"execution.nodes": 2}), {"VPO_NODE_RANK": "0"})


def test_max_parallel_counts_runs_with_each_node_s_gpus(tmp_path: Path) -> None:
    """Arms and nodes compose: a 2-node run of 8 processes per node takes 8 GPUs of each node, so an
    8-GPU node holds one run at a time; max_parallel is a number of runs."""
    from vpo.pipeline.engine.execution import Machine, concurrency

    config = write_pipelines(tmp_path)
    _accelerate(tmp_path, "one.yaml", processes=8)
    cfg = load_cfg(config, **{"trainer.accelerate_config": "one.yaml", "execution.nodes": 2})
    ex = concurrency(cfg, 4, Machine(16, tuple(str(i) for i in range(16))))
    assert (ex.max_parallel, ex.devices_per_stage) == (2, 8)


# --------------------------------------------------------------------------- two nodes on loopback


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_two_nodes_train_the_weights_of_one_node_with_two_processes(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    import torch

    prepared = prepared_run(tmp_path_factory.getbasetemp())
    one, node0, node1 = (copy_prepared(prepared, tmp_path / n).parent for n in ("one", "node0", "node1"))
    # the reference: one node, two processes
    proc = run_vpo(_train_args(_accelerate(one, "cpu2.yaml", processes=2)), one, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # two nodes of one process each, each in its own folder, started as a pool worker or a pod would be
    port = _free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = []
    try:
        for rank, folder in enumerate((node0, node1)):
            args = _train_args(_accelerate(folder, "cpu1.yaml", processes=1), "--set", "execution.nodes=2")
            procs.append(_start_node(folder, args, rank, port, logs[rank]))
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        _stop(*procs)
    out = [log.read_text() for log in logs]
    assert codes == [0, 0], out[0][-3000:] + "\n----\n" + out[1][-3000:]
    assert f"vpo-s0: node 0 of 2 (rank 0 of 2, node rank from VPO_NODE_RANK); rank 0 is node 0 at 127.0.0.1:{port}" \
        in out[0]
    assert f"vpo-s0: node 1 of 2 (rank 1 of 2, node rank from VPO_NODE_RANK); rank 0 is node 0 at 127.0.0.1:{port}" \
        in out[1]
    rank_logs = sorted((node1 / "runs" / RUN_NAME / "logs" / "ranks").glob("vpo-s0-node1-*/*/attempt_0/0/stdout.log"))
    assert rank_logs, "node 1's rank log"
    assert "node 1 of 2 finished its ranks (1); node 0 publishes the run" in out[1]
    # node 0 published and recorded the run; node 1 wrote none of its outputs
    assert json.loads((node0 / ARM / "metrics.json").read_text())["batch"]["world_size"] == 2
    assert (node0 / ARM / "stage.json").is_file()
    assert not (node1 / ARM / "model").exists() and not (node1 / ARM / "stage.json").exists()
    ref, two = _weights(one), _weights(node0)
    assert ref.keys() == two.keys()
    diff = max(float((ref[k].double() - two[k].double()).abs().max()) for k in ref)
    moved = max(float((ref[k].double() - _base(one)[k].double()).abs().max()) for k in ref)
    print(f"two nodes vs one node, two processes: max |weight difference| {diff:.3g} (training moved weights by up "
          f"to {moved:.3g})")
    assert moved > 0
    assert diff == 0.0 or all(torch.allclose(ref[k], two[k], rtol=0, atol=1e-6) for k in ref), diff


def _base(folder: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return load_file(str(folder / "runs" / RUN_NAME / "base" / "model.safetensors"))


# --------------------------------------------------------------------------- faults past one node


def _kill_node(pid: int) -> None:
    """What losing a machine does to its processes: every one of them SIGKILLed at once."""
    import os

    from vpo.pipeline.engine.processes import descendants

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            continue


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_rendezvous_nobody_joins_names_its_address_and_port(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = copy_prepared(prepared_run(tmp_path_factory.getbasetemp()), tmp_path / "node0").parent
    port = _free_port()
    args = _train_args(_accelerate(folder, "cpu1.yaml", processes=1), "--set", "execution.nodes=2",
                       "--set", "execution.rendezvous_timeout=5")
    proc = run_vpo(args, folder, timeout=500, env={"VPO_NODE_RANK": "0", "VPO_MAIN_ADDR": "127.0.0.1",
                                                   "VPO_MAIN_PORT": str(port)})
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert errors == [(f"error: vpo-s0: node 0 of 2: the rendezvous at "
                       f"127.0.0.1:{port} timed out after 5 s (node 1 never joined); start every node's command within "
                       f"execution.rendezvous_timeout, with VPO_MAIN_ADDR=127.0.0.1 VPO_MAIN_PORT={port} reachable "
                       "from each")], proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_a_node_killed_mid_run_fails_the_run_naming_it_and_the_resume_command(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    prepared = prepared_run(tmp_path_factory.getbasetemp())
    node0, node1 = (copy_prepared(prepared, tmp_path / n).parent for n in ("node0", "node1"))
    port, logs, procs = _free_port(), [tmp_path / "node0.log", tmp_path / "node1.log"], []
    try:
        for rank, folder in enumerate((node0, node1)):
            args = _train_args(_accelerate(folder, "cpu1.yaml", processes=1), "--set", "execution.nodes=2", steps=30)
            procs.append(_start_node(folder, args, rank, port, logs[rank]))
        progress = node0 / ARM / "progress.json"
        deadline = time.monotonic() + 800
        while not progress.exists():  # node 0 logged its first step: both nodes are training
            assert procs[0].poll() is None and procs[1].poll() is None, logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        _kill_node(procs[1].pid)  # node 1 lost: its command, its launcher and every rank on it
        code = procs[0].wait(timeout=300)
    finally:
        _stop(*procs)
    text = logs[0].read_text()
    assert code != 0, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text[-3000:]
    assert errors[0].startswith("error: vpo-s0: node 0 of 2: node 1 "
                                "stopped mid-run (its ranks' connections closed) after "), errors[0]
    print(errors[0])
    resume = errors[0].split("resume with `", 1)[1].split("`", 1)[0]
    assert " stage train " in resume and "--arm vpo --seed 0" in resume and "execution.nodes=2" in resume
    assert "on every node (same VPO_NODE_RANK each); it resumes from node 0's newest local checkpoint" in errors[0]


def test_a_node_other_than_0_never_records_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vpo stage train` on node 1 trains its share and records nothing (the CLI takes that path); running
    the stage through the runner there (what `vpo run` would do) is refused in one line."""
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.runner import run_step
    from vpo.pipeline.steps import steps_of

    config = write_pipelines(tmp_path)
    _accelerate(tmp_path, "one.yaml", processes=1)
    cfg = load_cfg(config, **{"trainer.accelerate_config": "one.yaml", "execution.nodes": 2})
    monkeypatch.setenv("VPO_NODE_RANK", "1")
    monkeypatch.setenv("VPO_MAIN_ADDR", "127.0.0.1")
    step = next(s for s in steps_of(cfg, ["train"]) if s.run.rid == "vpo-s0")
    with pytest.raises(StageError, match=r"^train@vpo-s0: this is node 1 of 2 \(rank 1 of 2, node rank from "
                                         r"VPO_NODE_RANK\): node 0 runs the pipeline and records the run; here run "
                                         r"only `vpo stage train --arm vpo --seed 0`"):
        run_step(cfg, step, progress=False)


@pytest.mark.integration  # starts node 0's heartbeat store (a TCP server) on loopback
def test_the_heartbeat_names_the_node_that_stopped_among_three() -> None:
    """Three nodes' heartbeats (threads here) on node 0's store: when node 2 stops beating, nodes 0 and 1
    both name it, and the failure line says it."""
    from vpo.pipeline.engine.nodes import Heartbeat, NodeRole, diagnose

    port = _free_port()
    roles = [NodeRole(r, 3, 1, "127.0.0.1", port, "VPO_NODE_RANK", 30) for r in range(3)]
    beats = [Heartbeat(role) for role in roles]
    try:
        for beat in beats:
            beat.start()
        deadline = time.monotonic() + 60
        while any(b._store is None for b in beats):  # connected (node 0 hosts the store)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.5)
        beats[2].stop()
        assert beats[0].silent(wait_s=2.5) == [2]
        assert beats[1].silent(wait_s=2.5) == [2]
    finally:
        for beat in beats:
            beat.stop()
    line = diagnose(roles[0], ["RuntimeError: Connection closed by peer [127.0.0.1]:5555"], 1, 12.0, "vpo-s0",
                    "resume with `X` on every node", [2])
    assert line == ("vpo-s0: node 0 of 3: node 2 stopped mid-run (its ranks' connections closed) after 12 s; "
                    "resume with `X` on every node")
    assert diagnose(roles[0], ["Connection reset by peer"], 1, 5.0, "r", "R").startswith(
        "r: node 0 of 3: one of node 1, node 2 stopped mid-run")  # no heartbeat: no guess past two nodes
