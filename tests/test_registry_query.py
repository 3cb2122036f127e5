"""Registry queries and upkeep: one entry per content (weights + tokenizer), re-hashing verify and
repair by re-registration, aliases (latest, best, promoted), unreadable entry files, the model card,
lineage by base hash, old entries, and the ``list|show|best|fetch|promote|verify`` CLI; local and S3."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.test_registry import make_checkpoint, stored_tree, tree
from vpo.pipeline import registry
from vpo.pipeline.registry import (
    RegistryError,
    RegistryInputError,
    best_entry,
    check_entry,
    content_hash,
    demote,
    fetch,
    get_entry,
    latest_entry,
    list_aliases,
    list_entries,
    metric_value,
    promote,
    read_card,
    register,
    scan_registry,
    verify_entry,
)


def eval_metrics(best: dict[int, float], diversity: float = 1.0) -> dict:
    """Metrics shaped like the pipeline's: training summary + the evaluation of one arm run."""
    return {
        "train": {"max_steps": 4, "final": {"reward": 0.5}},
        "eval": {
            "best_at_k": {str(k): v for k, v in best.items()},
            "pass_at_k": {str(k): v / 2 for k, v in best.items()},
            "reward_diversity": diversity,
            "parse_rate": 0.9,
            "k": sorted(best),
        },
    }


def flip_byte(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def register_three(reg: str | Path, tmp_path: Path) -> list:
    """Three entries of one pipeline: vpo best at k=5, grpo best at k=1, an older quick run."""
    quick = register(
        reg,
        make_checkpoint(tmp_path / "q", seed=3),
        name="route-quick",
        arm="vpo-s0",
        metrics=eval_metrics({1: 0.9, 5: 0.95}),
    )
    grpo = register(
        reg,
        make_checkpoint(tmp_path / "g", seed=1),
        name="route",
        arm="grpo-s0",
        metrics=eval_metrics({1: 0.5, 3: 0.55, 5: 0.6}, diversity=0.2),
    )
    vpo = register(
        reg,
        make_checkpoint(tmp_path / "v", seed=2),
        name="route",
        arm="vpo-s0",
        metrics=eval_metrics({1: 0.4, 3: 0.7, 5: 0.8}, diversity=1.3),
    )
    return [quick, grpo, vpo]


# --------------------------------------------------------------------------- content hash


def test_identical_weights_from_two_folders_register_once(tmp_path: Path, caplog) -> None:
    reg = tmp_path / "reg"
    a = make_checkpoint(tmp_path / "runs" / "a" / "model")
    b = make_checkpoint(tmp_path / "elsewhere" / "b" / "model")
    for folder in (a, b):  # what HF's Trainer leaves: its absolute output path, per-run state
        (folder / "training_args.bin").write_bytes(f"output_dir={folder.parent}".encode())
        (folder / "extra" / "trainer_state.json").write_text(json.dumps({"run": str(folder)}))
        (folder / "README.md").write_text(f"trainer card for {folder}")
    first = register(reg, a, name="route", arm="vpo-s0")
    caplog.set_level(logging.INFO, logger="vpo")
    second = register(reg, b, name="route", arm="grpo-s0")
    assert second == first and second.arm == "vpo-s0"
    assert [p.name for p in (reg / "entries").iterdir()] == [f"{first.hash}.json"]
    assert [p.name for p in (reg / "objects").iterdir()] == [first.hash]
    assert set(tree(reg / "objects" / first.hash)) == {"README.md", *stored_tree(a)}  # no run files
    assert "README.md" in first.left_out and "training_args.bin" in first.left_out
    assert "already registered as route/vpo-s0; not registered again as route/grpo-s0" in caplog.text
    flip_byte(b / "model.safetensors")
    assert register(reg, b, name="route", arm="grpo-s0").hash != first.hash  # other weights: new entry


def test_base_hash_helper_names_the_base_in_lineage(tmp_path: Path, caplog) -> None:
    base = make_checkpoint(tmp_path / "base", seed=9)
    (base / "sft_metrics.json").write_text("{}")  # stage outputs beside the model do not count
    bare = make_checkpoint(tmp_path / "bare", seed=9)
    assert content_hash(base) == content_hash(bare) == registry.hash_checkpoint(base)[0]
    assert content_hash(base) != content_hash(make_checkpoint(tmp_path / "other", seed=8))
    entry = register(
        tmp_path / "reg",
        make_checkpoint(tmp_path / "arm"),
        name="route",
        arm="vpo-s0",
        lineage={"estimator": "vpo"},
        base_hash=content_hash(base),
    )
    assert entry.lineage == {"estimator": "vpo", "base_hash": content_hash(base)}
    assert entry.summary()["base_hash"] == content_hash(base)[:12]
    caplog.set_level(logging.WARNING, logger="vpo")
    register(
        tmp_path / "reg",
        make_checkpoint(tmp_path / "untrained", seed=9),
        name="route",
        arm="grpo-s0",
        base_hash=content_hash(base),
    )
    assert "same weight and tokenizer files as its base model: training changed nothing" in caplog.text
    with pytest.raises(RegistryInputError, match="base_hash must be a content hash"):
        register(tmp_path / "reg", make_checkpoint(tmp_path / "arm2", seed=4), name="route", base_hash="base")
    with pytest.raises(registry.IncompleteCheckpointError, match="does not exist"):
        content_hash(tmp_path / "nope")
    with pytest.raises(RegistryInputError, match="registry name 'route/quick' is invalid"):
        register(tmp_path / "reg", base, name="route/quick")


# --------------------------------------------------------------------------- verify and repair


def test_verify_rehashes_and_names_the_corrupt_file(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    entry = register(reg, make_checkpoint(tmp_path / "ckpt"), name="route", arm="vpo-s0")
    verify_entry(entry)
    assert check_entry(entry) == []
    obj = reg / "objects" / entry.hash / "model.safetensors"
    size = obj.stat().st_size
    flip_byte(obj)  # same size: a size check alone cannot see it
    assert obj.stat().st_size == size
    problems = check_entry(entry)
    assert len(problems) == 1 and problems[0].startswith("model.safetensors is corrupt (sha256 ")
    with pytest.raises(RegistryError, match=r"failed verification: model\.safetensors is corrupt") as err:
        verify_entry(entry)
    assert "register an intact copy" in str(err.value)
    (reg / "objects" / entry.hash / "README.md").write_text("edited card")
    assert [p.split(" ")[0] for p in check_entry(entry)] == ["README.md", "model.safetensors"]


def test_reregistering_an_intact_copy_repairs_corrupt_and_missing_objects(tmp_path: Path, caplog) -> None:
    reg = tmp_path / "reg"
    entry = register(
        reg, make_checkpoint(tmp_path / "a"), name="route", arm="vpo-s0", metrics=eval_metrics({1: 0.5})
    )
    objects = reg / "objects" / entry.hash
    good = tree(objects)
    flip_byte(objects / "model.safetensors")
    (objects / "tokenizer_config.json").unlink()
    (objects / "README.md").write_text("garbage")
    caplog.set_level(logging.WARNING, logger="vpo")
    again = register(reg, make_checkpoint(tmp_path / "b"), name="route", arm="vpo-s0")  # an intact copy
    assert again == entry and again.created_at == entry.created_at  # the entry itself is unchanged
    assert tree(objects) == good  # every object restored byte for byte, the card re-made
    verify_entry(again)
    assert "repaired damaged objects" in caplog.text and "model.safetensors is corrupt" in caplog.text
    assert not [p for p in objects.iterdir() if p.name.startswith(".")]  # no temp files left


def test_losing_a_registration_race_leaves_the_winners_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two registrations of the same content with different metrics: the one whose entry lands
    first wins, and the loser's card (written over the winner's) is put back to the winner's."""
    reg = tmp_path / "reg"
    real_put = registry._Store.put_new_local
    winner: list = []
    started: list[bool] = []

    def winner_first(self, digest, files, fills):
        if not started:  # the other writer registers everything while this one is about to copy
            started.append(True)
            ckpt = make_checkpoint(tmp_path / "w")
            winner.append(register(reg, ckpt, name="route", arm="vpo-s0", metrics=eval_metrics({1: 0.9})))
        return real_put(self, digest, files, fills)

    monkeypatch.setattr(registry._Store, "put_new_local", winner_first)
    got = register(
        reg, make_checkpoint(tmp_path / "l"), name="route", arm="vpo-s0", metrics=eval_metrics({1: 0.1})
    )
    assert got == winner[0] and metric_value(got, "eval.best_at_k.1") == 0.9
    verify_entry(got)  # the card on disk is the winner's
    assert "| best@k | 0.9 |" in (reg / "objects" / got.hash / "README.md").read_text()


def test_repair_refuses_objects_it_has_no_identical_copy_of(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    entry = register(reg, make_checkpoint(tmp_path / "a"), name="route")
    flip_byte(reg / "objects" / entry.hash / "config.json", at=3)
    other = make_checkpoint(tmp_path / "b")
    (other / "config.json").write_text(json.dumps({"model_type": "tiny", "seed": 0, "use_cache": False}))
    with pytest.raises(
        RegistryError, match=r"no identical copy to repair them from: config\.json is corrupt"
    ):
        register(reg, other, name="route")  # same weights, another config: cannot restore the stored one
    assert register(reg, make_checkpoint(tmp_path / "c"), name="route") == entry  # the right one can
    verify_entry(entry)


def test_s3_verify_rehashes_and_reregistration_repairs(tmp_path: Path, s3_server, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/reg"
    entry = register(url, make_checkpoint(tmp_path / "a"), name="route", arm="vpo-s0")
    client = s3_server.client()
    key = f"reg/objects/{entry.hash}/model.safetensors"
    head = client.head_object(Bucket=s3_bucket, Key=key)
    body = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[7] ^= 0x80
    client.put_object(
        Bucket=s3_bucket, Key=key, Body=bytes(body), Metadata=head["Metadata"]
    )  # same size+metadata
    with pytest.raises(RegistryError, match=r"model\.safetensors is corrupt"):
        verify_entry(get_entry(url, entry.hash))
    assert registry.main(["verify", "--registry", url]) == 1
    assert register(url, make_checkpoint(tmp_path / "b"), name="route", arm="vpo-s0") == entry
    verify_entry(entry)
    assert (
        client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        == (tmp_path / "b" / "model.safetensors").read_bytes()
    )


# --------------------------------------------------------------------------- unreadable entry files


def test_one_bad_entry_file_never_breaks_list_or_register(tmp_path: Path, caplog, capsys) -> None:
    reg = tmp_path / "reg"
    good = register(reg, make_checkpoint(tmp_path / "a"), name="route", arm="vpo-s0")
    torn = "ab" * 32
    (reg / "entries" / f"{torn}.json").write_text('{"hash": "ab')  # a torn write by some other tool
    misfiled = json.loads((reg / "entries" / f"{good.hash}.json").read_text())
    (reg / "entries" / f"{'cd' * 32}.json").write_text(json.dumps(misfiled))  # copied under another name
    caplog.set_level(logging.WARNING, logger="vpo")
    assert list_entries(reg) == [good]
    assert f"entries/{torn}.json is not valid JSON" in caplog.text
    assert f"entries/{'cd' * 32}.json holds entry {good.hash[:12]}" in caplog.text
    new = register(reg, make_checkpoint(tmp_path / "b", seed=1), name="route", arm="grpo-s0")
    assert list_entries(reg) == [good, new]
    assert registry.main(["list", "--registry", str(reg)]) == 0
    out, err = capsys.readouterr()
    assert good.hash[:12] in out and new.hash[:12] in out
    assert f"warning: registry entry file entries/{torn}.json is not valid JSON" in err
    assert registry.main(["verify", "--registry", str(reg)]) == 1  # verify does not call that healthy
    out, err = capsys.readouterr()
    assert "2/2 entries verified; 2 unreadable file(s) named above" in out and torn in err


def test_bad_entry_file_of_the_same_content_is_replaced_on_register(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    ckpt = make_checkpoint(tmp_path / "a")
    digest = content_hash(ckpt)
    (reg / "entries").mkdir(parents=True)
    (reg / "entries" / f"{digest}.json").write_text("")  # empty: a crash of a non-atomic writer
    with pytest.raises(RegistryError, match="is not valid JSON"):
        get_entry(reg, digest)
    entry = register(reg, ckpt, name="route", arm="vpo-s0")
    assert get_entry(reg, digest) == entry and list_entries(reg) == [entry]
    verify_entry(entry)


def test_entry_with_unsafe_paths_or_wrong_manifest_is_rejected(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    entry = register(reg, make_checkpoint(tmp_path / "a"), name="route")
    data = entry.to_dict()
    evil = {**data, "files": [*data["files"], {"path": "../../etc/x", "size": 1, "sha256": "0" * 64}]}
    with pytest.raises(RegistryError, match="unsafe file path '../../etc/x'"):
        registry.RegistryEntry.from_dict(evil)
    forged = {
        **data,
        "files": [{**f, "size": f["size"] + 1} if f["role"] == "weights" else f for f in data["files"]],
    }
    with pytest.raises(RegistryError, match="manifest does not hash to"):
        registry.RegistryEntry.from_dict(forged)


# --------------------------------------------------------------------------- aliases and best


def test_latest_and_best_are_queries_by_name_arm_and_metric(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    quick, grpo, vpo = register_three(reg, tmp_path)
    assert latest_entry(reg) == vpo and latest_entry(reg, name="route-quick") == quick
    assert get_entry(reg, "route@latest") == vpo and get_entry(reg, "latest") == vpo
    assert best_entry(reg) == (quick, 0.95)  # default: best@k_max over every name
    assert best_entry(reg, name="route") == (vpo, 0.8)
    assert best_entry(reg, "eval.best_at_k.1", name="route") == (grpo, 0.5)
    assert best_entry(reg, "eval.reward_diversity", name="route", lower_is_better=True) == (grpo, 0.2)
    assert best_entry(reg, "eval.best_at_k.3") == (vpo, 0.7)  # the quick entry has no k=3: skipped
    assert best_entry(reg, name="route*", arm="grpo-*") == (grpo, 0.6)
    assert get_entry(reg, "route@best") == vpo and get_entry(reg, "route-quick@best") == quick
    assert metric_value(vpo, "eval.best_at_k.kmax") == 0.8 and metric_value(vpo, "eval.nope") is None
    with pytest.raises(
        RegistryInputError, match=r"is a group, not a number; pick one of: eval\.best_at_k\.1"
    ):
        best_entry(reg, "eval.best_at_k")
    with pytest.raises(RegistryInputError, match=r"no entry has metric 'eval\.bleu'.*eval\.best_at_k\.1"):
        best_entry(reg, "eval.bleu")
    with pytest.raises(RegistryInputError, match="no entries with name 'code'"):
        best_entry(reg, name="code")
    tie = register(
        reg,
        make_checkpoint(tmp_path / "t", seed=7),
        name="route",
        arm="vpo-s1",
        metrics=eval_metrics({1: 0.1, 5: 0.8}),
    )
    assert best_entry(reg, name="route")[0] == tie  # equal values: the newest wins


def test_names_tell_quick_from_full_and_pipeline_from_pipeline(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    quick, grpo, vpo = register_three(reg, tmp_path)
    code = register(reg, make_checkpoint(tmp_path / "c", seed=5), name="code-tiny", arm="vpo-s0")
    assert list_entries(reg, name="route") == [grpo, vpo]
    assert list_entries(reg, name="route-quick") == [quick]
    assert list_entries(reg, name="route*") == [quick, grpo, vpo]
    assert list_entries(reg, arm="vpo-s0") == [quick, vpo, code]
    assert list_entries(reg, name="code-tiny", arm="vpo-*") == [code]
    scan = scan_registry(reg)
    assert scan.aliases_of(quick) == ["latest", "best"] and scan.aliases_of(vpo) == ["latest", "best"]
    assert scan.aliases_of(grpo) == [] and scan.aliases_of(code) == ["latest"]  # code-tiny has no eval


def test_promote_sets_named_aliases_per_name(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    quick, grpo, vpo = register_three(reg, tmp_path)
    rec = promote(reg, grpo.hash[:10], "production", note="first release")
    assert (rec.key, rec.hash, rec.previous, rec.note) == (
        "route@production",
        grpo.hash,
        None,
        "first release",
    )
    assert get_entry(reg, "route@production") == grpo
    assert promote(reg, "route@best", "production").previous == grpo.hash  # moved: the old target is kept
    assert get_entry(reg, "route@production") == vpo
    promote(reg, quick.hash, "production")  # same alias name, other model name: independent
    assert get_entry(reg, "route-quick@production") == quick and get_entry(reg, "route@production") == vpo
    promote(reg, grpo.hash, "staging")
    assert sorted(a.key for a in list_aliases(reg)) == [
        "route-quick@production",
        "route@production",
        "route@staging",
    ]
    assert scan_registry(reg).aliases_of(vpo) == ["latest", "best", "production"]
    stored = json.loads((reg / "aliases" / "route" / "production.json").read_text())
    assert stored["hash"] == vpo.hash and stored["alias"] == "production"
    for bad, fragment in (
        ("latest", "computed by the registry"),
        ("best", "computed by the registry"),
        ("Prod", "is invalid"),
        ("a/b", "is invalid"),
    ):
        with pytest.raises(RegistryInputError, match=fragment):
            promote(reg, vpo.hash, bad)
    with pytest.raises(
        RegistryInputError, match=r"no alias 'route@canary'.*aliases of route: route@production"
    ):
        get_entry(reg, "route@canary")
    assert demote(reg, "route", "staging").hash == grpo.hash
    with pytest.raises(RegistryInputError, match="no alias route@staging"):
        demote(reg, "route", "staging")


def test_alias_write_is_all_or_nothing_and_concurrent_promotions_keep_every_alias(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = tmp_path / "reg"
    _, grpo, vpo = register_three(reg, tmp_path)
    promote(reg, grpo.hash, "production")
    from vpo.pipeline import storage

    def crash(*a, **kw):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(storage.os, "fsync", crash)  # dies after writing some bytes, before the rename
    with pytest.raises(OSError, match="injected"):
        promote(reg, vpo.hash, "production")
    monkeypatch.undo()
    assert get_entry(reg, "route@production") == grpo  # the old alias, whole
    assert [p.name for p in (reg / "aliases" / "route").iterdir()] == ["production.json"]  # no temp left

    errors: list[Exception] = []

    def writer(i: int) -> None:
        try:
            for j in range(10):
                promote(reg, (vpo if (i + j) % 2 else grpo).hash, f"a{i}")
                promote(reg, (vpo if j % 2 else grpo).hash, "shared")
        except Exception as exc:  # noqa: BLE001 - any failure in a thread is reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(200):
                rec = registry._Store(reg).read_alias("route", "shared")
                assert rec is None or rec.hash in (vpo.hash, grpo.hash)
        except Exception as exc:  # noqa: BLE001 - any failure in a thread is reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)] + [
        threading.Thread(target=reader)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(a.alias for a in list_aliases(reg, name="route")) == [
        "a0",
        "a1",
        "a2",
        "a3",
        "production",
        "shared",
    ]
    assert scan_registry(reg).bad == []


def test_s3_aliases_list_and_bad_entry(tmp_path: Path, s3_server, s3_bucket: str, caplog) -> None:
    url = f"s3://{s3_bucket}/registry"
    quick, grpo, vpo = register_three(url, tmp_path)
    promote(url, "route@best", "production")
    assert get_entry(url, "route@production") == vpo
    assert promote(url, grpo.hash, "production").previous == vpo.hash
    assert get_entry(url, "route@production") == grpo and get_entry(url, "route@latest") == vpo
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key=f"registry/entries/{'ef' * 32}.json", Body=b"[1, 2]")
    caplog.set_level(logging.WARNING, logger="vpo")
    assert list_entries(url) == [quick, grpo, vpo]
    assert f"entries/{'ef' * 32}.json does not hold a JSON object" in caplog.text
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert "registry/aliases/route/production.json" in keys
    assert demote(url, "route", "production").hash == grpo.hash
    assert list_aliases(url) == []


# --------------------------------------------------------------------------- model card


def test_model_card_states_task_estimator_m_k_metrics_and_lineage(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    ckpt = make_checkpoint(tmp_path / "ckpt")
    base = make_checkpoint(tmp_path / "base", seed=4)
    params = {
        "name": "route",
        "task": {"name": "route"},
        "trainer": {"num_weights": 100},
        "arms": [{"name": "vpo", "estimator": "vpo", "num_answers": 3, "num_generations": 8}],
        "evaluation": {"split": "test"},
    }
    entry = register(
        reg,
        ckpt,
        name="route",
        arm="vpo-s0",
        params=params,
        metrics=eval_metrics({1: 0.25, 3: 0.5, 10: 0.75}, diversity=1.25),
        lineage={"estimator": "vpo", "num_answers": 3, "seed": 0, "pipeline": "route", "quick": False},
        base_hash=content_hash(base),
    )
    card = (reg / "objects" / entry.hash / "README.md").read_text()
    assert card == read_card(entry) == registry.render_card(entry)
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n")[1])
    v = front["vpo"]
    assert (v["task"], v["estimator"], v["m"], v["K"], v["G"]) == ("route", "vpo", 3, 100, 8)
    assert v["content_hash"] == entry.hash and v["base_model_hash"] == content_hash(base)
    assert v["git_rev"] == entry.git_rev and v["dvc_lock_sha256"] == entry.dvc_lock_sha256
    assert front["library_name"] == "transformers"
    metrics = {m["name"]: m["value"] for m in front["model-index"][0]["results"][0]["metrics"]}
    assert metrics["best@10"] == 0.75 and metrics["pass@1"] == 0.125 and metrics["reward diversity"] == 1.25
    assert "| best@k | 0.25 | 0.5 | 0.75 |" in card
    assert f"base model content hash: `{content_hash(base)}`" in card
    assert "num_weights: 100" in card  # the params, in full
    assert registry.hash_checkpoint(reg / "objects" / entry.hash)[0] == entry.hash  # the card is not hashed
    again = register(
        tmp_path / "reg2",
        ckpt,
        name="route",
        arm="vpo-s0",
        params=params,
        metrics=entry.metrics,
        lineage={k: v for k, v in entry.lineage.items() if k != "base_hash"},
        base_hash=content_hash(base),
    )
    assert again.hash == entry.hash and again.created_at  # a second registry, another registration time
    assert (tmp_path / "reg2" / "objects" / entry.hash / "README.md").read_text() == card  # no timestamps
    assert next(f for f in entry.files if f.path == "README.md").role == "card"


def test_card_lists_what_it_lacks_and_falls_back_to_params(tmp_path: Path) -> None:
    entry = register(
        tmp_path / "reg",
        make_checkpoint(tmp_path / "a"),
        name="code-tiny",
        arm="grpo-s0",
        params={
            "task": {"name": "code"},
            "trainer": {"num_weights": 8},
            "arms": [{"name": "grpo", "estimator": "grpo", "num_answers": 1}],
        },
    )
    front = yaml.safe_load(read_card(entry).split("---\n")[1])
    assert (front["vpo"]["task"], front["vpo"]["estimator"], front["vpo"]["m"], front["vpo"]["K"]) == (
        "code",
        "grpo",
        1,
        8,
    )
    assert "model-index" not in front and "No evaluation metrics were recorded" in read_card(entry)
    assert "base model content hash: `not recorded`" in read_card(entry)


# --------------------------------------------------------------------------- old entries


def test_schema_1_entries_still_load_verify_and_fetch(tmp_path: Path, capsys) -> None:
    """An entry written by the earlier registry: every file hashed, no roles, no card."""
    reg = tmp_path / "reg"
    ckpt = make_checkpoint(tmp_path / "old")
    (ckpt / "training_args.bin").write_bytes(b"/abs/path")
    files = []
    for p in sorted(q for q in ckpt.rglob("*") if q.is_file()):
        rel = p.relative_to(ckpt).as_posix()
        files.append(
            {"path": rel, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        )
        (reg / "objects" / "X" / rel).parent.mkdir(parents=True, exist_ok=True)
        (reg / "objects" / "X" / rel).write_bytes(p.read_bytes())
    digest = registry._manifest_hash([registry.FileRecord(**f) for f in files])
    (reg / "objects" / "X").rename(reg / "objects" / digest)
    old = {
        "hash": digest,
        "name": "route-quick",
        "arm": "grpo-s0",
        "created_at": "2026-01-01T00:00:00Z",
        "git_rev": None,
        "git_dirty": None,
        "dvc_lock_sha256": None,
        "params": {},
        "lineage": {"base": "base"},
        "metrics": eval_metrics({1: 0.3}),
        "files": files,
        "size_bytes": 1,
        "schema": 1,
    }
    (reg / "entries").mkdir()
    (reg / "entries" / f"{digest}.json").write_text(json.dumps(old))
    entry = get_entry(reg, digest[:8])
    assert entry.schema == 1 and all(f.role is None and f.hashed for f in entry.files)
    verify_entry(entry)
    assert tree(fetch(entry, tmp_path / "out")) == tree(ckpt)
    assert "best@k | 0.3" in read_card(entry)  # rendered on demand
    new = register(reg, make_checkpoint(tmp_path / "new", seed=1), name="route-quick", arm="vpo-s0")
    assert list_entries(reg) == [entry, new] and latest_entry(reg) == new
    assert registry.main(["list", "--registry", str(reg)]) == 0
    assert digest[:12] in capsys.readouterr().out


# --------------------------------------------------------------------------- CLI


def test_cli_subcommands(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = tmp_path / "reg"
    quick, grpo, vpo = register_three(reg, tmp_path)
    r = ["--registry", str(reg)]

    def run(*argv: str) -> tuple[int, str, str]:
        code = registry.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = run("list", *r)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == [
        "hash",
        "name",
        "arm",
        "created",
        "best@1",
        "best@kmax",
        "diversity",
        "aliases",
    ]
    row = next(line for line in lines if line.startswith(vpo.hash[:12])).split()
    assert row[1:3] == ["route", "vpo-s0"] and row[5:8] == ["0.4", "0.8", "(k=5)"] and row[8] == "1.3"
    assert row[9] == "latest,best"
    code, out, _ = run("list", *r, "--name", "route-quick", "--json")
    assert code == 0 and [json.loads(x)["hash"] for x in out.splitlines()] == [quick.hash[:12]]
    assert json.loads(out)["best@k_max"] == 0.95 and json.loads(out)["aliases"] == ["latest", "best"]

    assert run("promote", *r, "route@best", "production", "--note", "ok")[0:2] == (
        0,
        f"route@production -> {vpo.hash[:12]}\n",
    )
    code, out, _ = run("show", *r, "route@production")
    shown = json.loads(out)
    assert code == 0 and shown["hash"] == vpo.hash and shown["aliases"] == ["latest", "best", "production"]
    assert shown["objects"].endswith(f"objects/{vpo.hash}")
    code, out, _ = run("show", *r, vpo.hash[:8], "--card")
    assert code == 0 and out == read_card(vpo)
    code, out, _ = run("best", *r, "--metric", "eval.best_at_k.1", "--name", "route")
    assert code == 0 and out.startswith(f"{grpo.hash[:12]}  route  grpo-s0  eval.best_at_k.1=0.5")
    code, out, _ = run("best", *r, "--json", "--metric", "eval.reward_diversity", "--lower-is-better")
    assert code == 0 and json.loads(out)["hash"] == grpo.hash[:12] and json.loads(out)["value"] == 0.2
    code, out, _ = run("fetch", *r, "route@production", str(tmp_path / "got"))
    assert (
        code == 0
        and out.strip() == str(tmp_path / "got")
        and registry.content_hash(tmp_path / "got") == vpo.hash
    )
    code, out, _ = run("verify", *r)
    assert code == 0 and out.count("ok   ") == 3 and "3/3 entries verified" in out
    flip_byte(reg / "objects" / grpo.hash / "model.safetensors")
    code, out, _ = run("verify", *r, grpo.hash[:8])
    assert code == 1 and f"FAIL {grpo.hash[:12]} (route/grpo-s0): model.safetensors is corrupt" in out
    code, out, _ = run("promote", *r, "--remove", "route@production")
    assert code == 0 and out == f"removed route@production (was {vpo.hash[:12]})\n"

    # bad input: one "error:" line, exit 2
    for argv, fragment in [
        (("show", *r, "route@production"), "error: no alias 'route@production'"),
        (("show", *r, "zz"), "error: entry key must be a hash"),
        (("best", *r, "--metric", "eval.bleu"), "error: no entry has metric 'eval.bleu'"),
        (("promote", *r, vpo.hash, "latest"), "error: alias 'latest' is computed by the registry"),
        (("promote", *r, vpo.hash), "error: promote: give the entry key and the alias"),
        (("fetch", *r, vpo.hash), "error: fetch: a destination folder is required"),
        (
            ("list", "--registry", str(tmp_path / "missing")),
            f"error: registry folder {tmp_path / 'missing'} does not",
        ),
        (("frobnicate", *r), "error: argument cmd: invalid choice: 'frobnicate'"),
    ]:
        code, out, err = run(*argv)
        assert code == 2 and fragment in err, (argv, err)
    monkeypatch.delenv("VPO_REGISTRY", raising=False)
    code, _, err = run("list")
    assert code == 2 and "error: no registry given: pass --registry URL" in err
    assert registry.main(["list", "--json"], default_registry=str(reg)) == 0  # the pipeline's registry
    assert len(capsys.readouterr().out.splitlines()) == 3
    monkeypatch.setenv("VPO_REGISTRY", str(tmp_path / "missing"))  # the environment overrides it
    assert run("list")[0] == 2
    assert registry.main(["list", "--registry", str(reg)], default_registry=str(tmp_path / "missing")) == 0
    capsys.readouterr()


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    entry = register(reg, make_checkpoint(tmp_path / "a"), name="route", arm="vpo-s0")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "vpo.pipeline.registry", "--registry", str(reg), "list"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert entry.hash[:12] in proc.stdout and "route" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "vpo.pipeline.registry", "--registry", str(reg), "show", "nothex"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: entry key must be")
