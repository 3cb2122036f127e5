"""Helpers for the DVC and Prefect flow tests: a throwaway git + DVC copy of the repository.

Tests never run ``dvc`` in the shared checkout: :func:`make_repo` copies what the stage graph needs
(``vpo/``, ``flows/``, ``pipelines.yaml``, ``dvc.yaml``, the ``.dvc`` config and plot templates) into a
temporary folder, optionally rewrites the storage section of ``pipelines.yaml`` (no DVC stage reads it)
setting, so it never invalidates a stage), and commits it to a fresh git repository so registry
entries carry a real git revision.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DVC = str(BIN / "dvc")
_COPY_FILES = ("pipelines.yaml", "params.yaml", "dvc.yaml", ".dvcignore", ".gitignore", ".dvc/config",
               ".dvc/.gitignore")
_COPY_DIRS = ("vpo", "flows", "bin", ".dvc/plots")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")


def tool_env(**extra: str) -> dict[str, str]:
    """Environment for dvc/vpo subprocesses: this venv's bin first on PATH, analytics off."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("GX_ANALYTICS_ENABLED", "False")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def run(
    cmd: list[str],
    cwd: Path,
    *,
    check: bool = True,
    timeout: float = 600,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in ``cwd`` capturing text output; on failure with ``check`` raise with the output."""
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=dict(env or tool_env()),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def make_repo(dest: Path, *, storage: Mapping[str, Any] | None = None) -> Path:
    """Copy the pipeline files into ``dest`` (a new git + DVC repo, one commit); ``storage`` overrides
    ``pipelines.route.storage`` keys (e.g. an ``s3://`` DVC remote and registry), and ``dvc.yaml`` and
    ``params.yaml`` are regenerated from the edited file."""
    dest.mkdir(parents=True, exist_ok=True)
    for rel in _COPY_DIRS:
        shutil.copytree(REPO / rel, dest / rel, ignore=_IGNORE, dirs_exist_ok=True)
    for rel in _COPY_FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    if storage:
        path = dest / "pipelines.yaml"
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        raw["pipelines"]["route"].setdefault("storage", {}).update(storage)
        path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        run([sys.executable, "-m", "vpo.pipeline.cli", "dvc"], dest)  # params.yaml follows pipelines.yaml
    git = ["git", "-c", "user.name=vpo-tests", "-c", "user.email=tests@vpo.invalid"]
    run(["git", "init", "-q", "-b", "main"], dest)
    run([*git, "add", "-A"], dest)
    run([*git, "commit", "-q", "-m", "test repo"], dest)
    return dest


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative posix path -> hex digest)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@dataclass
class FlowResult:
    """One finished flow run and the repository and bucket it ran with."""

    repo: Path
    bucket: str
    state: Any

    @property
    def run_id(self) -> UUID:
        """The flow run id."""
        return self.state.state_details.flow_run_id


def run_quick_flow(workdir: Path, s3_server: Any) -> FlowResult:
    """Run the retrain flow on the quick preset in a fresh repo under ``workdir`` with an S3 DVC remote
    and registry in a new bucket, and the ``VPO_FAULT_ONCE=train@vpo-s0`` hook armed (that task fails
    its first attempt). Needs an active Prefect API (the ``prefect_api`` fixture)."""
    from flows import retrain as rt
    from flows.tasks import FAULT_ENV

    bucket = s3_server.make_bucket()
    repo = make_repo(
        workdir / "repo", storage={"dvc_remote": f"s3://{bucket}/dvc", "registry": f"s3://{bucket}/registry"}
    )
    previous = os.environ.get(FAULT_ENV)
    os.environ[FAULT_ENV] = "train@vpo-s0"
    try:
        state = rt.retrain(
            pipeline="route",
            quick=True,
            config=str(repo / "pipelines.yaml"),
            retry_delay_s=1.0,
            return_state=True,
        )
    finally:
        if previous is None:
            os.environ.pop(FAULT_ENV, None)
        else:
            os.environ[FAULT_ENV] = previous
    return FlowResult(repo=repo, bucket=bucket, state=state)
