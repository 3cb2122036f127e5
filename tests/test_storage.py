"""vpo.pipeline.engine.storage: one set of AWS_* env vars for s3fs/DVC, secret redaction, and atomic writes that
leave the old or the new artifact after an injected crash, never a torn one."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vpo import atomic
from vpo.atomic import (
    atomic_dir,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    remove_stale_temps,
)
from vpo.pipeline.engine.storage import (
    RedactingFilter,
    S3Settings,
    StorageError,
    configure_dvc_remote,
    get_filesystem,
    install_redaction,
    redact,
    s3_storage_options,
    scan_for_secrets,
    subprocess_env,
)

REPO = Path(__file__).resolve().parents[1]
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
TOKEN = "IQoJb3JpZ2luX2VjEXAMPLETOKEN0123456789"


@pytest.fixture
def fake_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE12345")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


# --------------------------------------------------------------------------- S3 settings


def test_s3_options_come_from_env_without_region(fake_keys: None) -> None:
    opts = s3_storage_options()
    assert opts["key"] == "AKIAEXAMPLE12345" and opts["secret"] == SECRET and opts["token"] == TOKEN
    assert opts["client_kwargs"] == {"endpoint_url": "http://127.0.0.1:9"}
    assert "region_name" not in json.dumps(opts)  # s3fs + region breaks bucket creation on S3-compatibles
    assert opts["use_listings_cache"] is False


def test_s3_options_half_a_key_pair_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE12345")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with pytest.raises(StorageError, match="AWS_SECRET_ACCESS_KEY is not set"):
        s3_storage_options()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    assert s3_storage_options() == {"use_listings_cache": False}  # default AWS credential chain


def test_settings_repr_never_shows_secrets(fake_keys: None) -> None:
    text = repr(S3Settings.from_env()) + str(S3Settings.from_env())
    assert SECRET not in text and TOKEN not in text and "AKIAEXAMPLE12345" not in text
    assert "http://127.0.0.1:9" in text


def test_filesystem_local_and_s3_round_trip(tmp_path: Path, s3_server, s3_bucket: str) -> None:
    fs, root = get_filesystem(tmp_path / "x")
    fs.pipe_file(f"{root}/a.txt", b"local")
    assert (tmp_path / "x" / "a.txt").read_bytes() == b"local"
    fs, root = get_filesystem(f"s3://{s3_bucket}/prefix/")
    assert root == f"{s3_bucket}/prefix"
    fs.pipe_file(f"{root}/a.txt", b"remote")
    obj = s3_server.client().get_object(Bucket=s3_bucket, Key="prefix/a.txt")
    assert obj["Body"].read() == b"remote"
    with pytest.raises(StorageError, match="unsupported storage URL"):
        get_filesystem("gs://bucket/x")


def test_subprocess_env_carries_credentials_and_quiet_defaults(
    fake_keys: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DVC_NO_ANALYTICS", raising=False)
    env = subprocess_env(EXTRA="1")
    assert env["AWS_SECRET_ACCESS_KEY"] == SECRET and env["DVC_NO_ANALYTICS"] == "1" and env["EXTRA"] == "1"


# --------------------------------------------------------------------------- DVC remote


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("dvc") / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    dvc = Path(sys.executable).with_name("dvc")
    subprocess.run([str(dvc), "init", "-q"], cwd=repo, check=True, env=subprocess_env())
    return repo


def test_dvc_remote_url_only_no_secrets_in_tracked_files(
    dvc_repo: Path, fake_keys: None, tmp_path: Path
) -> None:
    configure_dvc_remote(dvc_repo, "s3://vpo-bucket/dvc")
    tracked = (dvc_repo / ".dvc" / "config").read_text()
    local = (dvc_repo / ".dvc" / "config.local").read_text()
    assert "vpo-bucket" not in tracked  # machine-specific remote stays in the git-ignored file
    assert "url = s3://vpo-bucket/dvc" in local and "remote = storage" in local
    assert "/config.local" in (dvc_repo / ".dvc" / ".gitignore").read_text()
    assert scan_for_secrets([dvc_repo / ".dvc"]) == []
    configure_dvc_remote(dvc_repo, str(tmp_path / "remote"), name="shared", default=False, local=False)
    assert f"url = {tmp_path / 'remote'}" in (dvc_repo / ".dvc" / "config").read_text()
    assert (tmp_path / "remote").is_dir()


def test_dvc_remote_refuses_credentials_and_non_repos(dvc_repo: Path, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="embeds credentials"):
        configure_dvc_remote(dvc_repo, "s3://key:secret@bucket/dvc")
    with pytest.raises(StorageError, match="not a DVC repository"):
        configure_dvc_remote(tmp_path, "s3://bucket/dvc")


# --------------------------------------------------------------------------- redaction


def test_redact_masks_env_secrets_and_url_credentials(
    fake_keys: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("VPO_RUN_NAME", "nightly-run")
    text = f"key={SECRET} tok={TOKEN} hf=hf_abcdefghijklmnop id=AKIAEXAMPLE12345 url=https://u:p4ss@host/x run=nightly-run false"
    out = redact(text)
    for secret in (SECRET, TOKEN, "hf_abcdefghijklmnop", "AKIAEXAMPLE12345", "p4ss"):
        assert secret not in out
    assert "https://***:***@host/x" in out and "nightly-run" in out and out.endswith("false")


def test_redacting_filter_masks_messages_args_and_tracebacks(fake_keys: None) -> None:
    logger = logging.getLogger("vpo.test.redact")
    logger.propagate = False
    stream_path = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            stream_path.append(self.format(record))

    handler = Capture()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    try:
        install_redaction(logger)
        install_redaction(logger)  # idempotent
        assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
        logger.warning("connecting with %s", SECRET)
        try:
            raise RuntimeError(f"auth failed for {TOKEN}")
        except RuntimeError:
            logger.exception("upload failed")
    finally:
        logger.removeHandler(handler)
    joined = "\n".join(stream_path)
    assert "connecting with ***" in joined and "auth failed for ***" in joined
    assert SECRET not in joined and TOKEN not in joined


def test_scan_for_secrets_finds_planted_value(fake_keys: None, tmp_path: Path) -> None:
    (tmp_path / "clean.json").write_text('{"endpoint": "http://127.0.0.1:9"}')
    nested = tmp_path / "a" / "b.log"
    nested.parent.mkdir()
    nested.write_text(f"oops {SECRET}")
    hits = scan_for_secrets([tmp_path])
    assert [h[0] for h in hits] == [str(nested)]
    assert SECRET not in repr(hits)


# --------------------------------------------------------------------------- atomic files


def test_atomic_write_helpers(tmp_path: Path) -> None:
    p = tmp_path / "deep" / "m.json"
    atomic_write_json(p, {"b": 1, "a": [1.5]})
    assert p.read_text() == '{\n  "a": [\n    1.5\n  ],\n  "b": 1\n}\n'
    atomic_write_text(p, "new")
    assert p.read_text() == "new"
    atomic_write_bytes(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01" and siblings(p) == []


def test_atomic_write_crash_keeps_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "metrics.json"
    atomic_write_text(p, "old")

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full (injected)")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="injected"):
        atomic_write_text(p, "new" * 1000)
    assert p.read_text() == "old" and siblings(p) == []


def test_atomic_dir_creates_replaces_and_rolls_back(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "a.bin").write_bytes(b"v1")
        assert not target.exists()  # invisible until the block finishes
    assert (target / "a.bin").read_bytes() == b"v1"
    with atomic_dir(target) as tmp:
        (tmp / "b.bin").write_bytes(b"v2")
    assert sorted(p.name for p in target.iterdir()) == ["b.bin"]
    with pytest.raises(RuntimeError, match="crash"), atomic_dir(target) as tmp:
        (tmp / "c.bin").write_bytes(b"partial")
        raise RuntimeError("crash mid-write (injected)")
    assert sorted(p.name for p in target.iterdir()) == ["b.bin"] and siblings(target) == []
    with pytest.raises(FileExistsError), atomic_dir(target, overwrite=False) as tmp:
        (tmp / "d.bin").write_bytes(b"x")
    assert siblings(target) == []


def test_atomic_dir_portable_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target = tmp_path / "out"
    for version in (b"1", b"2"):
        with atomic_dir(target) as tmp:
            (tmp / "f").write_bytes(version)
    assert (target / "f").read_bytes() == b"2" and siblings(target) == []


def test_atomic_dir_survives_sigkill_mid_write(tmp_path: Path) -> None:
    """A writer killed inside the block leaves the previous version intact (only a stale temp)."""
    target = tmp_path / "artifact"
    with atomic_dir(target) as tmp:
        (tmp / "data.txt").write_text("old")
    marker = tmp_path / "writing"
    code = textwrap.dedent(
        f"""
        import time, pathlib
        from vpo.atomic import atomic_dir
        with atomic_dir({str(target)!r}) as tmp:
            (tmp / "data.txt").write_text("new-but-unfinished")
            pathlib.Path({str(marker)!r}).touch()
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        deadline = time.time() + 30
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "writer did not start"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert (target / "data.txt").read_text() == "old"
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".artifact.tmp-")]
    assert len(stale) == 1
    assert remove_stale_temps(target, older_than_s=3600) == []  # young: may belong to a live writer
    assert remove_stale_temps(target, older_than_s=0) == stale
    assert siblings(target) == ["writing"]


def test_published_files_and_folders_follow_the_umask(tmp_path: Path) -> None:
    """Atomic writes publish with the umask's usual modes (mkstemp/mkdtemp alone give 0600/0700)."""
    import os

    old = os.umask(0o022)
    try:
        f = atomic_write_json(tmp_path / "a.json", {"x": 1})
        with atomic_dir(tmp_path / "folder") as tmp:
            (tmp / "inner.txt").write_text("x")
        os.umask(0o027)
        g = atomic_write_text(tmp_path / "b.txt", "y")
    finally:
        os.umask(old)
    assert (f.stat().st_mode & 0o777, (tmp_path / "folder").stat().st_mode & 0o777) == (0o644, 0o755)
    assert g.stat().st_mode & 0o777 == 0o640
