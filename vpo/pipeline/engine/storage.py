"""Storage plumbing shared by every stage: S3 settings from one set of env vars and secret
redaction for logs and artifacts (atomic file and folder writes are :mod:`vpo.atomic`).

One set of environment variables configures every S3 client in the project:

* ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and optional ``AWS_SESSION_TOKEN``),
* ``AWS_ENDPOINT_URL`` for an S3-compatible server (MinIO, moto); unset means AWS itself.

s3fs gets them through :func:`s3_storage_options`, DVC reads the same variables itself (remotes
are configured with a URL only, see :func:`configure_dvc_remote`), and Prefect's
``RemoteFileSystem(basepath="s3://...")`` block goes through s3fs, so it needs no stored keys.
No region is passed to s3fs: with an explicit ``region_name`` s3fs sends a LocationConstraint
when creating buckets, which S3-compatible servers reject; botocore still honours
``AWS_DEFAULT_REGION`` from the environment.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RedactingFilter",
    "S3Settings",
    "StorageError",
    "configure_dvc_remote",
    "get_filesystem",
    "install_redaction",
    "is_s3_url",
    "redact",
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
        from vpo.pipeline.engine.console import tool

        raise StorageError(f"{repo} is not a DVC repository (no .dvc/ folder); run `{tool('dvc', 'init')}` in it first")
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
