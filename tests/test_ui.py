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

from tests.support.procs import Descendants

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


def test_the_printed_stop_command_stops_a_kept_server_without_a_virtualenv(tmp_path: Path) -> None:
    """`vpo ui --keep` leaves the server up and prints how to stop it: that command, run as printed
    by a shell whose PATH has no virtualenv, stops it."""
    from flows.server import LocalServer, _healthy, stop_command

    server = LocalServer(tmp_path / "prefect-home", _free_port())
    server.start()
    proc = server.proc
    try:
        assert proc is not None
        server.keep()
        command = stop_command(server.home)
        assert command.startswith(f"PREFECT_HOME={server.home} /") and command.endswith(" server stop")
        done = subprocess.run(["sh", "-c", command], env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        proc.wait(timeout=60)
        assert not _healthy(server.api_url)
    finally:
        server.stop()


def _start(args: list[str], repo: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    import sys

    return subprocess.Popen([sys.executable, "-m", "vpo.pipeline.cli", *args], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen[str], marker: str, timeout: float = 300) -> list[str]:
    import time

    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if marker in line or time.monotonic() > deadline:
            break
    assert any(marker in line for line in seen), "".join(seen)[-3000:]
    return seen


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    from tests.support.repos import tool_env

    env = tool_env(PREFECT_HOME=str(tmp_path / "prefect-home"), OMP_NUM_THREADS="1", **extra)
    if "PREFECT_API_URL" not in extra:
        env.pop("PREFECT_API_URL", None)  # the command starts (or Prefect starts) its own server
    return env


def _repo(tmp_path: Path) -> Path:
    from tests.support.repos import make_repo

    return make_repo(tmp_path / "repo")


def test_vpo_serve_refuses_a_server_that_does_not_answer(tmp_path: Path) -> None:
    """PREFECT_API_URL set but nothing listening: one error line saying what to do, exit 2, and no
    deployment claimed to be served."""
    repo = _repo(tmp_path)
    api = f"http://127.0.0.1:{_free_port()}/api"
    proc = _start(["serve", "--quick"], repo, _env(tmp_path, PREFECT_API_URL=api))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-3000:]
    assert f"error: PREFECT_API_URL={api} does not answer" in out and "unset PREFECT_API_URL" in out
    assert "serving" not in out and "Traceback" not in out


@pytest.mark.slow
def test_vpo_serve_starts_its_server_serves_one_run_at_a_time_and_stops_cleanly(tmp_path: Path) -> None:
    """Without PREFECT_API_URL `vpo serve` starts a local server (no ephemeral one: it could not
    schedule), serves the deployment with a concurrency limit of one (later runs queued, as
    prefect.yaml's), and on SIGTERM pauses the schedule, stops the server and exits 143 with one line."""
    import signal
    import time

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.server import _healthy

    repo, port = _repo(tmp_path), _free_port()
    proc = _start(["serve", "--quick", "--port", str(port), "--cron", "0 4 * * *"], repo, _env(tmp_path))
    api = f"http://127.0.0.1:{port}/api"
    with Descendants(proc.pid) as watch:
        seen = _read_until(proc, "[vpo] serving deployment retrain/nightly of route-quick")
        assert f"UI at http://127.0.0.1:{port}" in seen[-1]
        deadline, deployment = time.monotonic() + 120, None
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            while deployment is None or deployment.status is None or deployment.status.value != "READY":
                assert time.monotonic() < deadline, (deployment, "".join(seen))
                time.sleep(1)
                try:
                    deployment = client.read_deployment_by_name("retrain/nightly")
                except Exception:  # noqa: BLE001 (not created yet)
                    deployment = None
        assert deployment.global_concurrency_limit is not None and deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy.value == "ENQUEUE"
        assert [s.schedule.cron for s in deployment.schedules] == ["0 4 * * *"]
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert proc.returncode == 143, out[-3000:]
    assert ("[vpo] stopped by SIGTERM; the served deployment's runs were cancelled and its schedule paused; the local "
            "Prefect server was stopped") in rest
    assert "Traceback" not in rest, rest[-3000:]
    assert watch.alive() == [] and not _healthy(api)
