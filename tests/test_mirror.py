"""Checkpoints mirrored to ``storage.checkpoints`` (vpo.pipeline.engine.mirror): copied whole with a
completion marker written last, the newest ``checkpoints_keep`` kept, the newest complete one restored
into a machine that has none, a copy cut mid-upload never restored. Against a local folder and against
moto's S3 server on loopback; then end to end: a run killed after its step-2 checkpoint was mirrored,
its machine's run folder gone, resumes on a fresh copy of the inputs from the mirror and ends with the
weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.faults import RUN_NAME, copy_prepared, prepared_run, start_wrapper, wait_for

ARM = Path("runs") / RUN_NAME / "arms" / "vpo-s0"


def _checkpoint(folder: Path, step: int) -> Path:
    """A small checkpoint-N folder that checkpoint_problem accepts (weights, optimizer, scheduler, RNG
    state, trainer_state.json), its tensors filled with ``step``."""
    import torch
    from safetensors.torch import save_file

    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.full((64, 64), float(step))}, str(path / "model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"step": step, "x": torch.arange(100)}, path / name)
    (path / "config.json").write_text("{}")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def _exercise(url: str, local: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vpo.pipeline.engine import mirror as mirror_mod
    from vpo.pipeline.engine.checkpoints import checkpoint_problem
    from vpo.pipeline.engine.mirror import MARKER, CheckpointMirror, newest_complete, restore

    lines: list[str] = []
    monkeypatch.setattr(mirror_mod, "log", lines.append)
    trainer = local / "trainer"
    mirror = CheckpointMirror(url, keep=2, warn=lines.append)
    for step in (1, 2, 3):
        mirror.submit(_checkpoint(trainer, step))
    mirror.wait()
    assert mirror.copied == [1, 2, 3] and not lines
    fs, root = mirror.fs, mirror.root
    names = sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert names == ["checkpoint-2", "checkpoint-3"]  # keep 2: the oldest deleted
    # a copy cut mid-upload: the upload dies after its first file, no marker is written
    put = fs.put_file
    calls = {"n": 0}

    def dying_put(lpath: str, rpath: str, **kw: Any) -> None:
        calls["n"] += 1
        if calls["n"] > 1:
            raise ConnectionError("connection reset mid-upload")
        put(lpath, rpath, **kw)

    monkeypatch.setattr(fs, "put_file", dying_put)
    mirror.submit(_checkpoint(trainer, 4))
    mirror.wait()
    monkeypatch.setattr(fs, "put_file", put)
    assert len(lines) == 1 and lines[0].startswith("warning: could not mirror checkpoint-4 to ")
    assert lines[0].endswith("(ConnectionError: connection reset mid-upload); training goes on with local checkpoints")
    assert fs.exists(f"{root}/checkpoint-4") and not fs.exists(f"{root}/checkpoint-4/{MARKER}")
    # a copy whose marker lists a file that is not there (deleted or overwritten since)
    mirror.submit(_checkpoint(trainer, 5))
    mirror.wait()
    fs.rm_file(f"{root}/checkpoint-5/optimizer.pt")
    lines.clear()
    newest = newest_complete(url)
    assert newest is not None and newest.step == 3
    assert lines == [f"skipping mirrored checkpoint-5 at {url}: optimizer.pt is missing; using the one before it",
                     (f"skipping mirrored checkpoint-4 at {url}: no completion marker (cut mid-upload); using the one "
                      "before it")]
    # a machine with an intact checkpoint of its own keeps it
    assert restore(trainer, url) is None
    # a machine with none gets the newest complete copy, byte for byte
    fresh = local / "fresh" / "trainer"
    restored = restore(fresh, url)
    assert restored == fresh / "checkpoint-3" and checkpoint_problem(restored) is None
    for name in ("model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"):
        assert (restored / name).read_bytes() == (trainer / "checkpoint-3" / name).read_bytes()
    assert not (restored / MARKER).exists() and not list(fresh.glob(".*"))
    assert lines[-1].startswith(f"restored checkpoint-3 from {url} (")


def test_mirror_to_a_folder_keeps_the_newest_and_never_restores_a_cut_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _exercise(str(tmp_path / "mirror"), tmp_path / "local", monkeypatch)


def test_mirror_to_s3_keeps_the_newest_and_never_restores_a_cut_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_bucket: str) -> None:
    _exercise(f"s3://{s3_bucket}/checkpoints", tmp_path / "local", monkeypatch)


def test_a_checkpoint_of_several_processes_is_intact_with_one_rng_state_each(tmp_path: Path) -> None:
    """The Trainer saves rng_state_<rank>.pth per process when several train (one node's or several
    nodes'): such a checkpoint is complete, and a torn one of them is still found."""
    import torch

    from vpo.pipeline.engine.checkpoints import checkpoint_problem

    path = _checkpoint(tmp_path, 2)
    (path / "rng_state.pth").unlink()
    assert checkpoint_problem(path) == "missing rng_state.pth"
    for rank in (0, 1):
        torch.save({"cpu": torch.arange(5)}, path / f"rng_state_{rank}.pth")
    assert checkpoint_problem(path) is None
    (path / "rng_state_1.pth").write_bytes(b"PK\x03\x04 torn")
    assert checkpoint_problem(path) == "rng_state_1.pth is not a complete archive (BadZipFile)"


def test_storage_checkpoints_refuses_credentials_in_the_url(tmp_path: Path) -> None:
    from tests.support.faults import load_cfg, write_pipelines
    from vpo.pipeline.config import ConfigError

    config = write_pipelines(tmp_path)
    with pytest.raises(ConfigError, match="must not embed credentials"):
        load_cfg(config, **{"storage.checkpoints": "s3://key:secret@bucket/x"})
    assert load_cfg(config, **{"storage.checkpoints": "gcs://bucket/ckpt"}).storage.checkpoints == "gcs://bucket/ckpt"


# --------------------------------------------------------------------------- end to end


STEPS, SAVE_STEPS = 4, 2


def _train_args(url: str) -> list[str]:
    return ["stage", "train", "--quick", "--config", "pipelines.yaml", "--arm", "vpo", "--seed", "0",
            "--set", f"trainer.max_steps={STEPS}", "--set", f"trainer.save_steps={SAVE_STEPS}",
            "--set", "arms.vpo.max_completion_length=32", "--set", f"storage.checkpoints={url}"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_run_whose_machine_is_lost_resumes_from_the_mirror_with_the_same_weights(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, s3_bucket: str) -> None:
    from safetensors.torch import load_file

    from tests.support.faults import run_wrapper
    from vpo.pipeline.engine.mirror import MARKER, filesystem

    url = f"s3://{s3_bucket}/ckpt"
    prepared = prepared_run(tmp_path_factory.getbasetemp(), task="faulttoy")
    ref_dir, lost_dir, fresh_dir = (tmp_path / n for n in ("reference", "lost", "fresh"))
    copy_prepared(prepared, ref_dir)
    copy_prepared(prepared, lost_dir)
    # the uninterrupted run (its own mirror prefix: another bucket path)
    ref = start_wrapper(_train_args(f"s3://{s3_bucket}/reference"), ref_dir, tmp_path / "ref.log")
    # the run whose machine is lost: stopped dead inside the save of checkpoint-4, once checkpoint-2 is mirrored
    marker = tmp_path / "paused"
    victim = start_wrapper(_train_args(url), lost_dir, tmp_path / "victim.log", pause_in_save=STEPS, marker=marker)
    wait_for(marker, victim, 900, tmp_path / "victim.log")
    fs, root = filesystem(url)
    copies = [p for p in fs.find(root) if p.endswith(f"/checkpoint-{SAVE_STEPS}/{MARKER}")]
    deadline = time.monotonic() + 120
    while not copies and time.monotonic() < deadline:  # the background copy of checkpoint-2 finishing
        time.sleep(0.2)
        copies = [p for p in fs.find(root) if p.endswith(f"/checkpoint-{SAVE_STEPS}/{MARKER}")]
    assert copies, (tmp_path / "victim.log").read_text()[-3000:]
    os.killpg(victim.pid, signal.SIGKILL)
    assert victim.wait(30) == -signal.SIGKILL
    shutil.rmtree(lost_dir)  # the machine and its disk are gone
    assert ref.wait(900) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    # a fresh machine: the inputs (as `dvc pull` brings them), no run folder
    copy_prepared(prepared, fresh_dir)
    assert not (fresh_dir / ARM).exists()
    proc = run_wrapper(_train_args(url), fresh_dir, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"restored checkpoint-{SAVE_STEPS} from {url}/" in out, out[-3000:]
    assert f"vpo-s0: resuming from checkpoint-{SAVE_STEPS} (step {SAVE_STEPS} of {STEPS})" in out
    metrics = json.loads((fresh_dir / ARM / "metrics.json").read_text())
    assert metrics["resumed_from"] == f"checkpoint-{SAVE_STEPS}"
    a = load_file(str(ref_dir / ARM / "model" / "model.safetensors"))
    b = load_file(str(fresh_dir / ARM / "model" / "model.safetensors"))
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    print(f"resumed from the mirror vs uninterrupted: max |weight difference| {diff:.3g}")
    assert diff == 0.0
    # the mirror keeps the newest checkpoints_keep (2) complete copies of the run: 2 and 4
    kept = sorted(p.rsplit("/", 2)[-2] for p in fs.find(root) if p.endswith(MARKER))
    assert kept == ["checkpoint-2", "checkpoint-4"]
