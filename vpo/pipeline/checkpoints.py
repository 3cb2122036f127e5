"""Model folders and trainer checkpoints: is this one complete, which one to resume from.

A model folder (the base, an arm's final model) must have its config, intact weights and tokenizer.
A trainer checkpoint (``trainer/checkpoint-N``) must also have its optimizer, scheduler and RNG state
and a ``trainer_state.json`` for step N (the HF Trainer writes it last); every file is checked for
truncation (safetensors headers, torch zip archives), so a checkpoint torn by a kill or a full disk
is skipped with a message and the previous one is used.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from vpo.pipeline.console import log
from vpo.pipeline.errors import StageError

__all__ = ["check_model_dir", "checkpoint_problem", "checkpoint_step", "latest_checkpoint", "safetensors_problem"]

_STATE_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth")


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
    from vpo.pipeline.registry import IncompleteCheckpointError, check_checkpoint

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
