"""Where the registry keeps what DVC does not: entry files and model cards, in a local folder or an
``s3://`` prefix (no weights: DVC's cache and remote hold them)::

    entries/<artifact>/<hash>.json   one per (artifact, content hash), written after its card
    entries/<artifact>/<hash>.md     the model card (also written into the model folder)
    stages/<artifact>/<stage>.json   a stage, only where no git tag could be written

Each file is replaced whole (temp + rename locally, one PUT on S3). A storage fault (an unreachable
endpoint, refused credentials) is one :class:`RegistryError` line. An older registry
(``entries/<hash>.json``, ``objects/``, ``aliases/``) is moved into this layout by :meth:`Store.migrate`;
its weight copies stay in ``objects/``, where its migrated entries fetch from.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from vpo.atomic import atomic_write_bytes
from vpo.pipeline.engine.console import command
from vpo.pipeline.engine.errors import disk_full, full_disk_text
from vpo.pipeline.engine.storage import StorageError, get_filesystem, is_s3_url, redact, secret_values
from vpo.pipeline.registry.entries import (
    HEX64,
    Entry,
    RegistryDiskFull,
    RegistryError,
    StorageUnavailableError,
    artifact_name,
)

__all__ = ["Store", "now"]

log = logging.getLogger(__name__)
STALE_TEMP_S = 600.0  # a temp file older than this belongs to a killed writer, not a running one


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
        self.url, self.remote = str(url), is_s3_url(url)
        with self.guard("open"):
            self.fs, self.root = get_filesystem(self.url)

    @contextlib.contextmanager
    def guard(self, doing: str) -> Iterator[None]:
        """Turn a storage fault (botocore's included) into one line naming the registry and the step."""
        try:
            yield
        except (RegistryError, FileNotFoundError):
            raise
        except OSError as exc:
            if disk_full(exc)[0] and not self.remote:
                raise RegistryDiskFull(f"registry {self.url}: could not {doing}: {full_disk_text(Path(self.root))}; "
                                       "free space there and run the command again", self.root) from None
            raise self._unavailable(doing, exc) from None
        except _faults() as exc:
            raise self._unavailable(doing, exc) from None

    def _unavailable(self, doing: str, exc: BaseException) -> StorageUnavailableError:
        first = redact((str(exc).strip().splitlines() or [""])[0][:200])
        return StorageUnavailableError(f"registry {redact(self.url)}: could not {doing} ({type(exc).__name__}: "
                                       f"{first}); check the storage is reachable and run the command again")

    def exists(self) -> bool:
        """Whether anything is at the registry's URL (a folder, or objects under the S3 prefix)."""
        with self.guard("look it up"):
            return bool(self.fs.exists(self.root))

    def _put(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data) if self.remote else atomic_write_bytes(path, data)

    def _files(self, folder: str) -> Iterator[tuple[str, tuple[str, ...]]]:
        """(full path, parts relative to the root) of every visible file under ``folder``."""
        try:
            found = sorted(str(p) for p in self.fs.find(f"{self.root}/{folder}"))
        except FileNotFoundError:
            found = []
        for full in found:
            parts = PurePosixPath(full[len(self.root):].lstrip("/")).parts
            if not parts[-1].startswith("."):
                yield full, parts

    def entries(self) -> tuple[list[Entry], list[str]]:
        """Every readable entry (oldest first) and one line per file that could not be read."""
        entries, bad, legacy = [], [], 0
        with self.guard("list its entries"):
            for full, parts in self._files("entries"):
                legacy += len(parts) == 2 and parts[1].endswith(".json")
                if len(parts) != 3 or not parts[2].endswith(".json"):
                    continue
                try:
                    entry = Entry.from_dict(json.loads(self.fs.cat_file(full)), self.url)
                    if (entry.artifact, entry.hash) != (parts[1], parts[2][:-5]):
                        raise RegistryError(f"it holds entry {entry.label}")
                    entries.append(entry)
                except (RegistryError, ValueError, UnicodeDecodeError) as exc:
                    bad.append(f"entry file {'/'.join(parts)} is unreadable ({exc})")
        if legacy:
            bad.append(f"{legacy} entries in an older registry layout: run `{command('registry', 'migrate', '--registry', redact(self.url))}` "
                       "to read them")
        return sorted(entries, key=lambda e: (e.created_at, e.artifact, e.hash)), bad

    def read(self, artifact: str, digest: str) -> Entry | None:
        """The entry of ``artifact`` with content ``digest``; None when there is none or it is unreadable."""
        with self.guard(f"read entry {artifact} {digest[:12]}"):
            try:
                return Entry.from_dict(json.loads(self.fs.cat_file(f"{self.root}/entries/{artifact}/{digest}.json")),
                                       self.url)
            except (FileNotFoundError, RegistryError, ValueError, UnicodeDecodeError):
                return None  # an unreadable entry is replaced by the registration that asked

    def write(self, entry: Entry, card: str) -> None:
        """Write the card, then the entry (an entry never exists without its card); secrets masked."""
        text = json.dumps(entry.to_dict(), indent=2, sort_keys=True, default=str) + "\n"
        if secret_values() and redact(text) != text:
            log.warning("entry %s contained secret values from the environment; they were masked", entry.label)
        base = f"{self.root}/entries/{entry.artifact}/{entry.hash}"
        with self.guard(f"write entry {entry.label}"):
            self._put(f"{base}.md", redact(card).encode())
            self._put(f"{base}.json", redact(text).encode())

    def card(self, entry: Entry) -> str | None:
        with self.guard(f"read the card of {entry.label}"):
            try:
                return self.fs.cat_file(f"{self.root}/entries/{entry.artifact}/{entry.hash}.md").decode()
            except FileNotFoundError:
                return None

    def stages(self) -> dict[tuple[str, str], dict[str, Any]]:
        """``{(artifact, stage): record}`` of the stages kept here."""
        out = {}
        with self.guard("read its stage records"):
            for full, parts in self._files("stages"):
                with contextlib.suppress(ValueError, UnicodeDecodeError, FileNotFoundError):
                    rec = json.loads(self.fs.cat_file(full))
                    if len(parts) == 3 and isinstance(rec, dict) and HEX64.match(str(rec.get("hash"))):
                        out[(parts[1], parts[2].removesuffix(".json"))] = rec
        return out

    def set_stage(self, artifact: str, stage: str, digest: str | None, why: str = "") -> None:
        """Record ``artifact`` content ``digest`` at ``stage`` (``digest`` None removes the record)."""
        path = f"{self.root}/stages/{artifact}/{stage}.json"
        with self.guard(f"record stage {stage} of {artifact}"):
            if digest is None:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)
            else:
                self._put(path, json.dumps({"hash": digest, "set_at": now(), "why": why}, indent=2).encode())

    def clean_temps(self) -> list[str]:
        """Delete temps killed writers left in a local registry (an older layout's object temps too);
        young ones are left alone: they may belong to a writer that is still running."""
        removed = []
        with self.guard("clean up temp files"):
            for full in [] if self.remote else self.fs.find(self.root, withdirs=True):
                name = PurePosixPath(str(full)).name
                if name.startswith(".") and (".tmp-" in name or ".old-" in name):
                    with contextlib.suppress(FileNotFoundError):
                        if self.fs.info(full)["mtime"] < time.time() - STALE_TEMP_S:
                            self.fs.rm(full, recursive=True)
                            removed.append(str(full)[len(self.root):].lstrip("/"))
        return removed

    def migrate(self) -> list[str]:
        """Move an older layout's entries and aliases (to stage records) into this one; one line each."""
        from vpo.pipeline.registry.hub import model_card

        done = []
        with self.guard("migrate it"):
            for full, parts in self._files("entries"):
                if len(parts) == 2 and HEX64.match(parts[1].removesuffix(".json")):
                    data = json.loads(self.fs.cat_file(full))
                    entry = Entry.from_dict({**data, "objects": f"objects/{data['hash']}"}, self.url)
                    self.write(entry, model_card(entry))
                    self.fs.rm_file(full)
                    done.append(f"entry {entry.label} (its weights stay in objects/{entry.hash[:12]}…)")
            entries = self.entries()[0]
            for full, parts in self._files("aliases"):
                rec, name, stage = json.loads(self.fs.cat_file(full)), parts[1], parts[2].removesuffix(".json")
                owner = next((e.artifact for e in entries if e.hash == rec.get("hash") and e.name == name), None)
                artifact = owner or artifact_name(name, None)
                self.set_stage(artifact, stage, rec["hash"], f"migrated alias {name}@{stage}")
                self.fs.rm_file(full)
                done.append(f"alias {name}@{stage} -> stage {stage} of {artifact}")
        return done
