"""A local Prefect server for ``vpo ui``: started on loopback with ``PREFECT_HOME`` under the
repository (or an already healthy one on that port reused), the flow run against it, its UI address
printed, and the server stopped afterwards unless ``--keep``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flows.tasks import kill_group
from vpo.pipeline.storage import subprocess_env

__all__ = ["LocalServer", "Terminated", "run_with_local_server", "stop_on_signals"]


def _exe(name: str) -> str | None:
    """``name`` next to this interpreter (the project venv), else on PATH."""
    import shutil

    sibling = Path(sys.executable).with_name(name)
    return str(sibling) if sibling.exists() else shutil.which(name)


def _healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class LocalServer:
    """``prefect server start`` on loopback with ``PREFECT_HOME`` under the repository, or a healthy
    server already on that port (then it is reused and left running)."""

    def __init__(self, home: Path, port: int, host: str = "127.0.0.1") -> None:
        self.home, self.port, self.host = home, port, host
        self.url = f"http://{host}:{port}"
        self.api_url = f"{self.url}/api"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> None:
        """Start (or reuse) the server and wait until ``/api/health`` answers."""
        if _healthy(self.api_url):
            print(f"reusing the Prefect server already running at {self.url}")
            return
        self.home.mkdir(parents=True, exist_ok=True)
        log = open(self.home / "server.log", "ab")  # noqa: SIM115 (handed to the child)
        # the UI asks the server where the API is; without this it says :4200 whatever --port was
        env = subprocess_env(PREFECT_HOME=str(self.home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                             PREFECT_UI_API_URL=self.api_url)
        prefect = _exe("prefect")
        cmd = [prefect] if prefect else [sys.executable, "-m", "prefect"]
        self.proc = subprocess.Popen(
            [*cmd, "server", "start", "--host", self.host, "--port", str(self.port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = (self.home / "server.log").read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"prefect server exited (rc={self.proc.returncode}):\n" + "\n".join(tail))
            if _healthy(self.api_url):
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"prefect server at {self.url} not healthy after {timeout:.0f} s "
            f"(log: {self.home / 'server.log'})"
        )

    def keep(self) -> None:
        """Leave the server running; ``prefect server stop`` (same PREFECT_HOME) stops it."""
        if self.proc is not None:
            (self.home / "server.pid").write_text(str(self.proc.pid))

    def stop(self) -> None:
        """Stop the server if this object started it."""
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None


def run_with_local_server(
    pipeline: str = "route",
    quick: bool = False,
    config: str = "pipelines.yaml",
    port: int = 4200,
    keep: bool = False,
    overrides: dict[str, Any] | None = None,
) -> str:
    """Start a local Prefect server (UI at http://127.0.0.1:PORT), run the flow against it and print
    the flow run's UI address; stop the server afterwards unless ``keep``. Returns that address."""
    repo = Path(config).expanduser().resolve().parent
    home = Path(os.environ.get("PREFECT_HOME") or repo / ".prefect")
    server = LocalServer(home, port)
    with stop_on_signals():
        server.start()
        try:
            return _run_flow(server, home, pipeline, quick, config, keep, overrides)
        finally:
            _drain_logs()  # what the flow logged last reaches the server before it stops
            server.stop()


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP turned into an exception, so ``finally`` blocks (stopping the server and the
    stage's process group) run as they do on Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP raise :class:`Terminated` in the main thread (Ctrl-C already
    raises KeyboardInterrupt), so every server and subprocess this process started is stopped."""
    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _drain_logs() -> None:
    try:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
    except Exception as exc:  # noqa: BLE001 (best effort: the server stops either way)
        print(f"[vpo] some flow logs may not have reached the server: {exc}", file=sys.stderr)


def _run_flow(server: LocalServer, home: Path, pipeline: str, quick: bool, config: str, keep: bool,
              overrides: dict[str, Any] | None) -> str:
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.retrain import retrain

    with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_HOME: str(home)}):
        state = retrain(pipeline=pipeline, quick=quick, config=config, overrides=overrides or {},
                        return_state=True)
    address = f"{server.url}/runs/flow-run/{state.state_details.flow_run_id}"
    print(f"\nflow run {state.name}: {address}")
    if keep:
        server.keep()
        print(f"Prefect UI: {server.url}  (stop it with: PREFECT_HOME={home} prefect server stop)")
        server.proc = None
    if state.is_failed():
        raise SystemExit(1)
    return address
