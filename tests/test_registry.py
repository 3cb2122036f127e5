"""Checkpoint registry on a local folder and on the loopback S3 server: content hashing, lineage,
entry-written-last atomicity under injected crashes, idempotence, verified fetch, no secrets."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

from vpo.pipeline import registry
from vpo.pipeline.registry import (
    IncompleteCheckpointError,
    RegistryError,
    check_checkpoint,
    fetch,
    get_entry,
    hash_checkpoint,
    list_entries,
    register,
    verify_entry,
)
from vpo.pipeline.storage import get_filesystem, scan_for_secrets


def make_checkpoint(root: Path, *, seed: int = 0, weights_size: int = 4096) -> Path:
    """A small but complete HF-style checkpoint folder (config, weights, tokenizer, nested file)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "tiny", "seed": seed}))
    (root / "model.safetensors").write_bytes(
        hashlib.sha256(str(seed).encode()).digest() * (weights_size // 32)
    )
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (root / "extra").mkdir(exist_ok=True)
    (root / "extra" / "trainer_state.json").write_text(json.dumps({"global_step": 10 + seed}))
    return root


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repo with a committed dvc.lock (the lineage sources)."""
    r = tmp_path / "repo"
    r.mkdir()
    (r / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@e",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@e",
    }
    subprocess.run(["git", "init", "-q"], cwd=r, check=True)
    subprocess.run(["git", "add", "dvc.lock"], cwd=r, check=True)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=r, check=True, env=env)
    return r


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


MODEL_FILES = {"config.json", "model.safetensors", "tokenizer_config.json"}  # of make_checkpoint


def stored_tree(ckpt: Path) -> dict[str, bytes]:
    """What the registry stores of ``ckpt``: its model files (no run-specific ones) and the card."""
    return {k: v for k, v in tree(ckpt).items() if k in MODEL_FILES}


# --------------------------------------------------------------------------- checkpoint checks


@pytest.mark.parametrize(
    ("breakage", "fragment"),
    [
        (lambda r: (r / "config.json").unlink(), "no model config"),
        (lambda r: (r / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        (lambda r: (r / "model.safetensors").unlink(), "no weights"),
        (lambda r: (r / "model.safetensors").write_bytes(b""), "empty weight files: model.safetensors"),
        (lambda r: (r / "tokenizer_config.json").unlink(), "no tokenizer files"),
        (
            lambda r: (r / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
            ),
            "lists missing shards: model-00001-of-00002.safetensors",
        ),
    ],
)
def test_incomplete_checkpoints_are_rejected_and_nothing_registered(
    tmp_path: Path, breakage, fragment: str
) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    breakage(ckpt)
    with pytest.raises(IncompleteCheckpointError, match=fragment) as err:
        register(tmp_path / "reg", ckpt, name="route", arm="vpo")
    assert str(ckpt) in str(err.value)
    assert not (tmp_path / "reg").exists()


def test_missing_folder_and_sharded_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(IncompleteCheckpointError, match="does not exist"):
        check_checkpoint(tmp_path / "nope")
    ckpt = make_checkpoint(tmp_path / "sharded")
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    check_checkpoint(ckpt)  # complete: the index's shard exists


def test_hash_covers_weight_and_tokenizer_files_only(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a")
    b = make_checkpoint(tmp_path / "b")
    digest, files = hash_checkpoint(a)
    assert digest == hash_checkpoint(b)[0] == registry.content_hash(a)  # same content elsewhere: same hash
    assert [f.path for f in files] == sorted(f.path for f in files)
    assert {(f.path, f.role) for f in files} == {
        ("config.json", "config"),
        ("model.safetensors", "weights"),
        ("tokenizer_config.json", "tokenizer"),
    }
    expected = hashlib.sha256()
    for f in files:
        if f.path != "config.json":
            expected.update(
                f"{f.path}\0{f.size}\0{hashlib.sha256((a / f.path).read_bytes()).hexdigest()}\n".encode()
            )
    assert digest == expected.hexdigest()  # the manifest of weights + tokenizer, nothing else
    (b / "extra" / "trainer_state.json").rename(b / "extra" / "state.json")
    (b / "training_args.bin").write_bytes(str(b).encode())  # run-specific: absolute path inside
    (b / "config.json").write_text(json.dumps({"model_type": "tiny", "seed": 0, "use_cache": False}))
    assert hash_checkpoint(b)[0] == digest  # run-specific files and the config are not hashed
    (b / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 65}))
    assert hash_checkpoint(b)[0] != digest  # the tokenizer is
    (a / "model.safetensors").rename(a / "model-00001-of-00001.safetensors")
    assert hash_checkpoint(a)[0] != digest  # a renamed weight file changes the hash
    c = make_checkpoint(tmp_path / "c")
    data = bytearray((c / "model.safetensors").read_bytes())
    data[100] ^= 1
    (c / "model.safetensors").write_bytes(bytes(data))
    assert hash_checkpoint(c)[0] != digest  # one flipped bit changes the hash


# --------------------------------------------------------------------------- local registry


def test_register_local_records_lineage_and_round_trips(tmp_path: Path, repo: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    reg = tmp_path / "registry"
    entry = register(
        reg,
        ckpt,
        name="route",
        arm="vpo",
        params={"trainer": {"steps": 4}},
        metrics={"best@5": 0.5},
        lineage={"dataset_md5": "abc", "seed": 0},
        repo_dir=repo,
    )
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert entry.hash == hash_checkpoint(ckpt)[0]
    assert entry.git_rev == head and entry.git_dirty is False
    assert entry.dvc_lock_sha256 == hashlib.sha256((repo / "dvc.lock").read_bytes()).hexdigest()
    assert entry.params == {"trainer": {"steps": 4}} and entry.metrics == {"best@5": 0.5}
    assert entry.lineage == {"dataset_md5": "abc", "seed": 0}
    card = (reg / "objects" / entry.hash / "README.md").read_bytes()
    assert entry.created_at.endswith("Z")
    assert entry.size_bytes == sum(len(b) for b in stored_tree(ckpt).values()) + len(card)
    assert entry.left_out == ("extra/trainer_state.json",)
    stored = json.loads((reg / "entries" / f"{entry.hash}.json").read_text())
    assert stored == entry.to_dict() and stored["schema"] == 2
    assert tree(reg / "objects" / entry.hash) == {**stored_tree(ckpt), "README.md": card}
    assert [e.hash for e in list_entries(reg)] == [entry.hash]
    assert list_entries(reg, arm="grpo") == [] and list_entries(reg, name="route", arm="vpo") == [entry]
    assert get_entry(reg, entry.hash[:8]) == entry
    verify_entry(entry)
    dest = fetch(get_entry(reg, entry.hash), tmp_path / "fetched")
    assert tree(dest) == {**stored_tree(ckpt), "README.md": card}
    assert fetch(entry, dest) == dest  # same content already there: no-op
    assert entry.summary()["metric.best@5"] == 0.5


def test_dirty_tree_and_no_git_are_recorded(tmp_path: Path, repo: Path) -> None:
    (repo / "dvc.lock").write_text("changed\n")
    e1 = register(tmp_path / "reg", make_checkpoint(tmp_path / "c1"), name="n", repo_dir=repo)
    assert e1.git_dirty is True
    plain = tmp_path / "plain"
    plain.mkdir()
    e2 = register(tmp_path / "reg", make_checkpoint(tmp_path / "c2", seed=2), name="n", repo_dir=plain)
    assert (e2.git_rev, e2.git_dirty, e2.dvc_lock_sha256) == (None, None, None)


def test_registering_twice_is_idempotent(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    first = register(reg, make_checkpoint(tmp_path / "a"), name="route", arm="grpo", metrics={"m": 1})
    again = register(reg, make_checkpoint(tmp_path / "b"), name="route", arm="grpo", metrics={"m": 2})
    assert again == first and again.metrics == {"m": 1} and again.created_at == first.created_at
    assert len(list((reg / "entries").iterdir())) == 1 and len(list((reg / "objects").iterdir())) == 1


def test_crash_while_copying_objects_registers_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    reg = tmp_path / "reg"
    real = registry._copy_verified
    calls = {"n": 0}

    def crash_on_second(src, rec, out):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("worker killed (injected)")
        return real(src, rec, out)

    monkeypatch.setattr(registry, "_copy_verified", crash_on_second)
    with pytest.raises(RegistryError, match="injected"):
        register(reg, ckpt, name="route", arm="vpo")
    assert list_entries(reg) == []
    assert not (reg / "objects").exists() or list((reg / "objects").iterdir()) == []  # temp dir removed
    monkeypatch.setattr(registry, "_copy_verified", real)
    entry = register(reg, ckpt, name="route", arm="vpo")
    verify_entry(entry)


def test_crash_before_entry_write_leaves_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    reg = tmp_path / "reg"

    def die(self, digest, text):
        raise KeyboardInterrupt("SIGINT before the entry (injected)")

    monkeypatch.setattr(registry._Store, "create_entry", die)
    with pytest.raises(KeyboardInterrupt):
        register(reg, ckpt, name="route")
    assert list_entries(reg) == [] and list((reg / "objects").iterdir())  # objects alone are not an entry
    monkeypatch.undo()
    assert register(reg, ckpt, name="route").hash == hash_checkpoint(ckpt)[0]
    assert [p.name for p in (reg / "entries").iterdir()] == [
        f"{hash_checkpoint(ckpt)[0]}.json"
    ]  # no temp left


def test_checkpoint_modified_during_registration_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    real_hash = registry._inspect

    def hash_then_writer_appends(path):
        out = real_hash(path)
        with open(Path(path) / "model.safetensors", "ab") as fh:  # the trainer is still writing
            fh.write(b"more")
        return out

    monkeypatch.setattr(registry, "_inspect", hash_then_writer_appends)
    with pytest.raises(RegistryError, match="changed while it was being registered"):
        register(tmp_path / "reg", ckpt, name="route")
    assert list_entries(tmp_path / "reg") == []


def test_fetch_detects_corrupt_and_missing_objects(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    entry = register(reg, make_checkpoint(tmp_path / "ckpt"), name="route")
    obj = reg / "objects" / entry.hash / "model.safetensors"
    good = obj.read_bytes()
    obj.write_bytes(b"X" + good[1:])  # same size, different bytes
    with pytest.raises(RegistryError, match="model.safetensors is corrupt"):
        fetch(entry, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    obj.unlink()
    with pytest.raises(RegistryError, match="model.safetensors is missing"):
        verify_entry(entry)
    with pytest.raises(RegistryError, match="is missing from the registry"):
        fetch(entry, tmp_path / "out")


def test_fetch_refuses_to_clobber_other_content(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    entry = register(reg, make_checkpoint(tmp_path / "ckpt"), name="route")
    other = make_checkpoint(tmp_path / "other", seed=5)
    with pytest.raises(RegistryError, match="already exists with other content"):
        fetch(entry, other)
    assert fetch(entry, other, overwrite=True) == other and hash_checkpoint(other)[0] == entry.hash


def test_get_entry_key_errors(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    e1 = register(reg, make_checkpoint(tmp_path / "a"), name="x")
    with pytest.raises(RegistryError, match=">= 6 hex digits"):
        get_entry(reg, "ab")
    with pytest.raises(RegistryError, match="no entry matching"):
        get_entry(reg, "ffffff" if not e1.hash.startswith("ffffff") else "000000")
    with pytest.raises(RegistryError, match="no entry"):
        get_entry(reg, "0" * 64 if e1.hash != "0" * 64 else "1" * 64)


def test_module_cli_lists_and_fetches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reg = tmp_path / "reg"
    entry = register(reg, make_checkpoint(tmp_path / "ckpt"), name="route", arm="vpo")
    assert registry.main(["list", "--registry", str(reg), "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip())
    assert row["hash"] == entry.hash[:12] and row["arm"] == "vpo"
    assert (
        registry.main(
            ["fetch", "--registry", str(reg), "--entry", entry.hash[:10], "--dest", str(tmp_path / "d")]
        )
        == 0
    )
    assert stored_tree(tmp_path / "d") == stored_tree(tmp_path / "ckpt")
    assert registry.main(["show", "--registry", str(reg), "--entry", "abcdef0"]) == 2
    assert "error: no entry matching" in capsys.readouterr().err


# --------------------------------------------------------------------------- S3 registry


def test_register_on_s3_round_trip_and_idempotent(tmp_path: Path, s3_server, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/registry"
    ckpt = make_checkpoint(tmp_path / "ckpt")
    entry = register(url, ckpt, name="route", arm="grpo_x3", metrics={"best@1": 0.25})
    client = s3_server.client()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == sorted(
        [f"registry/entries/{entry.hash}.json"]
        + [f"registry/objects/{entry.hash}/{f.path}" for f in entry.files]
    )
    head = client.head_object(Bucket=s3_bucket, Key=f"registry/objects/{entry.hash}/model.safetensors")
    assert head["Metadata"]["vpo-sha256"] == next(
        f.sha256 for f in entry.files if f.path == "model.safetensors"
    )
    assert get_entry(url, entry.hash[:7]) == entry and list_entries(url) == [entry]
    assert stored_tree(fetch(entry, tmp_path / "out")) == stored_tree(ckpt)
    again = register(url, make_checkpoint(tmp_path / "copy"), name="other")
    assert again == entry and again.name == "route"


def test_s3_interrupted_upload_leaves_no_entry_and_resumes(
    tmp_path: Path, s3_server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3_bucket}/reg"
    ckpt = make_checkpoint(tmp_path / "ckpt", weights_size=64 * 1024)
    fs, _ = get_filesystem(url)
    real_open = type(fs).open
    opened: list[str] = []

    def flaky_open(self, path, mode="rb", **kw):
        if "w" in mode:
            opened.append(path)
            if len(opened) == 3 and not fail_once.get("done"):
                fail_once["done"] = True
                raise ConnectionError("connection reset during upload (injected)")
        return real_open(self, path, mode, **kw)

    fail_once: dict[str, bool] = {}

    monkeypatch.setattr(type(fs), "open", flaky_open)
    with pytest.raises(ConnectionError):
        register(url, ckpt, name="route")
    assert list_entries(url) == []
    listing = s3_server.client().list_objects_v2(Bucket=s3_bucket).get("Contents", [])
    assert len(listing) == 2 and not any("entries/" in o["Key"] for o in listing)
    opened.clear()
    entry = register(url, ckpt, name="route")  # retry uploads only what is missing (re-hashed)
    # the card and config.json survived the first attempt intact and are not uploaded again
    uploaded = sorted(p.rsplit("/", 1)[1] for p in opened)
    assert uploaded == ["model.safetensors", "tokenizer_config.json"] and len(entry.files) == 4
    verify_entry(entry)


def test_s3_outage_then_retry(
    tmp_path: Path, s3_server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3_bucket}/reg"
    ckpt = make_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # fail fast instead of botocore's retry loop
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()
    with s3_server.outage():
        with pytest.raises(Exception) as err:
            register(url, ckpt, name="route")
        assert not isinstance(err.value, AssertionError)
    assert list_entries(url) == []
    entry = register(url, ckpt, name="route")
    verify_entry(entry)


def test_no_secret_reaches_registry_objects_entries_or_logs(
    tmp_path: Path, s3_server, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"s3://{s3_bucket}/reg"
    ckpt = make_checkpoint(tmp_path / "ckpt")
    caplog.set_level(logging.DEBUG, logger="vpo")
    # a careless caller passes the environment-derived settings as params: they must be masked
    params = {
        "storage": {
            "registry": url,
            "endpoint": s3_server.endpoint,
            "oops": os.environ["AWS_SECRET_ACCESS_KEY"],
        }
    }
    entry = register(url, ckpt, name="route", params=params, lineage={"by": "test"})
    assert entry.params["storage"]["oops"] == "***"
    fetched = fetch(entry, tmp_path / "fetched")
    dump = tmp_path / "bucket-dump"
    client = s3_server.client()
    for obj in client.list_objects_v2(Bucket=s3_bucket)["Contents"]:
        target = dump / obj["Key"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(client.get_object(Bucket=s3_bucket, Key=obj["Key"])["Body"].read())
    (tmp_path / "log.txt").write_text(caplog.text)
    secrets = [s3_server.secret_key, s3_server.access_key]
    assert scan_for_secrets([dump, fetched, tmp_path / "log.txt"], extra=secrets) == []
    assert caplog.text and "registered checkpoint" in caplog.text
    for s in secrets:
        assert s not in json.dumps(entry.to_dict())
