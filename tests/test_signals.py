"""Stopping a long-running command while a training run is in flight: `vpo run`, `vpo flow`, `vpo ui`
and `vpo serve` get SIGTERM (or SIGINT), and each must be gone within a bounded time, exit 143 (130),
say one line, print no traceback, and leave nothing it started running -- stage processes, the flow
runs a served deployment started, a Prefect server it started -- while a Prefect server it did not
start keeps answering.

Every test starts from a folder whose data, rewards and 1-layer base model were built once per
session (tests/support/faults.py), with ``trainer.max_steps`` far beyond what the test waits
for, and signals the command as soon as a `vpo stage train` process runs. How long the command lived
after the signal is printed (``pytest -rP`` shows it) and bounded by :data:`BOUND_S`: generous,
absolute, and far below what finishing the training would take.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.faults import copy_prepared, prepared_run, vpo_env
from tests.support.procs import Descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BOUND_S = 60.0
"""The most a command may live after the signal (it stops within seconds; training would take hours)."""
TRAINING = ["--set", "trainer.max_steps=5000"]
_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.argv[1], sys.argv[1:])")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Command:
    """A `vpo` command in a subprocess (SIGINT at its default even when the suite runs in the
    background), its output collected by a thread, its descendants watched."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        vpo = str(Path(sys.executable).with_name("vpo"))
        self.proc = subprocess.Popen([sys.executable, "-c", _SIGINT_DEFAULT, vpo, *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.watch = Descendants(self.proc.pid).__enter__()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what: str, timeout: float = 420) -> None:
        """Until a line contains ``what`` (fails with the output if the command ends or time runs out)."""
        deadline = time.monotonic() + timeout
        while not any(what in line for line in self.lines):
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {what!r}:\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {what!r} within {timeout:.0f} s:\n{self.output[-4000:]}"
            time.sleep(0.2)

    def wait_for_training(self, timeout: float = 420) -> None:
        """Until a `vpo stage train` process runs below the command and has said so."""
        deadline = time.monotonic() + timeout
        while True:
            self.watch.snapshot()
            if self.watch.matching("stage train") and any("train@" in line for line in self.lines):
                break
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before training:\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no training within {timeout:.0f} s:\n{self.output[-4000:]}"
            time.sleep(0.2)
        time.sleep(2)  # inside the run: model loaded, first steps going

    def stop_with(self, sig: int) -> float:
        """Send ``sig``; the seconds the command lived after it (fails past :data:`BOUND_S`)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            pytest.fail(f"still running {BOUND_S:.0f} s after {signal.Signals(sig).name}:\n{self.output[-4000:]}")
        lived = time.monotonic() - t0
        self._reader.join(timeout=30)
        return lived

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.watch.__exit__(None, None, None)


@pytest.fixture
def folder(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A copy of the prepared folder (data, rewards, base built): training is the next thing to run."""
    return copy_prepared(prepared_run(tmp_path_factory.getbasetemp() / "prepared"), tmp_path / "work").parent


@pytest.fixture(scope="module")
def outside_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Prefect server this test module started: the commands may use it, never stop it."""
    from flows.server import LocalServer

    server = LocalServer(tmp_path_factory.mktemp("outside-prefect"), _free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _env(tmp_path: Path, api: str | None = None) -> dict[str, str]:
    env = vpo_env({"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_RUNNER_POLL_FREQUENCY": "1",
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PATH": f"{Path(sys.executable).parent}"
                   f"{os.pathsep}{os.environ.get('PATH', '')}"})
    env.pop("PREFECT_API_URL", None)
    if api is not None:
        env["PREFECT_API_URL"] = api
    return env


def _stopped(cmd: Command, sig: int, lived: float, name: str) -> str:
    """The checks every stop shares: exit code, one line, no traceback, nothing left; its line."""
    out = cmd.output
    print(f"{name} lived {lived:.1f} s after {signal.Signals(sig).name} with a training run in flight")
    assert cmd.proc.returncode == 128 + sig, out[-4000:]
    word = "interrupted" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}"
    lines = [ln for ln in out.splitlines() if ln.startswith(f"[vpo] {word}")]
    assert len(lines) == 1, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    assert cmd.watch.alive() == [], out[-3000:]
    return lines[0]


def _stop_in_training(args: list[str], folder: Path, env: dict[str, str], sig: int,
                      first: Callable[[Command], object] | None = None) -> tuple[str, Command]:
    """Start `vpo ARGS`, (``first``, then) wait for a training run, send ``sig``: the command's one stop
    line, after the checks every stop shares (:func:`_stopped`)."""
    cmd = Command(args, folder, env)
    try:
        if first is not None:
            first(cmd)
        cmd.wait_for_training()
        lived = cmd.stop_with(sig)
        return _stopped(cmd, sig, lived, f"vpo {args[0]}"), cmd
    finally:
        cmd.close()


def test_vpo_run_stops_within_seconds_of_sigterm(folder: Path, tmp_path: Path) -> None:
    line, _ = _stop_in_training(["run", "--quick", *TRAINING], folder, _env(tmp_path), signal.SIGTERM)
    assert "again to resume" in line


def test_vpo_flow_stops_its_stages_and_prefects_temporary_server_on_sigterm(folder: Path, tmp_path: Path) -> None:
    """Prefect's flow engine replaces the command's SIGTERM handler while the flow runs: the stage
    processes must stop all the same, at once, not when the training ends."""
    line, cmd = _stop_in_training(["flow", "--quick", *TRAINING], folder, _env(tmp_path), signal.SIGTERM)
    assert "the running stages and Prefect's temporary server were stopped" in line
    assert cmd.watch.matching("uvicorn"), cmd.watch.seen  # Prefect's temporary server ran, and is gone


def test_vpo_flow_on_ctrl_c_leaves_a_server_it_did_not_start(folder: Path, tmp_path: Path, outside_server: Any) -> None:
    from flows.server import healthy

    api = outside_server.api_url
    line, _ = _stop_in_training(["flow", "--quick", *TRAINING], folder, _env(tmp_path, api), signal.SIGINT)
    assert f"the Prefect server at {api} is not this command's: left running" in line
    assert healthy(api)


def test_vpo_ui_stops_its_server_and_stages_on_sigterm(folder: Path, tmp_path: Path) -> None:
    from flows.server import healthy

    port = _free_port()
    line, cmd = _stop_in_training(["ui", "--quick", "--port", str(port), *TRAINING], folder, _env(tmp_path),
                                  signal.SIGTERM)
    assert "the local Prefect server and the running stage were stopped" in line
    assert cmd.watch.matching("server start") and not healthy(f"http://127.0.0.1:{port}/api")


def test_vpo_ui_on_ctrl_c_leaves_the_server_it_reused(folder: Path, tmp_path: Path, outside_server: Any) -> None:
    from flows.server import healthy

    line, _ = _stop_in_training(["ui", "--quick", "--port", str(outside_server.port), *TRAINING], folder,
                                _env(tmp_path), signal.SIGINT, lambda cmd: cmd.wait_for("reusing the Prefect server"))
    assert f"the Prefect server at {outside_server.url} was left running (this command did not start it)" in line
    assert healthy(outside_server.api_url)


def _start_a_run(api: str) -> Any:
    """A flow run of the served deployment, started now through the API (as the UI's "Run" does)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + 180
    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        while True:
            try:
                deployment = client.read_deployment_by_name("retrain/nightly")
                break
            except Exception:  # noqa: BLE001 (not registered yet)
                assert time.monotonic() < deadline, "the deployment was never registered"
                time.sleep(1)
        return client.create_flow_run_from_deployment(deployment.id).id


def _run_state(api: str, run_id: Any) -> str:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state
    return state.type.value if state is not None else "none"


def test_vpo_serve_cancels_its_running_flow_run_and_stops_its_server_on_sigterm(folder: Path, tmp_path: Path) -> None:
    """SIGTERM while a served run trains: the runner's shutdown is awaited (the flow run is cancelled,
    its stage processes stop with it), the schedule pauses, the local server stops."""
    from flows.server import healthy

    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"

    def serving(cmd: Command) -> None:
        cmd.wait_for("[vpo] serving deployment retrain/nightly")
        _start_a_run(api)

    line, cmd = _stop_in_training(["serve", "--quick", "--port", str(port), "--cron", "0 4 * * *", *TRAINING],
                                  folder, _env(tmp_path), signal.SIGTERM, serving)
    assert "runs were cancelled and its schedule paused; the local Prefect server was stopped" in line
    assert not healthy(api) and "never awaited" not in cmd.output


def test_vpo_serve_on_ctrl_c_cancels_the_run_and_leaves_a_server_it_did_not_start(
        folder: Path, tmp_path: Path, outside_server: Any) -> None:
    from flows.server import healthy

    api = outside_server.api_url
    runs: list[Any] = []

    def serving(cmd: Command) -> None:
        cmd.wait_for("[vpo] serving deployment retrain/nightly")
        runs.append(_start_a_run(api))

    line, _ = _stop_in_training(["serve", "--quick", "--cron", "0 4 * * *", *TRAINING], folder, _env(tmp_path, api),
                                signal.SIGINT, serving)
    assert f"the Prefect server at {api} is not this command's: left running" in line
    assert healthy(api) and _run_state(api, runs[0]) == "CANCELLED"
