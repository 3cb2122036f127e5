"""Faults on a whole pipeline run: two ``vpo run --quick`` started at once on the same run folder and
registry (training, evaluation and registration; the first stages prepared once per session), with fake
S3 keys and tokens in their environment.

One run must refuse at once (exit 3, naming the other's pid) and write nothing; the other completes
with consistent outputs and registry; and no secret value appears in any produced file or log.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.faults import RUN_NAME, VPO, copy_prepared, prepared_run, vpo_env

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # two whole `vpo run` processes race

FAKE_SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAFAULTSIXFAKEKEY7",
    "AWS_SECRET_ACCESS_KEY": "fAkE6sEcReT/kEy+FoR0tHe7fAuLtTeStS9xYzQw",
    "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEFAKEsessionTOKENfaultsix0123456789abcdef",
    "HF_TOKEN": "hf_FakeFaultSixTokenNotReal0123456789",
    "WANDB_API_KEY": "fake0wandb0key0faultsix0000000000000000",
}


@dataclass
class Race:
    """Outcome of the two concurrent runs."""

    folder: Path
    codes: list[int]
    pids: list[int]
    ended: list[float]
    logs: list[Path]
    other_running: list[bool]  # whether the other run was still running when this one ended


@pytest.fixture(scope="module")
def race(tmp_path_factory: pytest.TempPathFactory) -> Race:
    """Start two identical `vpo run --quick --no-search` processes at the same moment, in a folder whose
    data, rewards and base stages the session prepared once, and wait for both."""
    folder = tmp_path_factory.mktemp("race") / "work"
    copy_prepared(prepared_run(tmp_path_factory.getbasetemp()), folder)
    args = [str(VPO), "run", "--quick", "--no-search", "--config", "pipelines.yaml", "--set", "trainer.max_steps=2"]
    logs = [folder / "run-a.log", folder / "run-b.log"]
    env = vpo_env(FAKE_SECRETS)
    procs = []
    for log in logs:
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(args, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT))
    t0, ended, other_running = time.monotonic(), [0.0, 0.0], [False, False]
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            if p.poll() is not None and not ended[i]:
                ended[i] = time.monotonic() - t0
                other_running[i] = procs[1 - i].poll() is None
        if time.monotonic() - t0 > 400:
            for p in procs:
                p.kill()
            raise AssertionError("pipeline runs did not finish in 400 s")
        time.sleep(0.1)
    for i in range(2):
        ended[i] = ended[i] or time.monotonic() - t0
    return Race(folder, [p.returncode for p in procs], [p.pid for p in procs], ended, logs, other_running)


def test_second_concurrent_run_refuses_at_once(race: Race) -> None:
    """Exactly one run proceeds; the other stops at the lock: exit 3, one line naming the run, its
    folder and the holder's pid, no work started, and it ended while the holder still ran (it did
    not wait for the lock). Nothing here depends on how fast the machine is."""
    assert sorted(race.codes) == [0, 3], [log.read_text()[-2000:] for log in race.logs]
    win, lose = race.codes.index(0), race.codes.index(3)
    message = race.logs[lose].read_text()
    assert (
        f"error: pipeline {RUN_NAME} (run folder {race.folder / 'runs' / RUN_NAME}) is already running "
        f"(pid {race.pids[win]} on" in message
    ), message
    assert "Traceback" not in message and "[vpo]" not in message, "the refused run started working"
    assert race.other_running[lose], "the refused run waited for the lock instead of refusing at once"


def test_outputs_and_registry_are_consistent(race: Race) -> None:
    """The winner's outputs are complete, no temp leftovers, every registry entry verifies, the
    registered hashes are those of the arm models, and the lock is free again."""
    import pandas as pd

    from vpo.pipeline.engine.checkpoints import content_hash
    from vpo.pipeline.engine.locking import pipeline_lock, read_holder
    from vpo.pipeline.registry import Registry

    run = race.folder / "runs" / RUN_NAME
    # the run's lock and the arm locks of the trainings it ran side by side stay (empty: no holder)
    leftovers = [p for p in run.rglob(".*") if p.name not in (".lock", ".locks")
                 and not (p.parent.name == ".locks" and p.suffix == ".lock")]
    assert leftovers == [], leftovers
    assert all(read_holder(p) is None for p in (run / ".locks").glob("*.lock"))
    for split in ("train", "test"):
        assert len(pd.read_parquet(run / "data" / f"{split}.parquet")) > 0
    metrics = json.loads((run / "eval" / "metrics.json").read_text())
    assert sorted(metrics["runs"]) == ["base-m1", "base-m3", "grpo-s0", "grpo_x3-s0", "max_at_k-s0", "vpo-s0"]
    registered = json.loads((run / "registry.json").read_text())["entries"]
    reg = Registry(race.folder / "registry", race.folder)
    entries, _, bad = reg.scan()
    assert bad == [] and sorted(e["hash"] for e in registered) == sorted(e.hash for e in entries)
    for e in entries:
        model = run / "arms" / str(e.arm) / "model"
        assert content_hash(model) == e.hash and (model / "README.md").read_text() == reg.card(e)
    assert read_holder(run / ".lock") is None
    with pipeline_lock(run, RUN_NAME):
        pass


def test_no_secret_in_any_produced_file_or_log(race: Race) -> None:
    """Grep every file of the run folder, the registry, the config folder and both CLI logs."""
    from vpo.pipeline.engine.storage import scan_for_secrets, secret_values

    assert set(secret_values(FAKE_SECRETS)) == set(FAKE_SECRETS.values()), "the scanner would miss a secret"
    files = [p for p in race.folder.rglob("*") if p.is_file()]
    assert len(files) > 40 and any(p.suffix == ".safetensors" for p in files)
    assert scan_for_secrets([race.folder], env=FAKE_SECRETS) == []
    planted = race.folder.parent / "planted-control"
    planted.mkdir(exist_ok=True)
    (planted / "leak.bin").write_bytes(b"\x00prefix" + FAKE_SECRETS["AWS_SESSION_TOKEN"].encode() + b"\xff")
    assert [Path(p).name for p, _ in scan_for_secrets([planted], env=FAKE_SECRETS)] == ["leak.bin"]
