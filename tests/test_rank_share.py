"""Per-rank resources of a launched run: each of a node's ranks gets cores / ranks torch threads and its
share of the sandbox workers, stated once; the numbers reach every rank's environment and its pool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vpo.pipeline import config as C
from vpo.pipeline.engine.execution import THREADS_ENV, Machine, rank_share
from vpo.sandbox import Sandbox, SandboxConfig, rank_workers

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_inherited_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The share is computed from the machine, not from a thread count this test process inherited."""
    for name in (THREADS_ENV, "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_rank_workers_arithmetic() -> None:
    assert rank_workers(None, 96, 8) == 12  # the node's cores, shared
    assert rank_workers(32, 96, 8) == 4  # the configured workers are the node's, shared
    assert rank_workers(3, 2, 8) == 1  # at least one each
    assert rank_workers(None, 2, 1) == 2  # outside a launch: as before


def test_the_code_preset_on_an_8_gpu_node() -> None:
    """code-qwen-coder (ZeRO-2 over 8 processes, task.params.sandbox.workers 32) on 96 cores, 8 GPUs: one run
    at a time takes all of them; each rank gets 12 threads and 4 sandbox workers, not 96 threads and 32."""
    cfg = C.load_pipeline("code-qwen-coder", REPO / "pipelines.yaml")
    share = rank_share(cfg, 8, Machine(96, tuple(str(i) for i in range(8))))
    assert (share.ranks, share.threads, share.workers) == (8, 12, 4)
    assert share.describe() == ("8 ranks: 12 torch threads each (96 / 8), 4 sandbox workers each "
                                "(task.params.sandbox.workers 32 / 8)")
    assert share.env() == {THREADS_ENV: "12", "OMP_NUM_THREADS": "12", "MKL_NUM_THREADS": "12",
                           "OPENBLAS_NUM_THREADS": "12"}


def test_a_task_without_a_sandbox_shares_threads_only() -> None:
    cfg = C.load_pipeline("route", REPO / "pipelines.yaml", quick=True)
    share = rank_share(cfg, 2, Machine(2))
    assert (share.threads, share.workers) == (max(1, share.run_threads // 2), None)
    assert "sandbox" not in share.describe()


def test_a_pool_in_a_rank_takes_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with Sandbox(SandboxConfig(workers=6)) as sandbox:
        assert sandbox.workers == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with Sandbox(SandboxConfig(workers=6)) as sandbox:
        assert sandbox.workers == 6


RANK_SCRIPT = """
import json, os, sys, torch
from vpo.pipeline.config import load_pipeline
from vpo.pipeline.engine.execution import stage_threads, torch_threads
from vpo.sandbox import Sandbox, SandboxConfig
cfg = load_pipeline("route", sys.argv[1], quick=True)
with torch_threads(stage_threads(cfg)), Sandbox(SandboxConfig(workers=4)) as sandbox:
    print(json.dumps({"rank": os.environ["RANK"], "local_world": os.environ["LOCAL_WORLD_SIZE"],
                      "omp": os.environ["OMP_NUM_THREADS"], "torch_threads": torch.get_num_threads(),
                      "workers": sandbox.workers}), flush=True)
"""


@pytest.mark.slow  # two launched processes importing torch: about 10 s on a loaded machine
@pytest.mark.integration
def test_the_share_reaches_each_launched_rank(tmp_path: Path) -> None:
    """``accelerate launch`` of two CPU ranks (torchrun) with the environment the train stage gives its
    launch (``rank_share(...).env()``): each rank runs with the share of torch threads (read as the stage
    reads them) and its pool takes half of the 4 configured sandbox workers."""
    import os

    cfg_path = REPO / "pipelines.yaml"
    cfg = C.load_pipeline("route", cfg_path, quick=True)
    share = rank_share(cfg, 2, Machine(16))
    assert (share.run_threads, share.threads) == (4, 2)  # 16 cores for route-quick's 4 runs: 4 each, 2 per rank
    acc = tmp_path / "two_ranks.yaml"
    acc.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "num_processes": 2, "num_machines": 1,
                                   "use_cpu": True, "mixed_precision": "no"}))
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in (THREADS_ENV, "OMP_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc), str(script),
                           str(cfg_path)], env={**env, **share.env()}, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                   key=lambda r: r["rank"])
    assert ranks == [{"rank": r, "local_world": "2", "omp": "2", "torch_threads": 2, "workers": 2} for r in "01"]
