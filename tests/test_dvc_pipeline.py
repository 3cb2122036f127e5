"""dvc.yaml: generated from pipelines.yaml, reproducible offline, cached so a second repro re-runs
nothing, and restorable byte for byte from a local and an S3 (loopback moto) remote.

The slow tests work on a copy of the temporary git repository in which the session's quick flow
(``quick_flow`` in conftest.py) ran every quick stage through ``dvc repro --single-item``; plain
``dvc`` then has to agree with those results. Nothing here runs ``dvc`` in the shared checkout.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    from flows_fixtures import DVC, REPO, FlowResult, run, tree_digest
except ModuleNotFoundError:  # tests/ imported as a package
    from tests.flows_fixtures import DVC, REPO, FlowResult, run, tree_digest

from flows.dvcgen import dvc_yaml_text, stage_names
from vpo.config import load_pipeline
from vpo.stages import arm_runs
from vpo.storage import configure_dvc_remote, scan_for_secrets

QUICK = "route-quick"


def _declared_stages(dvc_yaml: dict[str, Any]) -> set[str]:
    names = set()
    for name, body in dvc_yaml["stages"].items():
        names.update(f"{name}@{k}" for k in body["foreach"]) if "foreach" in body else names.add(name)
    return names


def _quick_stage_names() -> list[str]:
    return [dvc for _, dvc, _ in stage_names(load_pipeline("route", REPO / "pipelines.yaml", quick=True))]


# --------------------------------------------------------------------------- fast: the file itself


def test_dvc_yaml_is_up_to_date_with_pipelines_yaml() -> None:
    """The committed dvc.yaml is exactly what flows.dvcgen derives from pipelines.yaml."""
    assert (REPO / "dvc.yaml").read_text(encoding="utf-8") == dvc_yaml_text(REPO / "pipelines.yaml"), (
        "dvc.yaml is stale: run `python -m flows.dvcgen`"
    )


@pytest.mark.parametrize("quick", [False, True])
def test_dvc_yaml_covers_every_arm_seed_and_real_params(quick: bool) -> None:
    """One train stage per enabled arm x seed; every params key exists; every code dep exists."""
    cfg = load_pipeline("route", REPO / "pipelines.yaml", quick=quick)
    dvc_yaml = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))
    prefix = "route-quick" if quick else "route"
    train = dvc_yaml["stages"][f"{prefix}-train"]
    assert sorted(train["foreach"]) == sorted(rid for _, _, rid in arm_runs(cfg))
    assert all(
        cfg.arm(item["arm"]).enabled and item["seed"] in cfg.arm(item["arm"]).seeds
        for item in train["foreach"].values()
    )
    assert {dvc for _, dvc, _ in stage_names(cfg)} <= _declared_stages(dvc_yaml)
    params = yaml.safe_load((REPO / "pipelines.yaml").read_text(encoding="utf-8"))
    for name, body in dvc_yaml["stages"].items():
        if not name.startswith(f"{prefix}-") or (not quick and name.startswith("route-quick-")):
            continue
        stage = body.get("do", body)
        for key in stage["params"][0]["pipelines.yaml"]:
            node: Any = params
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, (
                    f"{name}: params key {key} not in pipelines.yaml"
                )
                node = node[part]
        for dep in stage["deps"]:
            if dep.startswith("vpo/"):
                assert (REPO / dep).is_file(), f"{name}: dep {dep} does not exist"
    assert (
        json.loads((REPO / ".dvc" / "plots" / "arms.json").read_text())["encoding"]["color"]["field"] == "arm"
    )


def test_dvc_config_is_quiet_and_secret_free() -> None:
    """The tracked DVC config disables update checks and analytics and names no remote credentials."""
    text = (REPO / ".dvc" / "config").read_text(encoding="utf-8")
    assert re.search(r"check_update\s*=\s*false", text) and re.search(r"analytics\s*=\s*false", text)
    assert "secret" not in text and "access_key" not in text


# --------------------------------------------------------------------------- slow: repro, push, pull


@pytest.fixture(scope="module")
def repro_repo(quick_flow: FlowResult, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the repository the quick flow ran in (every quick stage already ran there through
    `dvc repro --single-item`), so plain `dvc` commands can be checked against the flow's results."""
    assert quick_flow.state.is_completed(), quick_flow.state.message
    repo = tmp_path_factory.mktemp("dvc") / "repo"
    src_tmp = quick_flow.repo / ".dvc" / "tmp"
    shutil.copytree(
        quick_flow.repo, repo, symlinks=True, ignore=lambda d, names: names if Path(d) == src_tmp else []
    )
    return repo


def _outs(repo: Path) -> list[Path]:
    lock = yaml.safe_load((repo / "dvc.lock").read_text(encoding="utf-8"))
    return [
        repo / out["path"]
        for name, st in lock["stages"].items()
        if name.startswith(f"{QUICK}-")
        for out in st.get("outs", [])
    ]


def _digest(repo: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for path in _outs(repo):
        if path.is_dir():
            out.update({f"{path.relative_to(repo)}/{k}": v for k, v in tree_digest(path).items()})
        else:
            out.update({str(path.relative_to(repo)): tree_digest(path.parent)[path.name]})
    return out


def _ran_and_skipped(output: str) -> tuple[set[str], set[str]]:
    ran = set(re.findall(r"Running stage '([^']+)'", output))
    return ran, set(re.findall(r"Stage '([^']+)' didn't change, skipping", output))


@pytest.mark.slow
@pytest.mark.integration
def test_plain_repro_after_the_flow_reruns_nothing(repro_repo: Path) -> None:
    """The flow's stage-by-stage results satisfy plain `dvc repro`: every quick stage is skipped."""
    expected = set(_quick_stage_names())
    ran, skipped = _ran_and_skipped(run([DVC, "repro", f"{QUICK}-evaluate"], repro_repo).stdout)
    assert ran == set() and skipped == expected
    status = run([DVC, "status", f"{QUICK}-evaluate", "--with-deps"], repro_repo)
    assert "Data and pipelines are up to date" in status.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_repro_reruns_exactly_the_changed_stage_then_nothing(repro_repo: Path) -> None:
    """Changing an evaluation-only param re-runs `evaluate` alone; the next repro runs nothing;
    metrics and the per-arm best@k plot are readable through DVC."""
    path = repro_repo / "pipelines.yaml"
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    raw["pipelines"]["route"]["quick"]["evaluation"]["n_samples"] = 6
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    ran, skipped = _ran_and_skipped(run([DVC, "repro", f"{QUICK}-evaluate"], repro_repo, timeout=900).stdout)
    assert ran == {f"{QUICK}-evaluate"} and skipped == set(_quick_stage_names()) - ran
    ran, skipped = _ran_and_skipped(run([DVC, "repro", f"{QUICK}-evaluate"], repro_repo).stdout)
    assert ran == set() and skipped == set(_quick_stage_names())
    metrics_path = f"runs/{QUICK}/eval/metrics.json"
    shown = json.loads(run([DVC, "metrics", "show", "--json", metrics_path], repro_repo).stdout)
    data = next(iter(shown.values()))["data"][metrics_path]["data"]
    assert data["n_samples"] == 6 and set(data["arms"]) >= {"grpo", "vpo", "grpo_x3"}
    plots = json.loads(
        run([DVC, "plots", "show", "--json", f"{QUICK}-best-at-k", f"{QUICK}-train-loss"], repro_repo).stdout
    )
    values = plots["data"][f"{QUICK}-best-at-k"][0]["content"]["data"]["values"]
    assert {v["arm"] for v in values} >= {"grpo", "vpo", "grpo_x3"} and all("k" in v for v in values)
    assert plots["data"][f"{QUICK}-train-loss"][0]["content"]["data"]["values"]
    shutil.rmtree(repro_repo / "dvc_plots", ignore_errors=True)


def _roundtrip(repo: Path, url: str) -> None:
    """Push to ``url``, wipe cache and outputs, pull, and compare every output byte for byte."""
    targets = _quick_stage_names()
    configure_dvc_remote(repo, url, name="storage")
    before = _digest(repo)
    assert len(before) > 20
    run([DVC, "push", "-r", "storage", *targets], repo)
    shutil.rmtree(repo / ".dvc" / "cache")
    for path in _outs(repo):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert not (repo / "runs" / QUICK / "eval").exists()
    run([DVC, "pull", "-r", "storage", *targets], repo)
    assert _digest(repo) == before
    status = run([DVC, "status", f"{QUICK}-evaluate", "--with-deps"], repo)
    assert "Data and pipelines are up to date" in status.stdout
    cloud = run([DVC, "status", "-c", "-r", "storage", *targets], repo)
    assert "in sync" in cloud.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_push_then_pull_into_empty_cache_local_remote(repro_repo: Path, tmp_path: Path) -> None:
    """Local-directory remote: the round trip restores every output byte for byte."""
    _roundtrip(repro_repo, str(tmp_path / "remote"))
    assert any((tmp_path / "remote" / "files" / "md5").rglob("*"))


@pytest.mark.slow
@pytest.mark.integration
def test_push_then_pull_into_empty_cache_s3_remote(repro_repo: Path, s3_bucket: str, s3_server: Any) -> None:
    """S3 remote on the loopback moto server: same round trip; keys stay out of the repo's files."""
    repo = repro_repo
    _roundtrip(repo, f"s3://{s3_bucket}/dvc")
    keys = s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="dvc/files/md5/")
    assert keys.get("KeyCount", 0) > 0
    config_local = (repo / ".dvc" / "config.local").read_text(encoding="utf-8")
    assert f"s3://{s3_bucket}/dvc" in config_local
    assert (
        scan_for_secrets([repo / ".dvc", repo / "dvc.yaml", repo / "dvc.lock", repo / "pipelines.yaml"]) == []
    )
