"""Suite-wide test setup: quiet, offline-friendly env defaults and the shared fixtures."""

from __future__ import annotations

import os

import pytest

try:  # tests/ is on sys.path (rootdir-relative conftest, no package)
    from s3_fixture import S3Server, s3_bucket, s3_server
except ModuleNotFoundError:  # tests/ turned into a package
    from tests.s3_fixture import S3Server, s3_bucket, s3_server  # noqa: F401

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


from collections.abc import Iterator


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """Session-wide Prefect test server on a temporary SQLite DB (started once, ~20-40 s); yields
    its API URL. Flows called while it is active run against it in-process."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield str(PREFECT_API_URL.value())


@pytest.fixture(scope="session")
def quick_flow(prefect_api: str, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> object:
    """The retrain flow run once on the quick preset (S3 remote + registry, one injected task
    failure); shared by test_flows.py and test_dvc_pipeline.py (see flows_fixtures.run_quick_flow)."""
    try:
        from flows_fixtures import run_quick_flow
    except ModuleNotFoundError:  # tests/ turned into a package
        from tests.flows_fixtures import run_quick_flow

    return run_quick_flow(tmp_path_factory.mktemp("flow"), s3_server)
