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
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.repos import DVC, REPO, FlowResult, QuickRun, copy_repo, run, tool_env, tree_digest
from vpo.pipeline.config import load_pipeline
from vpo.pipeline.config.layout import arm_runs
from vpo.pipeline.dvc.generate import dvc_yaml_text, params_yaml_text
from vpo.pipeline.engine.storage import configure_dvc_remote, scan_for_secrets
from vpo.pipeline.steps import steps_of

QUICK = "route-quick"


def _declared_stages(dvc_yaml: dict[str, Any]) -> set[str]:
    names = set()
    for name, body in dvc_yaml["stages"].items():
        names.update(f"{name}@{k}" for k in body["foreach"]) if "foreach" in body else names.add(name)
    return names


def _stage_names(cfg: Any) -> list[str]:
    return [step.dvc_name(cfg.variant) for step in steps_of(cfg) if step.stage.in_dvc]


def _quick_stage_names() -> list[str]:
    return _stage_names(load_pipeline("route", REPO / "pipelines.yaml", quick=True))


def _upto_evaluate() -> set[str]:
    """The quick stages `dvc repro route-quick-evaluate` covers (search comes after evaluate)."""
    return set(_quick_stage_names()) - {f"{QUICK}-search"}


# --------------------------------------------------------------------------- fast: the file itself


def test_dvc_yaml_and_params_yaml_are_up_to_date_with_pipelines_yaml() -> None:
    """The committed dvc.yaml and params.yaml are exactly what `vpo dvc` derives from pipelines.yaml."""
    assert (REPO / "dvc.yaml").read_text(encoding="utf-8") == dvc_yaml_text(REPO / "pipelines.yaml"), (
        "dvc.yaml is stale: run `vpo dvc`"
    )
    assert (REPO / "params.yaml").read_text(encoding="utf-8") == params_yaml_text(REPO / "pipelines.yaml"), (
        "params.yaml is stale: run `vpo dvc`"
    )


def _declared_repo(tmp_path: Path, *variants: str) -> Path:
    """A copy of pipelines.yaml with dvc.yaml and params.yaml generated for ``variants``."""
    shutil.copy(REPO / "pipelines.yaml", tmp_path / "pipelines.yaml")
    from vpo.pipeline.dvc.generate import main as dvc_main

    assert dvc_main(["--config", str(tmp_path / "pipelines.yaml"), *[a for v in variants for a in ("--add", v)]]) == 0
    return tmp_path


def test_dvc_yaml_declares_only_the_variants_in_use(tmp_path: Path) -> None:
    """The committed dvc.yaml declares the quick variant only (what make quick, CI and the flow tests
    run), so `dvc status` and `dvc metrics show` speak of nothing else; `vpo dvc --add route` declares
    the full main job, `--remove` drops it again, and the choice survives a plain `vpo dvc`."""
    from vpo.pipeline.dvc.generate import declared_variants
    from vpo.pipeline.dvc.generate import main as dvc_main

    committed = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))
    assert all(name.startswith(f"{QUICK}-") for name in committed["stages"])
    assert committed["metrics"] == [f"runs/{QUICK}/eval/summary.json"]
    repo = _declared_repo(tmp_path, "route")
    assert sorted(declared_variants(repo / "pipelines.yaml")) == ["route", "route-quick"]
    both = yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8"))
    assert "route-evaluate" in both["stages"] and f"{QUICK}-evaluate" in both["stages"]
    assert dvc_main(["--config", str(repo / "pipelines.yaml")]) == 0  # keeps the declared set
    assert "route-evaluate" in yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    assert dvc_main(["--config", str(repo / "pipelines.yaml"), "--remove", "route"]) == 0
    assert (repo / "dvc.yaml").read_text(encoding="utf-8") == (REPO / "dvc.yaml").read_text(encoding="utf-8")
    assert dvc_main(["--config", str(repo / "pipelines.yaml"), "--add", "nope"]) == 2


@pytest.mark.parametrize("quick", [False, True])
def test_dvc_yaml_covers_every_arm_seed_and_real_params(quick: bool, tmp_path: Path) -> None:
    """One train stage per enabled arm x seed; every params key exists; every code dep exists."""
    repo = _declared_repo(tmp_path, "route")
    cfg = load_pipeline("route", repo / "pipelines.yaml", quick=quick)
    dvc_yaml = yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8"))
    prefix = "route-quick" if quick else "route"
    train = dvc_yaml["stages"][f"{prefix}-train"]
    assert sorted(train["foreach"]) == sorted(r.rid for r in arm_runs(cfg))
    assert all(
        cfg.arm(item["arm"]).enabled and item["seed"] in cfg.arm(item["arm"]).seeds
        for item in train["foreach"].values()
    )
    assert set(_stage_names(cfg)) <= _declared_stages(dvc_yaml)
    params = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))
    for name, body in dvc_yaml["stages"].items():
        if not name.startswith(f"{prefix}-") or (not quick and name.startswith("route-quick-")):
            continue
        stage = body.get("do", body)
        items = list(body["foreach"].values()) if "foreach" in body else [{}]
        for key in stage["params"][0]["params.yaml"]:
            for item in items:
                node: Any = params
                for part in key.replace("${item.arm}", str(item.get("arm"))).split("."):
                    assert isinstance(node, dict) and part in node, (
                        f"{name}: params key {key} not in params.yaml"
                    )
                    node = node[part]
        for dep in stage["deps"]:
            if dep.startswith("vpo/"):
                assert (REPO / dep).is_file(), f"{name}: dep {dep} does not exist"
    assert (
        json.loads((REPO / ".dvc" / "plots" / "arms.json").read_text())["encoding"]["color"]["field"] == "arm"
    )
    assert json.loads((REPO / ".dvc" / "plots" / "runs.json").read_text())["encoding"]["color"]["field"] == "run"


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
    repo = copy_repo(quick_flow.repo, tmp_path_factory.mktemp("dvc") / "repo")
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
    """Digest of every file of the stages' outputs that DVC tracks (what ``.dvcignore`` excludes is not)."""
    import pathspec

    ignored = pathspec.PathSpec.from_lines("gitwildmatch", (repo / ".dvcignore").read_text().splitlines())
    out: dict[str, str] = {}
    for path in _outs(repo):
        if path.is_dir():
            out.update({f"{path.relative_to(repo)}/{k}": v for k, v in tree_digest(path).items()})
        else:
            out.update({str(path.relative_to(repo)): tree_digest(path.parent)[path.name]})
    return {k: v for k, v in out.items() if not ignored.match_file(k)}


def _ran_and_skipped(output: str) -> tuple[set[str], set[str]]:
    ran = set(re.findall(r"Running stage '([^']+)'", output))
    return ran, set(re.findall(r"Stage '([^']+)' didn't change, skipping", output))


@pytest.mark.slow
@pytest.mark.integration
def test_plain_repro_after_the_flow_reruns_nothing(repro_repo: Path) -> None:
    """The flow's stage-by-stage results satisfy plain `dvc repro`: every quick stage is skipped."""
    expected = _upto_evaluate()
    ran, skipped = _ran_and_skipped(run([DVC, "repro", f"{QUICK}-evaluate"], repro_repo).stdout)
    assert ran == set() and skipped == expected
    status = run([DVC, "status", f"{QUICK}-evaluate", "--with-deps"], repro_repo)
    assert "Data and pipelines are up to date" in status.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_repro_reruns_exactly_the_changed_stage_then_nothing(repro_repo: Path) -> None:
    """`dvc exp run -S` with an evaluation-only param re-runs `evaluate` alone and leaves pipelines.yaml
    byte-identical; the next repro runs nothing; metrics (a few lines) and the per-arm best@k plot are
    readable through DVC, and `dvc plots show` writes a page that needs no network."""
    pipelines_before = (repro_repo / "pipelines.yaml").read_bytes()
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", "add", "-A"], repro_repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "flow outputs"], repro_repo)
    exp = run([DVC, "exp", "run", "-S", f"{QUICK}.evaluation.n_samples=6", f"{QUICK}-evaluate"], repro_repo,
              timeout=900)
    ran, skipped = _ran_and_skipped(exp.stdout)
    assert ran == {f"{QUICK}-evaluate"} and skipped == _upto_evaluate() - ran, exp.stdout[-3000:]
    assert (repro_repo / "pipelines.yaml").read_bytes() == pipelines_before
    assert yaml.safe_load((repro_repo / "params.yaml").read_text(encoding="utf-8"))[QUICK]["evaluation"][
        "n_samples"] == 6
    ran, skipped = _ran_and_skipped(run([DVC, "repro", f"{QUICK}-evaluate"], repro_repo).stdout)
    assert ran == set() and skipped == _upto_evaluate()
    metrics_path = f"runs/{QUICK}/eval/metrics.json"
    shown = json.loads(run([DVC, "metrics", "show", "--json", metrics_path], repro_repo).stdout)
    data = next(iter(shown.values()))["data"][metrics_path]["data"]
    assert data["n_samples"] == 6 and set(data["arms"]) >= {"grpo", "vpo", "grpo_x3"}
    table = run([DVC, "metrics", "show"], repro_repo)  # the declared summary file: a few numbers per arm
    lines = table.stdout.strip().splitlines()
    assert len(lines) < 20 and "failed" not in (table.stdout + table.stderr).lower(), table.stdout
    assert lines[0].split()[0] == "Path" and "vpo.best@1" in lines[0] and lines[1].startswith(f"runs/{QUICK}/")
    plots = json.loads(
        run([DVC, "plots", "show", "--json", f"{QUICK}-best-at-k", f"{QUICK}-train-loss"], repro_repo).stdout
    )
    values = plots["data"][f"{QUICK}-best-at-k"][0]["content"]["data"]["values"]
    assert {v["arm"] for v in values} >= {"grpo", "vpo", "grpo_x3"} and all("k" in v for v in values)
    assert plots["data"][f"{QUICK}-train-loss"][0]["content"]["data"]["values"]
    run([DVC, "plots", "show", f"{QUICK}-best-at-k", f"{QUICK}-train-loss"], repro_repo)
    page = (repro_repo / "dvc_plots" / "index.html").read_text(encoding="utf-8")
    assert "vegaEmbed" in page and f"{QUICK}-best-at-k" in page
    assert not re.search(r"<script[^>]+src=[\"']https?:", page), "the page loads scripts from the network"
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


# --------------------------------------------------------------------------- vpo run, then plain dvc


@pytest.fixture(scope="module")
def main_job_repo(quick_repo: QuickRun, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A copy of the session's repository in which `vpo run --quick` ran (no `dvc repro`; its training
    runs side by side, two at once, as `execution.max_parallel: 2` in the committed pipelines.yaml
    says), with a `.venv` beside it as a fresh clone after `make quick` has; and what it printed."""
    return quick_repo.copy(tmp_path_factory.mktemp("mainjob") / "repo"), quick_repo.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_dvc_repro_after_a_parallel_vpo_run_reruns_nothing(main_job_repo: tuple[Path, str]) -> None:
    """`vpo run` trained the arms side by side, then recorded every stage it ran in dvc.lock (`dvc
    commit`): `dvc status` is clean and `dvc repro` (run as `env -i PATH=/usr/bin:/bin .venv/bin/dvc`)
    re-runs nothing. A forced stage finds the project's Python without a virtualenv on PATH, reports
    up to date and changes no output."""
    repo, printed = main_job_repo
    recorded = f"[vpo] dvc.lock: recorded {len(_quick_stage_names())} stages"
    assert "[vpo] 4 training runs, 2 at once" in printed and recorded in printed, printed
    env = {"HOME": str(Path.home()), "PATH": "/usr/bin:/bin", "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "1"}
    dvc = str(repo / ".venv" / "bin" / "dvc")
    status = run([dvc, "status", f"{QUICK}-evaluate", "--with-deps"], repo, env=env)
    assert "Data and pipelines are up to date" in status.stdout, status.stdout
    ran, skipped = _ran_and_skipped(run([dvc, "repro", f"{QUICK}-evaluate"], repo, env=env).stdout)
    assert ran == set() and skipped == _upto_evaluate()
    outputs = repo / "runs" / QUICK
    before = tree_digest(outputs)
    proc = run([dvc, "repro", "--force", "--single-item", f"{QUICK}-train@vpo-s0"], repo, env=env, timeout=900)
    assert "vpo: command not found" not in proc.stdout + proc.stderr
    assert "[vpo] train@vpo-s0: up to date" in proc.stdout, proc.stdout[-3000:]
    after = tree_digest(outputs)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing rebuilt or deleted
    ran, skipped = _ran_and_skipped(run([dvc, "repro", f"{QUICK}-evaluate"], repo, env=env).stdout)
    assert ran == set() and f"{QUICK}-evaluate" in skipped


@pytest.mark.slow
@pytest.mark.integration
def test_dvc_repro_during_a_running_vpo_run_loses_nothing(main_job_repo: tuple[Path, str], tmp_path: Path) -> None:
    """`dvc repro` started while `vpo run` holds the run lock: the stage refuses at the lock (persisted
    outputs: DVC deleted nothing first), and the running job finishes with its outputs intact."""
    import subprocess
    import time

    repo = tmp_path / "repo"
    copy_repo(main_job_repo[0], repo)
    data_before = tree_digest(repo / "runs" / QUICK / "data")
    job = subprocess.Popen([sys.executable, "-m", "vpo.pipeline.cli", "run", "--quick", "--no-search", "--set",
                            "arms.vpo.max_steps=5"], cwd=repo, env=tool_env(OMP_NUM_THREADS="1"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lock = repo / "runs" / QUICK / ".lock"
    deadline = time.monotonic() + 120
    while not (lock.is_file() and lock.read_text().strip()):
        assert job.poll() is None and time.monotonic() < deadline, "the run never took its lock"
        time.sleep(0.2)
    proc = run([DVC, "repro", "--single-item", f"{QUICK}-data", "--force"], repo, check=False)
    assert proc.returncode != 0 and "is already running" in proc.stdout + proc.stderr, proc.stdout[-2000:]
    assert tree_digest(repo / "runs" / QUICK / "data") == data_before
    out, _ = job.communicate(timeout=900)
    assert job.returncode == 0, out[-3000:]
    assert "train@vpo-s0: arm.max_steps set to 5; retraining" in out, out[-3000:]
    assert tree_digest(repo / "runs" / QUICK / "data") == data_before
    assert json.loads((repo / "runs" / QUICK / "arms" / "vpo-s0" / "metrics.json").read_text())["max_steps"] == 5
