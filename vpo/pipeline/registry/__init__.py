"""The model registry: DVC holds the weights, GTO's git tags hold versions and stages, and this package
keeps what neither does (an entry with metrics, lineage by content hash and the model card).

* :mod:`.entries` — what an entry is, model folders' content hashes, ``latest`` / ``best`` queries;
* :mod:`.store` — the entry files and cards in a local folder or ``s3://`` prefix;
* :mod:`.versions` — GTO versions and stages, and fetching weights through DVC;
* :mod:`.cli` — ``vpo registry list|show|best|fetch|promote|verify|migrate``.

Each arm run's final model is a DVC artifact in ``dvc.yaml`` (``<variant>-<arm>-s<seed>``), so ``dvc
artifacts get`` and DVC Studio see the same models as ``vpo registry``. Keys name entries as a hash
prefix, ``<name>@latest`` / ``@best`` (queries, never stored), ``<artifact>@v1.2.3`` (a GTO version),
``<name>@<stage>`` or a stage alone (``production``), where a name is a variant or an artifact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

from vpo.atomic import atomic_dir, atomic_write_text
from vpo.pipeline.registry.entries import (
    DEFAULT_METRIC,
    Entry,
    FileRecord,
    IncompleteCheckpointError,
    RegistryError,
    RegistryInputError,
    artifact_name,
    best,
    check_checkpoint,
    content_hash,
    hash_file,
    inspect_model,
    latest,
    metric_value,
    select,
)
from vpo.pipeline.registry.store import Store, now
from vpo.pipeline.registry.versions import assign, fetch_with_dvc, git_root, git_state, gto_state, tag_version
from vpo.pipeline.registry.versions import unversioned_because as _unversioned_because

__all__ = ["DEFAULT_METRIC", "Entry", "FileRecord", "IncompleteCheckpointError", "Registry", "RegistryError",
           "RegistryInputError", "artifact_name", "check_checkpoint", "content_hash", "main", "metric_value"]

log = logging.getLogger(__name__)
_STAGE = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


class Registry:
    """One registry (entries and cards at ``url``) over one project repository (``repo``: versions,
    stages and weights; default the git work tree holding the current folder)."""

    def __init__(self, url: str | Path, repo: str | Path | None = None) -> None:
        self.store = Store(str(url))
        self.repo = git_root(repo or Path.cwd())
        self.dvc_repo = Path(repo or self.repo or Path.cwd()).resolve()
        self.dvc_remote: str | None = None  # a DVC remote name to fetch from (default: the repo's default)

    # -- reading ---------------------------------------------------------------------------------
    def scan(self) -> tuple[list[Entry], dict[tuple[str, str], list[str]], list[str]]:
        """(entries, stages of each (artifact, hash), unreadable files). GTO versions whose entries this
        registry lacks (a fresh clone of a project whose registry was local) appear as bare entries."""
        entries, bad = self.store.entries()
        gto = gto_state(self.repo)
        known = {(e.artifact, e.hash) for e in entries}
        for artifact, info in gto.items():
            for version, v in info["versions"].items():
                if v["hash"] and (artifact, v["hash"]) not in known:
                    entries.append(Entry(artifact=artifact, hash=v["hash"], name=v.get("name") or artifact,
                                         arm=v.get("arm"), created_at=v["created_at"], trained_at=v["created_at"],
                                         files=(), version=version, git_rev=v["commit"]))
                    known.add((artifact, v["hash"]))
        by_version = {(artifact, ver): v["hash"] for artifact, info in gto.items() for ver, v in info["versions"].items()}
        entries = [e if e.version or not (ver := next((ver for (a, ver), h in by_version.items()
                                                        if a == e.artifact and h == e.hash), None))
                   else dataclasses.replace(e, version=ver) for e in entries]
        stages: dict[tuple[str, str], list[str]] = {}
        for artifact, info in gto.items():
            for stage, version in info["stages"].items():
                if digest := by_version.get((artifact, version)):
                    stages.setdefault((artifact, digest), []).append(stage)
        for (artifact, stage), rec in self.store.stages().items():
            if stage not in sum((v for (a, _), v in stages.items() if a == artifact), []):
                stages.setdefault((artifact, rec["hash"]), []).append(stage)
        return entries, stages, bad

    def get(self, key: str) -> Entry:
        """Resolve a key (see the module doc) to one entry."""
        entries, stages, _ = self.scan()
        key = key.strip()
        name, sep, what = key.replace("#", "@").rpartition("@")
        if not sep:
            name, what = (key, "latest") if select(entries, key) and not _is_hex(key) else (None, key)
        pool = select(entries, name) if name else entries
        if name and not pool:
            raise RegistryInputError(f"no entries named {name!r} in registry {self.store.url}")
        if what == "latest":
            return latest(pool)
        if what == "best":
            return best(pool)[0]
        if re.fullmatch(r"v\d+\.\d+\.\d+", what):
            found = [e for e in pool if e.version == what]
        elif _is_hex(what):
            found = [e for e in pool if e.hash.startswith(what.lower())]
        elif _STAGE.match(what):
            found = [e for e in pool if what in stages.get((e.artifact, e.hash), [])]
        else:
            raise RegistryInputError(f"key {key!r}: write a hash prefix (6+ hex digits), <name>@latest, <name>@best, "
                                     "<artifact>@v1.2.3, <name>@<stage> or a stage")
        if len(found) != 1:
            listed = ", ".join(e.label for e in found[:6])
            raise RegistryInputError(f"{key!r} matches {len(found)} entries" + (f" ({listed}): name one, e.g. "
                                     f"{found[0].artifact}@{found[0].hash[:12]}" if found else f" in {self.store.url}"))
        return found[0]

    def card(self, entry: Entry) -> str:
        from vpo.pipeline.hub import model_card

        return self.store.card(entry) or model_card(entry)

    # -- writing ---------------------------------------------------------------------------------
    def register(self, model_dir: str | Path, *, name: str, arm: str | None = None, path: str | None = None,
                 params: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
                 lineage: dict[str, Any] | None = None) -> tuple[Entry, str | None]:
        """Record the model in ``model_dir`` (``path``: the same folder relative to the repository, the
        artifact's path in ``dvc.yaml``) with its metrics and lineage; tag a GTO version when HEAD's
        ``dvc.lock`` records these very weights. Writes the card into the folder and the registry.
        Returns the entry and, when it has no version, why. Re-registering keeps ``created_at``."""
        check_checkpoint(model_dir)
        digest, files, left_out, trained_at = inspect_model(model_dir)
        artifact = artifact_name(name, arm)
        old = self.store.read(artifact, digest)
        rev, dirty = git_state(self.repo)
        lock = self.dvc_repo / "dvc.lock"
        entry = Entry(artifact=artifact, hash=digest, name=name, arm=arm, files=files, path=path,
                      created_at=old.created_at if old else now(),
                      trained_at=max(old.trained_at, trained_at) if old else trained_at,
                      git_rev=rev, git_dirty=dirty, dvc_lock_sha256=hash_file(lock)[1] if lock.is_file() else None,
                      params=dict(params or {}), metrics=dict(metrics or {}), lineage=dict(lineage or {}),
                      left_out=left_out, version=old.version if old else None, registry_url=self.store.url)
        if old and old.version:
            entry = dataclasses.replace(entry, git_rev=old.git_rev, git_dirty=old.git_dirty)
        why = _unversioned_because(self.repo, path, files) if not entry.version else None
        if why is None and not entry.version:
            try:
                entry = dataclasses.replace(entry, version=tag_version(self.repo, entry, rev), git_dirty=False)
            except RegistryError as exc:
                why = str(exc)
        from vpo.pipeline.hub import model_card

        card = model_card(entry)
        if self.store.clean_temps():
            log.info("registry: removed temp files a killed registration left")
        readme = Path(model_dir) / "README.md"  # .dvcignore keeps it out of DVC's hash of the folder
        if not readme.is_file() or readme.read_text(encoding="utf-8") != card:
            atomic_write_text(readme, card)
        self.store.write(entry, card)
        return entry, why

    def promote(self, key: str, stage: str, *, remove: bool = False) -> str:
        """Assign (or remove) ``stage`` for the entry ``key`` names: a GTO tag when the entry has a
        version, else a record in the registry (the returned line says which, and why)."""
        if not _STAGE.match(stage) or stage in ("latest", "best"):
            raise RegistryInputError(f"stage {stage!r} is invalid: lower-case letters, digits, '_' or '-', starting "
                                     "with a letter; latest and best are queries")
        entry = self.get(key)
        if entry.version and self.repo:
            try:
                assign(self.repo, entry, stage, remove=remove)
                return f"{entry.artifact} {entry.version} ({entry.hash[:12]}) {'left' if remove else 'is now in'} stage {stage} (GTO tag)"
            except RegistryError as exc:
                why = str(exc)
        else:
            why = "not a git repository" if not self.repo else "it has no GTO version (see `vpo registry show`)"
        self.store.set_stage(entry.artifact, stage, None if remove else entry.hash, why)
        return (f"{entry.label} {'left' if remove else 'is now in'} stage {stage}, kept in the registry's own record "
                f"because {why}")

    def fetch(self, entry: Entry, dest: str | Path, *, overwrite: bool = False) -> tuple[Path, str]:
        """Bring the entry's model into ``dest`` through DVC (legacy entries: from their old objects),
        check every file against the entry, add the card; returns the folder and where it came from."""
        dest = Path(dest)
        if dest.exists() and not overwrite:
            if dest.is_dir() and not self._problems(entry, dest):
                return dest, "already there"
            raise RegistryError(f"{dest} already exists with other content; fetch with --overwrite to replace it")
        with atomic_dir(dest, overwrite=True) as tmp:
            how = self._bring(entry, tmp)
            if problems := self._problems(entry, tmp):
                raise RegistryError(f"{entry.label}: what {how} returned does not match the entry: " + "; ".join(problems))
            if entry.files:
                (tmp / "README.md").write_text(self.card(entry), encoding="utf-8")
        return dest, how

    def verify(self, entry: Entry) -> list[str]:
        """Fetch the entry's files through DVC into a temp folder and re-hash them: one line per problem."""
        with tempfile.TemporaryDirectory(prefix="vpo-verify-") as tmp:
            try:
                self._bring(entry, Path(tmp) / "m")
            except RegistryError as exc:
                return [str(exc)]
            return self._problems(entry, Path(tmp) / "m")

    def _bring(self, entry: Entry, dest: Path) -> str:
        if entry.objects:  # migrated from a registry that kept its own copies
            with self.store.guard(f"read the objects of {entry.label}"):
                for f in entry.files:
                    (dest / f.path).parent.mkdir(parents=True, exist_ok=True)
                    with contextlib.suppress(FileNotFoundError):  # a missing one is named by the check
                        self.store.fs.get_file(f"{self.store.root}/{entry.objects}/{f.path}", str(dest / f.path))
            return f"the registry's {entry.objects}"
        dest.mkdir(parents=True, exist_ok=True)
        if entry.version and not self.repo:
            raise RegistryError(f"{entry.label} is GTO version {entry.version}: run this inside a clone of its repository")
        return fetch_with_dvc(self.repo or self.dvc_repo, entry, dest, self.dvc_remote)

    @staticmethod
    def _problems(entry: Entry, folder: Path) -> list[str]:
        if not entry.files:  # known from a GTO tag only: its content hash is what can be checked
            got = content_hash(folder)
            return [] if got == entry.hash else [f"content hash {got[:12]}, expected {entry.hash[:12]}"]
        out = []
        for f in entry.files:
            p = folder / f.path
            if not p.is_file():
                out.append(f"{f.path} is missing")
            elif (got := hash_file(p))[:2] != (f.size, f.sha256):
                out.append(f"{f.path} is corrupt ({got[0]} bytes, sha256 {got[1][:12]}; expected {f.size}, {f.sha256[:12]})")
        return out


def _is_hex(text: str) -> bool:
    return len(text) >= 6 and all(c in "0123456789abcdef" for c in text.lower())


def main(argv: list[str] | None = None, **kwargs: Any) -> int:
    """``vpo registry ...`` (see :mod:`.cli`)."""
    from vpo.pipeline.registry.cli import main as cli_main

    return cli_main(argv, **kwargs)

