"""Checkpoint registry in a local folder or an ``s3://`` prefix (through fsspec).

Layout under the registry URL::

    objects/<hash>/<relative paths of the checkpoint files>
    entries/<hash>.json        # written LAST: an entry exists only once all its objects do

``<hash>`` is the content hash of the checkpoint folder: sha256 over the sorted manifest lines
``<relative path>\\0<size>\\0<sha256 of the bytes>\\n`` (a Merkle-style hash over paths + bytes, so
each file can also be verified alone). An entry records that hash, the per-file manifest, the git
revision (and whether the tree was dirty), the sha256 of ``dvc.lock``, pipeline params, metrics,
free-form lineage and a UTC timestamp.

Atomicity: locally the objects are copied into a temp sibling folder and renamed into place, and the
entry is written to a temp file and hard-linked into place (first writer wins). On S3, objects are
uploaded first (each PUT is atomic), all are verified to exist with the right sizes, then the entry
is written with one conditional PUT. A crash at any point leaves no entry, so a half-written
checkpoint is never registered. Registering the same content twice returns the existing entry.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vpo.pipeline.storage import atomic_dir, get_filesystem, is_s3_url, redact, secret_values

__all__ = [
    "FileRecord",
    "IncompleteCheckpointError",
    "RegistryEntry",
    "RegistryError",
    "check_checkpoint",
    "fetch",
    "get_entry",
    "hash_checkpoint",
    "list_entries",
    "register",
    "verify_entry",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_CHUNK = 1 << 20
_SHA_META = "vpo-sha256"  # S3 user metadata recording each object's sha256
CONFIG_FILES = ("config.json", "adapter_config.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class RegistryError(RuntimeError):
    """The registry or one of its entries is unusable (missing object, hash mismatch, bad key)."""


class IncompleteCheckpointError(RegistryError):
    """A checkpoint folder lacks files a loadable model needs; nothing was registered."""


@dataclass(frozen=True)
class FileRecord:
    """One checkpoint file in an entry's manifest."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class RegistryEntry:
    """A registered checkpoint (``registry_url`` is where it was found and is not serialized)."""

    hash: str
    name: str
    arm: str | None
    created_at: str
    git_rev: str | None
    git_dirty: bool | None
    dvc_lock_sha256: str | None
    params: dict[str, Any]
    metrics: dict[str, Any]
    lineage: dict[str, Any]
    files: tuple[FileRecord, ...]
    size_bytes: int
    schema: int = SCHEMA_VERSION
    registry_url: str = field(default="", compare=False)

    @property
    def object_prefix(self) -> str:
        """Folder of the checkpoint's objects, relative to the registry root."""
        return f"objects/{self.hash}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of the entry (without the registry location)."""
        data = asdict(self)
        data.pop("registry_url")
        data["files"] = [asdict(f) for f in self.files]
        return data

    def summary(self) -> dict[str, Any]:
        """Flat one-row view for tables (Prefect table artifacts, ``vpo registry list``)."""
        return {
            "hash": self.hash[:12],
            "name": self.name,
            "arm": self.arm,
            "created_at": self.created_at,
            "git_rev": (self.git_rev or "")[:12],
            "files": len(self.files),
            "size_bytes": self.size_bytes,
            **{f"metric.{k}": v for k, v in self.metrics.items() if isinstance(v, (int, float, str, bool))},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], registry_url: str = "") -> RegistryEntry:
        """Rebuild an entry from its JSON dict; raises :class:`RegistryError` on a malformed one."""
        try:
            files = tuple(FileRecord(**f) for f in data["files"])
            return cls(
                hash=data["hash"],
                name=data["name"],
                arm=data.get("arm"),
                created_at=data["created_at"],
                git_rev=data.get("git_rev"),
                git_dirty=data.get("git_dirty"),
                dvc_lock_sha256=data.get("dvc_lock_sha256"),
                params=dict(data.get("params") or {}),
                metrics=dict(data.get("metrics") or {}),
                lineage=dict(data.get("lineage") or {}),
                files=files,
                size_bytes=int(data["size_bytes"]),
                schema=int(data.get("schema", SCHEMA_VERSION)),
                registry_url=registry_url,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RegistryError(f"malformed registry entry in {registry_url or 'data'}: {exc!r}") from None


# --------------------------------------------------------------------------- checkpoint inspection


def _walk_files(root: Path) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in filenames:
            full = Path(dirpath) / name
            out.append((full.relative_to(root).as_posix(), full))
    return sorted(out)


def check_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Reject a folder that is not a complete model checkpoint: it needs a config (``config.json`` or
    a PEFT ``adapter_config.json``), non-empty weights (all shards of a sharded index) and tokenizer
    files. Raises :class:`IncompleteCheckpointError` listing everything missing."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise IncompleteCheckpointError(f"checkpoint folder {root} does not exist or is not a folder")
    problems: list[str] = []
    configs = [c for c in CONFIG_FILES if (root / c).is_file()]
    if not configs:
        problems.append(f"no model config ({' or '.join(CONFIG_FILES)})")
    for c in configs:
        try:
            json.loads((root / c).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            problems.append(f"{c} is not valid JSON ({exc.__class__.__name__}: {exc})")
    weights = [w for w in WEIGHT_FILES if (root / w).is_file()]
    for index_name in WEIGHT_INDEXES:
        index = root / index_name
        if not index.is_file():
            continue
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            problems.append(f"{index_name} is unreadable ({exc.__class__.__name__}: {exc})")
            continue
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            problems.append(f"{index_name} lists missing shards: {', '.join(missing)}")
        weights += [s for s in shards if (root / s).is_file()]
    if not weights:
        problems.append(f"no weights ({', '.join(WEIGHT_FILES + WEIGHT_INDEXES)})")
    empty = [w for w in weights if (root / w).stat().st_size == 0]
    if empty:
        problems.append(f"empty weight files: {', '.join(sorted(set(empty)))}")
    if not any((root / t).is_file() for t in TOKENIZER_FILES):
        problems.append(f"no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    if problems:
        raise IncompleteCheckpointError(f"incomplete checkpoint {root}: " + "; ".join(problems))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _copy_verified(src: Path, rec: FileRecord, out: Any) -> None:
    """Copy ``src/rec.path`` into the open binary file ``out`` while hashing the bytes; raise if they
    differ from the manifest (the checkpoint changed while it was being registered)."""
    h = hashlib.sha256()
    size = 0
    with open(src / rec.path, "rb") as fin:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
            out.write(chunk)
    if size != rec.size or h.hexdigest() != rec.sha256:
        raise RegistryError(
            f"checkpoint file {src / rec.path} changed while it was being registered; retry when the writer is done"
        )


def _manifest_hash(records: Sequence[FileRecord]) -> str:
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r.path):
        h.update(f"{r.path}\0{r.size}\0{r.sha256}\n".encode())
    return h.hexdigest()


def hash_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> tuple[str, tuple[FileRecord, ...]]:
    """Content hash of a folder and its per-file manifest (sorted relative paths, sizes, sha256)."""
    root = Path(checkpoint_dir)
    records = tuple(
        FileRecord(rel, full.stat().st_size, _sha256_file(full)) for rel, full in _walk_files(root)
    )
    if not records:
        raise IncompleteCheckpointError(f"checkpoint folder {root} is empty")
    return _manifest_hash(records), records


# --------------------------------------------------------------------------- lineage helpers


def _git(repo: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _git_state(repo: Path) -> tuple[str | None, bool | None]:
    rev = _git(repo, "rev-parse", "--verify", "HEAD")
    if rev is None:
        return None, None
    status = _git(repo, "status", "--porcelain", "--untracked-files=no")
    return rev, (bool(status) if status is not None else None)


def _dvc_lock_sha256(repo: Path) -> str | None:
    lock = repo / "dvc.lock"
    return _sha256_file(lock) if lock.is_file() else None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _to_json(data: Mapping[str, Any]) -> str:
    def default(obj: Any) -> Any:
        if isinstance(obj, Path):
            return str(obj)
        if hasattr(obj, "tolist"):
            return obj.tolist()
        raise TypeError(f"{type(obj).__name__} in registry entry is not JSON serializable")

    text = json.dumps(data, indent=2, sort_keys=True, default=default) + "\n"
    if secret_values():
        masked = redact(text)
        if masked != text:
            log.warning("registry entry contained secret values from the environment; they were masked")
        text = masked
    return text


# --------------------------------------------------------------------------- store backends


class _Store:
    """The registry root on a filesystem: local (rename/link atomicity) or S3 (verify-then-put)."""

    def __init__(self, url: str | os.PathLike[str]):
        self.url = str(url)
        self.remote = is_s3_url(self.url)
        self.fs, self.root = get_filesystem(self.url)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def entry_path(self, digest: str) -> str:
        return self.path("entries", f"{digest}.json")

    def read_entry(self, digest: str) -> RegistryEntry | None:
        p = self.entry_path(digest)
        try:
            data = json.loads(self.fs.cat_file(p))
        except FileNotFoundError:
            return None
        return RegistryEntry.from_dict(data, self.url)

    def entry_digests(self) -> list[str]:
        try:
            names = self.fs.ls(self.path("entries"), detail=False)
        except FileNotFoundError:
            return []
        return sorted(Path(n).name[: -len(".json")] for n in names if str(n).endswith(".json"))

    # objects ---------------------------------------------------------------
    def put_objects(self, digest: str, src: Path, files: Sequence[FileRecord]) -> None:
        if self.remote:
            self._put_remote(digest, src, files)
        else:
            self._put_local(digest, src, files)
        self.verify_objects(digest, files)

    def _put_local(self, digest: str, src: Path, files: Sequence[FileRecord]) -> None:
        target = Path(self.path("objects", digest))
        if target.is_dir():
            return  # renamed into place atomically earlier: complete (sizes are verified next)
        try:
            with atomic_dir(target, overwrite=False) as tmp:
                for rec in files:
                    dst = tmp / rec.path
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    with open(dst, "wb") as fout:
                        _copy_verified(src, rec, fout)
        except RegistryError:
            raise
        except (FileExistsError, OSError) as exc:
            if not target.is_dir():  # not the "someone else just placed it" race
                raise RegistryError(f"could not store objects of {digest[:12]} in {self.url}: {exc}") from exc

    def _put_remote(self, digest: str, src: Path, files: Sequence[FileRecord]) -> None:
        for rec in files:
            key = self.path("objects", digest, rec.path)
            with contextlib.suppress(FileNotFoundError):
                same_size = int(self.fs.info(key)["size"]) == rec.size
                if same_size and self.fs.metadata(key).get(_SHA_META) == rec.sha256:
                    continue  # uploaded completely by an earlier (interrupted) attempt
            out = self.fs.open(key, "wb", Metadata={_SHA_META: rec.sha256})
            try:
                _copy_verified(src, rec, out)
            except BaseException:
                out.discard()  # abort: an S3 object only appears on a completed upload
                out.closed = True
                raise
            out.close()

    def verify_objects(self, digest: str, files: Sequence[FileRecord]) -> None:
        problems = []
        for rec in files:
            key = self.path("objects", digest, rec.path)
            try:
                size = int(self.fs.info(key)["size"])
            except FileNotFoundError:
                problems.append(f"{rec.path} is missing")
                continue
            if size != rec.size:
                problems.append(f"{rec.path} has {size} bytes, expected {rec.size}")
        if problems:
            raise RegistryError(
                f"objects of {digest[:12]} in {self.url} are incomplete: " + "; ".join(problems)
            )

    # entries ---------------------------------------------------------------
    def create_entry(self, digest: str, text: str) -> bool:
        """Write the entry unless one exists; True if this call created it."""
        data = text.encode()
        if self.remote:
            if self.fs.exists(self.entry_path(digest)):
                return False
            try:
                self.fs.pipe_file(self.entry_path(digest), data, mode="create")
            except (FileExistsError, OSError) as exc:
                if self.fs.exists(self.entry_path(digest)):
                    return False
                raise RegistryError(f"could not write entry {digest[:12]} to {self.url}: {exc}") from exc
            return True
        final = Path(self.entry_path(digest))
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, final)  # atomic and exclusive: the first registration wins
            except FileExistsError:
                return False
            except OSError:  # filesystem without hard links
                if final.exists():
                    return False
                os.replace(tmp, final)
                return True
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


# --------------------------------------------------------------------------- public API


def register(
    registry_url: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str],
    *,
    name: str,
    arm: str | None = None,
    params: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    lineage: Mapping[str, Any] | None = None,
    repo_dir: str | os.PathLike[str] | None = None,
) -> RegistryEntry:
    """Register a checkpoint folder: validate it, hash it, copy it to ``objects/<hash>/`` and write
    the entry last (see module doc). ``repo_dir`` (default: cwd) is where the git revision and
    ``dvc.lock`` are read. Returns the existing entry if the same content was registered before."""
    src = Path(checkpoint_dir)
    check_checkpoint(src)
    digest, files = hash_checkpoint(src)
    store = _Store(registry_url)
    existing = store.read_entry(digest)
    if existing is not None:
        log.info("checkpoint %s already registered as %s/%s", digest[:12], existing.name, existing.arm)
        return existing
    repo = Path(repo_dir) if repo_dir is not None else Path.cwd()
    git_rev, git_dirty = _git_state(repo)
    entry = RegistryEntry(
        hash=digest,
        name=name,
        arm=arm,
        created_at=_now(),
        git_rev=git_rev,
        git_dirty=git_dirty,
        dvc_lock_sha256=_dvc_lock_sha256(repo),
        params=dict(params or {}),
        metrics=dict(metrics or {}),
        lineage=dict(lineage or {}),
        files=files,
        size_bytes=sum(f.size for f in files),
        registry_url=store.url,
    )
    text = _to_json(entry.to_dict())
    store.put_objects(digest, src, files)
    if not store.create_entry(digest, text):
        winner = store.read_entry(digest)
        if winner is not None:
            return winner
    log.info(
        "registered checkpoint %s (%s/%s, %d files) in %s",
        digest[:12],
        name,
        arm,
        len(files),
        redact(store.url),
    )
    return RegistryEntry.from_dict(json.loads(text), store.url)


def list_entries(
    registry_url: str | os.PathLike[str], *, name: str | None = None, arm: str | None = None
) -> list[RegistryEntry]:
    """All entries of the registry (optionally filtered), oldest first."""
    store = _Store(registry_url)
    entries = [e for d in store.entry_digests() if (e := store.read_entry(d)) is not None]
    entries = [e for e in entries if (name is None or e.name == name) and (arm is None or e.arm == arm)]
    return sorted(entries, key=lambda e: (e.created_at, e.hash))


def get_entry(registry_url: str | os.PathLike[str], key: str) -> RegistryEntry:
    """The entry whose hash is ``key`` or starts with it (at least 6 hex digits, unambiguous)."""
    store = _Store(registry_url)
    key = key.strip().lower()
    if len(key) == 64:
        entry = store.read_entry(key)
        if entry is None:
            raise RegistryError(f"no entry {key[:12]}… in registry {redact(store.url)}")
        return entry
    if len(key) < 6 or any(c not in "0123456789abcdef" for c in key):
        raise RegistryError(f"entry key must be a hash or a hash prefix of >= 6 hex digits, got {key!r}")
    matches = [d for d in store.entry_digests() if d.startswith(key)]
    if not matches:
        raise RegistryError(f"no entry matching {key!r} in registry {redact(store.url)}")
    if len(matches) > 1:
        raise RegistryError(f"ambiguous entry prefix {key!r}: {', '.join(m[:12] for m in matches)}")
    entry = store.read_entry(matches[0])
    assert entry is not None
    return entry


def verify_entry(entry: RegistryEntry) -> None:
    """Check that every object of ``entry`` exists in its registry with the recorded size."""
    if not entry.registry_url:
        raise RegistryError("entry has no registry_url; load it with get_entry/list_entries")
    _Store(entry.registry_url).verify_objects(entry.hash, entry.files)


def fetch(entry: RegistryEntry, dest: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Download ``entry``'s checkpoint into ``dest`` atomically, verifying every file's sha256 and the
    folder hash. An existing ``dest`` with the same content is returned as is; different content is
    an error unless ``overwrite``."""
    if not entry.registry_url:
        raise RegistryError("entry has no registry_url; load it with get_entry/list_entries")
    dest = Path(dest)
    if dest.exists() and not overwrite:
        try:
            if dest.is_dir() and hash_checkpoint(dest)[0] == entry.hash:
                return dest
        except IncompleteCheckpointError:
            pass
        raise RegistryError(f"{dest} already exists with other content; pass overwrite=True to replace it")
    store = _Store(entry.registry_url)
    with atomic_dir(dest, overwrite=True) as tmp:
        for rec in entry.files:
            local = tmp / rec.path
            local.parent.mkdir(parents=True, exist_ok=True)
            try:
                store.fs.get_file(store.path("objects", entry.hash, rec.path), str(local))
            except FileNotFoundError:
                raise RegistryError(
                    f"entry {entry.hash[:12]}: object {rec.path} is missing from the registry"
                ) from None
            got = _sha256_file(local)
            if got != rec.sha256 or local.stat().st_size != rec.size:
                raise RegistryError(
                    f"entry {entry.hash[:12]}: object {rec.path} is corrupt (sha256 {got[:12]}…, expected {rec.sha256[:12]}…)"
                )
        digest, _ = hash_checkpoint(tmp)
        if digest != entry.hash:
            raise RegistryError(f"fetched folder hashes to {digest[:12]}…, expected {entry.hash[:12]}…")
    return dest


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``vpo registry {list,show,fetch}``: inspect a registry or fetch a checkpoint."""
    parser = argparse.ArgumentParser(prog="vpo registry", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_list = sub.add_parser("list", help="list entries")
    p_list.add_argument("--registry", required=True)
    p_list.add_argument("--name")
    p_list.add_argument("--arm")
    p_show = sub.add_parser("show", help="print one entry as JSON")
    p_show.add_argument("--registry", required=True)
    p_show.add_argument("--entry", required=True)
    p_fetch = sub.add_parser("fetch", help="download and verify a checkpoint")
    p_fetch.add_argument("--registry", required=True)
    p_fetch.add_argument("--entry", required=True)
    p_fetch.add_argument("--dest", required=True)
    p_fetch.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "list":
            for e in list_entries(args.registry, name=args.name, arm=args.arm):
                print(json.dumps(e.summary(), sort_keys=True))
        elif args.cmd == "show":
            print(json.dumps(get_entry(args.registry, args.entry).to_dict(), indent=2, sort_keys=True))
        else:
            print(fetch(get_entry(args.registry, args.entry), args.dest, overwrite=args.overwrite))
    except RegistryError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
