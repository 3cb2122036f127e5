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
