"""Model folders and trainer checkpoints: is this one complete, what is its content hash, which
checkpoint to resume from.

A model folder (the base, an arm's final model) must have its config, intact weights and tokenizer.
Its *content hash* is sha256 over the sorted lines ``<path>\0<size>\0<sha256>\n`` of its weight and
tokenizer files only, so byte-identical weights trained in two folders (whose ``training_args.bin``
differ by an absolute path) hash alike; config files are listed (and checked) but not hashed.
A trainer checkpoint (``trainer/checkpoint-N``) must also have its optimizer, scheduler and RNG state
and a ``trainer_state.json`` for step N (the HF Trainer writes it last); every file is checked for
truncation (safetensors headers, torch zip archives), so a checkpoint torn by a kill or a full disk
is skipped with a message and the previous one is used.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import zipfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from vpo.pipeline.engine.console import log
from vpo.pipeline.engine.errors import StageError

__all__ = ["FileRecord", "IncompleteCheckpointError", "check_checkpoint", "check_model_dir", "checkpoint_problem",
           "checkpoint_step", "content_hash", "latest_checkpoint", "manifest_hash", "model_manifest",
           "safetensors_problem"]

_STATE_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth")
_CONFIGS = ("config.json", "adapter_config.json")
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_ROLES = (*((p, "weights") for p in ("*.safetensors", "pytorch_model*.bin", "adapter_model.bin",
                                     "*.safetensors.index.json", "pytorch_model*.bin.index.json")),
          *((n, "tokenizer") for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                                       "special_tokens_map.json", "added_tokens.json", "vocab.txt", "merges.txt",
                                       "spiece.model", "chat_template.jinja", "chat_template.json")),
          *((n, "config") for n in ("config.json", "generation_config.json", "adapter_config.json")))
HASHED_ROLES = frozenset({"weights", "tokenizer", None})  # None: records written before roles existed


class IncompleteCheckpointError(ValueError):
    """A model folder lacks files a loadable model needs."""


@dataclass(frozen=True)
class FileRecord:
    """One file of a model folder: path, size, sha256, DVC's md5 and role (weights, tokenizer, config)."""

    path: str
    size: int
    sha256: str
    md5: str | None = None
    role: str | None = None


def check_checkpoint(folder: str | Path) -> None:
    """Refuse a folder that is not a complete model: a config (``config.json`` or a PEFT
    ``adapter_config.json``) that parses, non-empty weights (every shard an index lists) and tokenizer
    files. :class:`IncompleteCheckpointError` names everything missing."""
    root, problems = Path(folder), []
    if not root.is_dir():
        raise IncompleteCheckpointError(f"checkpoint folder {root} does not exist or is not a folder")
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
    """(size, sha256, md5) of a file, read once in 1 MiB chunks (md5 is DVC's object id)."""
    sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha.update(chunk)
            md5.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest(), md5.hexdigest()


def manifest_hash(records: list[FileRecord]) -> str:
    """The content hash of a manifest: over its weight and tokenizer files only."""
    h = hashlib.sha256()
    for r in sorted((r for r in records if r.role in HASHED_ROLES), key=lambda r: r.path):
        h.update(f"{r.path}\0{r.size}\0{r.sha256}\n".encode())
    return h.hexdigest()


def model_manifest(folder: str | Path) -> tuple[str, tuple[FileRecord, ...], tuple[str, ...], str]:
    """(content hash, the model files' records, the other files' names, when the weights were written)."""
    root, records, left_out, mtime = Path(folder), [], [], 0.0
    for full in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = full.relative_to(root).as_posix()
        role = None if "/" in rel else next((r for pat, r in _ROLES if fnmatch.fnmatchcase(rel, pat)), None)
        if role is None:
            left_out.append(rel)
            continue
        records.append(FileRecord(rel, *hash_file(full), role=role))
        mtime = max(mtime, full.stat().st_mtime) if role == "weights" else mtime
    if not any(r.role in HASHED_ROLES for r in records):
        raise IncompleteCheckpointError(f"model folder {root} has no weight or tokenizer files to hash")
    written = datetime.fromtimestamp(mtime, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return manifest_hash(records), tuple(records), tuple(left_out), written


def content_hash(folder: str | Path) -> str:
    """The content hash of a model folder (how the registry names it; a base model's in lineage)."""
    if not Path(folder).is_dir():
        raise IncompleteCheckpointError(f"model folder {folder} does not exist or is not a folder")
    return model_manifest(folder)[0]


def safetensors_problem(path: Path) -> str | None:
    """Why a ``.safetensors`` file is torn (its header promises more bytes than it has), else None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                return f"{path.name} is truncated ({size} bytes, header needs {8 + n})"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        return f"{path.name} has an unreadable header ({exc.__class__.__name__})"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{path.name} is truncated ({size} bytes, its tensors need {need})"
    return None


def _torch_file_problem(path: Path) -> str | None:
    """Why a ``torch.save`` file (a zip archive) is torn, else None."""
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        return f"{path.name} is not a complete archive ({exc.__class__.__name__})"
    return f"{path.name} has a damaged member {bad}" if bad else None


def check_model_dir(path: Path, what: str, fix: str) -> None:
    """One :class:`StageError` when ``path`` is not a complete model folder (config, intact weights,
    tokenizer); ``fix`` says which command rebuilds it."""
    try:
        check_checkpoint(path)
    except IncompleteCheckpointError as exc:
        raise StageError(f"{what}: {exc}; {fix}") from None
    for weights in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise StageError(f"{what}: incomplete checkpoint {path}: {problem}; {fix}")


def checkpoint_step(path: Path) -> int | None:
    """N of a ``checkpoint-N`` folder name (None for other names)."""
    tail = path.name.rsplit("-", 1)[-1]
    return int(tail) if path.name.startswith("checkpoint-") and tail.isdigit() else None


def checkpoint_problem(path: Path) -> str | None:
    """Why ``checkpoint-N`` cannot be resumed from (None when it is complete and intact)."""
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        return "no trainer_state.json (the save was interrupted)"
    try:
        step = int(json.loads(state_file.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable trainer_state.json ({exc.__class__.__name__})"
    if f"checkpoint-{step}" != path.name:
        return f"trainer_state.json is for step {step}"
    weights = sorted(path.glob("*.safetensors"))
    if not weights and not (path / "pytorch_model.bin").is_file():
        return "no model weights"
    missing = [f for f in _STATE_FILES if not (path / f).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    for w in weights:
        problem = safetensors_problem(w)
        if problem:
            return problem
    for f in (*_STATE_FILES, "pytorch_model.bin"):
        if (path / f).is_file():
            problem = _torch_file_problem(path / f)
            if problem:
                return problem
    return None


def latest_checkpoint(trainer_dir: Path) -> Path | None:
    """The newest complete ``checkpoint-N`` folder, if any; newer damaged ones are reported and skipped."""
    if not trainer_dir.is_dir():
        return None
    found = [p for p in trainer_dir.glob("checkpoint-*") if p.is_dir() and checkpoint_step(p) is not None]
    for path in sorted(found, key=lambda p: checkpoint_step(p) or 0, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log(f"skipping damaged checkpoint {path}: {problem}; using the one before it")
    return None
