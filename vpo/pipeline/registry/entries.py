"""Registry entries and the queries over them: what a registered model is (artifact, content hash,
file manifest, metrics, lineage, GTO version) and how ``latest``, ``best`` and ``list`` choose."""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any

from vpo.pipeline.engine.checkpoints import FileRecord, manifest_hash

__all__ = ["DEFAULT_METRIC", "Entry", "RegistryDiskFull", "RegistryError", "RegistryInputError",
           "StorageUnavailableError", "artifact_name", "best", "latest", "metric_value", "select", "settings_that_differ"]

DEFAULT_METRIC = "eval.best_at_k.kmax"
"""Metric of ``best`` when none is named: best@k at the largest k the entry was evaluated at."""
HEX64 = re.compile(r"^[0-9a-f]{64}$")


class RegistryError(RuntimeError):
    """The registry, an entry or the storage behind it is unusable; the message says which and why."""


class RegistryInputError(RegistryError):
    """Bad input: unknown or ambiguous key, bad metric or stage name."""


class RegistryDiskFull(RegistryError):
    """The disk holding a local registry is full; ``disk_path`` is the registry's folder."""

    def __init__(self, message: str, disk_path: str) -> None:
        super().__init__(message)
        self.disk_path = disk_path


class StorageUnavailableError(RegistryError):
    """The registry's storage could not be reached or refused a request: retrying later may help."""


def artifact_name(name: str, arm: str | None) -> str:
    """The DVC/GTO artifact name of an arm run: ``<variant>-<arm>`` (``route-quick-vpo-s0``)."""
    return f"{name}-{arm}" if arm else name


@dataclass(frozen=True)
class Entry:
    """A registered model of one arm run, one per (artifact, content hash): a run is always found by
    its own name, whatever other runs' weights are."""

    artifact: str
    hash: str
    name: str  # the variant (route-quick)
    arm: str | None  # the arm run (vpo-s0)
    created_at: str  # first registration; registering the same weights again keeps it
    trained_at: str  # when the weights were written: what `latest` orders by
    files: tuple[FileRecord, ...]
    path: str | None = None  # the model folder in the repository (the artifact's path in dvc.yaml)
    version: str | None = None  # the GTO version that tags it
    git_rev: str | None = None
    git_dirty: bool | None = None
    dvc_lock_sha256: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    lineage: dict[str, Any] = field(default_factory=dict)
    left_out: tuple[str, ...] = ()
    objects: str | None = None  # migrated entries: where an older registry kept its own copy
    schema: int = 3
    registry_url: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        return f"{self.artifact} {self.hash[:12]}"

    @property
    def tag_only(self) -> bool:
        """Known from a GTO version tag alone: the registry has no entry (no metrics, no card)."""
        return not self.files and not self.objects

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "registry_url"}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], registry_url: str = "") -> Entry:
        """An entry from its JSON (older schemas get an artifact name from name and arm); a
        :class:`RegistryError` when keys are missing, the hash is bad, a path is unsafe or the
        manifest does not hash to the entry's hash."""
        try:
            d = {k: v for k, v in data.items() if k in {f.name for f in fields(cls)}}
            d["files"] = tuple(FileRecord(**f) for f in data["files"] if f.get("role") != "card")
            d["left_out"] = tuple(d.get("left_out") or ())
            d.setdefault("artifact", artifact_name(data["name"], data.get("arm")))
            d.setdefault("trained_at", data["created_at"])
            entry = cls(**{**d, "schema": int(data.get("schema", 1))}, registry_url=registry_url)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RegistryError(f"malformed entry: {exc!r}") from None
        if not HEX64.match(str(entry.hash)):
            raise RegistryError(f"malformed entry: hash {entry.hash!r} is not 64 hex digits")
        for f in entry.files:
            parts = PurePosixPath(f.path).parts
            if f.path.startswith("/") or "\\" in f.path or not parts or {"", ".", ".."} & set(parts):
                raise RegistryError(f"malformed entry: unsafe file path {f.path!r}")
        if manifest_hash(list(entry.files)) != entry.hash:
            raise RegistryError(f"malformed entry: its manifest does not hash to {entry.hash[:12]}")
        return entry


def _match(value: str | None, pattern: str | None) -> bool:
    if pattern is None:
        return True
    glob = any(c in pattern for c in "*?[")
    return value is not None and (fnmatch.fnmatchcase(value, pattern) if glob else value == pattern)


def select(entries: Iterable[Entry], name: str | None = None, arm: str | None = None) -> list[Entry]:
    """Entries whose variant or artifact matches ``name`` and whose arm matches ``arm`` (exact or a glob)."""
    return [e for e in entries if (_match(e.name, name) or _match(e.artifact, name)) and _match(e.arm, arm)]


def _order(e: Entry) -> tuple[datetime, datetime, str]:
    def when(stamp: str) -> datetime:
        try:
            t = datetime.fromisoformat(stamp)
        except (ValueError, TypeError):
            return datetime.min.replace(tzinfo=UTC)
        return t if t.tzinfo else t.replace(tzinfo=UTC)

    return when(e.trained_at), when(e.created_at), e.hash


def latest(entries: Sequence[Entry]) -> Entry:
    """The most recently trained entry (re-registering unchanged weights moves nothing)."""
    if not entries:
        raise RegistryInputError("no entries to choose from")
    return max(entries, key=_order)


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    return float(value) if ok else None


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping) and data:
        return {k: v for key, val in data.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix[:-1]: data}


def metric_value(entry: Entry, metric: str) -> float | None:
    """The number at dotted key ``metric`` of the entry's metrics (``eval.best_at_k.10``; a last part
    ``kmax`` is the largest numeric key there): None when absent, :class:`RegistryInputError` when
    the key names a group or something that is not a number."""
    node: Any = entry.metrics
    parts = metric.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping):
            return None
        if part == "kmax" and i == len(parts) - 1 and part not in node:
            part = max((k for k in node if str(k).isdigit()), key=int, default="")
        node = node.get(part)
    if isinstance(node, Mapping):
        raise RegistryInputError(f"metric {metric!r} of {entry.label} is a group; pick one of: "
                                 + ", ".join(f"{metric}.{k}" for k in list(node)[:12]))
    if node is not None and _number(node) is None:
        raise RegistryInputError(f"metric {metric!r} of {entry.label} is {node!r}, not a number")
    return _number(node)


def best(entries: Sequence[Entry], metric: str = DEFAULT_METRIC, *, lower_is_better: bool = False) -> tuple[Entry, float]:
    """The entry with the highest (or lowest) ``metric``, and its value; ties go to the newest."""
    scored = [(e, v) for e in entries if (v := metric_value(e, metric)) is not None]
    if not scored:
        numeric = [k for k, v in _flat(latest(entries).metrics).items() if _number(v) is not None] if entries else []
        raise RegistryInputError(f"no entry has metric {metric!r}"
                                 + (f"; numeric metrics of the newest entry: {', '.join(numeric[:15])}" if numeric else ""))
    sign = -1.0 if lower_is_better else 1.0
    return max(scored, key=lambda ev: (sign * ev[1], *_order(ev[0])))


def settings_that_differ(entries: Sequence[Entry]) -> dict[tuple[str, str], list[str]]:
    """Per entry (artifact, hash): ``key=value`` of each setting not the same across the entries of
    its name, which is what tells twelve ``route-quick`` runs apart in ``list``."""
    out: dict[tuple[str, str], list[str]] = {}
    for name in {e.name for e in entries}:
        group = [e for e in entries if e.name == name]
        flats = [_flat(e.params) for e in group]
        keys = sorted({k for f in flats for k in f if len({json.dumps(g.get(k), default=str) for g in flats}) > 1})
        for e, f in zip(group, flats):
            out[(e.artifact, e.hash)] = [f"{k}={json.dumps(f.get(k), default=str)}" for k in keys]
    return out
