"""What produced a stage's output, and whether it still matches what is asked for.

Every stage output folder holds ``stage.json``: the *fingerprint* of the request that produced it —
the settings the stage reads (their values), the hashes of the code files it runs and the content
digests of its inputs (the upstream outputs) — plus the digest and file sizes of the output itself.
A stage is up to date when the fingerprint of the current request equals the recorded one and the
recorded files are all there; otherwise :func:`why_stale` says why in words a user can act on
("trainer.learning_rate changed 0.0001 -> 0.0005", "code changed: vpo/trainer.py", "input base
changed"). The record is written after the output is published, so a crash in between only costs a
re-run, never a stale output taken for a fresh one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import vpo
from vpo.atomic import atomic_write_json
from vpo.pipeline.config.layout import STATE_FILE

__all__ = ["CODE_ROOT", "Fingerprint", "content_digest", "file_sha256", "read_state", "why_stale", "write_state"]

CODE_ROOT = Path(vpo.__file__).resolve().parent.parent
"""The folder holding the ``vpo`` package (the repository in a checkout): code paths are relative to it."""

_FORMAT = 1


@dataclass(frozen=True)
class Fingerprint:
    """The request a stage output answers: settings, code and inputs."""

    params: dict[str, Any]
    code: dict[str, str]
    inputs: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """One hash of the whole request."""
        blob = json.dumps({"params": self.params, "code": self.code, "inputs": self.inputs}, sort_keys=True,
                          default=str)
        return hashlib.sha256(blob.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def code_hashes(files: Iterable[str | Path]) -> dict[str, str]:
    """{path relative to :data:`CODE_ROOT` (or absolute outside it): sha256} of code files."""
    out = {}
    for f in files:
        p = Path(f) if Path(f).is_absolute() else CODE_ROOT / f
        try:
            key = p.resolve().relative_to(CODE_ROOT).as_posix()
        except ValueError:
            key = str(p)
        out[key] = file_sha256(p) if p.is_file() else "missing"
    return out


def _walk(root: Path, exclude: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` (or ``root`` itself), sorted, skipping names in ``exclude`` at any depth."""
    if root.is_file():
        return [root]
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in exclude)
        found += [Path(dirpath) / f for f in sorted(files) if f not in exclude]
    return found


def content_digest(paths: Iterable[Path], base: Path, exclude: tuple[str, ...] = ()) -> tuple[str, dict[str, int]]:
    """(sha256 over the files' relative names and contents, {relative name: size}) of ``paths``
    (files or folders, relative names against ``base``)."""
    h = hashlib.sha256()
    sizes: dict[str, int] = {}
    for root in paths:
        for f in _walk(root, (STATE_FILE, *exclude)):
            rel = f.relative_to(base).as_posix()
            h.update(rel.encode() + b"\0" + file_sha256(f).encode() + b"\n")
            sizes[rel] = f.stat().st_size
    return h.hexdigest(), sizes


def read_state(path: Path) -> dict[str, Any] | None:
    """The record at ``path``; None when missing or unreadable (the output is then treated as stale)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == _FORMAT else None


def write_state(path: Path, fp: Fingerprint, out_digest: str, files: Mapping[str, int],
                summary: Mapping[str, Any] | None = None) -> None:
    """Record what produced an output (atomically, with the output's digest and file sizes)."""
    atomic_write_json(path, {"format": _FORMAT, "fingerprint": fp.digest, "params": fp.params, "code": fp.code,
                             "inputs": fp.inputs, "out_digest": out_digest, "files": dict(files),
                             "summary": dict(summary or {})})


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping) and data:
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def describe_changes(old: Mapping[str, Any], new: Mapping[str, Any], limit: int = 3) -> list[str]:
    """``"trainer.learning_rate changed 0.0001 -> 0.0005"`` for each differing setting (at most ``limit``
    named, then a count)."""
    a, b = _flat(old), _flat(new)
    keys = sorted(set(a) | set(b), key=lambda k: (k not in b, k))
    changes = []
    for k in keys:
        if k not in a:
            changes.append(f"{k} set to {_short(b[k])}")
        elif k not in b:
            changes.append(f"{k} removed (was {_short(a[k])})")
        elif a[k] != b[k]:
            changes.append(f"{k} changed {_short(a[k])} -> {_short(b[k])}")
    if len(changes) > limit:
        changes = [*changes[:limit], f"{len(changes) - limit} more setting(s) changed"]
    return changes


def why_stale(state: Mapping[str, Any] | None, fp: Fingerprint, base: Path, *, output_exists: bool) -> str | None:
    """Why the output recorded by ``state`` does not answer ``fp`` (None: it does and is intact)."""
    if state is None:
        return ("no finished output (an earlier run stopped before recording one)" if output_exists
                else "not built yet")
    if state["fingerprint"] != fp.digest:
        reasons = describe_changes(state.get("params", {}), fp.params)
        code = sorted(k for k in set(state.get("code", {})) | set(fp.code)
                      if state.get("code", {}).get(k) != fp.code.get(k))
        if code:
            reasons.append("code changed: " + ", ".join(code[:3]) + (f" (+{len(code) - 3})" if len(code) > 3 else ""))
        inputs = sorted(k for k in set(state.get("inputs", {})) | set(fp.inputs)
                        if state.get("inputs", {}).get(k) != fp.inputs.get(k))
        if inputs:
            reasons.append("input " + ", ".join(inputs[:3]) + (f" (+{len(inputs) - 3})" if len(inputs) > 3 else "")
                           + " changed")
        return "; ".join(reasons) or "request changed"
    for rel, size in (state.get("files") or {}).items():
        p = base / rel
        if not p.is_file():
            return f"output file {rel} is missing"
        if p.stat().st_size != size:
            return f"output file {rel} changed size ({size} -> {p.stat().st_size} bytes)"
    return None
