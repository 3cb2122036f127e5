"""The model registry: DVC keeps the weights, GTO's git tags the versions and stages, and this package
what neither does (an entry per arm run with metrics, lineage by content hash, and the model card).

:mod:`.entries` (entries, ``latest`` / ``best``), :mod:`.store` (entry files and cards, local or S3),
:mod:`.versions` (GTO tags, fetching through DVC), :mod:`.cli` (``vpo registry ...``). Each arm run's
final model is a DVC artifact of ``dvc.yaml`` (``<variant>-<arm>-s<seed>``). A key is a hash prefix,
``<name>@latest`` / ``@best`` (queries), ``<artifact>@v1.2.3`` (a GTO version), ``<name>@<stage>``
or a stage alone; a name is a variant (``route-quick``) or an artifact (``route-quick-vpo-s0``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import tempfile
from pathlib import Path
from typing import Any

from vpo.atomic import atomic_dir, atomic_write_text
from vpo.pipeline.engine.checkpoints import check_checkpoint, content_hash, hash_file, model_manifest
from vpo.pipeline.engine.console import command, tool
from vpo.pipeline.engine.storage import redact
from vpo.pipeline.registry import entries, versions
from vpo.pipeline.registry.entries import DEFAULT_METRIC, Entry, RegistryError, RegistryInputError
from vpo.pipeline.registry.store import Store, now

__all__ = ["DEFAULT_METRIC", "Entry", "Registry", "RegistryError", "RegistryInputError"]

_STAGE = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


class Registry:
    """Entries and cards at ``url``, over the project repository ``repo`` (default: the git work tree
    holding the current folder), whose tags hold versions and stages and whose DVC holds weights."""

    def __init__(self, url: str | Path, repo: str | Path | None = None) -> None:
        self.store = Store(str(url))
        self.repo = versions.git_root(repo or Path.cwd())  # None: not a git repository
        self.dvc_repo = Path(repo or self.repo or Path.cwd()).resolve()

    def scan(self) -> tuple[list[Entry], dict[tuple[str, str], list[str]], list[str]]:
        """(entries, the stages of each (artifact, hash), unreadable files). A GTO version this registry
        has no entry for (a fresh clone of a project whose registry was local) is a bare entry
        (:attr:`Entry.tag_only`)."""
        return self._scan()[:3]

    def _scan(self) -> tuple[list[Entry], dict[tuple[str, str], list[str]], list[str], dict[str, Any]]:
        listed, bad = self.store.entries()
        gto = versions.gto_state(self.repo)
        tagged = {(a, v["hash"]): ver for a, info in gto.items() for ver, v in info["versions"].items() if v["hash"]}
        listed = [dataclasses.replace(e, version=e.version or tagged.get((e.artifact, e.hash))) for e in listed]
        known = {(e.artifact, e.hash) for e in listed}
        for artifact, info in gto.items():
            for ver, v in info["versions"].items():
                if v["hash"] and (artifact, v["hash"]) not in known:
                    known.add((artifact, v["hash"]))
                    listed.append(Entry(artifact, v["hash"], v["name"] or artifact, v["arm"], v["created_at"],
                                         v["created_at"], (), version=ver, git_rev=v["commit"]))
        stages: dict[tuple[str, str], list[str]] = {}
        for artifact, info in gto.items():
            for stage, ver in info["stages"].items():
                if digest := info["versions"].get(ver, {}).get("hash"):
                    stages.setdefault((artifact, digest), []).append(stage)
        for (artifact, stage), rec in self.store.stages().items():
            if not any(a == artifact and stage in s for (a, _), s in stages.items()):
                stages.setdefault((artifact, rec["hash"]), []).append(stage)
        return listed, stages, bad, gto

    def get(self, key: str) -> Entry:
        """The one entry ``key`` names (see the module doc)."""
        listed, stages, _ = self.scan()
        return self._find(key, listed, stages)

    def _find(self, key: str, listed: list[Entry], stages: dict[tuple[str, str], list[str]]) -> Entry:
        name, sep, what = key.strip().replace("#", "@").rpartition("@")
        if not sep:
            name, what = (what, "latest") if entries.select(listed, what) and not _is_hex(what) else (None, what)
        pool = entries.select(listed, name) if name else listed
        if name and not pool:
            raise RegistryInputError(f"{key!r}: no entry is named {name!r} in {self.store.url} (names: "
                                     f"{_names(listed)})")
        if what in ("latest", "best") and pool:
            return entries.latest(pool) if what == "latest" else entries.best(pool)[0]
        if re.fullmatch(r"v\d+\.\d+\.\d+", what):
            found = [e for e in pool if e.version == what]
        elif _is_hex(what):
            found = [e for e in pool if e.hash.startswith(what.lower())]
        elif _STAGE.match(what):
            found = [e for e in pool if what in stages.get((e.artifact, e.hash), [])]
        else:
            raise RegistryInputError(f"key {key!r}: write a hash prefix (6+ hex digits), <name>@latest, <name>@best, "
                                     "<artifact>@v1.2.3, <name>@<stage> or a stage")
        if not found:
            raise RegistryInputError(f"{key!r} matches no entry in {self.store.url}")
        if len(found) > 1:
            raise RegistryInputError(f"{key!r} matches {len(found)} entries ({', '.join(e.label for e in found[:6])}): "
                                     f"name one, e.g. {found[0].artifact}@{found[0].hash[:12]}")
        return found[0]

    def card(self, entry: Entry) -> str:
        from vpo.pipeline.registry.hub import model_card

        return self.store.card(entry) or model_card(entry)

    def register(self, model_dir: str | Path, *, name: str, arm: str | None = None, path: str | None = None,
                 params: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
                 lineage: dict[str, Any] | None = None) -> tuple[Entry, str | None]:
        """Record the model in ``model_dir`` (at ``path`` in the repository: the artifact's path) with its
        settings, metrics and lineage, and tag a GTO version when HEAD's ``dvc.lock`` records these very
        weights. The card goes into the folder and the registry. Returns the entry and, when it has no
        version, why. Registering the same weights again keeps ``created_at``."""
        from vpo.pipeline.registry.hub import model_card

        check_checkpoint(model_dir)
        digest, files, left_out, trained_at = model_manifest(model_dir)
        artifact, lock = entries.artifact_name(name, arm), self.dvc_repo / "dvc.lock"
        old = self.store.read(artifact, digest)
        rev, dirty = (old.git_rev, old.git_dirty) if old and old.version else versions.git_state(self.repo)
        entry = Entry(artifact, digest, name, arm, old.created_at if old else now(),
                      max(old.trained_at, trained_at) if old else trained_at, files, path=path,
                      version=old.version if old else None, git_rev=rev, git_dirty=dirty,
                      dvc_lock_sha256=hash_file(lock)[1] if lock.is_file() else None, params=dict(params or {}),
                      metrics=dict(metrics or {}), lineage=dict(lineage or {}), left_out=left_out,
                      registry_url=self.store.url)
        why = None if entry.version else versions.unversioned_because(self.dvc_repo if self.repo else None, path)
        if not entry.version and why is None:
            try:
                entry = dataclasses.replace(entry, version=versions.tag_version(self.repo, entry, rev))
            except RegistryError as exc:
                why = str(exc)
        card = redact(model_card(entry))
        self.store.clean_temps()
        readme = Path(model_dir) / "README.md"  # .dvcignore keeps it out of DVC's hash of the folder
        if not readme.is_file() or readme.read_text(encoding="utf-8") != card:
            atomic_write_text(readme, card)
        self.store.write(entry, card)
        return entry, why

    def promote(self, key: str, stage: str, *, remove: bool = False) -> str:
        """Assign (or remove) ``stage`` for the entry ``key`` names: a GTO tag when it has a version, else
        a record in the registry; the returned line says which and why. Removing a stage the entry is
        not in, or one whose GTO tag cannot be written, is a :class:`RegistryError` (nothing changed)."""
        if not _STAGE.match(stage) or stage in ("latest", "best"):
            raise RegistryInputError(f"stage {stage!r} is invalid: lower-case letters, digits, '_' or '-', starting "
                                     "with a letter; latest and best are queries")
        listed, stages, _, gto = self._scan()
        entry = self._find(key, listed, stages)
        held = stages.get((entry.artifact, entry.hash), [])
        in_gto = bool(entry.version) and gto.get(entry.artifact, {}).get("stages", {}).get(stage) == entry.version
        record = self.store.stages().get((entry.artifact, stage))
        in_record = record is not None and record.get("hash") == entry.hash
        if remove:
            return self._unassign(entry, stage, held, in_gto=in_gto, in_record=in_record)
        if stage in held:
            return f"{entry.label} is already in stage {stage}; nothing changed"
        why = "not a git repository" if not self.repo else (
            f"it has no GTO version (`{command('registry', 'show', entry.artifact + '@' + entry.hash[:12])}` says why)")
        if entry.version and self.repo:
            try:
                versions.assign(self.repo, entry, stage)
                return f"{entry.artifact} {entry.version} ({entry.hash[:12]}) is now in stage {stage} (GTO tag)"
            except versions.GTORefused:
                raise
            except RegistryError as exc:  # git cannot write the tag: the registry keeps the stage instead
                why = str(exc)
        self.store.set_stage(entry.artifact, stage, entry.hash, why)
        return f"{entry.label} is now in stage {stage}, kept in the registry's own record because {why}"

    def _unassign(self, entry: Entry, stage: str, held: list[str], *, in_gto: bool, in_record: bool) -> str:
        if not (in_gto or in_record):
            raise RegistryInputError(f"{entry.label} is not in stage {stage} (its stages: {', '.join(held) or 'none'}); "
                                     "nothing to remove")
        done = []
        if in_gto:
            assert self.repo is not None and entry.version is not None
            try:
                versions.assign(self.repo, entry, stage, remove=True)
            except versions.GTORefused:
                raise
            except RegistryError as exc:
                raise RegistryError(f"{entry.artifact} {entry.version} stays in stage {stage}: its GTO tag cannot be "
                                    f"removed ({exc})") from None
            done.append(f"GTO: a {entry.artifact}#{stage}! tag, `{tool('gto', 'show')}` no longer lists it")
        if in_record:
            self.store.set_stage(entry.artifact, stage, None)
            done.append(f"the registry's record in {self.store.url}")
        return f"{entry.label}{f' {entry.version}' if entry.version else ''} left stage {stage} ({'; '.join(done)})"

    def fetch(self, entry: Entry, dest: str | Path, *, overwrite: bool = False) -> tuple[Path, str]:
        """The entry's model in ``dest``, brought through DVC and checked file by file against the entry,
        with its card; returns the folder and where the files came from."""
        dest = Path(dest)
        if dest.exists() and not overwrite:
            if dest.is_dir() and not self._problems(entry, dest):
                return dest, "already there"
            raise RegistryError(f"{dest} already exists with other content; fetch with --overwrite to replace it")
        with atomic_dir(dest, overwrite=True) as tmp:
            how = self._bring(entry, tmp)
            if problems := self._problems(entry, tmp):
                raise RegistryError(f"{entry.label}: what {how} returned does not match the entry: " + "; ".join(problems))
            atomic_write_text(tmp / "README.md", self.card(entry))
        return dest, how

    def verify(self, entry: Entry) -> list[str]:
        """Fetch the entry's files through DVC into a temp folder and re-hash them: one line per problem."""
        with tempfile.TemporaryDirectory(prefix="vpo-verify-") as tmp:
            try:
                self._bring(entry, Path(tmp))
            except RegistryError as exc:
                return [str(exc)]
            return self._problems(entry, Path(tmp))

    def _bring(self, entry: Entry, dest: Path) -> str:
        if entry.objects:  # migrated from a registry that kept its own copies
            with self.store.guard(f"read the objects of {entry.label}"):
                for f in entry.files:
                    with contextlib.suppress(FileNotFoundError):  # a missing one is named by the check
                        self.store.fs.get_file(f"{self.store.root}/{entry.objects}/{f.path}", str(dest / f.path))
            return f"the registry's {entry.objects}"
        if entry.version and not self.repo:
            raise RegistryError(f"{entry.label} is GTO version {entry.version}: run this in a clone of its repository")
        return versions.fetch_with_dvc(self.repo or self.dvc_repo, entry, dest)

    @staticmethod
    def _problems(entry: Entry, folder: Path) -> list[str]:
        if not entry.files:  # known from a GTO tag only: its content hash is what can be checked
            got = content_hash(folder)
            return [] if got == entry.hash else [f"content hash {got[:12]}, expected {entry.hash[:12]}"]
        out = []
        for f in entry.files:
            got = hash_file(folder / f.path)[:2] if (folder / f.path).is_file() else None
            if got != (f.size, f.sha256):
                out.append(f"{f.path} is missing" if got is None else
                           f"{f.path} is corrupt ({got[0]} bytes, sha256 {got[1][:12]}; expected {f.size}, {f.sha256[:12]})")
        return out


def _names(listed: list[Entry]) -> str:
    """The variants and artifacts of the entries, for an error that a name matched nothing."""
    variants = sorted({e.name for e in listed})
    return (", ".join(variants) + f"; artifacts: {', '.join(sorted({e.artifact for e in listed})[:8])}"
            if variants else "none: the registry is empty")


def _is_hex(text: str) -> bool:
    return len(text) >= 6 and all(c in "0123456789abcdef" for c in text.lower())
