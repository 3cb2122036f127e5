"""Storage plumbing shared by every stage: S3 settings from one set of env vars, secret
redaction for logs and artifacts, and atomic file/directory writes.

One set of environment variables configures every S3 client in the project:

* ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and optional ``AWS_SESSION_TOKEN``),
* ``AWS_ENDPOINT_URL`` for an S3-compatible server (MinIO, moto); unset means AWS itself.

s3fs gets them through :func:`s3_storage_options`, DVC reads the same variables itself (remotes
are configured with a URL only, see :func:`configure_dvc_remote`), and Prefect's
``RemoteFileSystem(basepath="s3://...")`` block goes through s3fs, so it needs no stored keys.
No region is passed to s3fs: with an explicit ``region_name`` s3fs sends a LocationConstraint
when creating buckets, which S3-compatible servers reject; botocore still honours
``AWS_DEFAULT_REGION`` from the environment.

Atomic writes: every artifact is written to a temporary sibling and renamed into place, so a crash
leaves either the old or the new version, never a torn one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RedactingFilter",
    "S3Settings",
    "StorageError",
    "atomic_dir",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "configure_dvc_remote",
    "current_umask",
    "get_filesystem",
    "install_redaction",
    "is_s3_url",
    "redact",
    "remove_stale_temps",
    "remove_temps_in",
    "s3_storage_options",
    "scan_for_secrets",
    "secret_values",
    "subprocess_env",
]

log = logging.getLogger(__name__)

ENV_KEY = "AWS_ACCESS_KEY_ID"
ENV_SECRET = "AWS_SECRET_ACCESS_KEY"
ENV_TOKEN = "AWS_SESSION_TOKEN"
ENV_ENDPOINT = "AWS_ENDPOINT_URL"

# Name components that mark an environment variable as holding a secret.
_SECRET_NAME_PARTS = frozenset(
    {"SECRET", "TOKEN", "PASSWORD", "PASSWD", "KEY", "APIKEY", "CREDENTIALS", "CREDENTIAL", "PAT"}
)
_ALWAYS_SECRET = frozenset({ENV_KEY, ENV_SECRET, ENV_TOKEN})
_MIN_SECRET_LEN = 6  # shorter values ("true", "1") would mask ordinary words
_MASK = "***"
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@")


class StorageError(RuntimeError):
    """A storage location or its configuration is unusable (missing credentials, bad URL, DVC error)."""


# --------------------------------------------------------------------------- S3 settings


@dataclass(frozen=True)
class S3Settings:
    """The S3 connection settings read from the environment (values are secrets: never log them)."""

    access_key_id: str | None
    secret_access_key: str | None
    session_token: str | None
    endpoint_url: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Settings:
        """Read the ``AWS_*`` variables from ``env`` (default: ``os.environ``); empty counts as unset."""
        env = os.environ if env is None else env
        return cls(
            access_key_id=env.get(ENV_KEY) or None,
            secret_access_key=env.get(ENV_SECRET) or None,
            session_token=env.get(ENV_TOKEN) or None,
            endpoint_url=env.get(ENV_ENDPOINT) or None,
        )

    def missing(self) -> list[str]:
        """Names of the variables an explicit key pair still needs (empty when both or neither are set)."""
        if bool(self.access_key_id) == bool(self.secret_access_key):
            return []
        return [ENV_KEY] if not self.access_key_id else [ENV_SECRET]

    def __repr__(self) -> str:  # never print secret values, even by accident
        return (
            f"S3Settings(access_key_id={'set' if self.access_key_id else None}, "
            f"secret_access_key={'set' if self.secret_access_key else None}, "
            f"session_token={'set' if self.session_token else None}, endpoint_url={self.endpoint_url!r})"
        )


def s3_storage_options(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """fsspec/s3fs ``storage_options`` built from the ``AWS_*`` env vars (no region: see module doc).

    Listing caches are off so that existence checks (the registry verifies every object before it
    writes an entry) always ask the server.
    """
    s = S3Settings.from_env(env)
    if s.missing():
        raise StorageError(
            f"incomplete S3 credentials: {', '.join(s.missing())} is not set "
            f"(set both {ENV_KEY} and {ENV_SECRET}, or neither to use the default AWS chain)"
        )
    opts: dict[str, Any] = {"use_listings_cache": False}
    if s.access_key_id:
        opts["key"] = s.access_key_id
        opts["secret"] = s.secret_access_key
    if s.session_token:
        opts["token"] = s.session_token
    if s.endpoint_url:
        opts["client_kwargs"] = {"endpoint_url": s.endpoint_url}
    return opts


def is_s3_url(url: str | os.PathLike[str]) -> bool:
    """True for ``s3://`` URLs (the only remote scheme the project uses)."""
    return str(url).startswith("s3://")


def get_filesystem(url: str | os.PathLike[str]) -> tuple[Any, str]:
    """Return ``(fsspec filesystem, path within it)`` for a local path or an ``s3://`` URL."""
    import fsspec

    text = str(url)
    if is_s3_url(text):
        fs = fsspec.filesystem("s3", **s3_storage_options())
        return fs, text[len("s3://") :].rstrip("/")
    if "://" in text and not text.startswith("file://"):
        raise StorageError(
            f"unsupported storage URL {redact(text)!r}: use a local path or s3://bucket/prefix"
        )
    text = text.removeprefix("file://")
    return fsspec.filesystem("file", auto_mkdir=True), str(Path(text).expanduser().resolve())


def subprocess_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for child processes (dvc, stage CLIs): the current env (S3 keys included, so
    nothing needs writing to disk) plus quiet, offline-friendly defaults and ``extra``."""
    env = dict(os.environ if base is None else base)
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("GX_ANALYTICS_ENABLED", "False")
    env.update(extra)
    return env


def _dvc_executable() -> list[str]:
    exe = Path(sys.executable).with_name("dvc")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("dvc")
    if found:
        return [found]
    return [sys.executable, "-m", "dvc"]


def configure_dvc_remote(
    repo_dir: str | os.PathLike[str],
    url: str,
    *,
    name: str = "storage",
    default: bool = True,
    local: bool = True,
) -> None:
    """Point the DVC repo at ``url`` (local path or ``s3://``) as remote ``name``.

    Only the URL is written; credentials and the endpoint come from the ``AWS_*`` env vars, which
    dvc-s3 reads itself. ``local=True`` writes to the git-ignored ``.dvc/config.local`` so that
    machine-specific remotes never reach tracked files.
    """
    if _URL_CREDENTIALS.search(url):
        raise StorageError("refusing to write a remote URL that embeds credentials; use the AWS_* env vars")
    repo = Path(repo_dir)
    if not (repo / ".dvc").is_dir():
        raise StorageError(f"{repo} is not a DVC repository (no .dvc/ folder); run `dvc init` first")
    if not is_s3_url(url):
        if "://" in url:
            raise StorageError(f"unsupported DVC remote URL {url!r}: use a local path or s3://bucket/prefix")
        url = str(Path(url).expanduser().resolve())
        Path(url).mkdir(parents=True, exist_ok=True)
    cmd = [*_dvc_executable(), "remote", "add", "--force"]
    if local:
        cmd.append("--local")
    if default:
        cmd.append("--default")
    cmd += [name, url]
    proc = subprocess.run(cmd, cwd=repo, env=subprocess_env(), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise StorageError(
            f"`dvc remote add {name}` failed (rc={proc.returncode}): {redact(proc.stderr.strip())}"
        )


# --------------------------------------------------------------------------- redaction


def _is_secret_name(name: str) -> bool:
    if name in _ALWAYS_SECRET:
        return True
    return any(part in _SECRET_NAME_PARTS for part in name.upper().split("_"))


def secret_values(env: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    """Secret values currently in the environment (by variable name), longest first."""
    env = os.environ if env is None else env
    values = {v for k, v in env.items() if v and len(v) >= _MIN_SECRET_LEN and _is_secret_name(k)}
    values.update(v for v in extra if v and len(v) >= _MIN_SECRET_LEN)
    return sorted(values, key=len, reverse=True)


def redact(text: str, *, env: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> str:
    """Mask every secret value from the environment (and ``extra``) and URL-embedded credentials."""
    for value in secret_values(env, extra):
        if value in text:
            text = text.replace(value, _MASK)
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{_MASK}:{_MASK}@", text)


class RedactingFilter(logging.Filter):
    """Logging filter that renders each record and masks secrets in its message and traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record in place with secrets masked; never drops a record."""
        try:
            message = record.getMessage()
        except (TypeError, ValueError, KeyError):  # a broken format string: keep the raw template
            message = str(record.msg)
        record.msg = redact(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install_redaction(logger: logging.Logger | None = None) -> RedactingFilter:
    """Attach one :class:`RedactingFilter` to every handler of ``logger`` (default: root) and to the
    logger itself; handler filters also see records propagated from child loggers."""
    logger = logger or logging.getLogger()
    filt = next((f for f in logger.filters if isinstance(f, RedactingFilter)), None) or RedactingFilter()
    if filt not in logger.filters:
        logger.addFilter(filt)
    for handler in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(filt)
    return filt


def scan_for_secrets(
    paths: Iterable[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    extra: Iterable[str] = (),
) -> list[tuple[str, str]]:
    """Find files (recursing into folders) that contain a secret value; returns ``(path, masked hint)``
    pairs so a test or a pre-publish check can fail without printing the secret itself."""
    secrets = [v.encode() for v in secret_values(env, extra)]
    hits: list[tuple[str, str]] = []
    if not secrets:
        return hits
    for root in paths:
        root = Path(root)
        files = (
            [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
        )
        for f in files:
            data = f.read_bytes()
            for s in secrets:
                if s in data:
                    hits.append((str(f), f"{s[:2].decode(errors='replace')}…({len(s)} chars)"))
                    break
    return hits


# --------------------------------------------------------------------------- atomic writes


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every platform/filesystem
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def current_umask() -> int:
    """The process umask (read without changing it where /proc allows, so threads never see 0)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` via a temp sibling + ``os.replace``: readers see old or new bytes.
    The file gets the umask's usual mode (``mkstemp`` alone would make it 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(path.parent)
    return path


def atomic_write_text(
    path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8", fsync: bool = True
) -> Path:
    """Atomically write ``text`` (see :func:`atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode(encoding), fsync=fsync)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int = 2, fsync: bool = True) -> Path:
    """Atomically write ``obj`` as JSON with sorted keys (stable bytes, so DVC hashes are stable)."""
    text = json.dumps(obj, indent=indent, sort_keys=True, default=_json_default) + "\n"
    return atomic_write_text(path, text, fsync=fsync)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy scalars and arrays
        return obj.tolist()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str], *, overwrite: bool = True, fsync: bool = True) -> Iterator[Path]:
    """Build a directory atomically: yields a temp sibling to fill; on normal exit it replaces ``path``
    (on Linux by an atomic exchange, so a crash leaves the old or the new folder), on error it is
    deleted and ``path`` is untouched. ``overwrite=False`` refuses to replace an existing ``path``.
    """
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700; publish with mkdir's usual mode
    try:
        yield tmp
        if fsync:
            _fsync_tree(tmp)
        if path.exists() or path.is_symlink():
            if not overwrite:
                raise FileExistsError(f"{path} already exists (atomic_dir called with overwrite=False)")
            if _exchange(tmp, path):
                shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old version
            else:  # portable fallback: two renames (a crash in between leaves the old copy at .old-*)
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
                os.rmdir(old)
                os.rename(path, old)
                try:
                    os.rename(tmp, path)
                except BaseException:
                    os.rename(old, path)
                    raise
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        if fsync:
            _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_temps_in(folder: str | os.PathLike[str]) -> list[Path]:
    """Delete every temp left by a killed writer directly inside ``folder`` (``.NAME.tmp-*`` /
    ``.NAME.old-*``); call it only while holding the lock of the stage that writes there."""
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                removed.append(p)
    return removed


def remove_stale_temps(path: str | os.PathLike[str], *, older_than_s: float = 3600.0) -> list[Path]:
    """Delete temp siblings of ``path`` left by killed writers (``.NAME.tmp-*`` / ``.NAME.old-*``)
    older than ``older_than_s``; young ones may belong to a writer that is still running."""
    path = Path(path).absolute()
    removed: list[Path] = []
    if not path.parent.is_dir():
        return removed
    cutoff = time.time() - older_than_s
    for pattern in (f".{path.name}.tmp-*", f".{path.name}.old-*"):
        for p in path.parent.glob(pattern):
            try:
                if p.lstat().st_mtime > cutoff:
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
                removed.append(p)
            except FileNotFoundError:
                continue
    return removed
