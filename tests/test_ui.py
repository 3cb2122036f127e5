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
