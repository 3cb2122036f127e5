"""Independent stages side by side (vpo/pipeline/engine/execution.py, runner.run_side_by_side): how many at
once and with what, the plan's groups, the shared model cache, and what SIGTERM/Ctrl-C to `vpo run`
and `vpo stage` leave behind (nothing they started).

Fast tests use machines described in code (no hardware needed); the slow ones run the CLI on a
prepared folder (data, rewards and a 1-layer base built once per session, tests/support/faults.py).
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.faults import RUN_NAME, VPO, copy_prepared, prepared_run, vpo_env
from tests.support.procs import Descendants
from vpo.pipeline.config import load_pipeline
from vpo.pipeline.engine.execution import THREADS_ENV, Machine, concurrency, stage_threads
from vpo.pipeline.runner import independent_groups
from vpo.pipeline.steps import steps_of

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_thread_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread count from the environment (the suite may run with OMP_NUM_THREADS=1)."""
    for name in (THREADS_ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def _quick(**overrides: object) -> object:
    return load_pipeline("route", REPO / "pipelines.yaml", quick=True, overrides=overrides or None)


def test_default_parallelism_follows_cores_and_runs(no_thread_env: None) -> None:
    """4 runs on 2 cores: 1 thread each, 2 at once; 1 core: 1 at once; 64 cores: all 4, 16 threads each."""
    cfg = _quick()
    two = concurrency(cfg, 4, Machine(cores=2))
    assert (two.max_parallel, two.threads) == (2, 1) and "2 cores, no GPU, 1 thread per run" in two.reason
    assert [s.env()["OMP_NUM_THREADS"] for s in two.slots()] == ["1", "1"]
    assert all("CUDA_VISIBLE_DEVICES" not in s.env() for s in two.slots())
    assert (concurrency(cfg, 4, Machine(cores=1)).max_parallel, concurrency(cfg, 4, Machine(1)).threads) == (1, 1)
    big = concurrency(cfg, 4, Machine(cores=64))
    assert (big.max_parallel, big.threads) == (4, 16)


def test_thread_count_never_depends_on_max_parallel(no_thread_env: None) -> None:
    """Sequential (max_parallel 1) and side by side: the same threads per run, so the same weights."""
    machine = Machine(cores=2)
    seq = concurrency(_quick(**{"execution.max_parallel": 1}), 4, machine)
    par = concurrency(_quick(), 4, machine)
    assert (seq.max_parallel, par.max_parallel) == (1, 2)
    assert seq.threads == par.threads == stage_threads(_quick(), machine=machine) == 1
    assert "execution.max_parallel 1" in seq.reason


def test_declared_threads_and_the_environment(no_thread_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """execution.threads_per_stage, else OMP_NUM_THREADS, set the threads; the parent's choice
    (VPO_STAGE_THREADS in a stage process it started) wins over both."""
    machine = Machine(cores=2)
    two = concurrency(_quick(**{"execution.threads_per_stage": 2}), 4, machine)
    assert (two.max_parallel, two.threads) == (1, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert stage_threads(_quick(), machine=machine) == 2
    assert stage_threads(_quick(**{"execution.threads_per_stage": 1}), machine=machine) == 1
    monkeypatch.setenv(THREADS_ENV, "3")
    assert stage_threads(_quick(**{"execution.threads_per_stage": 1}), machine=machine) == 3


def test_gpus_are_dealt_out_without_overlap(no_thread_env: None) -> None:
    """One GPU per run: as many at once as GPUs, each seeing its own; an accelerate config with 8
    processes: 8 GPUs per run; more runs than GPU slots asked for: capped, and the reason says so."""
    cfg = _quick()
    four = concurrency(cfg, 4, Machine(cores=16, gpus=("0", "1", "2", "3")))
    assert four.max_parallel == 4 and four.threads == 4
    assert [s.env()["CUDA_VISIBLE_DEVICES"] for s in four.slots()] == ["0", "1", "2", "3"]
    accel = _quick(**{"trainer.accelerate_config": "infra/accelerate/deepspeed_zero2.yaml"})
    gpus = tuple(str(i) for i in range(16))
    wide = concurrency(accel, 4, Machine(cores=32, gpus=gpus))
    assert wide.devices_per_stage == 8 and wide.max_parallel == 2
    assert [s.env()["CUDA_VISIBLE_DEVICES"] for s in wide.slots()] == [",".join(gpus[:8]), ",".join(gpus[8:])]
    capped = concurrency(_quick(**{"execution.max_parallel": 4}), 4, Machine(cores=8, gpus=("0", "1")))
    assert capped.max_parallel == 2 and "capped at 2 by 2 GPUs" in capped.reason


def test_max_parallel_is_validated_where_it_is_written(tmp_path: Path) -> None:
    """A bad execution setting is one config error naming the key (not a crash at run time)."""
    from vpo.pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"execution.max_parallel"):
        _quick(**{"execution.max_parallel": 0})
    with pytest.raises(ConfigError, match=r"execution.max_paralel"):
        _quick(**{"execution.max_paralel": 2})


def test_training_runs_form_one_group_between_their_neighbours() -> None:
    """The plan in groups: data, rewards, base alone, the four training runs together, then evaluate,
    search and register alone."""
    groups = independent_groups(steps_of(_quick()))
    labels = [[s.label for s in g] for g in groups]
    assert labels == [["data"], ["rewards"], ["base"],
                      ["train@grpo-s0", "train@vpo-s0", "train@grpo_x3-s0", "train@max_at_k-s0"],
                      ["evaluate"], ["search"], ["register"]]


_CACHE_USER = """
import json, os, sys, time
from pathlib import Path
from vpo.atomic import atomic_dir
from vpo.pipeline.engine.locking import shared_cache_lock
cache, out, log = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
with shared_cache_lock(cache, "the test cache"):
    t0 = time.time()
    if not (cache / "done.json").is_file():
        with atomic_dir(cache) as tmp:          # a slow import: 20 files, one by one
            for i in range(20):
                (tmp / f"part-{i}.bin").write_bytes(os.urandom(64))
                time.sleep(0.02)
            (tmp / "done.json").write_text(json.dumps({"by": os.getpid()}))
    files = sorted(p.name for p in cache.iterdir())
    out.write_text(json.dumps({"files": files, "by": json.loads((cache / "done.json").read_text())["by"]}))
    with open(log, "a") as fh:
        fh.write(f"{os.getpid()} {t0} {time.time()}\\n")
"""


def test_model_cache_is_filled_once_and_read_whole(tmp_path: Path) -> None:
    """Three stages wanting the shared model cache at once (as the base stages of several variants
    can): one fills it, the others wait and then read it whole; no two hold it at the same time."""
    cache = tmp_path / "runs" / "models" / "m-float32"
    log = tmp_path / "holds.log"
    procs = [subprocess.Popen([sys.executable, "-c", _CACHE_USER, str(cache), str(tmp_path / f"out{i}.json"), str(log)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(3)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    seen = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(3)]
    assert all(s["files"] == seen[0]["files"] and len(s["files"]) == 21 for s in seen)
    assert len({s["by"] for s in seen}) == 1, "the cache was filled more than once"
    holds = sorted(tuple(map(float, line.split()[1:])) for line in log.read_text().splitlines())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(holds)), holds
    assert sum("waiting for another stage that is preparing the test cache" in o for o in outputs) >= 1
    assert not [p for p in cache.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# --------------------------------------------------------------------------- signals (slow)


def _prepared_copy(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    return copy_prepared(prepared_run(tmp_path_factory.getbasetemp() / "prepared"), tmp_path / "work")


def _wait_for_lines(proc: subprocess.Popen[str], wanted: list[str], timeout: float) -> list[str]:
    """Read ``proc``'s output until every string in ``wanted`` appeared in some line."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if all(any(w in s for s in seen) for w in wanted) or time.monotonic() > deadline:
            break
    missing = [w for w in wanted if not any(w in s for s in seen)]
    assert not missing, f"never printed {missing}:\n" + "".join(seen)[-3000:]
    return seen


@pytest.mark.slow
def test_sigterm_to_vpo_run_stops_every_training_run_it_started(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """SIGTERM while two training runs train side by side: exit 143, one line naming how to resume, no
    traceback, and none of the processes `vpo run` started (the `vpo stage train` runs) is left."""
    config = _prepared_copy(tmp_path_factory, tmp_path)
    env = vpo_env({"OMP_NUM_THREADS": "1"})
    proc = subprocess.Popen([str(VPO), "run", "--quick", "--config", str(config), "--set", "trainer.max_steps=400",
                             "--set", "execution.max_parallel=2"], cwd=config.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with Descendants(proc.pid) as watch:
        seen = _wait_for_lines(proc, ["2 at once", "[vpo] train@grpo-s0: ", "[vpo] train@vpo-s0: ",
                                      "train@vpo-s0: "], 300)
        time.sleep(1)
        watch.snapshot()
        assert len(watch.matching("stage train")) == 2, watch.seen
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert proc.returncode == 143, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    stopped = [ln for ln in out.splitlines() if "stopped by SIGTERM" in ln]
    command = shlex.join([str(VPO), "run", "--quick", "--config", str(config), "--set", "trainer.max_steps=400",
                          "--set", "execution.max_parallel=2"])
    expected = (f"[vpo] stopped by SIGTERM; run `{command}` again to resume (finished stages are kept, "
                "training resumes from its last checkpoint)")
    assert stopped == [expected], out[-3000:]
    assert watch.alive() == []
    assert not (config.parent / "runs" / RUN_NAME / "registry.json").exists()


@pytest.mark.slow
def test_sigterm_to_vpo_stage_is_one_line_and_exit_143(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """`vpo stage train` stopped while it trains: 143, one line with the stage and the command, nothing
    left running; the arm's lock is free again at once."""
    from vpo.pipeline.engine.locking import arm_lock_path, pipeline_lock

    config = _prepared_copy(tmp_path_factory, tmp_path)
    args = [str(VPO), "stage", "train", "--quick", "--config", str(config), "--arm", "vpo", "--seed", "0",
            "--set", "trainer.max_steps=400"]
    proc = subprocess.Popen(args, cwd=config.parent, env=vpo_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    with Descendants(proc.pid) as watch:
        seen = _wait_for_lines(proc, ["[vpo] train@vpo-s0: "], 300)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert proc.returncode == 143 and "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if "stopped by SIGTERM" in ln]
    assert len(lines) == 1 and lines[0].startswith("[vpo] stopped by SIGTERM during train@vpo-s0; run `"), out[-2000:]
    assert shlex.join(args[1:]) in lines[0]
    assert watch.alive() == []
    run_dir = config.parent / "runs" / RUN_NAME
    assert arm_lock_path(run_dir, "vpo-s0").exists()
    with pipeline_lock(run_dir, RUN_NAME):
        pass


def test_os_environ_is_untouched_by_a_stage_slot() -> None:
    """A slot's environment is handed to the stage process only: this process keeps its own."""
    before = dict(os.environ)
    concurrency(_quick(), 4, Machine(cores=2)).slots()[0].env()
    assert dict(os.environ) == before


def test_a_failed_training_run_becomes_the_commands_one_error(tmp_path: Path) -> None:
    """What `vpo run` reports when training runs beside others fail: a lock refusal stays a lock
    refusal (exit 3), bad input stays bad input (exit 2) with the run's own error line, a crash names
    the run, its exit code and its last output; the others are counted."""
    from collections import deque
    from types import SimpleNamespace

    from vpo.pipeline.config.layout import RunLayout
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.engine.fanout import StageProcessFailed, _failure
    from vpo.pipeline.engine.locking import LockBusyError

    layout = RunLayout(tmp_path / "runs" / RUN_NAME, RUN_NAME)

    def child(label: str, rc: int, errors: list[str], tail: list[str]) -> object:
        return SimpleNamespace(label=label, proc=SimpleNamespace(returncode=rc),
                               errors=errors, tail=deque(tail))

    locked = _failure([child("train@vpo-s0", 3, ["error: arm vpo-s0 of pipeline x is already running"], [])], layout)
    assert isinstance(locked, LockBusyError) and str(locked).startswith("train@vpo-s0: arm vpo-s0 of pipeline x")
    bad = _failure([child("train@vpo-s0", 2, ["error: train row id 'r1': its prompt is 300 tokens"], []),
                    child("train@grpo-s0", 2, ["error: x"], [])], layout)
    assert isinstance(bad, StageError)
    assert str(bad) == "train@vpo-s0: train row id 'r1': its prompt is 300 tokens (and 1 more: train@grpo-s0)"
    crash = _failure([child("train@vpo-s0", -9, [], ["step 1", "Killed"])], layout)
    assert isinstance(crash, StageProcessFailed) and str(crash).startswith("train@vpo-s0 exited with -9")
    assert str(crash).endswith("  step 1\n  Killed")


def test_a_failed_process_stops_the_queue_and_the_call_returns(tmp_path: Path) -> None:
    """One slot, three commands, the first fails: the other two never start and the call raises the
    first's failure instead of waiting for slots that will never be asked for."""
    from vpo.pipeline.config.layout import RunLayout
    from vpo.pipeline.engine.execution import Concurrency
    from vpo.pipeline.engine.fanout import StageProcessFailed, run_processes

    layout = RunLayout(tmp_path / "runs" / RUN_NAME, RUN_NAME)
    layout.root.mkdir(parents=True)
    done: list[str] = []
    jobs = [("first", ["stage", "no-such-stage"]), ("second", ["pipelines"]), ("third", ["pipelines"])]
    with pytest.raises(StageProcessFailed) as err:
        run_processes(jobs, Concurrency(1, 1, 0, Machine(cores=2), "one slot"), layout=layout,
                      on_done=done.append, poll_s=0.05)
    assert str(err.value).startswith("first exited with 2;") and "more:" not in str(err.value)
    assert done == []
