"""Model versions and stages as git tags (GTO); model bytes back through DVC.

A version is GTO's ``<artifact>@vX.Y.Z`` tag on a commit whose ``dvc.lock`` records the model, so a
registration tags HEAD only when HEAD's ``dvc.lock`` records exactly the weights it registers. A stage
is GTO's ``<artifact>#<stage>#N`` tag: ``gto show``, DVC Studio and ``dvc artifacts get --stage`` see
what ``vpo registry promote`` did. A versioned model comes back with ``dvc artifacts get``; an
unversioned one from DVC's cache or remote by each file's md5.
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from vpo.pipeline.engine.console import tool
from vpo.pipeline.registry.entries import Entry, RegistryError

__all__ = ["GTORefused", "assign", "fetch_with_dvc", "git_root", "git_state", "gto_state", "tag_version", "unversioned_because"]

_MESSAGE = re.compile(r"vpo (\S+) (\S+): content sha256 ([0-9a-f]{64})")  # what tag_version writes


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_root(start: str | Path) -> Path | None:
    """The git work tree holding ``start`` (None outside one)."""
    top = _git(Path(start), "rev-parse", "--show-toplevel")
    return Path(top.strip()) if top else None


def git_state(root: Path | None) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked files have uncommitted changes); Nones outside a repository."""
    rev = _git(root, "rev-parse", "--verify", "HEAD") if root else None
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if rev else None
    return (rev.strip(), bool(status.strip()) if status is not None else None) if rev else (None, None)


@contextlib.contextmanager
def _dvc(root: Path, doing: str) -> Iterator[Any]:
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            yield repo
    except DvcException as exc:
        raise RegistryError(f"DVC could not {doing}: {(str(exc).splitlines() or [type(exc).__name__])[0]}") from None


def _gto_error(exc: Exception) -> RegistryError:
    return RegistryError(f"git tags cannot be written ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})")


def unversioned_because(root: Path | None, path: str | None) -> str | None:
    """None when HEAD's ``dvc.lock`` (in the DVC project ``root``) records the output holding the model
    at ``path`` exactly as it is in the workspace, so a GTO version on HEAD gets these bytes back; else
    why no version can be tagged (worded alike for every arm run, so a stage says it once)."""
    if root is None or path is None:
        return "the project is not a git repository"
    text = _git(root, "show", "HEAD:./dvc.lock")
    if text is None:
        return "HEAD has no committed dvc.lock"
    outs = _lock_outs(text)
    out = next((o for o in outs if path == o.get("path") or path.startswith(f"{o.get('path')}/")), None)
    if out is None:
        return "HEAD's dvc.lock records no output holding the model"
    from dvc_data.hashfile.build import build

    with _dvc(root, "hash the model's output") as repo:  # DVC's own hash, its ignores (the card) honoured
        _, _, obj = build(repo.cache.local, str(root / out["path"]), repo.fs, "md5", ignore=repo.dvcignore,
                          dry_run=True)
    if obj.hash_info.value != out.get("md5"):
        return "HEAD's dvc.lock records other outputs than this run's (commit dvc.lock, then register again)"
    return None


@functools.lru_cache(maxsize=4)
def _lock_outs(text: str) -> list[dict[str, Any]]:
    """The outputs a dvc.lock's text records, parsed once per text (a registration of every arm run
    asks for each of them; the C parser when PyYAML has it: a lock has a thousand lines)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    data = yaml.load(text, Loader=loader) or {}
    return [o for st in (data.get("stages") or {}).values() for o in st.get("outs", [])]


def gto_state(root: Path | None) -> dict[str, dict[str, Any]]:
    """``{artifact: {"versions": {version: {commit, hash, name, arm, created_at}}, "stages": {stage:
    version}}}`` from the GTO tags, stages exactly as ``gto show`` reports them; empty without git."""
    if root is None:
        return {}
    from gto.api import show
    from gto.registry import GitRegistry

    try:
        shown = show(str(root))
        with GitRegistry.from_url(str(root)) as reg:
            artifacts = reg.get_artifacts()
    except Exception:  # noqa: BLE001 - unreadable tags: the registry works without GTO
        return {}
    out: dict[str, dict[str, Any]] = {}
    for artifact, art in artifacts.items():
        versions = {}
        for v in (v for v in art.versions if v.is_registered and v.is_active):
            name, arm, digest = m.groups() if (m := _MESSAGE.search(v.message or "")) else (None, None, None)
            versions[v.version] = {"commit": v.commit_hexsha, "hash": digest, "name": name,
                                   "arm": None if arm == "None" else arm, "created_at": v.created_at.isoformat()}
        out[artifact] = {"versions": versions,
                         "stages": {s: ver for s, ver in (shown.get(artifact, {}).get("stage") or {}).items() if ver}}
    return out


def tag_version(root: Path, entry: Entry, rev: str) -> str:
    """The entry's GTO version at commit ``rev``: the existing one, else a new tag whose message holds
    the content hash (a clone without the registry still knows what the version holds)."""
    from gto.api import register

    for version, info in gto_state(root).get(entry.artifact, {}).get("versions", {}).items():
        if info["commit"] == rev and info["hash"] in (None, entry.hash):
            return version
    try:
        return register(str(root), entry.artifact, rev, message=f"vpo {entry.name} {entry.arm}: "
                        f"content sha256 {entry.hash}").version
    except Exception as exc:  # noqa: BLE001 - GTO and scmrepo raise many types (identity, permissions, refs)
        raise _gto_error(exc) from None


def assign(root: Path, entry: Entry, stage: str, *, remove: bool = False) -> None:
    """Assign GTO stage ``stage`` to the entry's version, or (``remove``) unassign it the GTO way: a
    ``<artifact>#<stage>!#N`` tag, after which ``gto show`` no longer lists the stage. GTO refusing the
    request is a :class:`RegistryError`; git refusing to write the tag is one too, worded by
    :func:`_gto_error` (the caller may keep the stage in the registry's own record instead)."""
    from gto.api import assign as gto_assign
    from gto.api import unassign
    from gto.exceptions import GTOException

    try:
        if remove:
            unassign(str(root), entry.artifact, version=entry.version, stage=stage)
        else:
            gto_assign(str(root), entry.artifact, stage, version=entry.version)
    except GTOException as exc:
        raise GTORefused(f"GTO refused to {'unassign' if remove else 'assign'} stage {stage} of {entry.artifact} "
                         f"{entry.version} ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})") from None
    except Exception as exc:  # noqa: BLE001 - git and scmrepo raise many types (identity, permissions, refs)
        raise _gto_error(exc) from None


class GTORefused(RegistryError):
    """GTO itself refused a request (not git failing to write a tag): nothing to fall back to."""


def fetch_with_dvc(root: Path, entry: Entry, dest: Path) -> str:
    """Put the entry's model files into the empty folder ``dest`` through DVC (its default remote); returns how."""
    if entry.version:
        got = dest / ".dvc-artifact"  # DVC wants a new folder; its content then moves up
        with _dvc(root, f"get {entry.artifact} {entry.version}") as repo:
            repo.artifacts.download(entry.artifact, version=entry.version, out=str(got), force=True)
        for p in got.iterdir():
            p.rename(dest / p.name)
        got.rmdir()
        return f"dvc artifacts get {entry.artifact} --rev {entry.version}"
    from dvc_data.hashfile.hash_info import HashInfo

    if any(not f.md5 for f in entry.files):
        raise RegistryError(f"{entry.label} records no DVC ids (md5) for its files; register it again")
    with _dvc(root, f"fetch the files of {entry.label}") as repo:
        odb = repo.cache.local
        if missing := [HashInfo("md5", f.md5) for f in entry.files if not odb.exists(f.md5)]:
            repo.cloud.pull(missing)
        if lost := [f.path for f in entry.files if not odb.exists(f.md5)]:
            raise RegistryError(f"{entry.label}: {', '.join(lost)} not in the DVC cache or remote; record the run "
                                f"with `{tool('dvc', 'commit')}` and `{tool('dvc', 'push')}` it (the flow does both)")
        for f in entry.files:
            shutil.copyfile(odb.oid_to_path(f.md5), dest / f.path)
    return "the DVC cache and remote (by md5)"
