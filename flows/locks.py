"""Exclusion across machines: Prefect global concurrency limits of one slot, one per thing protected.

A lock file says nothing to a worker on another machine, so what two machines could do at once
through the same Prefect server takes a slot of a named global concurrency limit (created on first
use with a limit of 1) for as long as it runs:

* ``vpo-train-<variant>-<run>``: one arm run trains in one place at a time (a second flow run that
  wants it fails at once, naming the limit; the local ``.locks/`` file lock still guards the folder);
* ``vpo-registry-<hash of the registry URL>``: registrations into one registry take turns.

Slots are leases the holder renews while it runs (:data:`LEASE_S`); a holder that dies without
releasing frees its slot when the lease expires, the cross-machine counterpart of a dead process's
``flock``. ``prefect gcl ls`` / ``prefect gcl inspect NAME`` show them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError  # what concurrency() raises
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from vpo.pipeline.engine.console import tool

__all__ = ["LEASE_S", "Busy", "exclusive", "limit_name", "registry_limit", "train_limit"]

LEASE_S = 60.0
"""How long a dead holder's slot stays taken (the holder renews it every ~45 s while alive)."""


class Busy(RuntimeError):
    """The limit's slot is taken: the same thing runs elsewhere."""


def limit_name(*parts: str) -> str:
    """``vpo-<parts>`` with characters a limit name allows (letters, digits, dashes, underscores)."""
    return "-".join(["vpo", *(re.sub(r"[^A-Za-z0-9_-]+", "-", p).strip("-") for p in parts)])


def train_limit(variant: str, run_id: str) -> str:
    """The limit of one arm run of a variant."""
    return limit_name("train", variant, run_id)


def registry_limit(registry_url: str) -> str:
    """The limit of one registry (by the hash of its URL: no bucket names in limit names)."""
    return limit_name("registry", hashlib.sha256(registry_url.encode()).hexdigest()[:16])


def _ensure(name: str) -> None:
    """Create the one-slot limit ``name`` unless it exists (two creators at once: one wins)."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass


@contextmanager
def exclusive(name: str, what: str, *, wait_s: float | None = 0.0) -> Iterator[None]:
    """Hold the one slot of limit ``name`` for the block. ``wait_s`` 0: raise :class:`Busy` at once when
    it is taken (``what`` is already running elsewhere); a number: wait that long; None: wait."""
    _ensure(name)
    try:
        ctx = concurrency(name, occupy=1, strict=True, lease_duration=LEASE_S,
                          max_retries=0 if wait_s == 0 else None,
                          timeout_seconds=None if not wait_s else wait_s)
        ctx.__enter__()
    except ConcurrencySlotAcquisitionError as exc:
        status = getattr(getattr(exc.__cause__, "response", None), "status_code", None)
        if status == 423:
            raise Busy(f"{what} is already running elsewhere (Prefect global concurrency limit {name!r} has "
                       f"no free slot; `{tool('prefect', 'gcl', 'inspect', name)}` shows it; a holder that died frees it "
                       f"within {LEASE_S:.0f} s)") from None
        raise
    except TimeoutError:
        raise Busy(f"{what} did not get its turn within {wait_s:.0f} s (Prefect global concurrency limit "
                   f"{name!r})") from None
    try:
        yield
    except BaseException as exc:
        ctx.__exit__(type(exc), exc, exc.__traceback__)
        raise
    else:
        ctx.__exit__(None, None, None)
