"""The lifecycle of the generation server the train stage starts in vLLM server mode
(vpo.pipeline.engine.vllm_server): start, wait for ``/health/``, stop on success, on an error, on Ctrl-C
and on SIGTERM; a server that never answers and one that dies mid-run fail with one line each.

These tests replace `trl vllm-serve` with a small HTTP stand-in (tests/support/vllm_standin.py) that
answers the health check and nothing else: they check the lifecycle only, never generation (vLLM needs a
GPU and its own environment, docs/gpu.md). The command the stage would start is checked as text."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.vllm_standin import server_command

STANDIN = Path(__file__).parent / "support" / "vllm_standin.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spec(tmp_path: Path, *extra: str, timeout_s: float = 60.0) -> object:
    from vpo.pipeline.engine.vllm_server import ServerSpec

    port = _free_port()
    return ServerSpec(server_command(port, "--pidfile", str(tmp_path / "server.pid"), *extra),
                      f"http://127.0.0.1:{port}/health/", timeout_s, tmp_path / "logs" / "vllm.log")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _pid(tmp_path: Path) -> int:
    return int((tmp_path / "server.pid").read_text())


def test_server_is_started_waited_for_and_stopped_after_training(tmp_path: Path) -> None:
    from vpo.pipeline.engine.vllm_server import serving

    spec = _spec(tmp_path, "--start-after", "1")
    with serving(spec) as server:
        assert server.proc is not None and server.proc.poll() is None
        with urllib.request.urlopen(spec.health_url, timeout=5) as resp:
            assert resp.status == 200
    assert server.proc.poll() is not None and _gone(_pid(tmp_path))
    assert "standin: serving on 127.0.0.1:" in spec.log.read_text()


def test_server_is_stopped_when_training_fails(tmp_path: Path) -> None:
    from vpo.pipeline.engine.vllm_server import serving

    with pytest.raises(RuntimeError, match="the trainer failed"), serving(_spec(tmp_path)):
        raise RuntimeError("the trainer failed")
    assert _gone(_pid(tmp_path))


def test_a_server_that_never_answers_fails_in_one_line_after_the_timeout(tmp_path: Path) -> None:
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.engine.vllm_server import serving

    spec = _spec(tmp_path, "--never-answer", timeout_s=3)
    t0 = time.monotonic()
    with pytest.raises(StageError) as err, serving(spec):
        pytest.fail("training must not start")
    message = str(err.value)
    assert "\n" not in message and time.monotonic() - t0 < 30
    assert message.startswith(f"vLLM server did not answer {spec.health_url} within 3 s (trainer.vllm_server_timeout; "
                              "last: timed out); stopped it, see "), message
    assert _gone(_pid(tmp_path))


def test_a_server_that_exits_at_start_fails_in_one_line(tmp_path: Path) -> None:
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.engine.vllm_server import serving

    spec = _spec(tmp_path, "--exit-code", "3")
    with pytest.raises(StageError) as err, serving(spec):
        pytest.fail("training must not start")
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"vLLM server exited with 3 before {spec.health_url} answered (after ")
    assert "standin: failing at start with 3" in spec.log.read_text()


def test_a_missing_server_command_fails_in_one_line(tmp_path: Path) -> None:
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.engine.vllm_server import ServerSpec, serving

    spec = ServerSpec(("vpo-no-such-server-command",), "http://127.0.0.1:9/health/", 5.0, tmp_path / "vllm.log")
    with pytest.raises(StageError, match=r"^vLLM server: cannot start `vpo-no-such-server-command` \(No such file"), \
            serving(spec):
        pytest.fail("training must not start")


def test_a_server_that_dies_mid_run_stops_the_training_with_one_line(tmp_path: Path) -> None:
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.engine.vllm_server import serving

    spec = _spec(tmp_path, "--die-after", "2")
    t0 = time.monotonic()
    with pytest.raises(StageError) as err, serving(spec):
        while time.monotonic() - t0 < 120:  # "training": interrupted once the server is gone
            time.sleep(0.05)
        pytest.fail("the training went on without its server")
    message = str(err.value)
    assert "\n" not in message and time.monotonic() - t0 < 60
    assert message.startswith("vLLM server exited with 7 while the run was training; the training was stopped. See "), \
        message


_LAUNCHER = """
import subprocess, sys, time
from pathlib import Path
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
Path(sys.argv[1]).write_text(f"{rank.pid}")
rank.wait()
"""


def test_a_server_that_dies_under_a_launched_training_stops_its_processes(tmp_path: Path) -> None:
    """The accelerate path: the stage waits on a launcher (subprocess.run) whose rank processes train; the
    server's death ends the wait at once and no rank outlives it."""
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.engine.vllm_server import serving

    spec, ranks = _spec(tmp_path, "--die-after", "4"), tmp_path / "rank.pid"
    t0 = time.monotonic()
    with pytest.raises(StageError, match=r"^vLLM server exited with 7 while the run was training"), serving(spec):
        subprocess.run([sys.executable, "-c", _LAUNCHER, str(ranks)], check=False, timeout=240)
        pytest.fail("the launch went on without its server")
    assert time.monotonic() - t0 < 120
    rank = int(ranks.read_text())
    deadline = time.monotonic() + 10
    while not _gone(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(rank), "a rank process outlived the server"


@pytest.mark.integration
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_stop_the_server(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    """The vpo command's signal handling (stop_on_signals) around a serving block: the signal ends the
    command with 130 / 143 and the server's process group is gone."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(STANDIN), "hold", "--port", str(_free_port()), "--ready", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.2)
        server_pid = int(ready.read_text())
        assert not _gone(server_pid)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == code
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while not _gone(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(server_pid)


# --------------------------------------------------------------------------- what the stage starts


def _server_cfg(tmp_path: Path, **extra: object) -> object:
    from tests.support.faults import load_cfg, write_pipelines

    return load_cfg(write_pipelines(tmp_path), **{"trainer.use_vllm": True, "trainer.vllm_mode": "server",
                                                  "execution.vllm_gpus": 2, **extra})


def test_the_stage_starts_trl_vllm_serve_on_the_reserved_gpus(tmp_path: Path) -> None:
    from vpo.pipeline.config.layout import RunLayout, arm_runs
    from vpo.pipeline.engine.context import StageContext
    from vpo.pipeline.engine.execution import Machine, concurrency
    from vpo.pipeline.engine.vllm_server import spec_for, split_devices

    cfg = _server_cfg(tmp_path, **{"trainer.vllm_server_port": 8123, "trainer.vllm_max_model_length": 2048})
    layout = RunLayout.of(cfg)
    run = arm_runs(cfg)[0]
    train, server = split_devices(("0", "1", "2", "3"), 2, "here")
    assert (train, server) == (("0", "1"), ("2", "3"))
    spec = spec_for(StageContext(cfg, layout, "train", run), server)
    assert spec.command == ("trl", "vllm-serve", "--model", str(layout.base), "--host", "0.0.0.0", "--port", "8123",
                            "--tensor_parallel_size", "1", "--data_parallel_size", "2",
                            "--gpu_memory_utilization", "0.3", "--max_model_len", "2048")
    from trl.scripts.vllm_serve import make_parser

    (args,) = make_parser().parse_args_into_dataclasses(list(spec.command[2:]))  # TRL's own parser takes it
    assert (args.port, args.data_parallel_size, args.max_model_len) == (8123, 2, 2048)
    assert spec.health_url == "http://127.0.0.1:8123/health/" and spec.timeout_s == 240.0
    assert spec.env()["CUDA_VISIBLE_DEVICES"] == "2,3"
    # a run takes its training GPU and the server's: an 8-GPU machine holds two such runs at once
    assert concurrency(cfg, 4, Machine(16, tuple(str(i) for i in range(8)))).devices_per_stage == 3
    own = _server_cfg(tmp_path / "own", **{"execution.vllm_command": ["my-server", "--port={port}", "{model}"]})
    assert spec_for(StageContext(own, RunLayout.of(own), "train", arm_runs(own)[0]), server).command == (
        "my-server", "--port=8000", str(RunLayout.of(own).base))


def test_split_and_settings_refuse_what_cannot_work(tmp_path: Path) -> None:
    from tests.support.faults import load_cfg, write_pipelines
    from vpo.pipeline.config import ConfigError
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.engine.vllm_server import split_devices

    with pytest.raises(StageError, match=r"^here: execution.vllm_gpus 2 leaves no GPU to train on \(2 visible: 0,1\)"):
        split_devices(("0", "1"), 2, "here")
    config = write_pipelines(tmp_path)
    with pytest.raises(ConfigError, match=r"needs a server: trainer.vllm_server_base_url \(one you run\) or "
                                          r"execution.vllm_gpus"):
        load_cfg(config, **{"trainer.use_vllm": True, "trainer.vllm_mode": "server"})
    with pytest.raises(ConfigError, match=r"execution.vllm_gpus \(1\) keeps GPUs for a generation server: it needs "
                                          r"trainer.use_vllm: true and trainer.vllm_mode: server"):
        load_cfg(config, **{"execution.vllm_gpus": 1})


def test_the_memory_plan_and_the_hardware_check_count_the_server_gpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vpo.memory import device_by_name
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.engine.preflight import check_hardware
    from vpo.pipeline.memory import plan_pipeline

    cfg = _server_cfg(tmp_path, **{"storage.runs_dir": str(tmp_path / "runs")})
    plans = dict(plan_pipeline(cfg, device=device_by_name("h100-80gb")))
    notes = [n for n in plans["route/vpo"].notes if n.startswith("vLLM server mode:")]
    assert notes == [("vLLM server mode: 2 GPUs per run kept for the generation server (execution.vllm_gpus), not "
                      "planned here; a node gives the run 1 training + 2 server = 3 GPUs")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(StageError, match=r"a run needs 1 training GPU \(trainer.accelerate_config\) \+ 2 for its vLLM "
                                         r"server \(execution.vllm_gpus\) on this node, and 2 are visible"):
        check_hardware(cfg, cuda=True)
