"""The flow's Prefect tasks: one per stage (a subprocess, retried with backoff), DVC pull and push,
registration. Nothing here decides what a stage is: :mod:`flows.plan` and the stage table do.

Stages run in a subprocess, so a retry starts clean; a non-zero exit fails the task. Deterministic
failures (``vpo stage`` exit code 2: a great_expectations check, a bad config, a missing upstream
output; a DVC error that is not about the network) are not retried; the flow stops with the
underlying error line. Every output line goes to the task's log in the Prefect UI (redacted).

Fault-injection hook (tests, drills): ``VPO_FAULT_ONCE=<label>[,<label>...]`` makes the named tasks
(``data``, ``train@vpo-s0``, ``dvc-push`` ...) raise :class:`InjectedFault` on their first attempt
only, before doing any work; the retry policy then has to complete them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.runtime import task_run as runtime_task_run
from prefect.states import State
from prefect.tasks import Task, exponential_backoff

from flows.plan import Plan, artifact_slug
from vpo.pipeline.errors import EXIT_BAD_INPUT
from vpo.pipeline.storage import configure_dvc_remote, redact, subprocess_env

__all__ = [
    "FAULT_ENV",
    "DataValidationFailed",
    "InjectedFault",
    "PermanentStageFailure",
    "ProgressSpec",
    "StageFailed",
    "console_without_stage_tracebacks",
    "dvc_error",
    "dvc_pull",
    "dvc_push",
    "progress_markdown",
    "register",
    "run_stage",
    "validation_failure",
]

FAULT_ENV = "VPO_FAULT_ONCE"
PROGRESS_POLL_S = 0.5
_TAIL_LINES = 80


# --------------------------------------------------------------------------- errors


class StageFailed(RuntimeError):
    """A stage subprocess exited non-zero; the message holds the (redacted) tail of its output."""

    permanent: bool = False


class PermanentStageFailure(StageFailed):
    """A failure that a retry cannot fix (bad input or config, missing upstream output)."""

    permanent = True


class DataValidationFailed(PermanentStageFailure):
    """A great_expectations suite failed; the message names each failed expectation and its rows."""


class InjectedFault(RuntimeError):
    """Raised by the ``VPO_FAULT_ONCE`` hook on a task's first attempt."""


def _retryable(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry condition: everything but permanent stage failures goes to the retry policy."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return not getattr(exc, "permanent", False)


def maybe_inject_fault(label: str) -> None:
    """The ``VPO_FAULT_ONCE`` hook: fail the first attempt of the named task."""
    wanted = {s.strip() for s in os.environ.get(FAULT_ENV, "").split(",") if s.strip()}
    if label in wanted and (runtime_task_run.run_count or 1) <= 1:
        raise InjectedFault(f"injected failure of task {label!r} on its first attempt ({FAULT_ENV})")


# --------------------------------------------------------------------------- subprocess plumbing


def _exe(name: str) -> str | None:
    """``name`` next to this interpreter (the project venv), else on PATH."""
    sibling = Path(sys.executable).with_name(name)
    return str(sibling) if sibling.exists() else shutil.which(name)


def dvc_cmd(*args: str) -> list[str]:
    exe = _exe("dvc")
    return [exe, *args] if exe else [sys.executable, "-m", "dvc", *args]


def vpo_cmd(*args: str) -> list[str]:
    """The ``vpo`` CLI of this installation (never whatever ``vpo`` PATH finds first)."""
    return [sys.executable, "-m", "vpo.pipeline.cli", *args]


def _child_env() -> dict[str, str]:
    """The stage environment: ours (S3 keys stay in memory) with this venv's bin first on PATH, so
    the ``vpo`` commands in dvc.yaml resolve to the same installation."""
    env = subprocess_env(PYTHONUNBUFFERED="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@dataclass
class _Result:
    rc: int
    tail: list[str]
    seconds: float

    @property
    def text(self) -> str:
        return "\n".join(self.tail)


def run_streaming(
    cmd: Sequence[str], cwd: Path, *, log_prefix: str, on_tick: Callable[[float], None] | None = None
) -> _Result:
    """Run ``cmd`` in its own process group, logging each output line (redacted) to the Prefect run
    logger and calling ``on_tick(start_time)`` about every second; the group is killed if we are
    interrupted, so no stage outlives its task."""
    logger = get_run_logger()
    t0 = time.time()
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n").split("\r")[-1].rstrip()
            if not line:
                continue
            line = redact(line)
            tail.append(line)
            logger.info("%s | %s", log_prefix, line)

    # the reader thread runs in a copy of this context: Prefect's settings (the API URL of `vpo ui`'s
    # server, set with temporary_settings) and the task run live in context variables, which a bare
    # thread does not inherit -- its records then went to another API (or none) and never reached the UI
    context = contextvars.copy_context()
    reader = threading.Thread(target=context.run, args=(pump,), name=f"pump-{log_prefix}", daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            if on_tick is not None:
                on_tick(t0)
            try:
                proc.wait(timeout=PROGRESS_POLL_S)
            except subprocess.TimeoutExpired:
                continue
    except BaseException:
        kill_group(proc)
        raise
    reader.join(timeout=10)
    return _Result(rc=proc.returncode, tail=list(tail), seconds=round(time.time() - t0, 1))


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM then SIGKILL the subprocess's whole process group."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


_VALIDATION_HEAD = re.compile(r"((?:dataset|reward vectors) '[^']*' failed \d+ of \d+ expectations:?)\s*$")
_EXITED = re.compile(r"exited with (-?\d+)")


def validation_failure(lines: Sequence[str]) -> str | None:
    """The great_expectations failure message (header + one line per failed expectation) in a
    stage's output, or None."""
    for i, line in enumerate(lines):
        m = _VALIDATION_HEAD.search(line)
        if m:
            body = [m.group(1)]
            for nxt in lines[i + 1 :]:
                if not nxt.startswith("  - "):
                    break
                body.append(nxt)
            return "\n".join(body)
    return None


def _inner_rc(res: _Result, use_dvc: bool) -> int:
    """The stage command's own exit code (DVC reports it as "exited with N")."""
    if use_dvc:
        codes = [int(m.group(1)) for line in res.tail for m in [_EXITED.search(line)] if m]
        return codes[-1] if codes else res.rc
    return res.rc


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class ProgressSpec:
    """Where a train task reports: its own progress artifact and the run's progress file."""

    artifact_id: str
    progress_file: str


_PROGRESS_ROWS = 12
"""Rows of the per-step table in a training run's progress artifact (the newest steps)."""


def progress_markdown(label: str, rows: Sequence[tuple[int, int, dict[str, float]]]) -> str:
    """The progress artifact's description: the run and a table of its latest logged steps with the
    headline numbers (reward, E max, diversity, parse rate, loss), newest first."""
    from vpo.pipeline.stages.train import HEADLINE

    names = [name for name, _ in HEADLINE]
    head = ["step", *[("parse rate" if n == "parse" else n) for n in names]]
    lines = [f"**{label}** step {rows[-1][0]}/{rows[-1][1]}" if rows else f"**{label}** waiting for the first step",
             "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for step, _, numbers in reversed(rows[-_PROGRESS_ROWS:]):
        cells = [f"{100 * numbers[n]:.0f}%" if n == "parse" and n in numbers else
                 (f"{numbers[n]:.3f}" if n in numbers else "") for n in names]
        lines.append("| " + " | ".join([str(step), *cells]) + " |")
    return "\n".join(lines)


def _progress_updater(spec: ProgressSpec, label: str) -> Callable[[float], None]:
    """A tick callback that reads progress.json (if written after ``start``), sets the run's progress
    artifact to its share of steps done with a table of the steps' numbers as its description, and
    logs each new step with those numbers."""
    from vpo.pipeline.console import format_numbers

    last = [-1]
    rows: list[tuple[int, int, dict[str, float]]] = []
    path = Path(spec.progress_file)
    logger = get_run_logger()

    def tick(start: float) -> None:
        try:
            if path.stat().st_mtime < start:
                return
            data = json.loads(path.read_text(encoding="utf-8"))
            step, max_steps = int(data["step"]), max(1, int(data["max_steps"]))
            numbers = {k: float(v) for k, v in (data.get("numbers") or {}).items() if isinstance(v, (int, float))}
            logged = {int(s): {k: float(v) for k, v in n.items()} for s, n in data.get("rows") or []}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
        if step > last[0]:
            seen = {r[0] for r in rows}  # every logged step, also those between two polls
            rows.extend((s, max_steps, n) for s, n in sorted(logged.items()) if s not in seen and s < step)
            rows.append((step, max_steps, logged.get(step, numbers)))
            update_progress_artifact(artifact_id=UUID(spec.artifact_id),
                                     progress=round(100.0 * min(1.0, max(0.0, step / max_steps)), 1),
                                     description=progress_markdown(label, rows))
            text = format_numbers(numbers)
            logger.info("%s: step %d/%d%s", label, step, max_steps, f"  {text}" if text else "")
            last[0] = step

    return tick


@task(
    name="stage",
    retries=2,
    retry_delay_seconds=exponential_backoff(10),
    retry_jitter_factor=0.2,
    retry_condition_fn=_retryable,
    cache_policy=NO_CACHE,
)
def run_stage(
    label: str, cmd: list[str], cwd: str, use_dvc: bool, variant: str, progress: ProgressSpec | None = None
) -> dict[str, Any]:
    """Run one stage (``dvc repro --single-item`` or ``vpo stage``); raise on a non-zero exit."""
    maybe_inject_fault(label)
    logger = get_run_logger()
    tick = _progress_updater(progress, label) if progress is not None else None
    res = run_streaming(cmd, Path(cwd), log_prefix=label, on_tick=tick)
    if res.rc != 0:
        message = validation_failure(res.tail)
        if message is not None:
            _publish_validation_failure(variant, label, message)
            raise DataValidationFailed(f"stage {label} stopped the flow: {message}")
        rc = _inner_rc(res, use_dvc)
        kind = PermanentStageFailure if rc == EXIT_BAD_INPUT else StageFailed
        raise kind(f"stage {label} failed (exit code {rc}); last output:\n" + "\n".join(res.tail[-30:]))
    if progress is not None:
        update_progress_artifact(artifact_id=UUID(progress.artifact_id), progress=100.0)
    skipped = use_dvc and any("didn't change, skipping" in line for line in res.tail)
    outcome = "skipped (unchanged)" if skipped else "ran"
    logger.info("stage %s %s in %.1f s", label, outcome, res.seconds)
    return {"stage": label, "outcome": outcome, "seconds": res.seconds}


def _publish_validation_failure(variant: str, label: str, message: str) -> None:
    """Markdown artifact naming every failed expectation and its example rows."""
    header, *items = message.splitlines()
    md = [f"# Data validation failed: stage `{label}`", "", f"**{header}**", ""]
    md += [
        f"- `{item.strip()[2:]}`" if item.strip().startswith("- ") else f"- {item.strip()}" for item in items
    ]
    md += ["", "The flow stopped at this stage: nothing downstream ran, nothing was pushed or registered."]
    create_markdown_artifact(
        key=f"{artifact_slug(variant)}-validation-failure",
        markdown=redact("\n".join(md)),
        description=f"great_expectations failure in stage {label}",
    )


_DETERMINISTIC = re.compile(
    r"can't remove|unsaved files|use `-f` to force|does not exist|not found|no such|invalid|config file|"
    r"permission denied|missing params|is not a dvc", re.IGNORECASE)
_TRANSIENT = re.compile(
    r"connect|timed? ?out|temporar|unavailable|reset by peer|broken pipe|throttl|slow ?down|too many requests"
    r"|\b50[0234]\b|unable to acquire lock|failed to (transfer|upload|download)|files? failed to",
    re.IGNORECASE)


def dvc_error(lines: Sequence[str]) -> tuple[str, bool]:
    """DVC's own error line(s) in its output (``ERROR: ...`` and the lines it lists under it), and
    whether the failure looks transient (network, object store, a busy lock): only those are retried."""
    for i, line in enumerate(lines):
        if line.lstrip().startswith("ERROR"):
            body = [line.strip()] + [nxt.strip() for nxt in lines[i + 1: i + 6] if nxt.strip()]
            text = "\n".join(body)
            return text, not _DETERMINISTIC.search(text) and bool(_TRANSIENT.search(text))
    return "\n".join(lines[-5:]), False


def _dvc(args: list[str], cwd: Path, label: str) -> _Result:
    maybe_inject_fault(label)
    res = run_streaming(dvc_cmd(*args), cwd, log_prefix=label)
    if res.rc != 0:
        message, transient = dvc_error(res.tail)
        kind = StageFailed if transient else PermanentStageFailure
        raise kind(f"`dvc {args[0]}` failed (exit code {res.rc}): {message}")
    return res


@task(
    name="dvc-pull",
    retries=3,
    retry_delay_seconds=exponential_backoff(10),
    retry_jitter_factor=0.2,
    retry_condition_fn=_retryable,
    cache_policy=NO_CACHE,
)
def dvc_pull(repo: str, remote_url: str, remote_name: str, targets: list[str]) -> dict[str, Any]:
    """Point DVC at the remote (``.dvc/config.local``, URL only) and restore the given stages' outputs
    (the plan passes only stages whose outputs are not in the workspace: nothing here is overwritten)."""
    configure_dvc_remote(repo, remote_url, name=remote_name)
    if not targets:
        get_run_logger().info("dvc-pull: nothing to restore (every output recorded in dvc.lock is in the "
                              "workspace)")
        return {"remote": redact(remote_url), "seconds": 0.0, "targets": []}
    res = _dvc(["pull", "--allow-missing", "-r", remote_name, *targets], Path(repo), "dvc-pull")
    return {"remote": redact(remote_url), "seconds": res.seconds, "targets": targets}


@task(
    name="dvc-push",
    retries=3,
    retry_delay_seconds=exponential_backoff(10),
    retry_jitter_factor=0.2,
    retry_condition_fn=_retryable,
    cache_policy=NO_CACHE,
)
def dvc_push(repo: str, remote_url: str, remote_name: str, targets: list[str]) -> dict[str, Any]:
    """Upload this variant's outputs to the DVC remote (content-addressed, so a retry resumes)."""
    configure_dvc_remote(repo, remote_url, name=remote_name)
    res = _dvc(["push", "-r", remote_name, *targets], Path(repo), "dvc-push")
    pushed = next((line for line in reversed(res.tail) if "pushed" in line or "up to date" in line), "")
    return {"remote": redact(remote_url), "seconds": res.seconds, "summary": pushed}


@task(
    name="register",
    retries=2,
    retry_delay_seconds=exponential_backoff(10),
    retry_jitter_factor=0.2,
    retry_condition_fn=_retryable,
    cache_policy=NO_CACHE,
)
def register(plan: Plan) -> dict[str, Any]:
    """Register every arm checkpoint (``vpo stage register``) and return registry.json."""
    maybe_inject_fault("register")
    res = run_streaming(vpo_cmd(*plan.register_argv), plan.repo, log_prefix="register")
    if res.rc != 0:
        kind = PermanentStageFailure if res.rc == EXIT_BAD_INPUT else StageFailed
        raise kind(f"register failed (exit code {res.rc}); last output:\n" + "\n".join(res.tail[-30:]))
    from vpo.pipeline.layout import RunLayout

    return json.loads(RunLayout(plan.run_dir, plan.variant).registry_json.read_text(encoding="utf-8"))




class _StageFailureFormatter(logging.Formatter):
    """A console formatter that leaves out the traceback of a :class:`StageFailed`: the stage already
    printed its own one-line error, and Prefect's traceback only shows the flow code re-raising it.
    Other exceptions keep theirs; the UI's log handler is untouched (it still gets the traceback)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, StageFailed):
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


@contextmanager
def console_without_stage_tracebacks() -> Iterator[None]:
    """While a flow runs in this process, Prefect's console handlers print a stage failure as its
    error line only (see :class:`_StageFailureFormatter`)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = {h for name in ("prefect", "") for h in logging.getLogger(name).handlers
                if isinstance(h, PrefectConsoleHandler)}
    saved = {h: h.formatter for h in handlers}
    for h in handlers:
        h.setFormatter(_StageFailureFormatter(h.formatter))
    try:
        yield
    finally:
        for h, fmt in saved.items():
            h.setFormatter(fmt)
