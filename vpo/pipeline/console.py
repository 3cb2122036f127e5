"""What the pipeline prints: one line per event, prefixed so it stands out from library output."""

from __future__ import annotations

__all__ = ["log"]


def log(msg: str) -> None:
    """Print one pipeline line (flushed, so logs interleave correctly with subprocess output)."""
    print(f"[vpo] {msg}", flush=True)
