"""Suite-wide test setup: quiet, offline-friendly env defaults and the shared fixtures."""

from __future__ import annotations

import logging
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
    if hasattr(config.option, "loadscopereorder"):
        # xdist hands out groups by test count unless told not to; the order set below (longest first)
        # is what lets the two workers overlap the long setups instead of queueing them on one worker
        config.option.loadscopereorder = False


_SHARED_GROUPS = {  # fixture -> the xdist group of every test that uses it (one worker builds it once)
    "quick_flow": "prefect",  # the flow runs against the session's Prefect server
    "prefect_api": "prefect",
    "quick_repo": "quick_repo",
}
_SLOW_FIXTURES = {"quick_repo", "quick_flow"}  # a whole quick pipeline run, built once per session
_SERVER_FIXTURES = {"prefect_api", "quick_flow", "s3_server", "s3_bucket", "quick_repo"}
_FIRST = ("prefect", "tests/test_real_chat.py", "quick_repo")  # the longest groups, one per worker first
_GROUP = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its own hook adds them to the test ids)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks that follow from the shared fixtures a test uses (a quick pipeline run: ``slow``; a real
    server or subprocess cluster: ``integration``), and the xdist group of each test for ``make test``'s
    ``-n 2 --dist loadgroup``: the tests of one shared setup run on the worker that built it, every other
    test with the rest of its file (its module fixtures are built once); the longest groups first, so the
    two workers overlap them."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & _SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if names & _SERVER_FIXTURES:
            item.add_marker(pytest.mark.integration)
        group = next((g for f, g in _SHARED_GROUPS.items() if f in names), item.nodeid.split("::")[0])
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[_GROUP] = group
    rank = {g: i for i, g in enumerate(_FIRST)}
    slow_groups = {it.stash[_GROUP] for it in items if "slow" in it.keywords}
    # then the other groups that hold slow tests, then the rest: a long group never starts last;
    # stable: file order otherwise kept
    items.sort(key=lambda it: (rank.get(it.stash[_GROUP], len(rank)), it.stash[_GROUP] not in slow_groups))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup`` every test id carries its group once xdist has read the marks; if none
    does, this pytest and pytest-xdist do not work together and each worker would build the shared
    setups again: stop with one line instead of running twice as long."""
    if getattr(session.config.option, "loadgroup", False) and session.items and not any(
            "@" in item.nodeid for item in session.items):
        raise pytest.UsageError("pytest-xdist's --dist loadgroup had no effect (test ids carry no group): "
                                "install the versions the test extra pins (pip install -e '.[test]')")



@pytest.fixture(autouse=True)
def _dvc_logs_reach_this_tests_streams() -> None:
    """DVC's console handlers keep the stream they were made with; made during an earlier test, that is
    the earlier test's captured (now closed) stdout or stderr. Point them at this test's streams."""
    if "dvc.logger" not in sys.modules:
        return
    for handler in logging.getLogger("dvc").handlers:
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.StreamHandler) and getattr(stream, "closed", False):
            handler.setStream(sys.stderr if handler.level >= logging.WARNING else sys.stdout)


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


_UNMARKED_SLOW_S = 10.0
_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each test's setup, call and teardown time (in the main process, also under xdist)."""
    if "slow" not in report.keywords:
        _SPENT[report.nodeid] = _SPENT.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the tests that took longer than ten seconds without the ``slow`` mark (fixtures they built
    included), so `make test-fast` stays fast: a note to look at, not a failure (times vary with load)."""
    over = sorted(((s, n) for n, s in _SPENT.items() if s > _UNMARKED_SLOW_S), reverse=True)
    if over:
        terminalreporter.section("over 10 s without the slow mark")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f}s {nodeid}")
