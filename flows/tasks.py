"""The flow's Prefect tasks: one per stage (a subprocess, retried with backoff), DVC pull, commit and
push, registration. Nothing here decides what a stage is: :mod:`flows.flow_run` and the stage table do.

Stages run in a subprocess (its own process group, registered with :mod:`vpo.pipeline.engine.processes`
so a SIGTERM or Ctrl-C of the command stops it), so a retry starts clean; a non-zero exit fails the
task, except when the command is stopping (then nothing is retried). Deterministic
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
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.runtime import task_run as runtime_task_run
from prefect.states import State
from prefect.tasks import Task, exponential_backoff

from flows.flow_run import FlowRun, artifact_slug
from vpo.pipeline.engine.errors import EXIT_BAD_INPUT
from vpo.pipeline.engine.processes import kill_group, stopping, track, untrack
from vpo.pipeline.engine.storage import configure_dvc_remote, redact, subprocess_env

__all__ = [
    "FAULT_ENV",
    "DataValidationFailed",
    "InjectedFault",
    "PermanentStageFailure",
    "ProgressSpec",
    "StageFailed",
    "Stopped",
    "console_without_stage_tracebacks",
    "dvc_commit",
    "dvc_error",
    "dvc_pull",
    "dvc_push",
    "open_progress",
    "progress_markdown",
    "register",
    "run_stage",
    "validation_failure",
]

FAULT_ENV = "VPO_FAULT_ONCE"
PROGRESS_POLL_S = 0.5
REGISTRY_WAIT_S = 1800.0
"""How long a registration waits for another one into the same registry to finish."""
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


class Stopped(StageFailed):
    """The stage's process was stopped because the command got SIGTERM/SIGINT: never retried."""

    permanent = True


def _retryable(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry condition: everything but permanent stage failures goes to the retry policy, and nothing
    while the command is stopping."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return not getattr(exc, "permanent", False) and not stopping()


def maybe_inject_fault(label: str) -> None:
    """The ``VPO_FAULT_ONCE`` hook: fail the first attempt of the named task."""
    wanted = {s.strip() for s in os.environ.get(FAULT_ENV, "").split(",") if s.strip()}
    if label in wanted and (runtime_task_run.run_count or 1) <= 1:
        raise InjectedFault(f"injected failure of task {label!r} on its first attempt ({FAULT_ENV})")


def _retrying(name: str, retries: int, first_delay_s: float) -> dict[str, Any]:
    """Options of a task retried with exponential backoff (jittered) unless its failure is permanent."""
    return {"name": name, "retries": retries, "retry_delay_seconds": exponential_backoff(first_delay_s),
            "retry_jitter_factor": 0.2, "retry_condition_fn": _retryable, "cache_policy": NO_CACHE}


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


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The stage environment: ours (S3 keys stay in memory) with this venv's bin first on PATH, so
    the ``vpo`` commands in dvc.yaml resolve to the same installation; ``extra`` (a concurrent stage's
    threads and GPUs) on top."""
    env = subprocess_env(PYTHONUNBUFFERED="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra or {})
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
    cmd: Sequence[str], cwd: Path, *, log_prefix: str, on_tick: Callable[[float], None] | None = None,
    env: dict[str, str] | None = None,
) -> _Result:
    """Run ``cmd`` in its own process group, logging each output line (redacted) to the Prefect run
    logger and calling ``on_tick(start_time)`` about every second; the group is killed if we are
    interrupted (and by the command's signal handler, which knows every group), so no stage outlives
    its task. ``env`` adds to the stage environment. Raises :class:`Stopped` when it was stopped."""
    logger = get_run_logger()
    t0 = time.time()
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    if stopping():
        raise Stopped(f"{log_prefix}: not started, the command is stopping")
    proc = track(subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=_child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    ))

    held: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n").split("\r")[-1].rstrip()
            if not line:
                continue
            line = redact(line)
            tail.append(line)
            if stopping():  # the command says once how to resume; the stage's own advice would mislead
                continue
            if _STOPPED_LINE.match(line):  # the stage's resume advice: shown only if the command goes on
                held.append(line)
                continue
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
    finally:
        untrack(proc)
    reader.join(timeout=10)
    if stopping():
        raise Stopped(f"{log_prefix}: stopped (exit code {proc.returncode}) because the command is stopping")
    for line in held:  # the stage alone was signalled: its own line says how to resume it
        logger.info("%s | %s", log_prefix, line)
    return _Result(rc=proc.returncode, tail=list(tail), seconds=round(time.time() - t0, 1))


_STOPPED_LINE = re.compile(r"\[vpo\] (?:interrupted|stopped by \w+)\b")
"""A stage's own line when a signal stopped it (:func:`vpo.pipeline.engine.console.interrupted`)."""
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
    """Where a train task reports: its own progress artifact (and the key it was created under)
    and the run's progress file."""

    artifact_id: str
    progress_file: str
    key: str | None = None


def open_progress(variant: str, run: str, progress_file: str | os.PathLike[str]) -> ProgressSpec:
    """Create training run ``run``'s progress artifact at 0 % (one per run, keyed by variant and run)."""
    key = f"{artifact_slug(variant)}-train-{artifact_slug(run)}"
    artifact = create_progress_artifact(progress=0.0, key=key,
                                        description=progress_markdown(f"{variant}: train@{run}", []))
    return ProgressSpec(artifact_id=str(artifact), progress_file=str(progress_file), key=key)


_PROGRESS_ROWS = 12
"""Rows of the per-step table in a training run's progress artifact (the newest steps)."""


def progress_markdown(label: str, rows: Sequence[tuple[int, int, dict[str, float]]], status: str | None = None) -> str:
    """The progress artifact's description: the run (``status``, e.g. "up to date", when it did not
    train now) and a table of its latest logged steps with the headline numbers (reward, E max,
    diversity, parse rate, loss), newest first."""
    from vpo.pipeline.stages.train import HEADLINE

    names = [name for name, _ in HEADLINE]
    head = ["step", *[("parse rate" if n == "parse" else n) for n in names]]
    if rows:
        title = f"**{label}** {status + ', ' if status else ''}step {rows[-1][0]}/{rows[-1][1]}"
    else:
        title = f"**{label}** {status or 'waiting for the first step'}"
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for step, _, numbers in reversed(rows[-_PROGRESS_ROWS:]):
        cells = [f"{100 * numbers[n]:.0f}%" if n == "parse" and n in numbers else
                 (f"{numbers[n]:.3f}" if n in numbers else "") for n in names]
        lines.append("| " + " | ".join([str(step), *cells]) + " |")
    return "\n".join(lines)


def _read_progress(path: Path) -> tuple[int, int, dict[str, float], dict[int, dict[str, float]]] | None:
    """(step, max_steps, newest numbers, numbers by logged step) of a progress.json, or None."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        step, max_steps = int(data["step"]), max(1, int(data["max_steps"]))
        numbers = {k: float(v) for k, v in (data.get("numbers") or {}).items() if isinstance(v, (int, float))}
        logged = {int(s): {k: float(v) for k, v in n.items()} for s, n in data.get("rows") or []}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return step, max_steps, numbers, logged


class ProgressPoller:
    """Publishes a training run's progress.json to its progress artifact: :meth:`tick` (about every
    second while the stage runs) pushes each new step (share of steps done, a table of the steps'
    numbers) and logs it; :meth:`finish` sets 100 % and, when the run did not train now (up to date),
    shows the numbers its last training logged instead of "waiting for the first step"."""

    def __init__(self, spec: ProgressSpec, label: str) -> None:
        self.spec, self.label = spec, label
        self.path = Path(spec.progress_file)
        self.rows: list[tuple[int, int, dict[str, float]]] = []
        self.last = -1
        self.logger = get_run_logger()

    def tick(self, start: float) -> None:
        from vpo.pipeline.engine.console import format_numbers

        try:
            if self.path.stat().st_mtime < start:
                return
        except OSError:
            return
        read = _read_progress(self.path)
        if read is None:
            return
        step, max_steps, numbers, logged = read
        if step > self.last:
            seen = {r[0] for r in self.rows}  # every logged step, also those between two polls
            self.rows.extend((s, max_steps, n) for s, n in sorted(logged.items()) if s not in seen and s < step)
            self.rows.append((step, max_steps, logged.get(step, numbers)))
            update_progress_artifact(artifact_id=UUID(self.spec.artifact_id),
                                     progress=round(100.0 * min(1.0, max(0.0, step / max_steps)), 1),
                                     description=progress_markdown(self.label, self.rows))
            text = format_numbers(numbers)
            self.logger.info("%s: step %d/%d%s", self.label, step, max_steps, f"  {text}" if text else "")
            self.last = step

    def numbers(self) -> str:
        """The newest logged numbers of the run (what it trained now, or before), compact."""
        from vpo.pipeline.engine.console import format_numbers

        read = _read_progress(self.path)
        return format_numbers(read[2]) if read else ""

    def finish(self, status: str | None) -> None:
        """Progress 100 %; when no step was seen while the stage ran (``status``: it did not train now,
        e.g. "up to date"; or it finished between two polls) the run's last logged steps too."""
        self._drop_copies()
        if self.rows:
            update_progress_artifact(artifact_id=UUID(self.spec.artifact_id), progress=100.0)
            return
        read = _read_progress(self.path)
        rows = [(s, read[1], n) for s, n in sorted(read[3].items())] if read else []
        if read and (not rows or rows[-1][0] != read[0]):
            rows.append((read[0], read[1], read[2]))
        if not rows and status is None:  # nothing to show: no table at all beats "waiting" at 100 %
            update_progress_artifact(artifact_id=UUID(self.spec.artifact_id), progress=100.0,
                                     description=f"**{self.label}** done")
        else:
            update_progress_artifact(artifact_id=UUID(self.spec.artifact_id), progress=100.0,
                                     description=progress_markdown(self.label, rows, status))

    def _drop_copies(self) -> None:
        """Delete every other artifact under this run's key in this flow run. A create that the API
        client sent again (its first answer lost on a busy machine, the first request done all the
        same) leaves a second copy that no task updates: the UI would show it stuck at 0 %."""
        from prefect.client.orchestration import get_client
        from prefect.runtime import flow_run as runtime_flow_run

        if self.spec.key is None or not runtime_flow_run.id:
            return
        copies = [a for a in flow_run_artifacts(UUID(runtime_flow_run.id), self.spec.key)
                  if str(a.id) != self.spec.artifact_id]
        if not copies:
            return
        with get_client(sync_client=True) as client:
            for copy in copies:
                client.delete_artifact(copy.id)
                self.logger.warning("%s: removed a second progress artifact %s under key %s (never updated)",
                                    self.label, copy.id, self.spec.key)


_UP_TO_DATE = re.compile(r"^\[vpo\] (\S+): up to date$")


def stage_outcome(label: str, tail: Sequence[str], use_dvc: bool) -> str:
    """``up to date`` when DVC skipped the stage or the stage found its output current, else ``ran``."""
    if use_dvc and any("didn't change, skipping" in line for line in tail):
        return "up to date"
    if any((m := _UP_TO_DATE.match(line)) and m.group(1) == label for line in tail):
        return "up to date"
    return "ran"


@task(**_retrying("stage", 2, 10))
def run_stage(
    label: str, cmd: list[str], cwd: str, use_dvc: bool, variant: str, progress: ProgressSpec | None = None,
    env: dict[str, str] | None = None, limit: str | None = None,
) -> dict[str, Any]:
    """Run one stage (``dvc repro --single-item`` or ``vpo stage``); raise on a non-zero exit. ``env``
    adds to its environment (a concurrent stage's threads and GPUs); ``limit`` names the global
    concurrency limit it holds while it runs (:mod:`flows.locks`: one place at a time across machines)."""
    maybe_inject_fault(label)
    logger = get_run_logger()
    poller = ProgressPoller(progress, label) if progress is not None else None
    with _holding(limit, f"stage {label} of {variant}"):
        res = run_streaming(cmd, Path(cwd), log_prefix=label, on_tick=poller.tick if poller else None, env=env)
    if res.rc != 0:
        message = validation_failure(res.tail)
        if message is not None:
            _publish_validation_failure(variant, label, message)
            raise DataValidationFailed(f"stage {label} stopped the flow: {message}")
        rc = _inner_rc(res, use_dvc)
        kind = PermanentStageFailure if rc == EXIT_BAD_INPUT else StageFailed
        raise kind(f"stage {label} failed (exit code {rc}); last output:\n" + "\n".join(res.tail[-30:]))
    outcome = stage_outcome(label, res.tail, use_dvc)
    result: dict[str, Any] = {"stage": label, "outcome": outcome, "seconds": res.seconds}
    if poller is not None:
        poller.finish(outcome if outcome != "ran" else None)
        numbers = poller.numbers()
        if numbers:
            result["last numbers"] = numbers
    logger.info("stage %s %s in %.1f s", label, outcome, res.seconds)
    return result


@contextmanager
def _holding(limit: str | None, what: str) -> Iterator[None]:
    """Hold global concurrency limit ``limit`` (none: nothing); busy elsewhere: a permanent failure."""
    if limit is None:
        yield
        return
    from flows.locks import Busy, exclusive

    try:
        cm = exclusive(limit, what)
        cm.__enter__()
    except Busy as exc:
        raise PermanentStageFailure(str(exc)) from None
    try:
        yield
    finally:
        cm.__exit__(None, None, None)


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


@task(**_retrying("dvc-pull", 3, 10))
def dvc_pull(repo: str, remote_url: str, remote_name: str, targets: list[str], force: bool = False) -> dict[str, Any]:
    """Point DVC at the remote (``.dvc/config.local``, URL only) and restore the given stages' outputs
    (the flow run passes only stages whose outputs are not in the workspace: nothing here is overwritten;
    ``force``: outputs another machine produced replace what is here)."""
    configure_dvc_remote(repo, remote_url, name=remote_name)
    if not targets:
        get_run_logger().info("dvc-pull: nothing to restore (every output recorded in dvc.lock is in the "
                              "workspace)")
        return {"remote": redact(remote_url), "seconds": 0.0, "targets": []}
    args = ["pull", *(["--force"] if force else ["--allow-missing"]), "-r", remote_name, *targets]
    res = _dvc(args, Path(repo), "dvc-pull")
    return {"remote": redact(remote_url), "seconds": res.seconds, "targets": targets}


@task(**_retrying("dvc-commit", 3, 5))
def dvc_commit(repo: str, stages: list[str]) -> dict[str, Any]:
    """Record stages that ran outside ``dvc repro`` (training runs side by side: two ``dvc repro`` in
    one repository wait for each other's lock) in ``dvc.lock`` and the cache, as ``dvc repro`` would."""
    res = _dvc(["commit", "--force", *stages], Path(repo), "dvc-commit")
    return {"stages": list(stages), "seconds": res.seconds}


@task(**_retrying("dvc-push", 3, 10))
def dvc_push(repo: str, remote_url: str, remote_name: str, targets: list[str]) -> dict[str, Any]:
    """Upload this variant's outputs to the DVC remote (content-addressed, so a retry resumes)."""
    configure_dvc_remote(repo, remote_url, name=remote_name)
    res = _dvc(["push", "-r", remote_name, *targets], Path(repo), "dvc-push")
    pushed = next((line for line in reversed(res.tail) if "pushed" in line or "up to date" in line), "")
    return {"remote": redact(remote_url), "seconds": res.seconds, "summary": pushed}


ARM_RESULT = "arm-result"
"""Key part of the markdown artifact in which a work-pool training run reports its dvc.lock record."""


def arm_result_key(variant: str, run_id: str) -> str:
    """The key of a training run's result artifact (``<variant>-arm-result-<run>``)."""
    return f"{artifact_slug(variant)}-{ARM_RESULT}-{artifact_slug(run_id)}"


def flow_run_artifacts(flow_run_id: UUID, key: str | None = None) -> list[Any]:
    """The artifacts flow run ``flow_run_id`` created (only those under ``key`` when given), from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    where = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
                           key=ArtifactFilterKey(any_=[key]) if key is not None else None)
    with get_client(sync_client=True) as client:
        return list(client.read_artifacts(artifact_filter=where))


def read_arm_result(flow_run_id: UUID) -> dict[str, Any]:
    """The result a ``train-arm`` flow run published (its JSON block), from the Prefect API."""
    for art in flow_run_artifacts(flow_run_id):
        if art.key and ARM_RESULT in art.key and isinstance(art.data, str) and "```json" in art.data:
            return json.loads(art.data.split("```json", 1)[1].split("```", 1)[0])
    raise PermanentStageFailure(f"flow run {flow_run_id} completed without publishing its {ARM_RESULT} artifact")


@task(name="train-on-pool", cache_policy=NO_CACHE)
def train_on_pool(deployment: str, label: str, parameters: dict[str, Any], key: str) -> dict[str, Any]:
    """Run one training run as a flow run of ``deployment`` (its work pool decides the worker), wait
    for it, and return what it reported (its dvc.lock record, where and when it trained). ``key``
    (the calling flow run and the run's label) makes the request idempotent: a request the client
    repeats after a timeout returns the same flow run instead of starting the training twice."""
    from prefect.deployments import run_deployment

    logger = get_run_logger()
    run = run_deployment(name=deployment, parameters=parameters, timeout=None, idempotency_key=key)
    state = run.state
    if state is None or not state.is_completed():
        raise PermanentStageFailure(f"{label}: flow run {run.name} of {deployment} ended "
                                    f"{state.name if state else 'without a state'}: {state.message if state else ''}")
    result = read_arm_result(run.id)
    logger.info("%s: flow run %s completed (%s)", label, run.name, result.get("outcome"))
    return result


@task(**_retrying("register", 2, 10))
def register(run: FlowRun) -> dict[str, Any]:
    """Register every arm checkpoint (``vpo stage register``) and return registry.json. Registrations
    into one registry take turns across machines (a global concurrency limit, :mod:`flows.locks`)."""
    from flows.locks import Busy, exclusive, registry_limit

    maybe_inject_fault("register")
    try:
        with exclusive(registry_limit(run.registry_url), f"registration into {redact(run.registry_url)}",
                       wait_s=REGISTRY_WAIT_S):
            res = run_streaming(vpo_cmd(*run.register_argv), run.repo, log_prefix="register")
    except Busy as exc:
        raise StageFailed(str(exc)) from None
    if res.rc != 0:
        kind = PermanentStageFailure if res.rc == EXIT_BAD_INPUT else StageFailed
        raise kind(f"register failed (exit code {res.rc}); last output:\n" + "\n".join(res.tail[-30:]))
    from vpo.pipeline.config.layout import RunLayout

    return json.loads(RunLayout(run.run_dir, run.variant).registry_json.read_text(encoding="utf-8"))




class _StageFailureFormatter(logging.Formatter):
    """A console formatter that leaves out the traceback of a :class:`StageFailed` or an interruption
    (Ctrl-C, SIGTERM, Prefect's own termination signal): the stage already printed its own one-line error (the command its one line on
    stopping), and Prefect's traceback only shows the flow code re-raising it.
    Other exceptions keep theirs; the UI's log handler is untouched (it still gets the traceback)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        from prefect.exceptions import ExternalSignal

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, (StageFailed, KeyboardInterrupt, ExternalSignal)):  # a stop says one line itself
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
