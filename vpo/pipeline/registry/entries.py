"""Registry entries and the queries over them: what a registered model is (content hash, manifest,
metrics, lineage, GTO version) and how ``latest``, ``best`` and ``list`` pick among entries.

The *content hash* of a model folder is sha256 over the sorted manifest lines ``<path>\\0<size>\\0<sha256>\\n``
of its weight and tokenizer files only, so byte-identical weights trained in two folders (whose
``training_args.bin`` differ by an absolute path) hash alike. Config files are in the manifest (checked
byte for byte) but not in the hash; run-specific files (trainer state, optimizer) are named in
``left_out``. Each file also carries its md5, DVC's own object id: the weights are fetched from the
DVC cache or remote by it, never from a copy the registry keeps.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["DEFAULT_METRIC", "Entry", "FileRecord", "IncompleteCheckpointError", "RegistryError",
           "RegistryInputError", "artifact_name", "best", "check_checkpoint", "content_hash", "inspect_model",
           "latest", "metric_value", "select", "settings_that_differ"]

DEFAULT_METRIC = "eval.best_at_k.kmax"
"""Metric of ``best`` when none is named: best@k at the largest k the entry was evaluated at."""
SCHEMA = 3
HASHED_ROLES = frozenset({"weights", "tokenizer", None})  # None: entries of schema 1 hashed every file
_ROLES = (("*.safetensors", "weights"), ("pytorch_model*.bin", "weights"), ("adapter_model.bin", "weights"),
          ("*.safetensors.index.json", "weights"), ("pytorch_model*.bin.index.json", "weights"),
          *((n, "tokenizer") for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                       "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                                       "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json")),
          *((n, "config") for n in ("config.json", "generation_config.json", "adapter_config.json")))
_CONFIGS = ("config.json", "adapter_config.json")
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HEX64 = re.compile(r"^[0-9a-f]{64}$")


class RegistryError(RuntimeError):
    """The registry, an entry or the storage behind it is unusable; the message says which and why."""


class RegistryInputError(RegistryError):
    """Bad input: unknown or ambiguous key, invalid name or stage, unknown metric."""


class IncompleteCheckpointError(RegistryError):
    """A model folder lacks files a loadable model needs; nothing was registered."""


@dataclass(frozen=True)
class FileRecord:
    """One model file: its path in the folder, size, sha256, DVC md5 and role (weights, tokenizer, config)."""

    path: str
    size: int
    sha256: str
    md5: str | None = None
    role: str | None = None


@dataclass(frozen=True)
class Entry:
    """A registered model of one arm run. ``artifact`` is its DVC/GTO name; one entry per (artifact,
    content hash), so a run is always found by its own name whatever other runs' weights are."""

    artifact: str
    hash: str
    name: str
    arm: str | None
    created_at: str  # first registration; a repair by re-registration keeps it
    trained_at: str  # when the weights were written: what `latest` orders by
    files: tuple[FileRecord, ...]
    path: str | None = None  # the model folder in the repository (the artifact's path in dvc.yaml)
    version: str | None = None  # GTO version, when a git tag records it
    git_rev: str | None = None
    git_dirty: bool | None = None
    dvc_lock_sha256: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    lineage: dict[str, Any] = field(default_factory=dict)
    left_out: tuple[str, ...] = ()
    objects: str | None = None  # migrated entries only: where an older registry kept the weights
    schema: int = SCHEMA
    registry_url: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        return f"{self.artifact} {self.hash[:12]}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["registry_url"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], registry_url: str = "") -> Entry:
        """An entry from its JSON (schema 1-3; older ones get an artifact name from name and arm).
        :class:`RegistryError` when malformed: missing keys, bad hash, unsafe paths, wrong manifest."""
        try:
            known = {f.name for f in fields(cls)}
            d = {k: v for k, v in data.items() if k in known}
            d["files"] = tuple(FileRecord(**{k: v for k, v in f.items() if k != "role" or v != "card"})
                               for f in data["files"] if f.get("role") != "card")
            d["left_out"] = tuple(d.get("left_out") or ())
            d.setdefault("artifact", artifact_name(data["name"], data.get("arm")))
            d.setdefault("trained_at", data["created_at"])
            d["schema"] = int(data.get("schema", 1))
            entry = cls(**d, registry_url=registry_url)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RegistryError(f"malformed registry entry: {exc!r}") from None
        if not isinstance(entry.hash, str) or not HEX64.match(entry.hash):
            raise RegistryError(f"malformed registry entry: hash {entry.hash!r} is not 64 hex digits")
        if bad := [f.path for f in entry.files if not _safe(f.path)]:
            raise RegistryError(f"malformed registry entry: unsafe file path {bad[0]!r}")
        if manifest_hash(f for f in entry.files if f.role in HASHED_ROLES) != entry.hash:
            raise RegistryError(f"malformed registry entry: its manifest does not hash to {entry.hash[:12]}")
        return entry


def artifact_name(name: str, arm: str | None) -> str:
    """The DVC/GTO artifact name of an arm run: ``<variant>-<arm>`` (``route-quick-vpo-s0``)."""
    return f"{name}-{arm}" if arm else name


# --------------------------------------------------------------------------- model folders


def _safe(path: Any) -> bool:
    parts = PurePosixPath(path).parts if isinstance(path, str) and "\\" not in path else ()
    return bool(parts) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _role(rel: str) -> str | None:
    return None if "/" in rel else next((r for pat, r in _ROLES if fnmatch.fnmatchcase(rel, pat)), None)


def check_checkpoint(folder: str | os.PathLike[str]) -> None:
    """Refuse a folder that is not a complete model: it needs a config (``config.json`` or a PEFT
    ``adapter_config.json``) that parses, non-empty weights (every shard an index lists) and tokenizer
    files. Raises :class:`IncompleteCheckpointError` naming everything missing."""
    root = Path(folder)
    if not root.is_dir():
        raise IncompleteCheckpointError(f"checkpoint folder {root} does not exist or is not a folder")
    problems: list[str] = []
    configs = [c for c in _CONFIGS if (root / c).is_file()]
    if not configs:
        problems.append(f"no model config ({' or '.join(_CONFIGS)})")
    for c in configs:
        try:
            json.loads((root / c).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            problems.append(f"{c} is not valid JSON ({exc.__class__.__name__}: {exc})")
    weights = [w for w in _WEIGHTS if (root / w).is_file()]
    for index in (i for i in _INDEXES if (root / i).is_file()):
        try:
            shards = sorted(set(json.loads((root / index).read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            problems.append(f"{index} is unreadable ({exc.__class__.__name__}: {exc})")
            continue
        if missing := [s for s in shards if not (root / s).is_file()]:
            problems.append(f"{index} lists missing shards: {', '.join(missing)}")
        weights += [s for s in shards if (root / s).is_file()]
    if not weights:
        problems.append(f"no weights ({', '.join(_WEIGHTS + _INDEXES)})")
    if empty := sorted({w for w in weights if (root / w).stat().st_size == 0}):
        problems.append(f"empty weight files: {', '.join(empty)}")
    if not any((root / t).is_file() for t in _TOKENIZERS):
        problems.append(f"no tokenizer files (one of {', '.join(_TOKENIZERS)})")
    if problems:
        raise IncompleteCheckpointError(f"incomplete checkpoint {root}: " + "; ".join(problems))


def hash_file(path: Path) -> tuple[int, str, str]:
    """(size, sha256, md5) of a file, read once in 1 MiB chunks."""
    sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha.update(chunk)
            md5.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest(), md5.hexdigest()


def manifest_hash(records: Iterable[FileRecord]) -> str:
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r.path):
        h.update(f"{r.path}\0{r.size}\0{r.sha256}\n".encode())
    return h.hexdigest()


def inspect_model(folder: str | os.PathLike[str]) -> tuple[str, tuple[FileRecord, ...], tuple[str, ...], str]:
    """(content hash, manifest of the model files, files left out, when the weights were written)."""
    root = Path(folder)
    records, left_out, mtime = [], [], 0.0
    for full in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = full.relative_to(root).as_posix()
        if (role := _role(rel)) is None:
            left_out.append(rel)
            continue
        records.append(FileRecord(rel, *hash_file(full), role=role))
        mtime = max(mtime, full.stat().st_mtime) if role == "weights" else mtime
    hashed = [r for r in records if r.role in HASHED_ROLES]
    if not hashed:
        raise IncompleteCheckpointError(f"model folder {root} has no weight or tokenizer files to hash")
    written = datetime.fromtimestamp(mtime, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return manifest_hash(hashed), tuple(records), tuple(left_out), written


def content_hash(folder: str | os.PathLike[str]) -> str:
    """The content hash of a model folder (how the registry names it): use it for a base model in lineage."""
    if not Path(folder).is_dir():
        raise IncompleteCheckpointError(f"model folder {folder} does not exist or is not a folder")
    return inspect_model(folder)[0]


# --------------------------------------------------------------------------- queries


def _match(value: str | None, pattern: str | None) -> bool:
    if pattern is None:
        return True
    return value is not None and (fnmatch.fnmatchcase(value, pattern) if any(c in pattern for c in "*?[")
                                  else value == pattern)


def select(entries: Iterable[Entry], name: str | None = None, arm: str | None = None) -> list[Entry]:
    """Entries whose name (variant, or artifact) and arm match (exact, or a glob such as ``route*``)."""
    return [e for e in entries if (_match(e.name, name) or _match(e.artifact, name)) and _match(e.arm, arm)]


def _when(stamp: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(stamp)
    except (ValueError, TypeError):
        return datetime.min.replace(tzinfo=UTC)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _order(e: Entry) -> tuple[datetime, datetime, str]:
    return _when(e.trained_at), _when(e.created_at), e.hash


def latest(entries: Sequence[Entry]) -> Entry:
    """The most recently trained entry (a re-registration of the same weights moves nothing)."""
    if not entries:
        raise RegistryInputError("no entries to choose from")
    return max(entries, key=_order)


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    return float(value) if ok else None


def metric_value(entry: Entry, metric: str) -> float | None:
    """The number at dotted key ``metric`` of the entry's metrics (``eval.best_at_k.10``; a last part
    ``kmax`` is the largest numeric key there). None when absent; :class:`RegistryInputError` when the
    key names a group or a non-number."""
    node: Any = entry.metrics
    parts = metric.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping):
            return None
        if part == "kmax" and i == len(parts) - 1 and part not in node:
            ks = [k for k in node if str(k).isdigit()]
            node = node[max(ks, key=int)] if ks else None
        else:
            node = node.get(part)
    if isinstance(node, Mapping):
        raise RegistryInputError(f"metric {metric!r} of {entry.label} is a group, not a number; pick one of: "
                                 + ", ".join(f"{metric}.{k}" for k in list(node)[:12]))
    if node is not None and _number(node) is None:
        raise RegistryInputError(f"metric {metric!r} of {entry.label} is {node!r}, not a number")
    return _number(node)


def best(entries: Sequence[Entry], metric: str = DEFAULT_METRIC, *, lower_is_better: bool = False) -> tuple[Entry, float]:
    """The entry with the highest (or lowest) ``metric`` and its value; ties go to the newest."""
    scored = [(e, v) for e in entries if (v := metric_value(e, metric)) is not None]
    if not scored:
        numeric = [k for k, v in _flat(latest(entries).metrics).items() if _number(v) is not None] if entries else []
        raise RegistryInputError(f"no entry has metric {metric!r}"
                                 + (f"; numeric metrics of the newest entry: {', '.join(numeric[:15])}" if numeric else ""))
    sign = -1.0 if lower_is_better else 1.0
    return max(scored, key=lambda ev: (sign * ev[1], *_order(ev[0])))


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping) and data:
        return {k: v for key, val in data.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix[:-1]: data}


def settings_that_differ(entries: Sequence[Entry]) -> dict[tuple[str, str], list[str]]:
    """For each entry (keyed by artifact and hash), ``key=value`` of every setting whose value is not
    the same in all entries of its name: what tells twelve ``route-quick`` runs apart in ``list``."""
    out: dict[tuple[str, str], list[str]] = {}
    for name in {e.name for e in entries}:
        group = [e for e in entries if e.name == name]
        flats = [_flat(e.params) for e in group]
        keys = sorted({k for f in flats for k in f if len({json.dumps(g.get(k), default=str) for g in flats}) > 1})
        for e, f in zip(group, flats):
            out[(e.artifact, e.hash)] = [f"{k}={json.dumps(f.get(k), default=str)}" for k in keys]
    return out
