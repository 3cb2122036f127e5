"""User ids for sandboxes, leased machine-wide: each :class:`~vpo.sandbox.Sandbox` instance holds
its own block of ids, so sandboxes of two concurrent stages (or two copies of the test suite)
never share a uid, and nothing of one can be mistaken for the other's.

A block is held by a ``filelock`` lock file in a machine-wide directory. The kernel drops the lock
when its holder's process dies, so a crashed holder's block is free again at once; a live holder
releases it on :meth:`UidLease.release` (a sandbox's ``close()``). Only a sandbox started as root
switches user ids, so only it needs a lease (and ``filelock``).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["BLOCK", "BLOCKS", "UidLease", "lease_dir"]

BLOCK = 1024  # ids per instance: one per fork-server slot
BLOCKS = 1024  # blocks after the configured base id (BLOCK * BLOCKS = 2**20 ids)


def lease_dir() -> Path:
    """The machine-wide directory of lease files: ``/run/vpo-sandbox`` (root), else
    ``<tmp>/vpo-sandbox-<uid>``."""
    if os.geteuid() == 0 and os.access("/run", os.W_OK):
        return Path("/run/vpo-sandbox")
    return Path(tempfile.gettempdir()) / f"vpo-sandbox-{os.geteuid()}"


class UidLease:
    """An exclusive block of ``BLOCK`` user ids starting at ``first``, held until released or
    until this process exits."""

    def __init__(self, base: int, directory: Path | None = None) -> None:
        if not 0 < base or base + BLOCK * BLOCKS >= 2**32 - 1:
            raise ValueError(f"uid_base {base} leaves no room for {BLOCK * BLOCKS} user ids below 2**32 - 1")
        from filelock import (  # only needed as root: the rest of the sandbox is standard library
            FileLock,
            Timeout,
        )

        self.directory = directory or lease_dir()
        self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        start = secrets.randbelow(BLOCKS)  # spread concurrent instances so they rarely probe the same files
        for k in range(BLOCKS):
            index = (start + k) % BLOCKS
            lock = FileLock(self.directory / f"uids-{base}-{index}.lock", timeout=0, thread_local=False,
                            fallback_to_soft=False)
            try:
                lock.acquire()
            except Timeout:
                continue
            self._lock: Any = lock
            self.index = index
            self.first = base + index * BLOCK
            return
        raise RuntimeError(f"all {BLOCKS} blocks of sandbox user ids from {base} are leased (in {self.directory})")

    @property
    def ids(self) -> range:
        return range(self.first, self.first + BLOCK)

    def release(self) -> None:
        """Give the block back (idempotent)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release(force=True)
