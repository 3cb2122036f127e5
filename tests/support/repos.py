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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml

REPO = Path(__file__).resolve().parents[2]
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


def tree_digest(root: Path, *, skip: Callable[[Path], bool] = lambda rel: False) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative posix path -> hex digest), leaving out the paths
    (relative to ``root``) that ``skip`` names."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not p.is_symlink() and not skip(rel):
            out[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_repo(src: Path, dest: Path) -> Path:
    """Copy a test repository (git, DVC cache, run outputs) to ``dest``, links kept as links and DVC's
    own scratch folder (``.dvc/tmp``: its locks and index) left behind, and return the copy."""
    scratch = src / ".dvc" / "tmp"
    shutil.copytree(src, dest, symlinks=True, ignore=lambda d, names: names if Path(d) == scratch else [])
    return dest


def _scratch(rel: Path) -> bool:
    """What reading a repository may write: DVC's scratch folder, git's stat cache and Python's
    bytecode caches."""
    return rel.parts[:2] == (".dvc", "tmp") or rel.parts == (".git", "index") or "__pycache__" in rel.parts


def untouched(repo: Path, digest: Mapping[str, str], what: str) -> None:
    """Assert that no file of ``repo`` differs from ``digest`` (taken when it was built)."""
    now = tree_digest(repo, skip=_scratch)
    changed = sorted(k for k in now.keys() | digest.keys() if now.get(k) != digest.get(k))
    assert not changed, f"a test wrote into {what} (copy it first): {changed[:10]}"


@dataclass(frozen=True)
class QuickRun:
    """The repository in which `vpo run --quick` ran once for the whole test session, and what it
    printed. Shared read-only: a test that writes anything works on :meth:`copy`; the session checks
    at its end that no file changed (:meth:`check_untouched`)."""

    repo: Path
    stdout: str
    digest: dict[str, str]

    @property
    def run(self) -> Path:
        """The run folder, ``runs/route-quick``."""
        return self.repo / "runs" / "route-quick"

    def copy(self, dest: Path) -> Path:
        """A private copy of the repository at ``dest``; returns its path."""
        return copy_repo(self.repo, dest)

    def check_untouched(self) -> None:
        """Fail naming the files a test changed, added or deleted in the shared repository."""
        untouched(self.repo, self.digest, "the shared quick repository")


def build_quick_repo(workdir: Path) -> QuickRun:
    """A git + DVC copy of the project in which `vpo run --quick` (search included) ran as a user runs
    it: the training runs and the searches side by side (``execution.max_parallel: 2`` committed in
    the quick preset, so it holds on any machine), one torch thread each, a ``.venv`` link beside it
    as a fresh clone has after `make quick`."""
    repo = make_repo(workdir / "repo")
    path = repo / "pipelines.yaml"
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    raw["pipelines"]["route"]["quick"]["execution"] = {"max_parallel": 2}
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    run([sys.executable, "-m", "vpo.pipeline.cli", "dvc"], repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qam", "two at once"], repo)
    (repo / ".venv").symlink_to(Path(sys.executable).parents[1], target_is_directory=True)
    proc = run([sys.executable, "-m", "vpo.pipeline.cli", "run", "--quick"], repo, timeout=1200,
               env=tool_env(OMP_NUM_THREADS="1"))
    return QuickRun(repo=repo, stdout=proc.stdout, digest=tree_digest(repo, skip=_scratch))


@dataclass
class FlowResult:
    """One finished flow run and the repository and bucket it ran with. Shared read-only like
    :class:`QuickRun`: tests that write work on ``copy_repo(result.repo, ...)``."""

    repo: Path
    bucket: str
    state: Any
    digest: dict[str, str] = field(default_factory=dict)

    def check_untouched(self) -> None:
        """Fail naming the files a test changed, added or deleted in the flow's repository."""
        untouched(self.repo, self.digest, "the quick flow's repository")

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
    return FlowResult(repo=repo, bucket=bucket, state=state, digest=tree_digest(repo, skip=_scratch))
