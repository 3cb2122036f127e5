"""Shared pieces of the fault-injection tests (tests/test_faults_*.py); holds no tests itself.

* :func:`write_pipelines`: a temp ``pipelines.yaml`` holding the repo's ``route`` pipeline with a
  1-layer tiny model, its runs folder and registry inside the temp folder (``--quick`` applies);
* :func:`run_vpo` / :func:`vpo_env`: the ``vpo`` CLI in a subprocess, one torch thread (the test
  machine has 2 shared cores; with more threads the tiny model is 5x slower);
* :func:`prepared_run`: data, rewards and base stages run once per test session, copied per test;
* the ``faulttoy`` task: the route grids with a dense reward (fraction of each move letter in every
  ``[UDLR]+`` run), so an untrained model already gets varied reward vectors and non-zero advantages;
  ``faultbadrows`` (one broken row) and ``faultbadreward`` (wrong shape / NaN / inf) break it on purpose;
* run as a script it is a thin wrapper around ``vpo.pipeline.cli.main`` that registers these tasks,
  can record every step's advantages, and can stop
  dead inside a chosen checkpoint save (the test then SIGKILLs it there):
  ``python tests/support/faults.py [--record F] [--pause-in-save N --marker M] -- ARGS``.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vpo.rewards import VectorReward
from vpo.tasks import available_tasks, register_task
from vpo.tasks.route import RouteTask

REPO = Path(__file__).resolve().parents[2]
VPO = Path(sys.executable).with_name("vpo")
SCRIPT = Path(__file__).resolve()
TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
RUN_NAME = "route-quick"


# --------------------------------------------------------------------------- the dense toy task


class MoveMixReward(VectorReward):
    """d=4: the fraction of U, D, L and R moves in an answer; answers are the ``[UDLR]+`` runs."""

    names = ("up", "down", "left", "right")

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        """Per answer, the share of each move letter."""
        return np.array([[a.count(c) / max(1, len(a)) for c in "UDLR"] for a in answers], dtype=np.float64)

    def parse(self, completion: str, m: int) -> list[str]:
        """The first m runs of move letters."""
        return re.findall(r"[UDLR]+", completion)[:m]


class FaultToyTask(RouteTask):
    """Route prompts and demonstrations with :class:`MoveMixReward`."""

    name = "faulttoy"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.reward = MoveMixReward()


class BadRowsTask(RouteTask):
    """Route rows with one row of ``bad_split`` broken as ``defect`` says (a bad dataset source)."""

    name = "faultbadrows"

    def __init__(
        self, defect: str = "missing_prompt", bad_row: int = 5, bad_split: str = "train", **params: Any
    ) -> None:
        super().__init__(**params)
        self.defect, self.bad_row, self.bad_split = defect, bad_row, bad_split

    def load(self, split: str) -> list[dict[str, Any]]:
        """The route rows, one of them broken."""
        rows: list[Any] = super().load(split)
        if split == self.bad_split:
            row = rows[self.bad_row]
            if self.defect == "missing_prompt":
                del row["prompt"]
            elif self.defect == "int_prompt":
                row["prompt"] = 12345
            elif self.defect == "none_id":
                row["id"] = None
            elif self.defect == "not_mapping":
                rows[self.bad_row] = ["not", "a", "row"]
            else:
                raise ValueError(f"unknown defect {self.defect!r}")
        return rows


class BrokenReward(MoveMixReward):
    """:class:`MoveMixReward` breaking its contract: ``dim`` (one column short), ``nan`` or ``inf``."""

    def __init__(self, defect: str) -> None:
        self.defect = defect

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        """The move shares with the defect applied to the first answer."""
        out = super().score(answers, row)
        if self.defect == "dim":
            return out[:, :-1]
        out[0, 1] = {"nan": np.nan, "inf": np.inf}[self.defect]
        return out


class BadRewardTask(FaultToyTask):
    """:class:`FaultToyTask` with a :class:`BrokenReward`."""

    name = "faultbadreward"

    def __init__(self, defect: str = "nan", **params: Any) -> None:
        super().__init__(**params)
        self.reward = BrokenReward(defect)


for _task in (FaultToyTask, BadRowsTask, BadRewardTask):
    if _task.name not in available_tasks():
        register_task(_task.name)(_task)


# --------------------------------------------------------------------------- config and CLI


def write_pipelines(folder: Path, *, task: str = "route", changes: Mapping[str, Any] | None = None) -> Path:
    """Write ``folder/pipelines.yaml``: the repo's ``route`` pipeline with the tiny model, runs and
    registry under ``folder``, task ``task``; ``changes`` maps dotted keys to values (base section)."""
    data = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    pipe = copy.deepcopy(data["pipelines"]["route"])
    pipe["task"]["name"] = task
    pipe["model"]["builder_params"] = dict(TINY_MODEL)
    pipe["storage"] = {"registry": "registry", "runs_dir": "runs", "dvc_remote": None}
    # the untrained tiny test model rarely emits EOS: score completions cut at the token limit too,
    # or every advantage would be zero
    pipe["trainer"]["truncated_scores_zero"] = False
    for key, value in (changes or {}).items():
        node = pipe
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pipelines.yaml"
    path.write_text(
        yaml.safe_dump({"version": 1, "default": "route", "pipelines": {"route": pipe}}, sort_keys=False)
    )
    return path


def vpo_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for CLI subprocesses: offline, one thread, no progress bars."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TQDM_DISABLE": "1",
            "PYTHONUNBUFFERED": "1",
            "DVC_NO_ANALYTICS": "1",
            "GX_ANALYTICS_ENABLED": "False",
        }
    )
    env.update(extra or {})
    return env


def run_vpo(
    args: Sequence[str], cwd: Path, *, timeout: float = 300, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``vpo ARGS`` to completion and capture its output."""
    return subprocess.run(
        [str(VPO), *args],
        cwd=cwd,
        env=vpo_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def start_wrapper(
    args: Sequence[str],
    cwd: Path,
    log: Path,
    *,
    record: Path | None = None,
    pause_in_save: int | None = None,
    pause_in_publish: bool = False,
    marker: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start this file as the wrapper script around ``vpo ARGS`` (output to ``log``)."""
    cmd = [sys.executable, str(SCRIPT)]
    if record is not None:
        cmd += ["--record", str(record)]
    if pause_in_save is not None:
        assert marker is not None
        cmd += ["--pause-in-save", str(pause_in_save), "--marker", str(marker)]
    if pause_in_publish:
        assert marker is not None
        cmd += ["--pause-in-publish", "--marker", str(marker)]
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*cmd, "--", *args],
            cwd=cwd,
            env=vpo_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_wrapper(args: Sequence[str], cwd: Path, *, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``vpo ARGS`` through the wrapper (test tasks registered) to completion, output captured."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--", *args],
        cwd=cwd,
        env=vpo_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    """Poll until ``path`` exists; fail with the process log if it exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"process exited ({proc.returncode}) before {path.name}:\n{log.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {path.name}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- folders


def tree_digest(root: Path, *, skip_hidden: bool = False) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative posix path -> hex digest), leaving out the run
    folders' own log files (``runs/<variant>/logs/*.log``: each command adds one, which loses nothing)."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if skip_hidden and any(part.startswith(".") for part in rel.parts):
            continue
        if rel.suffix == ".log" and len(rel.parts) >= 2 and rel.parts[-2] == "logs":
            continue
        if p.is_file() and not p.is_symlink():
            out[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run in-process torch work with ``n`` threads, restoring the previous setting."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_cfg(config: Path, **overrides: Any) -> Any:
    """The quick ``route`` pipeline of ``config`` with dotted-key overrides."""
    from vpo.pipeline.config import load_pipeline

    return load_pipeline("route", config, quick=True, overrides=overrides or None)


_PREPARED: dict[str, Path] = {}


def prepared_run(cache_root: Path, task: str = "route") -> Path:
    """A folder with ``pipelines.yaml`` and ``runs/route-quick/{data,rewards,base}`` built once per
    session (in-process, one torch thread); copy it with :func:`copy_prepared` before writing."""
    if task in _PREPARED:
        return _PREPARED[task]
    from vpo.pipeline.runner import run_all

    folder = cache_root / f"prepared-{task}"
    cfg = load_cfg(write_pipelines(folder, task=task))
    with torch_threads(1):
        run_all(cfg, ["data", "rewards", "base"], progress=False)
    _PREPARED[task] = folder
    return folder


def copy_prepared(src: Path, dst: Path) -> Path:
    """Copy a prepared folder to ``dst`` and return the copy's ``pipelines.yaml``."""
    shutil.copytree(src, dst)
    return dst / "pipelines.yaml"


# --------------------------------------------------------------------------- wrapper script


def _install_recorder(record: Path) -> None:
    """Append ``{"step", "advantages"}`` of every batch to ``record`` (flushed line by line)."""
    from vpo.trainer import VPOTrainer

    original = VPOTrainer._generate_and_score_completions

    def recording(self: Any, inputs: Any) -> Any:
        step = self.state.global_step
        out = original(self, inputs)
        with open(record, "a") as fh:
            fh.write(json.dumps({"step": step, "advantages": self.last_advantages.tolist()}) + "\n")
        return out

    VPOTrainer._generate_and_score_completions = recording  # type: ignore[method-assign]


def _install_pause(step: int, marker: Path) -> None:
    """Stop forever inside the save of checkpoint-``step``, after weights, optimizer and scheduler
    are written and before the RNG state and trainer_state.json (a torn checkpoint)."""
    from transformers import Trainer

    original = Trainer._save_rng_state

    def pausing(self: Any, output_dir: Any) -> Any:
        if self.state.global_step == step:
            marker.write_text(json.dumps({"pid": os.getpid(), "step": step}))
            while True:
                time.sleep(60)
        return original(self, output_dir)

    Trainer._save_rng_state = pausing  # type: ignore[method-assign]


def _install_publish_pause(marker: Path) -> None:
    """Stop forever at the start of publishing the final model (after the last checkpoint)."""
    from vpo.pipeline.stages import train

    def pausing(*args: Any, **kw: Any) -> Any:
        marker.write_text(json.dumps({"pid": os.getpid(), "at": "publish"}))
        while True:
            time.sleep(60)

    train._publish = pausing  # type: ignore[assignment]


def main(argv: Sequence[str] | None = None) -> int:
    """The wrapper: parse its own options up to ``--``, install the hooks, run ``vpo`` on the rest."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(prog="tests/support/faults.py")
    ap.add_argument("--record", type=Path)
    ap.add_argument("--pause-in-save", type=int)
    ap.add_argument("--pause-in-publish", action="store_true")
    ap.add_argument("--marker", type=Path)
    opts = ap.parse_args(argv[:split])
    if opts.record:
        _install_recorder(opts.record)
    if opts.pause_in_save is not None:
        _install_pause(opts.pause_in_save, opts.marker)
    if opts.pause_in_publish:
        _install_publish_pause(opts.marker)
    from vpo.pipeline.cli import main as vpo_main

    return vpo_main(argv[split + 1 :])


if __name__ == "__main__":
    raise SystemExit(main())
