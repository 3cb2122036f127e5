"""Suite-wide test setup: quiet, offline-friendly env defaults and the shared fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.repos import FlowResult, QuickRun
    from tests.support.s3 import S3Server

pytest_plugins = ["tests.support.s3"]  # the s3_server and s3_bucket fixtures

_ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "GX_ANALYTICS_ENABLED": "False",
}


def pytest_configure(config: pytest.Config) -> None:
    """Set env defaults before any test module imports Prefect, DVC or great_expectations."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``-n N --dist loadgroup`` (``make test``): a test file runs on one worker, so its
    module-wide fixtures (a quick run, a chat run) are built once, and every test of the session's
    quick flow, whatever its file, runs on the worker that built it."""
    for item in items:
        group = "quick_flow" if "quick_flow" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True, scope="module")
def _close_shared_sandboxes() -> Iterator[None]:
    """The code task's rewards share one sandbox pool per process (its fork servers are reused): close
    it when a test module ends, so no module's sandbox processes outlive its tests."""
    yield
    code = sys.modules.get("vpo.tasks.code")
    if code is not None:
        code.close_shared_sandboxes()


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """Session-wide Prefect test server on a temporary SQLite DB (started once, ~20-40 s); yields
    its API URL. Flows called while it is active run against it in-process."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield str(PREFECT_API_URL.value())


@pytest.fixture(scope="session")
def quick_flow(prefect_api: str, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[FlowResult]:
    """The retrain flow run once on the quick preset (S3 remote + registry, one injected task
    failure; tests/support/repos.py run_quick_flow), shared by the flow, DVC and registry tests.
    Read-only like ``quick_repo``: the session fails if a file of its repository changed."""
    from tests.support.repos import run_quick_flow

    result = run_quick_flow(tmp_path_factory.mktemp("flow"), s3_server)
    yield result
    result.check_untouched()


@pytest.fixture(scope="session")
def quick_repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuickRun]:
    """`vpo run --quick` run once per test session in a git + DVC copy of the project (see
    tests/support/repos.py build_quick_repo). Read-only: a test that writes copies it first
    (``quick_repo.copy(tmp_path / "repo")``); the session fails if a file of it changed."""
    from tests.support.repos import build_quick_repo

    built = build_quick_repo(tmp_path_factory.mktemp("quick"))
    yield built
    built.check_untouched()
