"""`vpo ui`'s server (flows.server.LocalServer): a real ``prefect server start`` on loopback that
serves both the API and the UI, offline, and stops cleanly.

When a Chromium is installed (Debian: ``apt-get install chromium``), the flow run page is also
rendered headless: the rendered DOM must name the flow run and the PNG must not be blank. Without
Chromium that part is skipped (the server part always runs).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        exe = shutil.which(name)
        if exe:
            return exe
    return None


def _render(exe: str, url: str, out: Path, tmp: Path) -> str:
    """Headless Chromium: screenshot ``url`` to ``out`` and return the DOM after scripts ran."""
    common = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              f"--user-data-dir={tmp / 'chromium-profile'}", "--window-size=1400,900",
              "--virtual-time-budget=20000", "--run-all-compositor-stages-before-draw"]
    subprocess.run([*common, f"--screenshot={out}", url], check=True, capture_output=True, timeout=120)
    dom = subprocess.run([*common, "--dump-dom", url], check=True, capture_output=True, timeout=120)
    return dom.stdout.decode("utf-8", "replace")


def test_local_server_serves_api_and_ui_and_a_flow_run_page(tmp_path: Path) -> None:
    from prefect import flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.server import LocalServer, _healthy

    server = LocalServer(tmp_path / "prefect-home", _free_port())
    server.start()
    try:
        assert _healthy(server.api_url)
        with urllib.request.urlopen(server.url + "/", timeout=10) as resp:
            page = resp.read().decode("utf-8", "replace")
        assert resp.status == 200 and "<html" in page.lower() and "<script" in page.lower(), page[:300]

        @flow(name="ui-check", flow_run_name="ui-check-run")
        def ui_check() -> int:
            return 42

        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            state = ui_check(return_state=True)
        assert state.is_completed() and state.result() == 42
        run_url = f"{server.url}/runs/flow-run/{state.state_details.flow_run_id}"

        exe = _chromium()
        if exe is None:
            pytest.skip("no Chromium installed: the rendered-page check needs one (apt-get install chromium)")
        png = tmp_path / "flow-run.png"
        dom = _render(exe, run_url, png, tmp_path)
        assert "ui-check-run" in dom, "the rendered flow run page does not name the run"
        from PIL import Image

        with Image.open(png) as img:
            assert img.size == (1400, 900)
            colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is None or len(colours) > 50, "the screenshot is (nearly) blank"
    finally:
        server.stop()
    assert not _healthy(server.api_url), "the server is still answering after stop()"


def _processes_with_env(key: str, value: str) -> list[str]:
    """Live processes whose environment has ``key=value`` (pid and command line)."""
    found = []
    needle = f"{key}={value}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().split(") ", 1)[1].startswith("Z"):
                continue  # a zombie has exited
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            found.append(f"{proc.name}: {cmdline[:200]}")
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_sigterm_during_vpo_ui_leaves_no_server_or_stage_running(tmp_path: Path) -> None:
    """`vpo ui --quick` gets SIGTERM while the flow runs a stage: it exits (143) with one line, and no
    process it started -- the Prefect server, the stage's `dvc repro` and `vpo stage` -- is left."""
    import signal
    import sys
    import time

    try:
        from flows_fixtures import make_repo, tool_env
    except ModuleNotFoundError:
        from tests.flows_fixtures import make_repo, tool_env

    repo = make_repo(tmp_path / "repo")
    home = tmp_path / "prefect-home"  # a unique value: every child process inherits it
    port = _free_port()
    env = tool_env(PREFECT_HOME=str(home), OMP_NUM_THREADS="1")
    env.pop("PREFECT_API_URL", None)  # `vpo ui` talks to its own server
    proc = subprocess.Popen([sys.executable, "-m", "vpo.pipeline.cli", "ui", "--quick", "--port", str(port)],
                            cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # the flow's log lines: wait until the base stage is running
        seen.append(line)
        if "[vpo] base:" in line or time.monotonic() > deadline:
            break
    assert any("[vpo] base:" in line for line in seen), "".join(seen)[-3000:]
    assert _processes_with_env("PREFECT_HOME", str(home)), "nothing running under the test's PREFECT_HOME"
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, rest[-3000:]
    assert "[vpo] stopped by SIGTERM; the local Prefect server and the running stage were stopped" in rest
    time.sleep(1)
    assert _processes_with_env("PREFECT_HOME", str(home)) == []
    from flows.server import _healthy

    assert not _healthy(f"http://127.0.0.1:{port}/api")
