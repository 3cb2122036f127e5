"""`dvc exp show` on the metrics file the evaluate stage writes (vpo.pipeline.stages.evaluate._summary):
after `dvc exp run -S <variant>.trainer.max_steps=8`, `dvc exp show --only-changed` at 200 columns
shows the changed setting by its full name and every headline metric, none of them cut to `…`.

The experiment is real DVC (git repository, `dvc exp run`), with a stage that writes the summary of a
made-up evaluation of the quick preset's four arms whose numbers all change with the setting -- the
widest row an experiment can have, without minutes of training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ARMS = ("grpo", "vpo", "grpo_x3", "max_at_k")
_STAGE = """
import json, sys, yaml
from vpo.pipeline.stages.evaluate import _summary
steps = yaml.safe_load(open("params.yaml"))["route-quick"]["trainer"]["max_steps"]
agg = {arm: {"best_at_k": {"1": {"mean": 0.3}, "5": {"mean": 0.4 + 0.001 * steps * i}},
             "reward_diversity": {"mean": 1.0 + 0.01 * steps * i}} for i, arm in enumerate(ARMS, 1)}
json.dump(_summary(agg, [1, 5]), open("summary.json", "w"), indent=1)
""".replace("ARMS", repr(ARMS))


def _run(*cmd: str, cwd: Path, **env: str) -> str:
    full = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t.invalid",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t.invalid",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env}
    proc = subprocess.run(list(cmd), cwd=cwd, env=full, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_an_experiments_changed_setting_and_headline_metrics_fit_in_200_columns(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _run("git", "init", "-q", "-b", "main", cwd=repo)
    _run("dvc", "init", "-q", cwd=repo)
    (repo / "stage.py").write_text(_STAGE)
    (repo / "params.yaml").write_text(yaml.safe_dump({"route-quick": {"trainer": {"max_steps": 4}}}))
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"route-quick-evaluate": {
        "cmd": f"{sys.executable} stage.py", "deps": ["stage.py"], "params": ["route-quick.trainer.max_steps"],
        "metrics": [{"summary.json": {"cache": False}}]}}}))
    _run("dvc", "repro", "-q", cwd=repo)
    _run("git", "add", "-A", cwd=repo)
    _run("git", "commit", "-qm", "baseline", cwd=repo)
    _run("dvc", "exp", "run", "-q", "-S", "route-quick.trainer.max_steps=8", cwd=repo)
    assert json.loads((repo / "summary.json").read_text())["best@5"]["max_at_k"] > 0.4
    shown = _run("dvc", "exp", "show", "--only-changed", "--no-pager", cwd=repo, COLUMNS="200")
    lines = shown.splitlines()
    header = next(line for line in lines if "Experiment" in line)
    wanted = [f"best@5.{a}" for a in ARMS] + [f"div.{a}" for a in ARMS] + ["route-quick.trainer.max_steps"]
    assert all(f" {name} " in f"{header} " for name in wanted) and "…" not in shown, shown
    assert max(len(line) for line in lines) <= 200, shown
    assert header.index("best@5.grpo") < header.index("div.grpo") < header.index("route-quick.trainer.max_steps")
