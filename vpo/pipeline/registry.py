"""Checkpoint registry in a local folder or an ``s3://`` prefix (through fsspec), with aliases,
metric queries, re-hashing verification and a generated model card.

Layout under the registry URL::

    objects/<hash>/<model files>     # weights, tokenizer and config files, plus the generated README.md
    entries/<hash>.json              # written LAST: an entry exists only once all its objects do
    aliases/<name>/<alias>.json      # user-named aliases (``production``...), one object per alias

``<hash>`` is the *content hash* of the model: sha256 over the sorted manifest lines
``<relative path>\\0<size>\\0<sha256 of the bytes>\\n`` of the weight and tokenizer files only, so
byte-identical weights trained in two folders (whose ``training_args.bin`` differ by an absolute path)
register once. Only model files are stored: weights, tokenizer and config files (config files are
verified byte for byte but not part of the hash; run-specific files such as ``training_args.bin`` or
``trainer_state.json`` stay in the run folder and are named in the entry's ``left_out``). The model
card ``README.md`` is generated from the entry and stored with the objects; it is verified like every
object but does not change the hash. An entry records the hash, the per-file manifest (each file with
its ``role``), name and arm, the git revision (and whether the tree was dirty), the sha256 of
``dvc.lock``, pipeline params, metrics, lineage (``base_hash``: the base model's content hash) and a
UTC timestamp.

Atomicity: locally the objects are copied into a temp sibling folder and renamed into place, and the
entry is written to a temp file and hard-linked into place (first writer wins). On S3, objects are
uploaded first (each PUT is atomic), all are verified to exist with the right sizes, then the entry
is written with one conditional PUT. A crash at any point leaves no entry, so a half-written
checkpoint is never registered. Registering the same content again returns the existing entry after
re-hashing its objects and rewriting any missing or corrupt one from the new (intact) copy.

Aliases: ``latest`` (newest entry of a name) and ``best`` (highest value of a metric) are queries,
computed when asked, so they are never stale and no writer can race on them. User-named aliases
(:func:`promote`) are one small object each, written whole (a temp file renamed into place locally,
a single PUT on S3): concurrent promotions of different aliases never touch each other, and of the
same alias the last writer wins while readers always see one complete record.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any

from vpo.atomic import atomic_dir, atomic_write_bytes
from vpo.pipeline.storage import get_filesystem, is_s3_url, redact, secret_values

__all__ = [
    "DEFAULT_METRIC",
    "AliasRecord",
    "FileRecord",
    "IncompleteCheckpointError",
    "RegistryEntry",
    "RegistryError",
    "RegistryInputError",
    "RegistryScan",
    "best_entry",
    "check_checkpoint",
    "check_entry",
    "content_hash",
    "demote",
    "fetch",
    "file_role",
    "get_entry",
    "hash_checkpoint",
    "latest_entry",
    "list_aliases",
    "list_entries",
    "main",
    "metric_value",
    "promote",
    "read_card",
    "register",
    "render_card",
    "scan_registry",
    "verify_entry",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
_CHUNK = 1 << 20
_SHA_META = "vpo-sha256"  # S3 user metadata recording each object's sha256
CONFIG_FILES = ("config.json", "adapter_config.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# Roles of stored files. The content hash covers HASHED_ROLES; entries of schema 1 have no roles and
# hashed every file (a role of None counts as hashed, so old entries still verify and fetch).
ROLE_WEIGHTS, ROLE_TOKENIZER, ROLE_CONFIG, ROLE_CARD = "weights", "tokenizer", "config", "card"
HASHED_ROLES = frozenset({ROLE_WEIGHTS, ROLE_TOKENIZER, None})
CARD_FILE = "README.md"
_ROLE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("*.safetensors", ROLE_WEIGHTS),
    ("pytorch_model*.bin", ROLE_WEIGHTS),
    ("adapter_model.bin", ROLE_WEIGHTS),
    ("*.safetensors.index.json", ROLE_WEIGHTS),
    ("pytorch_model*.bin.index.json", ROLE_WEIGHTS),
    ("tokenizer.json", ROLE_TOKENIZER),
    ("tokenizer_config.json", ROLE_TOKENIZER),
    ("tokenizer.model", ROLE_TOKENIZER),
    ("special_tokens_map.json", ROLE_TOKENIZER),
    ("added_tokens.json", ROLE_TOKENIZER),
    ("vocab.json", ROLE_TOKENIZER),
    ("vocab.txt", ROLE_TOKENIZER),
    ("merges.txt", ROLE_TOKENIZER),
    ("spiece.model", ROLE_TOKENIZER),
    ("chat_template.jinja", ROLE_TOKENIZER),
    ("chat_template.json", ROLE_TOKENIZER),
    ("config.json", ROLE_CONFIG),
    ("generation_config.json", ROLE_CONFIG),
    ("adapter_config.json", ROLE_CONFIG),
)

DEFAULT_METRIC = "eval.best_at_k.kmax"
"""Metric of ``best`` when none is named: best@k at the largest k the entry was evaluated at."""
RESERVED_ALIASES = frozenset({"latest", "best"})
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ALIAS_RE = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


class RegistryError(RuntimeError):
    """The registry or one of its entries is unusable (missing object, hash mismatch, bad key)."""


class RegistryInputError(RegistryError):
    """Bad input from the caller: unknown or ambiguous key, invalid name or alias, unknown metric."""


class IncompleteCheckpointError(RegistryError):
    """A checkpoint folder lacks files a loadable model needs; nothing was registered."""


@dataclass(frozen=True)
class FileRecord:
    """One stored file in an entry's manifest (``role``: weights, tokenizer, config or card;
    None in entries of schema 1, where every file was hashed)."""

    path: str
    size: int
    sha256: str
    role: str | None = None

    @property
    def hashed(self) -> bool:
        """Whether the file is part of the content hash."""
        return self.role in HASHED_ROLES


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
    left_out: tuple[str, ...] = ()
    registry_url: str = field(default="", compare=False)

    @property
    def object_prefix(self) -> str:
        """Folder of the checkpoint's objects, relative to the registry root."""
        return f"objects/{self.hash}"

    @property
    def label(self) -> str:
        """``<hash12> (<name>/<arm>)`` for messages."""
        return f"{self.hash[:12]} ({self.name}/{self.arm or '-'})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of the entry (without the registry location)."""
        data = asdict(self)
        data.pop("registry_url")
        data["files"] = [asdict(f) for f in self.files]
        data["left_out"] = list(self.left_out)
        return data

    def headline(self) -> dict[str, Any]:
        """The few metrics worth a column: best@1, best@k_max (and k_max), reward diversity, parse rate."""
        ev = self.metrics.get("eval") if isinstance(self.metrics.get("eval"), Mapping) else {}
        best = ev.get("best_at_k") if isinstance(ev.get("best_at_k"), Mapping) else {}
        ks = sorted(int(k) for k in best if str(k).isdigit())
        return {
            "best@1": _number(best.get("1")),
            "k_max": ks[-1] if ks else None,
            "best@k_max": _number(best.get(str(ks[-1]))) if ks else None,
            "diversity": _number(ev.get("reward_diversity")),
            "parse_rate": _number(ev.get("parse_rate")),
        }

    def summary(self) -> dict[str, Any]:
        """Flat one-row view for tables (Prefect table artifacts, ``list --json``)."""
        return {
            "hash": self.hash[:12],
            "name": self.name,
            "arm": self.arm,
            "created_at": self.created_at,
            "git_rev": (self.git_rev or "")[:12],
            "base_hash": (str(self.lineage.get("base_hash") or ""))[:12],
            "files": len(self.files),
            "size_bytes": self.size_bytes,
            **self.headline(),
            **{f"metric.{k}": v for k, v in self.metrics.items() if isinstance(v, (int, float, str, bool))},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], registry_url: str = "") -> RegistryEntry:
        """Rebuild an entry from its JSON dict (schema 1 or 2); raises :class:`RegistryError` on a
        malformed one (missing keys, bad hash, unsafe paths, a manifest that does not hash to it)."""
        where = registry_url or "data"
        try:
            files = tuple(FileRecord(**f) for f in data["files"])
            entry = cls(
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
                schema=int(data.get("schema", 1)),
                left_out=tuple(data.get("left_out") or ()),
                registry_url=registry_url,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RegistryError(f"malformed registry entry in {where}: {exc!r}") from None
        if not isinstance(entry.hash, str) or not _HEX64_RE.match(entry.hash):
            raise RegistryError(
                f"malformed registry entry in {where}: hash {entry.hash!r} is not 64 hex digits"
            )
        for f in entry.files:
            if not _safe_relpath(f.path):
                raise RegistryError(f"malformed registry entry in {where}: unsafe file path {f.path!r}")
        if _manifest_hash([f for f in entry.files if f.hashed]) != entry.hash:
            raise RegistryError(
                f"malformed registry entry in {where}: its manifest does not hash to {entry.hash[:12]}…"
            )
        return entry


@dataclass(frozen=True)
class AliasRecord:
    """A user-named alias: ``<name>@<alias>`` points at entry ``hash``."""

    alias: str
    name: str
    hash: str
    set_at: str
    previous: str | None = None
    note: str | None = None

    @property
    def key(self) -> str:
        """``<name>@<alias>``: how the alias is written on the command line."""
        return f"{self.name}@{self.alias}"


@dataclass
class RegistryScan:
    """Everything readable in a registry: the entries (oldest first), the user aliases, and one
    line per file that could not be read (listing never fails because of one bad file)."""

    url: str
    entries: list[RegistryEntry]
    aliases: list[AliasRecord]
    bad: list[str]

    def aliases_of(self, entry: RegistryEntry, *, metric: str = DEFAULT_METRIC) -> list[str]:
        """Alias names pointing at ``entry``: ``latest`` and ``best`` (per name) and user aliases."""
        same = [e for e in self.entries if e.name == entry.name]
        out = []
        if same and _newest(same).hash == entry.hash:
            out.append("latest")
        with contextlib.suppress(RegistryError):
            if _best_of(same, metric, lower_is_better=False)[0].hash == entry.hash:
                out.append("best")
        out += sorted(a.alias for a in self.aliases if a.name == entry.name and a.hash == entry.hash)
        return out


# --------------------------------------------------------------------------- checkpoint inspection


def _safe_relpath(path: Any) -> bool:
    if not isinstance(path, str) or not path or "\\" in path or path.startswith("/"):
        return False
    parts = PurePosixPath(path).parts
    return bool(parts) and all(p not in ("", ".", "..") for p in parts)


def _walk_files(root: Path) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in filenames:
            full = Path(dirpath) / name
            out.append((full.relative_to(root).as_posix(), full))
    return sorted(out)


def file_role(relpath: str) -> str | None:
    """Role of a checkpoint file by its relative path (top-level model files only), None if it is
    not a model file (``training_args.bin``, trainer state, optimizer, a trainer-written README)."""
    if "/" in relpath:
        return None
    for pattern, role in _ROLE_PATTERNS:
        if fnmatch.fnmatchcase(relpath, pattern):
            return role
    return None


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


def _manifest_hash(records: Iterable[FileRecord]) -> str:
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r.path):
        h.update(f"{r.path}\0{r.size}\0{r.sha256}\n".encode())
    return h.hexdigest()


def _inspect(root: Path) -> tuple[str, tuple[FileRecord, ...], tuple[str, ...]]:
    records: list[FileRecord] = []
    left_out: list[str] = []
    for rel, full in _walk_files(root):
        role = file_role(rel)
        if role is None or role == ROLE_CARD:
            left_out.append(rel)
            continue
        records.append(FileRecord(rel, full.stat().st_size, _sha256_file(full), role))
    hashed = [r for r in records if r.hashed]
    if not hashed:
        raise IncompleteCheckpointError(
            f"checkpoint folder {root} has no weight or tokenizer files to hash"
            + (f" (found only: {', '.join(left_out[:8])})" if left_out else " (it is empty)")
        )
    return _manifest_hash(hashed), tuple(records), tuple(left_out)


def hash_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> tuple[str, tuple[FileRecord, ...]]:
    """Content hash of a model folder (weight and tokenizer files only, see module doc) and the
    manifest of the model files that would be stored (weights, tokenizer, config; with roles)."""
    digest, records, _ = _inspect(Path(checkpoint_dir))
    return digest, records


def content_hash(model_dir: str | os.PathLike[str]) -> str:
    """The content hash of a model folder, the same hash the registry files it under: use it to
    name a base model in a registered checkpoint's lineage (``register(..., base_hash=...)``)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise IncompleteCheckpointError(f"model folder {root} does not exist or is not a folder")
    return _inspect(root)[0]


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
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _time_key(stamp: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(stamp)
    except (ValueError, AttributeError):
        return datetime.min.replace(tzinfo=UTC)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} in registry entry is not JSON serializable")


def _to_json(data: Mapping[str, Any]) -> str:
    text = json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n"
    if secret_values():
        masked = redact(text)
        if masked != text:
            log.warning("registry entry contained secret values from the environment; they were masked")
        text = masked
    return text


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


# --------------------------------------------------------------------------- model card


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _dig(data: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(data, Mapping) or k not in data:
            return None
        data = data[k]
    return data


def _card_facts(entry: RegistryEntry) -> dict[str, Any]:
    """Task, estimator, m, K and friends from the entry's lineage (preferred) or its params."""
    lin, params = entry.lineage, entry.params
    arm_cfg = None
    arm_name = lin.get("arm_name") or (entry.arm.rsplit("-s", 1)[0] if entry.arm else None)
    arms = params.get("arms")
    if isinstance(arms, list):
        arm_cfg = next((a for a in arms if isinstance(a, Mapping) and a.get("name") == arm_name), None)
    elif isinstance(arms, Mapping):  # settings() form: arms keyed by name, each with what it sets itself
        arm_cfg = arms.get(arm_name) if isinstance(arms.get(arm_name), Mapping) else None
    arm_cfg = arm_cfg or {}
    return {
        "task": lin.get("task") or _dig(params, "task", "name"),
        "estimator": lin.get("estimator") or arm_cfg.get("estimator"),
        "m": lin.get("m", lin.get("num_answers", arm_cfg.get("num_answers", arm_cfg.get("m")))),
        "K": lin.get("K", lin.get("num_weights", _dig(params, "trainer", "num_weights"))),
        "G": lin.get("num_generations", arm_cfg.get("num_generations", _dig(params, "trainer", "num_generations"))),
        "seed": lin.get("seed"),
        "pipeline": lin.get("pipeline") or params.get("name"),
        "quick": lin.get("quick"),
    }


def render_card(entry: RegistryEntry) -> str:
    """The Hugging Face style model card (YAML front matter + markdown) of ``entry``: task,
    estimator, m, K, metrics, lineage (base hash, git rev, dvc.lock hash, params). A function of the
    entry's content, never of its registration time, own card record or total size: a lost card can
    be re-made, and a retried registration re-uses the card an interrupted one uploaded."""
    import yaml

    facts = _card_facts(entry)
    ev = entry.metrics.get("eval") if isinstance(entry.metrics.get("eval"), Mapping) else {}
    train = entry.metrics.get("train") if isinstance(entry.metrics.get("train"), Mapping) else {}
    model_files = [f for f in entry.files if f.role != ROLE_CARD]
    ks = sorted(
        {int(k) for sub in ("best_at_k", "pass_at_k") for k in (ev.get(sub) or {}) if str(k).isdigit()}
    )
    index_metrics = []
    for sub, label in (
        ("best_at_k", "best"),
        ("pass_at_k", "pass"),
        ("expected_weighted_best_at_k", "E_w best"),
    ):
        values = ev.get(sub) if isinstance(ev.get(sub), Mapping) else {}
        for k in ks:
            v = _number(values.get(str(k)))
            if v is not None:
                index_metrics.append(
                    {"type": f"{sub}", "name": f"{label}@{k}", "value": round(v, 6), "args": {"k": k}}
                )
    for key, label in (("reward_diversity", "reward diversity"), ("parse_rate", "parse rate")):
        v = _number(ev.get(key))
        if v is not None:
            index_metrics.append({"type": key, "name": label, "value": round(v, 6)})
    tags = ["vpo", "reinforcement-learning", "multi-answer"]
    tags += [str(facts[k]) for k in ("estimator", "task") if facts.get(k)]
    front: dict[str, Any] = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": tags,
        "vpo": {
            "content_hash": entry.hash,
            "name": entry.name,
            "arm": entry.arm,
            **{k: facts[k] for k in ("task", "estimator", "m", "K", "G", "seed", "pipeline", "quick")},
            "base_model_hash": entry.lineage.get("base_hash"),
            "git_rev": entry.git_rev,
            "git_dirty": entry.git_dirty,
            "dvc_lock_sha256": entry.dvc_lock_sha256,
        },
    }
    if index_metrics:
        front["model-index"] = [
            {
                "name": f"{entry.name}/{entry.arm}" if entry.arm else entry.name,
                "results": [
                    {
                        "task": {"type": "text-generation", "name": str(facts.get("task") or entry.name)},
                        "dataset": {
                            "type": f"vpo/{facts.get('task') or entry.name}",
                            "name": "held-out split",
                            "split": str(_dig(entry.params, "evaluation", "split") or "test"),
                        },
                        "metrics": index_metrics,
                    }
                ],
            }
        ]
    title = f"{entry.name} / {entry.arm}" if entry.arm else entry.name
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False, default_flow_style=False, allow_unicode=True).rstrip(),
        "---",
        "",
        f"# {title}",
        "",
        (
            f"A checkpoint trained with the `{facts.get('estimator') or '?'}` advantage estimator "
            f"(m = {_fmt(facts.get('m'))} answers per rollout, K = {_fmt(facts.get('K'))} scalarisation "
            f"weights per prompt group) on the `{facts.get('task') or '?'}` task, registered by vpo."
        ),
        "",
        "| task | estimator | m | K | G | seed | pipeline | quick |",
        "|---|---|---|---|---|---|---|---|",
        "| "
        + " | ".join(
            _fmt(facts.get(k)) for k in ("task", "estimator", "m", "K", "G", "seed", "pipeline", "quick")
        )
        + " |",
        "",
        "## Evaluation",
        "",
    ]
    if ks:
        lines += ["| k | " + " | ".join(str(k) for k in ks) + " |", "|---|" + "---|" * len(ks)]
        for sub, label in (
            ("best_at_k", "best@k"),
            ("pass_at_k", "pass@k"),
            ("expected_weighted_best_at_k", "E_w best@k"),
        ):
            values = ev.get(sub) if isinstance(ev.get(sub), Mapping) else {}
            if values:
                lines.append(
                    f"| {label} | " + " | ".join(_fmt(_number(values.get(str(k)))) for k in ks) + " |"
                )
        lines.append("")
    others = [
        (k, ev.get(k))
        for k in ("reward_diversity", "parse_rate", "n_problems", "n_samples", "n_chains")
        if k in ev
    ]
    if others:
        lines += ["; ".join(f"{k.replace('_', ' ')}: {_fmt(v)}" for k, v in others), ""]
    if not ks and not others:
        lines += ["No evaluation metrics were recorded with this entry.", ""]
    if train:
        final = train.get("final") if isinstance(train.get("final"), Mapping) else {}
        bits = [
            f"{k}: {_fmt(train.get(k))}"
            for k in ("max_steps", "num_generations", "resumed_from")
            if k in train
        ]
        bits += [
            f"final {k}: {_fmt(final.get(k))}" for k in ("reward", "loss", "vpo/expected_max") if k in final
        ]
        if bits:
            lines += ["## Training", "", "; ".join(bits), ""]
    lines += [
        "## Lineage",
        "",
        f"- content hash (sha256 over weight and tokenizer files): `{entry.hash}`",
        f"- base model content hash: `{entry.lineage.get('base_hash') or 'not recorded'}`",
        f"- git revision: `{entry.git_rev or 'unknown'}`"
        + (" (uncommitted changes)" if entry.git_dirty else ""),
        f"- dvc.lock sha256: `{entry.dvc_lock_sha256 or 'none'}`",
        "",
        "| file | role | bytes | sha256 |",
        "|---|---|---|---|",
        *[f"| {f.path} | {f.role or '-'} | {f.size} | `{f.sha256[:16]}…` |" for f in model_files],
        "",
    ]
    if entry.left_out:
        lines += [f"Not stored (run-specific): {', '.join(entry.left_out)}.", ""]
    other_lineage = {k: v for k, v in entry.lineage.items() if k != "base_hash"}
    if other_lineage:
        lines += [
            "Lineage fields: " + ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(other_lineage.items())),
            "",
        ]
    lines += [
        "## Use",
        "",
        "```bash",
        f"vpo registry fetch {entry.hash[:16]} ./model   # downloads and verifies every file",
        "```",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("./model")',
        'tokenizer = AutoTokenizer.from_pretrained("./model")',
        "```",
        "",
    ]
    if entry.params:
        lines += [
            "<details><summary>Pipeline parameters</summary>",
            "",
            "```yaml",
            yaml.safe_dump(
                json.loads(json.dumps(entry.params, default=_json_default)), sort_keys=True
            ).rstrip(),
            "```",
            "",
            "</details>",
            "",
        ]
    return "\n".join(lines)


def _card_bytes(entry: RegistryEntry) -> bytes:
    return redact(render_card(entry)).encode("utf-8")


# --------------------------------------------------------------------------- store backends


class _Store:
    """The registry root on a filesystem: local (rename/link atomicity) or S3 (verify-then-put)."""

    def __init__(self, url: str | os.PathLike[str]):
        self.url = str(url)
        self.remote = is_s3_url(self.url)
        self.fs, self.root = get_filesystem(self.url)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def rel(self, full: str) -> str:
        return str(full)[len(self.root) :].lstrip("/") if str(full).startswith(self.root) else str(full)

    def exists(self) -> bool:
        return bool(self.fs.exists(self.root))

    def entry_path(self, digest: str) -> str:
        return self.path("entries", f"{digest}.json")

    def read_entry(self, digest: str) -> RegistryEntry | None:
        """The entry filed under ``digest``; None if there is none; RegistryError naming the file if
        it is unreadable, malformed or filed under another hash."""
        p = self.entry_path(digest)
        try:
            raw = self.fs.cat_file(p)
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RegistryError(
                f"registry entry file entries/{digest}.json is not valid JSON ({exc})"
            ) from None
        if not isinstance(data, Mapping):
            raise RegistryError(f"registry entry file entries/{digest}.json does not hold a JSON object")
        try:
            entry = RegistryEntry.from_dict(data, self.url)
        except RegistryError as exc:
            raise RegistryError(f"registry entry file entries/{digest}.json: {redact(str(exc))}") from None
        if entry.hash != digest:
            raise RegistryError(f"registry entry file entries/{digest}.json holds entry {entry.hash[:12]}…")
        return entry

    def entry_digests(self) -> list[str]:
        try:
            names = self.fs.ls(self.path("entries"), detail=False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            base = PurePosixPath(str(n)).name
            if base.endswith(".json") and not base.startswith("."):
                out.append(base[: -len(".json")])
        return sorted(out)

    def scan_entries(self) -> tuple[list[RegistryEntry], list[str]]:
        entries, bad = [], []
        for d in self.entry_digests():
            try:
                entry = self.read_entry(d)
            except RegistryError as exc:
                bad.append(str(exc))
                continue
            except OSError as exc:
                bad.append(
                    f"registry entry file entries/{d}.json could not be read ({exc.__class__.__name__}: {exc})"
                )
                continue
            if entry is not None:
                entries.append(entry)
        return sorted(entries, key=lambda e: (_time_key(e.created_at), e.hash)), bad

    # objects ---------------------------------------------------------------
    def object_key(self, digest: str, rel: str) -> str:
        return self.path("objects", digest, rel)

    def _hash_object(self, key: str) -> tuple[int, str]:
        h = hashlib.sha256()
        size = 0
        with self.fs.open(key, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
        return size, h.hexdigest()

    def object_problem(self, digest: str, rec: FileRecord, *, rehash: bool = True) -> str | None:
        """None if the object of ``rec`` exists with the recorded size (and, with ``rehash``, the
        recorded sha256 of its bytes, read back from the store); else what is wrong with it."""
        key = self.object_key(digest, rec.path)
        try:
            if rehash:
                size, sha = self._hash_object(key)
            else:
                size, sha = int(self.fs.info(key)["size"]), rec.sha256
        except FileNotFoundError:
            return f"{rec.path} is missing"
        except IsADirectoryError:
            return f"{rec.path} is a folder, not a file"
        if size != rec.size:
            return f"{rec.path} has {size} bytes, expected {rec.size}"
        if sha != rec.sha256:
            return f"{rec.path} is corrupt (sha256 {sha[:12]}…, expected {rec.sha256[:12]}…)"
        return None

    def write_object(self, digest: str, rec: FileRecord, fill: Callable[[IO[bytes]], None]) -> None:
        """Write one object whole (temp file + rename locally, one upload on S3); ``fill`` writes the
        bytes and raises if they do not match ``rec``, in which case nothing is replaced."""
        key = self.object_key(digest, rec.path)
        if self.remote:
            out = self.fs.open(key, "wb", Metadata={_SHA_META: rec.sha256})
            try:
                fill(out)
            except BaseException:
                out.discard()  # abort: an S3 object only appears on a completed upload
                out.closed = True
                raise
            out.close()
            return
        final = Path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fill(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def put_new_local(self, digest: str, files: Sequence[FileRecord], fills: Mapping[str, Callable]) -> bool:
        """First local copy of an entry's objects: built in a temp folder and renamed into place.
        False when the folder already exists (left by an earlier attempt: repaired file by file)."""
        target = Path(self.path("objects", digest))
        if target.is_dir():
            return False
        try:
            with atomic_dir(target, overwrite=False) as tmp:
                for rec in files:
                    dst = tmp / rec.path
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    with open(dst, "wb") as fout:
                        fills[rec.path](fout)
        except RegistryError:
            raise
        except (FileExistsError, OSError) as exc:
            if not target.is_dir():  # not the "someone else just placed it" race
                raise RegistryError(
                    f"could not store objects of {digest[:12]} in {redact(self.url)}: {exc}"
                ) from exc
            return False
        return True

    def ensure_objects(
        self, digest: str, files: Sequence[FileRecord], fills: Mapping[str, Callable[[IO[bytes]], None]]
    ) -> list[str]:
        """Re-hash every object; rewrite missing or corrupt ones for which ``fills`` has a source.
        Returns what was repaired; raises naming every object that is bad and has no good source."""
        repaired, unrepairable = [], []
        for rec in files:
            problem = self.object_problem(digest, rec)
            if problem is None:
                continue
            fill = fills.get(rec.path)
            if fill is None:
                unrepairable.append(problem)
                continue
            self.write_object(digest, rec, fill)
            repaired.append(problem)
        if unrepairable:
            raise RegistryError(
                f"objects of {digest[:12]} in {redact(self.url)} are damaged and this checkpoint has no "
                f"identical copy to repair them from: " + "; ".join(unrepairable)
            )
        return repaired

    def verify_sizes(self, digest: str, files: Sequence[FileRecord]) -> None:
        problems = [p for rec in files if (p := self.object_problem(digest, rec, rehash=False))]
        if problems:
            raise RegistryError(
                f"objects of {digest[:12]} in {redact(self.url)} are incomplete: " + "; ".join(problems)
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
                raise RegistryError(
                    f"could not write entry {digest[:12]} to {redact(self.url)}: {exc}"
                ) from exc
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

    def replace_file(self, path: str, data: bytes) -> None:
        """Replace a small file whole: temp + rename locally, one PUT on S3 (readers see old or new)."""
        if self.remote:
            self.fs.pipe_file(path, data)
        else:
            atomic_write_bytes(path, data)

    # aliases ---------------------------------------------------------------
    def alias_path(self, name: str, alias: str) -> str:
        return self.path("aliases", name, f"{alias}.json")

    def scan_aliases(self) -> tuple[list[AliasRecord], list[str]]:
        try:
            found = self.fs.find(self.path("aliases"))
        except FileNotFoundError:
            return [], []
        records, bad = [], []
        for full in sorted(str(p) for p in found):
            rel = self.rel(full)
            parts = PurePosixPath(rel).parts
            if len(parts) != 3 or not parts[2].endswith(".json") or parts[2].startswith("."):
                continue
            try:
                records.append(self._read_alias_file(full, rel))
            except RegistryError as exc:
                bad.append(str(exc))
        return records, bad

    def _read_alias_file(self, full: str, rel: str) -> AliasRecord:
        try:
            data = json.loads(self.fs.cat_file(full))
            rec = AliasRecord(**data)
        except FileNotFoundError:
            raise
        except (ValueError, TypeError, UnicodeDecodeError, OSError) as exc:
            raise RegistryError(f"alias file {rel} is unreadable ({exc.__class__.__name__}: {exc})") from None
        if not _HEX64_RE.match(str(rec.hash)):
            raise RegistryError(f"alias file {rel} points at {rec.hash!r}, not a 64-hex-digit hash")
        return rec

    def read_alias(self, name: str, alias: str) -> AliasRecord | None:
        full = self.alias_path(name, alias)
        try:
            return self._read_alias_file(full, self.rel(full))
        except FileNotFoundError:
            return None


# --------------------------------------------------------------------------- public API


def _check_name(what: str, value: str | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise RegistryInputError(
            f"registry {what} {value!r} is invalid: use letters, digits, '.', '_' or '-' "
            f"(starting with a letter or digit, at most 128 characters)"
        )


def register(
    registry_url: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str],
    *,
    name: str,
    arm: str | None = None,
    params: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    lineage: Mapping[str, Any] | None = None,
    base_hash: str | None = None,
    repo_dir: str | os.PathLike[str] | None = None,
) -> RegistryEntry:
    """Register a checkpoint folder: validate it, hash its weight and tokenizer files, store its
    model files and a generated model card under ``objects/<hash>/`` and write the entry last.

    ``name`` tells pipelines and variants apart (``route`` vs ``route-quick``), ``arm`` the arm run
    (``vpo-s0``); ``base_hash`` is the base model's :func:`content_hash` (kept in the lineage);
    ``repo_dir`` (default: cwd) is where the git revision and ``dvc.lock`` are read. Content that is
    already registered returns the existing entry, after its objects are re-hashed and any damaged
    one rewritten from this copy."""
    _check_name("name", name)
    _check_name("arm", arm, optional=True)
    if base_hash is not None and not (isinstance(base_hash, str) and _HEX64_RE.match(base_hash)):
        raise RegistryInputError(f"base_hash must be a content hash (64 hex digits), got {base_hash!r}")
    src = Path(checkpoint_dir)
    check_checkpoint(src)
    digest, files, left_out = _inspect(src)
    store = _Store(registry_url)
    source = {rec.path: rec for rec in files}
    replace_bad_entry = False
    try:
        existing = store.read_entry(digest)
    except RegistryError as exc:
        log.warning("%s; it is replaced by this registration", exc)
        existing, replace_bad_entry = None, True
    if existing is not None:
        return _reuse(store, existing, src, source, name=name, arm=arm)
    if base_hash == digest:
        log.warning(
            "checkpoint %s has the same weight and tokenizer files as its base model: training changed nothing",
            digest[:12],
        )
    lin = dict(lineage or {})
    if base_hash is not None:
        lin["base_hash"] = base_hash
    repo = Path(repo_dir) if repo_dir is not None else Path.cwd()
    git_rev, git_dirty = _git_state(repo)
    draft = RegistryEntry(
        hash=digest,
        name=name,
        arm=arm,
        created_at=_now(),
        git_rev=git_rev,
        git_dirty=git_dirty,
        dvc_lock_sha256=_dvc_lock_sha256(repo),
        params=dict(params or {}),
        metrics=dict(metrics or {}),
        lineage=lin,
        files=files,
        size_bytes=sum(f.size for f in files),
        left_out=left_out,
        registry_url=store.url,
    )
    masked = RegistryEntry.from_dict(json.loads(_to_json(draft.to_dict())), store.url)
    card = _card_bytes(masked)
    card_rec = FileRecord(CARD_FILE, len(card), hashlib.sha256(card).hexdigest(), ROLE_CARD)
    all_files = tuple(sorted((*masked.files, card_rec), key=lambda r: r.path))
    entry = replace(masked, files=all_files, size_bytes=sum(f.size for f in all_files))
    text = _to_json(entry.to_dict())
    fills = _fills(src, source, entry, card)
    if store.remote or not store.put_new_local(digest, all_files, fills):
        repaired = store.ensure_objects(digest, all_files, fills)
        if repaired and not store.remote:
            log.info(
                "objects of %s left by an earlier attempt were rewritten: %s",
                digest[:12],
                "; ".join(repaired),
            )
    store.verify_sizes(digest, all_files)
    if replace_bad_entry:
        store.replace_file(store.entry_path(digest), text.encode())
    elif not store.create_entry(digest, text):
        winner = store.read_entry(digest)
        if winner is not None:  # a concurrent registration of the same content won: objects as its entry says
            return _reuse(store, winner, src, source, name=name, arm=arm)
    if left_out:
        log.info("registry: not stored (run-specific, not model files): %s", ", ".join(left_out))
    log.info(
        "registered checkpoint %s (%s/%s, %d files) in %s",
        digest[:12],
        name,
        arm,
        len(all_files),
        redact(store.url),
    )
    return RegistryEntry.from_dict(json.loads(text), store.url)


def _fills(
    src: Path, source: Mapping[str, FileRecord], entry: RegistryEntry, card: bytes | None
) -> dict[str, Callable[[IO[bytes]], None]]:
    """Sources for an entry's objects: the checkpoint's file when it is byte-identical to the
    manifest's, the re-generated card when it matches the recorded one."""
    fills: dict[str, Callable[[IO[bytes]], None]] = {}
    for rec in entry.files:
        if rec.role == ROLE_CARD:
            if card is not None and hashlib.sha256(card).hexdigest() == rec.sha256:
                fills[rec.path] = lambda out, data=card: out.write(data)
        elif (have := source.get(rec.path)) is not None and (have.sha256, have.size) == (
            rec.sha256,
            rec.size,
        ):
            fills[rec.path] = lambda out, r=rec: _copy_verified(src, r, out)
    return fills


def _reuse(
    store: _Store,
    existing: RegistryEntry,
    src: Path,
    source: Mapping[str, FileRecord],
    *,
    name: str,
    arm: str | None,
) -> RegistryEntry:
    if (existing.name, existing.arm) != (name, arm):
        log.warning(
            "checkpoint %s is already registered as %s/%s; not registered again as %s/%s",
            existing.hash[:12],
            existing.name,
            existing.arm,
            name,
            arm,
        )
    else:
        log.info("checkpoint %s already registered as %s/%s", existing.hash[:12], existing.name, existing.arm)
    card = _card_bytes(existing) if any(f.role == ROLE_CARD for f in existing.files) else None
    repaired = store.ensure_objects(existing.hash, existing.files, _fills(src, source, existing, card))
    if repaired:
        log.warning(
            "entry %s: repaired damaged objects from %s: %s", existing.label, src, "; ".join(repaired)
        )
    return existing


def _match(value: str | None, pattern: str | None) -> bool:
    if pattern is None:
        return True
    if any(c in pattern for c in "*?["):
        return value is not None and fnmatch.fnmatchcase(value, pattern)
    return value == pattern


def scan_registry(registry_url: str | os.PathLike[str]) -> RegistryScan:
    """Read every entry and alias of a registry; unreadable files are named in ``bad``, not fatal."""
    store = _Store(registry_url)
    entries, bad = store.scan_entries()
    aliases, bad_aliases = store.scan_aliases()
    known = {e.hash for e in entries}
    bad += bad_aliases
    bad += [
        f"alias {a.key} points at {a.hash[:12]}…, which has no readable entry"
        for a in aliases
        if a.hash not in known
    ]
    return RegistryScan(store.url, entries, aliases, bad)


def list_entries(
    registry_url: str | os.PathLike[str], *, name: str | None = None, arm: str | None = None
) -> list[RegistryEntry]:
    """All readable entries (oldest first), optionally filtered by ``name`` / ``arm`` (exact, or a
    glob such as ``route*``). An unreadable entry file is skipped with a warning naming it."""
    scan = scan_registry(registry_url)
    for line in scan.bad:
        log.warning("registry %s: %s", redact(scan.url), line)
    return [e for e in scan.entries if _match(e.name, name) and _match(e.arm, arm)]


def list_aliases(registry_url: str | os.PathLike[str], *, name: str | None = None) -> list[AliasRecord]:
    """User-named aliases (optionally of one name); unreadable alias files are skipped with a warning."""
    records, bad = _Store(registry_url).scan_aliases()
    for line in bad:
        log.warning("registry %s: %s", redact(str(registry_url)), line)
    return [a for a in records if _match(a.name, name)]


def metric_value(entry: RegistryEntry, metric: str) -> float | None:
    """The number at dotted key ``metric`` in the entry's metrics (``eval.best_at_k.10``); a last
    component ``kmax`` means the largest numeric key there (best@k_max). None when the entry lacks
    it; :class:`RegistryInputError` when the key leads to something that is not a number."""
    node: Any = entry.metrics
    parts = metric.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping):
            return None
        if part in node:
            node = node[part]
        elif part == "kmax" and i == len(parts) - 1:
            ks = [k for k in node if str(k).isdigit()]
            if not ks:
                return None
            node = node[max(ks, key=int)]
        else:
            return None
    if isinstance(node, Mapping):
        raise RegistryInputError(
            f"metric {metric!r} of entry {entry.label} is a group, not a number; pick one of: "
            + ", ".join(f"{metric}.{k}" for k in list(node)[:12])
        )
    if node is None:
        return None
    value = _number(node)
    if value is None:
        raise RegistryInputError(f"metric {metric!r} of entry {entry.label} is {node!r}, not a number")
    return value


def _numeric_keys(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, Mapping):
        return [k for key, v in data.items() for k in _numeric_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if _number(data) is not None else []


def _newest(entries: Sequence[RegistryEntry]) -> RegistryEntry:
    return max(entries, key=lambda e: (_time_key(e.created_at), e.hash))


def _best_of(
    entries: Sequence[RegistryEntry], metric: str, *, lower_is_better: bool
) -> tuple[RegistryEntry, float]:
    scored = [(e, v) for e in entries if (v := metric_value(e, metric)) is not None]
    if not scored:
        hint = ""
        if entries:
            keys = _numeric_keys(_newest(entries).metrics)
            hint = f"; numeric metrics of the newest entry: {', '.join(keys[:15])}" + (
                " …" if len(keys) > 15 else ""
            )
        raise RegistryInputError(f"no entry has metric {metric!r}{hint}")
    sign = -1.0 if lower_is_better else 1.0
    # ties go to the newest entry
    return max(scored, key=lambda ev: (sign * ev[1], _time_key(ev[0].created_at), ev[0].hash))


def best_entry(
    registry_url: str | os.PathLike[str],
    metric: str = DEFAULT_METRIC,
    *,
    name: str | None = None,
    arm: str | None = None,
    lower_is_better: bool = False,
) -> tuple[RegistryEntry, float]:
    """The entry with the highest (or, with ``lower_is_better``, lowest) value of ``metric`` among
    those matching ``name`` / ``arm``, and that value; entries without the metric are skipped."""
    entries = list_entries(registry_url, name=name, arm=arm)
    if not entries:
        raise RegistryInputError(
            f"no entries{_filter_text(name, arm)} in registry {redact(str(registry_url))}"
        )
    return _best_of(entries, metric, lower_is_better=lower_is_better)


def latest_entry(
    registry_url: str | os.PathLike[str], *, name: str | None = None, arm: str | None = None
) -> RegistryEntry:
    """The most recently registered entry matching ``name`` / ``arm``."""
    entries = list_entries(registry_url, name=name, arm=arm)
    if not entries:
        raise RegistryInputError(
            f"no entries{_filter_text(name, arm)} in registry {redact(str(registry_url))}"
        )
    return _newest(entries)


def _filter_text(name: str | None, arm: str | None) -> str:
    bits = [f"name {name!r}" if name else "", f"arm {arm!r}" if arm else ""]
    text = " and ".join(b for b in bits if b)
    return f" with {text}" if text else ""


def get_entry(registry_url: str | os.PathLike[str], key: str) -> RegistryEntry:
    """Resolve ``key`` to an entry: a hash or a prefix of >= 6 hex digits; ``<name>@<alias>`` where
    alias is ``latest``, ``best`` (by :data:`DEFAULT_METRIC`) or a promoted one (``production``);
    or ``latest`` / ``best`` alone (over all names)."""
    store = _Store(registry_url)
    key = key.strip()
    if "@" in key or key in RESERVED_ALIASES:
        name, _, alias = key.rpartition("@")
        name = name or None
        if alias == "latest":
            return latest_entry(registry_url, name=name)
        if alias == "best":
            return best_entry(registry_url, name=name)[0]
        if name is None:
            raise RegistryInputError(f"alias {alias!r} needs a name: write <name>@{alias}")
        _check_name("name", name)
        _check_alias(alias, allow_reserved=True)
        rec = store.read_alias(name, alias)
        if rec is None:
            known = sorted(a.key for a in list_aliases(registry_url, name=name))
            raise RegistryInputError(
                f"no alias {key!r} in registry {redact(store.url)}"
                + (
                    f"; aliases of {name}: {', '.join(known)}"
                    if known
                    else f" ({name} has no promoted aliases)"
                )
            )
        entry = store.read_entry(rec.hash)
        if entry is None:
            raise RegistryError(
                f"alias {key} points at {rec.hash[:12]}…, which has no entry in {redact(store.url)}"
            )
        return entry
    low = key.lower()
    if len(low) == 64 and _HEX64_RE.match(low):
        entry = store.read_entry(low)
        if entry is None:
            raise RegistryInputError(f"no entry {low[:12]}… in registry {redact(store.url)}")
        return entry
    if len(low) < 6 or any(c not in "0123456789abcdef" for c in low):
        raise RegistryInputError(
            f"entry key must be a hash or a hash prefix of >= 6 hex digits, <name>@<alias>, latest or best; got {key!r}"
        )
    matches = [d for d in store.entry_digests() if d.startswith(low)]
    if not matches:
        raise RegistryInputError(f"no entry matching {key!r} in registry {redact(store.url)}")
    if len(matches) > 1:
        raise RegistryInputError(f"ambiguous entry prefix {key!r}: {', '.join(m[:12] for m in matches)}")
    entry = store.read_entry(matches[0])
    if entry is None:
        raise RegistryError(f"entry {matches[0][:12]}… disappeared while it was being read")
    return entry


def _check_alias(alias: str, *, allow_reserved: bool = False) -> None:
    if not isinstance(alias, str) or not _ALIAS_RE.match(alias):
        raise RegistryInputError(
            f"alias {alias!r} is invalid: use lower-case letters, digits, '_' or '-', starting with a letter"
        )
    if alias in RESERVED_ALIASES and not allow_reserved:
        raise RegistryInputError(
            f"alias {alias!r} is computed by the registry (latest: newest entry of a name; best: highest metric) "
            f"and cannot be set; pick another name, e.g. production or staging"
        )


def promote(
    registry_url: str | os.PathLike[str], key: str, alias: str, *, note: str | None = None
) -> AliasRecord:
    """Point ``<name>@<alias>`` (name: that of the entry ``key`` resolves to) at that entry. The alias
    is one object written whole; the record keeps the hash it pointed at before (best effort)."""
    _check_alias(alias)
    entry = get_entry(registry_url, key)
    store = _Store(registry_url)
    try:
        before = store.read_alias(entry.name, alias)
    except RegistryError:
        before = None  # an unreadable alias file is simply replaced
    previous = None
    if before is not None:
        previous = before.previous if before.hash == entry.hash else before.hash
    rec = AliasRecord(
        alias=alias, name=entry.name, hash=entry.hash, set_at=_now(), previous=previous, note=note
    )
    store.replace_file(store.alias_path(entry.name, alias), _to_json(asdict(rec)).encode())
    log.info("alias %s -> %s", rec.key, entry.label)
    return rec


def demote(registry_url: str | os.PathLike[str], name: str, alias: str) -> AliasRecord:
    """Remove the user alias ``<name>@<alias>``; returns the record that was removed."""
    _check_name("name", name)
    _check_alias(alias)
    store = _Store(registry_url)
    rec = store.read_alias(name, alias)
    if rec is None:
        raise RegistryInputError(f"no alias {name}@{alias} in registry {redact(store.url)}")
    with contextlib.suppress(FileNotFoundError):
        store.fs.rm_file(store.alias_path(name, alias))
    return rec


def check_entry(entry: RegistryEntry) -> list[str]:
    """Re-hash every stored object of ``entry``; one line per missing, resized or corrupt object."""
    if not entry.registry_url:
        raise RegistryError("entry has no registry_url; load it with get_entry/list_entries")
    store = _Store(entry.registry_url)
    return [p for rec in entry.files if (p := store.object_problem(entry.hash, rec))]


def verify_entry(entry: RegistryEntry) -> None:
    """Re-hash every stored object of ``entry`` against its manifest; raise naming each bad object."""
    problems = check_entry(entry)
    if problems:
        raise RegistryError(
            f"entry {entry.label} failed verification: "
            + "; ".join(problems)
            + "; register an intact copy of the checkpoint again to repair it"
        )


def read_card(entry: RegistryEntry) -> str:
    """The stored model card of ``entry`` (entries of schema 1 have none: one is rendered)."""
    if not any(f.role == ROLE_CARD for f in entry.files):
        return render_card(entry)
    store = _Store(entry.registry_url)
    try:
        return store.fs.cat_file(store.object_key(entry.hash, CARD_FILE)).decode("utf-8")
    except FileNotFoundError:
        raise RegistryError(f"entry {entry.label}: its model card {CARD_FILE} is missing") from None


def _folder_matches(dest: Path, files: Sequence[FileRecord]) -> bool:
    try:
        return all(
            (p := dest / rec.path).is_file()
            and p.stat().st_size == rec.size
            and _sha256_file(p) == rec.sha256
            for rec in files
        )
    except OSError:
        return False


def fetch(entry: RegistryEntry, dest: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Download ``entry``'s checkpoint into ``dest`` atomically, verifying every file's sha256. An
    existing ``dest`` holding the same files is returned as is; other content is an error unless
    ``overwrite``."""
    if not entry.registry_url:
        raise RegistryError("entry has no registry_url; load it with get_entry/list_entries")
    dest = Path(dest)
    if dest.exists() and not overwrite:
        if dest.is_dir() and _folder_matches(dest, entry.files):
            return dest
        raise RegistryError(f"{dest} already exists with other content; pass overwrite=True to replace it")
    store = _Store(entry.registry_url)
    with atomic_dir(dest, overwrite=True) as tmp:
        for rec in entry.files:
            local = tmp / rec.path
            local.parent.mkdir(parents=True, exist_ok=True)
            try:
                store.fs.get_file(store.object_key(entry.hash, rec.path), str(local))
            except FileNotFoundError:
                raise RegistryError(
                    f"entry {entry.hash[:12]}: object {rec.path} is missing from the registry"
                ) from None
            got = _sha256_file(local)
            if got != rec.sha256 or local.stat().st_size != rec.size:
                raise RegistryError(
                    f"entry {entry.hash[:12]}: object {rec.path} is corrupt (sha256 {got[:12]}…, expected {rec.sha256[:12]}…)"
                )
        if _manifest_hash([f for f in entry.files if f.hashed]) != entry.hash:  # from_dict checks it too
            raise RegistryError(f"entry {entry.hash[:12]}: its manifest does not hash to its name")
    return dest


# --------------------------------------------------------------------------- CLI


def _table(rows: list[dict[str, Any]], cols: Sequence[str]) -> str:
    cells = [[_fmt(r.get(c)) if not isinstance(r.get(c), str) else r[c] for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(out)


def _row(entry: RegistryEntry, scan: RegistryScan, metric: str) -> dict[str, Any]:
    head = entry.headline()
    return {
        "hash": entry.hash[:12],
        "name": entry.name,
        "arm": entry.arm or "-",
        "created": entry.created_at[:19].replace("T", " "),
        "best@1": head["best@1"],
        "best@kmax": (
            f"{head['best@k_max']:.4g} (k={head['k_max']})" if head["best@k_max"] is not None else "–"
        ),
        "diversity": head["diversity"],
        "aliases": ",".join(scan.aliases_of(entry, metric=metric)) or "-",
    }


_LIST_COLS = ("hash", "name", "arm", "created", "best@1", "best@kmax", "diversity", "aliases")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own: usage + "error:" line, exit 2
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")


def _parser(prog: str) -> argparse.ArgumentParser:
    reg = argparse.ArgumentParser(add_help=False)
    reg.add_argument(
        "--registry",
        default=argparse.SUPPRESS,
        help="registry URL: a folder or s3://bucket/prefix (default: $VPO_REGISTRY)",
    )
    p = _Parser(
        prog=prog,
        parents=[reg],
        description="Query the checkpoint registry: entries, aliases, "
        "metrics, verification and fetching (local folder or s3://).",
    )
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    s = sub.add_parser("list", parents=[reg], help="entries with headline metrics and aliases")
    s.add_argument("--name", help="only this name (glob allowed: 'route*')")
    s.add_argument("--arm", help="only this arm run (glob allowed: 'vpo-*')")
    s.add_argument("--json", action="store_true", help="one JSON object per entry")
    s = sub.add_parser("show", parents=[reg], help="one entry as JSON (or its model card)")
    s.add_argument("key", nargs="?", help="hash prefix, <name>@<alias>, latest or best")
    s.add_argument("--entry", help=argparse.SUPPRESS)  # the key, as earlier versions spelled it
    s.add_argument("--card", action="store_true", help="print the model card (README.md) instead")
    s = sub.add_parser("best", parents=[reg], help="the entry with the highest value of a metric")
    s.add_argument(
        "--metric",
        default=DEFAULT_METRIC,
        help=f"dotted key into the entry's metrics (default {DEFAULT_METRIC}: best@k at the largest k)",
    )
    s.add_argument("--lower-is-better", action="store_true", help="pick the lowest value instead")
    s.add_argument("--name", help="only this name (glob allowed)")
    s.add_argument("--arm", help="only this arm run (glob allowed)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("fetch", parents=[reg], help="download a checkpoint and verify every file")
    s.add_argument("key", nargs="?", help="hash prefix, <name>@<alias>, latest or best")
    s.add_argument("dest", nargs="?", help="destination folder")
    s.add_argument("--entry", help=argparse.SUPPRESS)
    s.add_argument("--dest", dest="dest_opt", help=argparse.SUPPRESS)
    s.add_argument("--overwrite", action="store_true", help="replace a destination with other content")
    s = sub.add_parser("promote", parents=[reg], help="set (or --remove) a named alias such as production")
    s.add_argument(
        "key",
        help="entry to point at (hash prefix, <name>@<alias>, latest, best); with --remove: <name>@<alias>",
    )
    s.add_argument("alias", nargs="?", help="alias name, e.g. production or staging")
    s.add_argument("--note", help="free text kept with the alias (why it was promoted)")
    s.add_argument("--remove", action="store_true", help="remove the alias given as <name>@<alias>")
    s = sub.add_parser("verify", parents=[reg], help="re-hash stored objects (all entries by default)")
    s.add_argument("keys", nargs="*", help="entries to verify (default: all)")
    return p


def _one_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    if args.key and args.entry and args.key != args.entry:
        parser.error(f"give the entry once (got {args.key!r} and --entry {args.entry!r})")
    key = args.key or args.entry
    if not key:
        parser.error(f"{args.cmd}: an entry key is required (hash prefix, <name>@<alias>, latest or best)")
    return key


def main(
    argv: Sequence[str] | None = None,
    *,
    default_registry: str | None = None,
    prog: str = "python -m vpo.pipeline.registry",
) -> int:
    """``{prog} [--registry URL] list|show|best|fetch|promote|verify``. The registry is ``--registry``,
    else ``$VPO_REGISTRY``, else ``default_registry`` (the pipeline's ``storage.registry``). Exit 0 on
    success, 1 when verification or storage fails, 2 for bad input (unknown key or alias, bad metric,
    no registry)."""
    parser = _parser(prog)
    try:
        args = parser.parse_args(argv)
        url = getattr(args, "registry", None) or os.environ.get("VPO_REGISTRY") or default_registry
        if not url:
            parser.error(
                "no registry given: pass --registry URL (a folder or s3://bucket/prefix) or set VPO_REGISTRY"
            )
        if not is_s3_url(url) and not Path(url).expanduser().is_dir():
            raise RegistryInputError(f"registry folder {url} does not exist")
        return _run(args, parser, url)
    except BrokenPipeError:  # output piped into `head`: not an error of the registry
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the interpreter's flush at exit
        return 0
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, "error:" line printed)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except RegistryInputError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except (RegistryError, OSError) as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1


def _warn(lines: Iterable[str]) -> None:
    for line in lines:
        print(f"warning: {redact(line)}", file=sys.stderr)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser, url: str) -> int:
    if args.cmd == "list":
        scan = scan_registry(url)
        _warn(scan.bad)
        entries = [e for e in scan.entries if _match(e.name, args.name) and _match(e.arm, args.arm)]
        if args.json:
            for e in entries:
                print(json.dumps({**e.summary(), "aliases": scan.aliases_of(e)}, sort_keys=True))
        elif entries:
            print(_table([_row(e, scan, DEFAULT_METRIC) for e in entries], _LIST_COLS))
        else:
            print(f"no entries{_filter_text(args.name, args.arm)} in {redact(url)}")
        return 0
    if args.cmd == "show":
        entry = get_entry(url, _one_key(args, parser))
        if args.card:
            print(read_card(entry), end="")
            return 0
        scan = scan_registry(url)
        data = {
            **entry.to_dict(),
            "aliases": scan.aliases_of(entry),
            "objects": redact(f"{url.rstrip('/')}/{entry.object_prefix}"),
        }
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    if args.cmd == "best":
        entry, value = best_entry(
            url, args.metric, name=args.name, arm=args.arm, lower_is_better=args.lower_is_better
        )
        if args.json:
            print(json.dumps({**entry.summary(), "metric": args.metric, "value": value}, sort_keys=True))
        else:
            print(
                f"{entry.hash[:12]}  {entry.name}  {entry.arm or '-'}  {args.metric}={value:.6g}  "
                f"(full hash {entry.hash})"
            )
        return 0
    if args.cmd == "fetch":
        key = _one_key(args, parser)
        if args.dest and args.dest_opt and args.dest != args.dest_opt:
            parser.error(f"give the destination once (got {args.dest!r} and --dest {args.dest_opt!r})")
        dest = args.dest or args.dest_opt
        if not dest:
            parser.error("fetch: a destination folder is required")
        print(fetch(get_entry(url, key), dest, overwrite=args.overwrite))
        return 0
    if args.cmd == "promote":
        if args.remove:
            if args.alias is not None or "@" not in args.key:
                parser.error("promote --remove takes one argument: <name>@<alias>")
            name, _, alias = args.key.rpartition("@")
            rec = demote(url, name, alias)
            print(f"removed {rec.key} (was {rec.hash[:12]})")
            return 0
        if args.alias is None:
            parser.error("promote: give the entry key and the alias, e.g. promote route@latest production")
        rec = promote(url, args.key, args.alias, note=args.note)
        prev = f" (was {rec.previous[:12]})" if rec.previous else ""
        print(f"{rec.key} -> {rec.hash[:12]}{prev}")
        return 0
    # verify
    if args.keys:
        entries, bad = [get_entry(url, k) for k in args.keys], []
    else:
        scan = scan_registry(url)
        entries, bad = scan.entries, scan.bad
    _warn(bad)
    failed = 0
    for e in entries:
        problems = check_entry(e)
        if problems:
            failed += 1
            print(f"FAIL {e.label}: " + "; ".join(problems))
        else:
            print(f"ok   {e.label}: {len(e.files)} files, {e.size_bytes} bytes re-hashed")
    print(
        f"{len(entries) - failed}/{len(entries)} entries verified"
        + (f"; {len(bad)} unreadable file(s) named above" if bad else "")
    )
    return 1 if failed or bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
