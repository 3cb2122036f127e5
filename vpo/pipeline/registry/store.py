"""Where the registry keeps what DVC does not: small entry files and model cards, in a local folder
or an ``s3://`` prefix. No weights are stored here: DVC's cache and remote hold them.

Layout under the registry URL::

    entries/<artifact>/<hash>.json   one per (artifact, content hash), written after its card
    entries/<artifact>/<hash>.md     the model card (also written into the model folder)
    stages/<artifact>/<stage>.json   a stage kept here only when no git tag could be written

Each file is replaced whole (temp + rename locally, one PUT on S3): readers see the old or the new
one. Storage faults (an unreachable S3 endpoint, refused credentials) become one
:class:`RegistryError` line. An older registry (``entries/<hash>.json``, ``objects/``, ``aliases/``)
is read by :meth:`Store.migrate`, which moves its entries and aliases into this layout; its weight
copies stay under ``objects/`` and are what a migrated entry fetches from.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any

from vpo.atomic import atomic_write_bytes
from vpo.pipeline.registry.entries import HEX64, Entry, RegistryError, artifact_name
from vpo.pipeline.storage import StorageError, get_filesystem, is_s3_url, redact, secret_values

__all__ = ["Store", "now"]

log = logging.getLogger(__name__)
STALE_TEMP_S = 600.0  # a temp file older than this belongs to a killed writer


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _faults() -> tuple[type[BaseException], ...]:
    kinds: list[type[BaseException]] = [OSError, StorageError, TimeoutError]
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError, ClientError

        kinds += [BotoCoreError, ClientError]
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError as HttpError

        kinds.append(HttpError)
    return tuple(kinds)


class Store:
    """The registry folder or S3 prefix: entries, cards and stage records."""

    def __init__(self, url: str) -> None:
        self.url = str(url)
        self.remote = is_s3_url(self.url)
        with self.guard("open"):
            self.fs, self.root = get_filesystem(self.url)

    @contextlib.contextmanager
    def guard(self, doing: str) -> Iterator[None]:
        """Turn a storage fault into one :class:`RegistryError` line naming the registry and what failed."""
        try:
            yield
        except (RegistryError, FileNotFoundError):
            raise
        except _faults() as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise RegistryError(f"registry {redact(self.url)}: could not {doing} ({exc.__class__.__name__}: "
                                f"{redact(first)}); check the storage is reachable and run the command again") from None

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _put(self, path: str, data: bytes) -> None:
        if self.remote:
            self.fs.pipe_file(path, data)
        else:
            atomic_write_bytes(path, data)

    def _json(self, path: str) -> Any:
        return json.loads(self.fs.cat_file(path))

    # -- entries and cards --------------------------------------------------------------------
    def entries(self) -> tuple[list[Entry], list[str]]:
        """Every readable entry, oldest first, and one line per file that could not be read."""
        entries, bad = [], []
        with self.guard("list its entries"):
            try:
                found = sorted(str(p) for p in self.fs.find(self._path("entries")))
            except FileNotFoundError:
                found = []
            legacy = 0
            for full in found:
                parts = PurePosixPath(full[len(self.root):].lstrip("/")).parts
                if len(parts) == 2 and parts[1].endswith(".json"):
                    legacy += 1
                if len(parts) != 3 or not parts[2].endswith(".json") or parts[2].startswith("."):
                    continue
                try:
                    entry = Entry.from_dict(self._json(full), self.url)
                    if (entry.artifact, entry.hash) != (parts[1], parts[2][:-5]):
                        raise RegistryError(f"it holds entry {entry.label}")
                    entries.append(entry)
                except (RegistryError, ValueError, UnicodeDecodeError) as exc:
                    bad.append(f"entry file {'/'.join(parts)} is unreadable ({exc})")
        if legacy:
            bad.append(f"{legacy} entries in an older registry layout: run `vpo registry migrate` to read them")
        return sorted(entries, key=lambda e: (e.created_at, e.artifact, e.hash)), bad

    def read(self, artifact: str, digest: str) -> Entry | None:
        """The entry of ``artifact`` with content ``digest``, None if there is none or it is unreadable."""
        with self.guard(f"read entry {artifact} {digest[:12]}"):
            try:
                return Entry.from_dict(self._json(self._path("entries", artifact, f"{digest}.json")), self.url)
            except FileNotFoundError:
                return None
            except (RegistryError, ValueError, UnicodeDecodeError):
                return None  # an unreadable entry is replaced by the registration that asked

    def write(self, entry: Entry, card: str) -> None:
        """Write the card, then the entry (an entry exists only with its card)."""
        text = json.dumps(entry.to_dict(), indent=2, sort_keys=True, default=str) + "\n"
        if secret_values() and redact(text) != text:
            log.warning("entry %s contained secret values from the environment; they were masked", entry.label)
            text = redact(text)
        base = self._path("entries", entry.artifact, entry.hash)
        with self.guard(f"write entry {entry.label}"):
            self._put(f"{base}.md", redact(card).encode())
            self._put(f"{base}.json", text.encode())

    def card(self, entry: Entry) -> str | None:
        """The stored model card of ``entry`` (None when it has none)."""
        with self.guard(f"read the card of {entry.label}"):
            try:
                return self.fs.cat_file(self._path("entries", entry.artifact, f"{entry.hash}.md")).decode()
            except FileNotFoundError:
                return None

    # -- stage records (only where git tags cannot be written) ---------------------------------
    def stages(self) -> dict[tuple[str, str], dict[str, Any]]:
        """``{(artifact, stage): record}`` of the stages kept here."""
        out = {}
        with self.guard("read its stage records"):
            try:
                found = sorted(str(p) for p in self.fs.find(self._path("stages")))
            except FileNotFoundError:
                found = []
            for full in found:
                parts = PurePosixPath(full[len(self.root):].lstrip("/")).parts
                if len(parts) == 3 and parts[2].endswith(".json") and not parts[2].startswith("."):
                    with contextlib.suppress(ValueError, UnicodeDecodeError, FileNotFoundError):
                        rec = self._json(full)
                        if isinstance(rec, dict) and HEX64.match(str(rec.get("hash"))):
                            out[(parts[1], parts[2][:-5])] = rec
        return out

    def set_stage(self, artifact: str, stage: str, digest: str | None, why: str = "") -> None:
        """Record ``artifact`` at ``stage`` (``digest`` None removes the record)."""
        path = self._path("stages", artifact, f"{stage}.json")
        with self.guard(f"record stage {stage} of {artifact}"):
            if digest is None:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)
            else:
                self._put(path, json.dumps({"hash": digest, "set_at": now(), "why": why}, indent=2).encode())

    # -- housekeeping -------------------------------------------------------------------------
    def clean_temps(self) -> list[str]:
        """Delete temp files killed writers left in a local registry (older ones only: a young one may
        belong to a writer that is still running), including an older layout's object temps."""
        if self.remote:
            return []
        removed = []
        with self.guard("clean up temp files"):
            for full in self.fs.find(self.root, withdirs=True):
                name = PurePosixPath(str(full)).name
                if name.startswith(".") and (".tmp-" in name or ".old-" in name):
                    with contextlib.suppress(FileNotFoundError):
                        if self.fs.info(full)["mtime"] < time.time() - STALE_TEMP_S:
                            self.fs.rm(full, recursive=True)
                            removed.append(str(full)[len(self.root):].lstrip("/"))
        return removed

    def migrate(self) -> list[str]:
        """Move entries and aliases of the older layout into this one; returns one line per item moved."""
        done = []
        with self.guard("migrate it"):
            try:
                old = [str(p) for p in self.fs.ls(self._path("entries"), detail=False)]
            except FileNotFoundError:
                old = []
            for full in sorted(p for p in old if p.endswith(".json") and HEX64.match(PurePosixPath(p).name[:-5])):
                data = self._json(full)
                entry = Entry.from_dict({**data, "objects": f"objects/{data['hash']}"}, self.url)
                from vpo.pipeline.hub import model_card

                self.write(entry, model_card(entry))
                self.fs.rm_file(full)
                done.append(f"entry {entry.label} (weights stay in objects/{entry.hash[:12]}…)")
            try:
                aliases = sorted(str(p) for p in self.fs.find(self._path("aliases")))
            except FileNotFoundError:
                aliases = []
            entries = self.entries()[0]
            for full in aliases:
                parts = PurePosixPath(full[len(self.root):].lstrip("/")).parts
                rec = self._json(full)
                owners = [e.artifact for e in entries if e.hash == rec.get("hash") and e.name == parts[1]]
                artifact = owners[0] if owners else artifact_name(parts[1], None)
                self.set_stage(artifact, parts[2][:-5], rec["hash"], f"migrated alias {parts[1]}@{parts[2][:-5]}")
                self.fs.rm_file(full)
                done.append(f"alias {parts[1]}@{parts[2][:-5]} -> stage {parts[2][:-5]} of {artifact}")
        return done
