"""The registry without git: model folders and content hashes, entries per (artifact, hash), what
``latest`` / ``best`` / ``list`` show, the card in the model folder, no copy of the weights, temp
files of killed writers, one-line storage errors on S3, and migrating an older registry."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import dvc  # noqa: F401 (DVC binds its log handler to sys.stderr on first import: not to a test's capture)
import pytest

from tests.support.registry import make_checkpoint, metrics
from vpo.pipeline.engine.checkpoints import (
    FileRecord,
    IncompleteCheckpointError,
    check_checkpoint,
    content_hash,
    manifest_hash,
)
from vpo.pipeline.engine.console import command
from vpo.pipeline.engine.storage import scan_for_secrets
from vpo.pipeline.registry import Registry, RegistryInputError
from vpo.pipeline.registry.cli import main
from vpo.pipeline.registry.entries import StorageUnavailableError


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    """A local registry outside any git repository (versions and stages fall back to its own record)."""
    return Registry(tmp_path / "registry", tmp_path)


def cli(reg: Registry, *argv: str) -> int:
    """``vpo registry ARGV`` on ``reg`` (its registry and project folder)."""
    return main(["--registry", reg.store.url, "--repo", str(reg.dvc_repo), *argv])


def add(reg: Registry, folder: Path, arm: str = "vpo-s0", name: str = "route-quick", **kw):
    entry, _ = reg.register(folder, name=name, arm=arm, path=None, **kw)
    return entry


# --------------------------------------------------------------------------- model folders


@pytest.mark.parametrize(("breakage", "fragment"), [
    (lambda r: (r / "config.json").unlink(), "no model config"),
    (lambda r: (r / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    (lambda r: (r / "model.safetensors").unlink(), "no weights"),
    (lambda r: (r / "model.safetensors").write_bytes(b""), "empty weight files: model.safetensors"),
    (lambda r: (r / "tokenizer_config.json").unlink(), "no tokenizer files"),
    (lambda r: (r / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "m-1.safetensors"}})),
     "lists missing shards: m-1.safetensors"),
])
def test_incomplete_model_folders_register_nothing(reg: Registry, tmp_path: Path, breakage, fragment: str) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    breakage(ckpt)
    with pytest.raises(IncompleteCheckpointError, match=fragment) as err:
        add(reg, ckpt)
    assert str(ckpt) in str(err.value) and not (tmp_path / "registry").exists()
    with pytest.raises(IncompleteCheckpointError, match="does not exist"):
        check_checkpoint(tmp_path / "nope")


def test_content_hash_covers_weights_and_tokenizer_only(tmp_path: Path) -> None:
    a, b = make_checkpoint(tmp_path / "a"), make_checkpoint(tmp_path / "b")
    assert content_hash(a) == content_hash(b)  # training_args.bin differs, the hash does not
    (b / "config.json").write_text(json.dumps({"model_type": "tiny", "x": 1}))
    assert content_hash(a) == content_hash(b)
    (b / "tokenizer_config.json").write_text("{}")
    assert content_hash(a) != content_hash(b)


# --------------------------------------------------------------------------- entries


def test_register_keeps_entry_and_card_but_no_weights(reg: Registry, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", weights_size=1 << 16)
    entry, why = reg.register(ckpt, name="route-quick", arm="vpo-s0", metrics=metrics({1: 0.5}),
                              lineage={"estimator": "vpo", "task": "route", "base_hash": "b" * 64})
    assert why == "the project is not a git repository" and entry.version is None
    assert entry.artifact == "route-quick-vpo-s0" and entry.left_out == ("training_args.bin",)
    assert {f.path: f.role for f in entry.files} == {"config.json": "config", "model.safetensors": "weights",
                                                     "tokenizer_config.json": "tokenizer"}
    assert all(f.md5 == hashlib.md5((ckpt / f.path).read_bytes()).hexdigest() for f in entry.files)
    stored = [p for p in (tmp_path / "registry").rglob("*") if p.is_file()]
    assert sorted(p.suffix for p in stored) == [".json", ".md"]
    weights = (ckpt / "model.safetensors").read_bytes()
    assert sum(p.stat().st_size for p in stored) < len(weights) // 4  # entries and a card, never the weights
    assert all(weights[:4096] not in p.read_bytes() for p in stored)
    card = (ckpt / "README.md").read_text()
    assert card == reg.card(entry) and "route-quick-vpo-s0" in card
    assert content_hash(ckpt) == entry.hash  # the card in the folder changes nothing


def test_identical_weights_from_two_runs_stay_findable_by_their_own_names(reg: Registry, tmp_path: Path,
                                                                          capsys) -> None:
    a = add(reg, make_checkpoint(tmp_path / "a"), arm="grpo-s0")
    b = add(reg, make_checkpoint(tmp_path / "b"), arm="vpo-s0")
    assert a.hash == b.hash and a.artifact != b.artifact
    assert reg.get("route-quick-vpo-s0").arm == "vpo-s0" and reg.get("route-quick-grpo-s0").arm == "grpo-s0"
    assert cli(reg, "list", "--arm", "vpo-s0", "--json") == 0
    assert [json.loads(line)["artifact"] for line in capsys.readouterr().out.splitlines()] == ["route-quick-vpo-s0"]
    with pytest.raises(RegistryInputError, match="matches 2 entries"):
        reg.get(a.hash[:8])


def test_latest_follows_training_not_registration(reg: Registry, tmp_path: Path) -> None:
    """Default run, then a max_steps=60 run, then the default again with identical weights: latest is
    the default; re-registering the unchanged folder (a repair) moves nothing and keeps created_at."""
    default = make_checkpoint(tmp_path / "default", seed=0)
    first = add(reg, default, params={"trainer": {"max_steps": 4}})
    time.sleep(0.01)
    long_run = add(reg, make_checkpoint(tmp_path / "long", seed=1), params={"trainer": {"max_steps": 60}})
    assert reg.get("route-quick@latest").hash == long_run.hash
    again = add(reg, default, params={"trainer": {"max_steps": 4}})  # a repair: same files, same times
    assert (again.created_at, again.trained_at) == (first.created_at, first.trained_at)
    assert reg.get("route-quick@latest").hash == long_run.hash
    later = time.time() + 5  # the default run trained again and wrote identical weights
    os.utime(default / "model.safetensors", (later, later))
    retrained = add(reg, default, params={"trainer": {"max_steps": 4}})
    assert retrained.created_at == first.created_at and retrained.trained_at > long_run.trained_at
    assert reg.get("route-quick@latest").hash == first.hash


def test_best_and_list_show_metrics_stages_and_the_settings_that_differ(reg: Registry, tmp_path: Path,
                                                                        capsys) -> None:
    add(reg, make_checkpoint(tmp_path / "a", seed=1), metrics=metrics({1: 0.5, 5: 0.6}),
        params={"trainer": {"max_steps": 4, "learning_rate": 1e-4}, "seed": 0})
    top = add(reg, make_checkpoint(tmp_path / "b", seed=2), metrics=metrics({1: 0.4, 5: 0.8}),
              params={"trainer": {"max_steps": 60, "learning_rate": 1e-4}, "seed": 0})
    assert reg.get("route-quick@best").hash == top.hash
    assert cli(reg, "best", "--metric", "eval.best_at_k.1") == 0
    assert "eval.best_at_k.1=0.5" in capsys.readouterr().out
    assert cli(reg, "best", "--metric", "eval.nope") == 2
    assert "numeric metrics of the newest entry: eval.best_at_k.1" in capsys.readouterr().err
    assert cli(reg, "promote", top.hash[:10], "--stage", "production") == 0
    assert "kept in the registry's own record because not a git repository" in capsys.readouterr().out
    assert cli(reg, "list") == 0
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if top.hash[:12] in line)
    assert "latest,best,production" in row and "trainer.max_steps=60" in row and "learning_rate" not in row
    assert "0.8 (k=5)" in row
    assert reg.get("production").hash == top.hash == reg.get("route-quick@production").hash
    assert cli(reg, "promote", "production", "--stage", "production", "--remove") == 0
    with pytest.raises(RegistryInputError, match="matches no entry"):
        reg.get("production")
    assert cli(reg, "promote", "best", "--stage", "latest") == 2


def test_fetch_conflict_names_the_cli_flag(reg: Registry, tmp_path: Path, capsys) -> None:
    entry = add(reg, make_checkpoint(tmp_path / "ckpt"))
    other = make_checkpoint(tmp_path / "other", seed=5)
    assert cli(reg, "fetch", entry.hash[:8], str(other)) == 1
    assert "already exists with other content; fetch with --overwrite to replace it" in capsys.readouterr().err


def test_stale_temp_files_are_removed_by_a_rerun_and_by_verify(reg: Registry, tmp_path: Path, capsys) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    entry = add(reg, ckpt)
    folder = tmp_path / "registry" / "entries" / entry.artifact
    old_layout = tmp_path / "registry" / "objects" / f".{entry.hash}.tmp-x1"  # what a killed older version left
    old_layout.mkdir(parents=True)
    (old_layout / "model.safetensors").write_bytes(b"w" * 4096)
    stale, young = folder / f".{entry.hash}.json.tmp-dead", folder / f".{entry.hash}.json.tmp-busy"
    stale.write_text("{")
    young.write_text("{")
    past = time.time() - 3600
    for p in (stale, old_layout):
        os.utime(p, (past, past))
    add(reg, ckpt)
    assert not stale.exists() and not old_layout.exists() and young.exists()  # a young one may be a live writer
    os.utime(young, (past, past))  # its writer was killed after all: verify removes it too
    assert cli(reg, "verify") == 1  # this entry's weights are in no DVC project here: verify says so
    assert f"removed entries/{entry.artifact}/{young.name}" in capsys.readouterr().out and not young.exists()


def test_unreadable_entry_files_are_named_and_never_hide_the_others(reg: Registry, tmp_path: Path, capsys) -> None:
    good = add(reg, make_checkpoint(tmp_path / "ckpt"))
    bad = tmp_path / "registry" / "entries" / "route-quick-grpo-s0" / f"{'0' * 64}.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    forged = json.loads((tmp_path / "registry" / "entries" / good.artifact / f"{good.hash}.json").read_text())
    forged["artifact"] = "route-quick-grpo-s0"
    next(f for f in forged["files"] if f["role"] == "weights")["size"] += 1  # a manifest that does not hash to its name
    (bad.parent / f"{good.hash}.json").write_text(json.dumps(forged))
    assert cli(reg, "list") == 0
    captured = capsys.readouterr()
    assert good.hash[:12] in captured.out and captured.err.count("warning: entry file") == 2
    assert "does not hash to" in captured.err


def test_no_secret_reaches_entries_cards_or_output(reg: Registry, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("VPO_TEST_API_TOKEN", "tok-" + "s3cr3t" * 4)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    add(reg, ckpt, params={"note": f"uses {os.environ['VPO_TEST_API_TOKEN']}"})
    assert cli(reg, "show", "latest") == 0
    assert "s3cr3t" not in capsys.readouterr().out
    assert scan_for_secrets([tmp_path / "registry", ckpt / "README.md"]) == []


# --------------------------------------------------------------------------- an older registry


def test_migrate_moves_an_older_registry_and_its_weights_still_fetch(tmp_path: Path, capsys) -> None:
    """entries/<hash>.json, objects/<hash>/ and aliases/<name>/<alias>.json, as earlier versions wrote."""
    old = tmp_path / "old"
    ckpt = make_checkpoint(tmp_path / "ckpt")
    files = []
    for name, role in (("config.json", "config"), ("model.safetensors", "weights"), ("tokenizer_config.json", "tokenizer")):
        data = (ckpt / name).read_bytes()
        files.append(FileRecord(name, len(data), hashlib.sha256(data).hexdigest(), role=role))
        (old / "objects" / "H" / name).parent.mkdir(parents=True, exist_ok=True)
        (old / "objects" / "H" / name).write_bytes(data)
    digest = manifest_hash(files)
    (old / "objects" / "H").rename(old / "objects" / digest)
    entry = {"hash": digest, "name": "route", "arm": "vpo-s0", "created_at": "2026-01-02T03:04:05.000Z",
             "git_rev": None, "git_dirty": None, "dvc_lock_sha256": None, "params": {}, "metrics": metrics({1: 0.3}),
             "lineage": {}, "size_bytes": 1, "schema": 2, "left_out": [],
             "files": [{"path": f.path, "size": f.size, "sha256": f.sha256, "role": f.role} for f in files]}
    (old / "entries").mkdir()
    (old / "entries" / f"{digest}.json").write_text(json.dumps(entry))
    (old / "aliases" / "route").mkdir(parents=True)
    (old / "aliases" / "route" / "production.json").write_text(json.dumps({"alias": "production", "name": "route",
                                                                           "hash": digest, "set_at": "x"}))
    assert main(["--registry", str(old), "list"]) == 0
    assert f"older registry layout: run `{command('registry', 'migrate', '--registry', str(old))}`" in \
        capsys.readouterr().err
    assert main(["--registry", str(old), "migrate"]) == 0
    assert "alias route@production -> stage production of route-vpo-s0" in capsys.readouterr().out
    reg = Registry(old, tmp_path)
    moved = reg.get("route@production")
    assert (moved.artifact, moved.created_at, moved.objects) == ("route-vpo-s0", entry["created_at"], f"objects/{digest}")
    dest, how = reg.fetch(moved, tmp_path / "fetched")
    assert content_hash(dest) == digest and "objects" in how and (dest / "README.md").is_file()
    assert reg.verify(moved) == []
    (old / "objects" / digest / "model.safetensors").write_bytes(b"x" * 4096)
    assert "model.safetensors is corrupt" in reg.verify(moved)[0]
    assert not (old / "aliases" / "route" / "production.json").exists() and not (old / "entries" / f"{digest}.json").exists()


# --------------------------------------------------------------------------- S3


def test_s3_registry_round_trip_and_one_line_errors_while_the_endpoint_is_down(tmp_path: Path, s3_server,
                                                                               s3_bucket: str, capsys, monkeypatch) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries only make the outage slower to report
    url = f"s3://{s3_bucket}/registry"
    reg = Registry(url, tmp_path)
    entry = add(reg, make_checkpoint(tmp_path / "ckpt"), metrics=metrics({1: 0.5}))
    keys = sorted(o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == [f"registry/entries/{entry.artifact}/{entry.hash}.{x}" for x in ("json", "md")]
    assert Registry(url, tmp_path).get("latest") == entry
    with s3_server.outage():
        with pytest.raises(StorageUnavailableError, match="could not .*check the storage is reachable"):
            add(Registry(url, tmp_path), make_checkpoint(tmp_path / "ckpt2", seed=2))
        for argv in (["list"], ["best"], ["verify"], ["show", "latest"]):
            assert main(["--registry", url, "--repo", str(tmp_path), *argv]) == 1, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("error: registry s3://"), err
            assert "Traceback" not in err
    assert Registry(url, tmp_path).get("latest") == entry  # nothing was lost


def test_a_name_arm_registry_or_metric_that_matches_nothing_says_which(reg: Registry, tmp_path: Path,
                                                                        capsys) -> None:
    """Every verb either answers or fails with exit 2 and one line naming what matched nothing."""
    add(reg, make_checkpoint(tmp_path / "a"), metrics=metrics({1: 0.5}))
    cases = [(["list", "--name", "route"], ("--name 'route' matches no entry (variants and artifacts: route-quick, "
                                            "route-quick-vpo-s0")),
             (["best", "--name", "route"], "--name 'route' matches no entry"),
             (["best", "--arm", "grpo-s0"], "--arm 'grpo-s0' matches no entry (arm runs: vpo-s0"),
             (["best", "--metric", "eval.nope"], "no entry has metric 'eval.nope'"),
             (["show", "route@latest"], "no entry is named 'route'"),
             (["promote", "route-quick-vpo-s0", "--stage", "production", "--remove"],
              "is not in stage production (its stages: none); nothing to remove")]
    for argv, message in cases:
        assert cli(reg, *argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert main(["--registry", "", "list"]) == 2
    assert "--registry is empty" in capsys.readouterr().err
    assert main(["--registry", str(tmp_path / "elsewhere"), "--repo", str(tmp_path), "list"]) == 2
    assert "(--registry) does not exist: nothing is at that path; check the URL" in capsys.readouterr().err
    (tmp_path / "blank").mkdir()
    assert main(["--registry", str(tmp_path / "blank"), "--repo", str(tmp_path), "list"]) == 0  # empty, but there
    assert "no entries in" in capsys.readouterr().out
