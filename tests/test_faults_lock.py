"""Fault: a second run started on a run folder another process is writing (vpo/locking.py).

Light holders (``python -c`` taking the lock, no torch) stand in for a running pipeline, so these
cases cost well under a second each; tests/test_faults_pipeline.py races two real ``vpo run``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.faults import RUN_NAME, run_vpo, write_pipelines
from vpo.pipeline.engine.locking import LockBusyError, arm_lock_path, pipeline_lock, read_holder

HOLDER = """
import os, sys, time
from vpo.pipeline.engine.locking import pipeline_lock
run_dir, arm, fork = sys.argv[1], sys.argv[2] or None, sys.argv[3] == "1"
with pipeline_lock(run_dir, "route-quick", arm=arm, command="holder-under-test"):
    if fork:
        child = os.fork()
        if child == 0:
            time.sleep(900)
            os._exit(0)
        print("child", child, flush=True)
    print("locked", flush=True)
    time.sleep(900)  # killed by the test; long enough for three CLI starts on a busy machine
"""


class Holder:
    """A subprocess holding the run lock (optionally with a forked child) until killed."""

    def __init__(self, run_dir: Path, arm: str | None = None, fork: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run_dir), arm or "", "1" if fork else "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.child: int | None = None
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("child"):
                self.child = int(line.split()[1])
            if line.startswith("locked"):
                break
        else:
            raise AssertionError(f"holder exited with {self.proc.wait()}")

    @property
    def pid(self) -> int:
        """The holder's pid."""
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the holder (not its child) and reap it."""
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    """Holders started by a test; all killed (with their children) at the end."""
    started: list[Holder] = []
    yield started
    for h in started:
        if h.proc.poll() is None:
            h.kill()
        if h.child is not None:
            try:
                os.kill(h.child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_busy_lock_fails_fast_naming_the_holder(tmp_path: Path, holders: list[Holder]) -> None:
    """Exclusive and shared requests both fail at once with pid, start time and command."""
    holders.append(Holder(tmp_path))
    for arm in (None, "vpo-s0"):
        t0 = time.monotonic()
        with pytest.raises(LockBusyError) as err, pipeline_lock(tmp_path, "route-quick", arm=arm):
            pass
        assert time.monotonic() - t0 < 30  # the holder never lets go: a request that waited would not return
        msg = str(err.value)
        assert (
            f"pipeline route-quick (run folder {tmp_path}) is already running (pid {holders[0].pid} on "
            in msg
        )
        assert "since 20" in msg and "holder-under-test" in msg and "wait for it to finish" in msg
        assert err.value.holder is not None and err.value.holder.pid == holders[0].pid


def test_lock_of_a_killed_holder_is_taken_over(tmp_path: Path, holders: list[Holder]) -> None:
    """A SIGKILLed holder leaves its record but not the lock; the next run takes it over."""
    holders.append(Holder(tmp_path))
    holders[0].kill()
    stale = read_holder(tmp_path / ".lock")
    assert stale is not None and stale.pid == holders[0].pid and stale.alive() is False
    with pipeline_lock(tmp_path, "route-quick", command="successor"):
        now = read_holder(tmp_path / ".lock")
        assert now is not None and now.pid == os.getpid() and now.command == "successor"
    assert read_holder(tmp_path / ".lock") is None, "a released lock keeps no holder record"


def test_forked_child_of_a_killed_holder_does_not_keep_the_lock(
    tmp_path: Path, holders: list[Holder]
) -> None:
    """A child forked by the holder (e.g. a sandbox worker) outliving it does not block the next run."""
    holders.append(Holder(tmp_path, fork=True))
    child = holders[0].child
    assert child is not None
    holders[0].kill()
    os.kill(child, 0)  # the child is still alive
    with pipeline_lock(tmp_path, "route-quick"):
        pass


def test_arms_train_in_parallel_but_not_twice(tmp_path: Path, holders: list[Holder]) -> None:
    """Arm locks: another arm may train beside a running one; the same arm or a whole-pipeline
    command may not, and the message names the running arm's process."""
    holders.append(Holder(tmp_path, arm="vpo-s0"))
    with pipeline_lock(tmp_path, "route-quick", arm="grpo-s0"):
        assert arm_lock_path(tmp_path, "grpo-s0").is_file()
    with pytest.raises(LockBusyError) as err, pipeline_lock(tmp_path, "route-quick", arm="vpo-s0"):
        pass
    assert str(err.value).startswith("arm vpo-s0 of pipeline route-quick") and f"pid {holders[0].pid}" in str(
        err.value
    )
    with pytest.raises(LockBusyError) as err, pipeline_lock(tmp_path, "route-quick"):
        pass
    assert "arm training is running" in str(err.value) and f"pid {holders[0].pid}" in str(err.value)


def test_nested_acquisition_in_one_process_is_counted(tmp_path: Path) -> None:
    """run_all inside a command that already holds the lock does not deadlock or release early."""
    with pipeline_lock(tmp_path, "route-quick"):
        with pipeline_lock(tmp_path, "route-quick"), pipeline_lock(tmp_path, "route-quick", arm="vpo-s0"):
            pass
        holder = read_holder(tmp_path / ".lock")
        assert holder is not None and holder.pid == os.getpid(), "inner release dropped the outer lock"
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import sys; from vpo.pipeline.engine.locking import pipeline_lock\n"
                    "with pipeline_lock(sys.argv[1], 'x'): pass"
                ),
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert probe.returncode != 0 and "LockBusyError" in probe.stderr


@pytest.mark.slow
@pytest.mark.integration
def test_cli_run_and_stage_exit_3_while_locked(tmp_path: Path, holders: list[Holder]) -> None:
    """`vpo run` and `vpo stage` exit 3 with the holder in the message, before touching any output."""
    config = write_pipelines(tmp_path)
    run_dir = tmp_path / "runs" / RUN_NAME
    holders.append(Holder(run_dir))
    for args in (["run"], ["stage", "data"], ["stage", "train", "--arm", "vpo", "--seed", "0"]):
        proc = run_vpo([*args, "--quick", "--config", str(config)], tmp_path, timeout=120)
        assert proc.returncode == 3, proc.stderr
        assert f"is already running (pid {holders[0].pid} on" in proc.stderr, proc.stderr
        assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
    # a refused run leaves only its own log file (runs/<variant>/logs/) beside the holder's lock
    assert sorted(p.name for p in run_dir.iterdir()) in ([".lock"], [".lock", "logs"]), "a refused run wrote there"
    assert all(p.suffix == ".log" for p in (run_dir / "logs").glob("*")), sorted((run_dir / "logs").glob("*"))


PARENT = """
import os, subprocess, sys
from vpo.pipeline.engine.locking import child_env, pipeline_lock
run_dir = sys.argv[1]
probe = ("import sys\\nfrom vpo.pipeline.engine.locking import LockBusyError, pipeline_lock\\n"
         "try:\\n    with pipeline_lock(sys.argv[1], 'route-quick', arm=sys.argv[2]): print('trained')\\n"
         "except LockBusyError as e: print('refused:', e)")
with pipeline_lock(run_dir, "route-quick", command="parent-under-test"):
    for arm, env in (("vpo-s0", {**os.environ, **child_env(run_dir)}), ("grpo-s0", dict(os.environ))):
        out = subprocess.run([sys.executable, "-c", probe, run_dir, arm], env=env, capture_output=True, text=True)
        print(arm, out.stdout.strip(), out.stderr.strip()[-500:], flush=True)
"""


def test_a_whole_pipeline_run_lets_only_its_own_children_train_beside_it(tmp_path: Path) -> None:
    """`vpo run` holds the run folder and starts the arm trainings itself: those (told so through the
    environment, and really its children) train; any other arm training is refused, naming the run."""
    out = subprocess.run([sys.executable, "-c", PARENT, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["vpo-s0"].startswith("trained"), out.stdout
    assert lines["grpo-s0"].startswith("refused: pipeline route-quick") and "parent-under-test" in lines["grpo-s0"]


def test_the_parent_token_is_no_pass_for_anyone_else(tmp_path: Path, holders: list[Holder],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that merely inherits (or copies) the parent's variable is not the parent's child: it
    is refused like any other arm training while the run holds the folder."""
    holders.append(Holder(tmp_path))
    monkeypatch.setenv("VPO_RUN_LOCK", f"{tmp_path / '.lock'}:{holders[0].pid}")
    with pytest.raises(LockBusyError, match="is already running"), pipeline_lock(tmp_path, "route-quick",
                                                                                arm="vpo-s0"):
        pass


def test_a_refused_arm_training_creates_nothing(tmp_path: Path, holders: list[Holder]) -> None:
    """Refused before it takes its own lock: the run folder holds the holder's lock file only."""
    holders.append(Holder(tmp_path))
    with pytest.raises(LockBusyError), pipeline_lock(tmp_path, "route-quick", arm="vpo-s0"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
