"""A local Prefect server for ``vpo ui`` and ``vpo serve``: started on loopback with ``PREFECT_HOME``
under the repository (or an already healthy one on that port reused), the flow run (or served)
against it, its UI address printed, and the server stopped afterwards unless ``--keep``."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vpo.pipeline.engine.processes import Terminated, kill_group, stop_on_signals, stopping
from vpo.pipeline.engine.storage import subprocess_env

__all__ = ["LocalServer", "Terminated", "healthy", "prefect_home", "run_with_local_server", "stop_command",
           "stop_on_signals"]


def _exe(name: str) -> str | None:
    """``name`` next to this interpreter (the project venv), else on PATH."""
    import shutil

    sibling = Path(sys.executable).with_name(name)
    return str(sibling) if sibling.exists() else shutil.which(name)


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    """Whether a Prefect API answers ``/health`` at ``api_url``."""
    return _healthy(api_url, timeout)


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
        self.started_here = False

    def fate(self) -> str:
        """What stopping this command did to the server: stopped it, or left alone one it did not start."""
        if self.started_here:
            return "the local Prefect server was stopped"
        return f"the Prefect server at {self.url} was left running (this command did not start it)"

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
        self.started_here = True
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
        """Leave the server running; :func:`stop_command` (``prefect server stop``, same PREFECT_HOME)
        stops it."""
        if self.proc is not None:
            (self.home / "server.pid").write_text(str(self.proc.pid))

    def stop(self) -> None:
        """Stop the server if this object started it."""
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None


def prefect_home(config: str) -> Path:
    """``PREFECT_HOME``, else ``.prefect`` beside the config file (the repository)."""
    repo = Path(config).expanduser().resolve().parent
    return Path(os.environ.get("PREFECT_HOME") or repo / ".prefect")


def stop_command(home: Path) -> str:
    """The command that stops a kept server, runnable as printed without an activated virtualenv."""
    prefect = _exe("prefect")
    cmd = shlex.quote(prefect) if prefect else f"{shlex.quote(sys.executable)} -m prefect"
    return f"PREFECT_HOME={shlex.quote(str(home))} {cmd} server stop"


def run_with_local_server(
    pipeline: str = "route",
    quick: bool = False,
    config: str = "pipelines.yaml",
    port: int = 4200,
    keep: bool = False,
    overrides: dict[str, Any] | None = None,
    server: LocalServer | None = None,
) -> str:
    """Start a local Prefect server (UI at http://127.0.0.1:PORT; ``server``: this one), run the flow
    against it and print the flow run's UI address; stop the server afterwards unless ``keep`` (a
    server already running on that port is reused and left running). Returns that address.
    SIGTERM/SIGHUP/Ctrl-C stop the running stages and the server, then raise (KeyboardInterrupt)."""
    home = prefect_home(config)
    server = server or LocalServer(home, port)
    home = server.home
    with stop_on_signals():
        server.start()
        try:
            return _run_flow(server, home, pipeline, quick, config, keep, overrides)
        finally:
            _drain_logs(2.0 if stopping() else 10.0)  # what the flow logged last reaches the server first
            server.stop()


def _drain_logs(timeout: float) -> None:
    """Send the flow's last log records to the server, waiting at most ``timeout`` seconds (a command
    stopping on a signal waits 2 s: stopping within seconds matters more than its last lines)."""
    try:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=timeout)
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
        print(f"Prefect UI: {server.url}  (stop it with: {stop_command(home)})")
        server.proc = None
    if state.is_failed():
        raise SystemExit(1)
    return address
