"""The registry over a real git + DVC project: GTO versions and stages as git tags (and ``gto show``
agreeing with ``vpo registry list``), weights fetched through DVC (``dvc artifacts get`` for a version,
the cache and remote by md5 otherwise), verify re-hashing what DVC returns, a fresh clone that has only
the git tags, and the one-line fallback when tags cannot be written. The slow test runs the quick
pipeline with an S3 DVC remote (the session's quick flow), promotes an arm and gets it back in a clone."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.registry import make_checkpoint, metrics
from tests.support.repos import QuickRun, copy_repo
from vpo.pipeline.engine.checkpoints import content_hash
from vpo.pipeline.registry import Registry
from vpo.pipeline.registry.cli import main

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "runs/q/arms/vpo-s0/model"
GIT_ID = {"GIT_AUTHOR_NAME": "vpo-tests", "GIT_AUTHOR_EMAIL": "tests@vpo.invalid",
          "GIT_COMMITTER_NAME": "vpo-tests", "GIT_COMMITTER_EMAIL": "tests@vpo.invalid"}


def sh(*cmd: str | Path, cwd: Path) -> str:
    env = {**os.environ, **GIT_ID, "DVC_NO_ANALYTICS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def record(repo: Path, message: str) -> None:
    """What a user does after a run: `dvc commit` the train stage, push, commit dvc.lock."""
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc:
        dvc.commit(f"{repo}/dvc.yaml:train", force=True)
        dvc.push()
    sh("git", "add", "-A", cwd=repo)
    sh("git", "commit", "-qm", message, cwd=repo)


def files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
            if p.is_file() and p.name != "README.md"}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A git + DVC project: one train stage whose output holds an arm's model folder (a dvc.yaml artifact),
    recorded in dvc.lock, pushed to a local DVC remote and committed."""
    repo = tmp_path / "proj"
    repo.mkdir()
    sh("git", "init", "-q", "-b", "main", cwd=repo)
    for key, value in (("user.name", "vpo-tests"), ("user.email", "tests@vpo.invalid")):
        sh("git", "config", key, value, cwd=repo)
    from dvc.repo import Repo

    Repo.init(str(repo)).close()
    (repo / ".dvc" / "config").write_text(f"[core]\n    remote = here\n['remote \"here\"']\n    url = {tmp_path / 'remote'}\n")
    shutil.copy(REPO / ".dvcignore", repo / ".dvcignore")
    (repo / ".gitignore").write_text("/runs/\n")
    (repo / "dvc.yaml").write_text(yaml.safe_dump({
        "stages": {"train": {"cmd": "true", "outs": [{"runs/q/arms/vpo-s0": {"persist": True}}]}},
        "artifacts": {"q-vpo-s0": {"path": MODEL, "type": "model"}}}))
    make_checkpoint(repo / MODEL)
    record(repo, "first run")
    return repo


def register(repo: Path, registry: Path) -> tuple:
    return Registry(registry, repo).register(repo / MODEL, name="q", arm="vpo-s0", path=MODEL,
                                             metrics=metrics({1: 0.5}), lineage={"estimator": "vpo", "task": "route"})


def test_versions_and_stages_are_git_tags_that_gto_show_reports(project: Path, tmp_path: Path, capsys) -> None:
    reg_dir = tmp_path / "registry"
    entry, why = register(project, reg_dir)
    assert why is None and entry.version == "v0.0.1"
    assert entry.git_rev == sh("git", "rev-parse", "HEAD", cwd=project).strip()
    assert register(project, reg_dir)[0].version == "v0.0.1"  # registering again tags nothing new
    assert main(["--registry", str(reg_dir), "--repo", str(project), "promote", "q-vpo-s0", "--stage", "production"]) == 0
    assert "is now in stage production (GTO tag)" in capsys.readouterr().out
    assert sh("git", "tag", cwd=project).split() == ["q-vpo-s0#production#1", "q-vpo-s0@v0.0.1"]
    shown = sh("gto", "show", "--json", cwd=project)
    gto = yaml.safe_load(shown)
    assert gto["q-vpo-s0"]["version"] == "v0.0.1" and gto["q-vpo-s0"]["stage"]["production"] == "v0.0.1"
    assert main(["--registry", str(reg_dir), "--repo", str(project), "list"]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert "q-vpo-s0" in row and "v0.0.1" in row and "production" in row


def test_fetch_and_verify_go_through_dvc_and_a_clone_needs_only_the_tags(project: Path, tmp_path: Path) -> None:
    reg = Registry(tmp_path / "registry", project)
    entry, _ = register(project, tmp_path / "registry")
    reg.promote("q-vpo-s0", "production")
    dest, how = reg.fetch(reg.get("production"), tmp_path / "out")
    assert how.startswith("dvc artifacts get q-vpo-s0") and files(dest) == files(project / MODEL)
    assert (dest / "README.md").read_text() == reg.card(entry)
    assert reg.verify(entry) == []
    cached = next(Path(p) for p in (project / ".dvc" / "cache" / "files" / "md5").rglob("*")
                  if p.is_file() and p.stat().st_size == (project / MODEL / "model.safetensors").stat().st_size)
    cached.chmod(0o644)
    cached.write_bytes(b"X" * cached.stat().st_size)  # the cache's copy of the weights rots
    assert "model.safetensors is corrupt" in " ".join(reg.verify(entry))
    clone = tmp_path / "clone"
    sh("git", "clone", "-q", str(project), str(clone), cwd=tmp_path)
    sh("dvc", "artifacts", "get", ".", "q-vpo-s0", "--stage", "production", "-o", str(tmp_path / "got"), cwd=clone)
    assert files(tmp_path / "got") == files(project / MODEL)  # from the DVC remote: the cache was not cloned
    assert main(["--registry", str(tmp_path / "empty"), "--repo", str(clone), "fetch", "production",
                 str(tmp_path / "fetched")]) == 0  # no registry entries here: the GTO tag says what to check
    assert files(tmp_path / "fetched") == files(project / MODEL)


def test_a_run_not_in_a_committed_dvc_lock_is_unversioned_until_it_is(project: Path, tmp_path: Path) -> None:
    reg_dir = tmp_path / "registry"
    register(project, reg_dir)
    make_checkpoint(project / MODEL, seed=7)  # a new training run, dvc.lock not committed yet
    entry, why = register(project, reg_dir)
    assert entry.version is None and "HEAD's dvc.lock records other outputs than this run's" in why
    from dvc.repo import Repo

    with Repo(str(project)) as dvc:
        dvc.commit(f"{project}/dvc.yaml:train", force=True)  # in the DVC cache, not in git: fetched by md5
    dest, how = Registry(reg_dir, project).fetch(entry, tmp_path / "out")
    assert "by md5" in how and content_hash(dest) == entry.hash
    record(project, "second run")
    again, why = register(project, reg_dir)
    assert (again.version, why, again.created_at) == ("v0.0.2", None, entry.created_at)


def test_tags_that_cannot_be_written_fall_back_to_the_registrys_record(project: Path, tmp_path: Path) -> None:
    tags = project / ".git" / "refs" / "tags"
    shutil.rmtree(tags)
    tags.write_text("not a folder\n")  # no tag can be created (even by root)
    entry, why = register(project, tmp_path / "registry")
    assert entry.version is None and why.startswith("git tags cannot be written")
    line = Registry(tmp_path / "registry", project).promote(entry.hash[:8], "production")
    assert "kept in the registry's own record" in line
    assert Registry(tmp_path / "registry", project).get("production").hash == entry.hash


# --------------------------------------------------------------------------- vpo run and dvc.lock


@pytest.mark.slow
def test_after_vpo_run_dvc_finds_every_stage_up_to_date_and_models_version_once_committed(
        quick_repo: QuickRun, tmp_path: Path) -> None:
    """`vpo run --quick` (the session's, conftest ``quick_repo``) recorded what it ran in dvc.lock: `dvc
    status` and `dvc repro` agree with vpo (nothing re-runs); committing dvc.lock then lets `vpo stage
    register` tag GTO versions."""
    from tests.support.faults import run_vpo

    assert re.search(r"dvc\.lock: recorded \d+ stages \(dvc commit\)", quick_repo.stdout)
    assert re.search(r"no GTO version for grpo-s0, vpo-s0\b.*: HEAD has no committed dvc\.lock", quick_repo.stdout)
    repo = quick_repo.copy(tmp_path / "proj")
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=repo)
    repro = sh("dvc", "repro", cwd=repo)
    assert "Running stage" not in repro and "didn't change, skipping" in repro
    sh("git", "add", "dvc.lock", cwd=repo)
    sh("git", "commit", "-qm", "quick run", cwd=repo)
    proc = run_vpo(["stage", "register", "--quick"], repo, timeout=600, env=GIT_ID)
    assert proc.returncode == 0 and "route-quick-vpo-s0" in proc.stdout and "v0.0.1" in proc.stdout, proc.stdout
    assert "route-quick-vpo-s0@v0.0.1" in sh("git", "tag", cwd=repo).split()
    assert (repo / "runs" / "route-quick" / "arms" / "vpo-s0" / "model" / "README.md").is_file()
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=repo)  # the card is not DVC's


def test_a_run_with_other_settings_than_params_yaml_leaves_dvc_lock_alone(tmp_path: Path) -> None:
    """`vpo run --set ...` must not record its outputs under params.yaml's settings; outside a DVC
    project, or for a variant dvc.yaml does not declare, nothing is recorded either, and each says why."""
    from tests.support.faults import write_pipelines
    from vpo.pipeline.config import load_pipeline
    from vpo.pipeline.dvc.generate import main as dvc_main
    from vpo.pipeline.dvc.record import unmanaged_reason

    path = write_pipelines(tmp_path)
    assert dvc_main(["--config", str(path)]) == 0
    changed = load_pipeline("route", path, quick=True, overrides={"evaluation.n_samples": 6})
    names = ["route-quick-data", "route-quick-evaluate"]
    assert "is not a DVC repository" in unmanaged_reason(changed, names)
    (tmp_path / ".dvc").mkdir()
    assert "overridden with --set" in unmanaged_reason(changed, names)
    assert unmanaged_reason(load_pipeline("route", path, quick=True), names) is None
    assert "does not declare route-data" in unmanaged_reason(load_pipeline("route", path), ["route-data"])
    assert not (tmp_path / "dvc.lock").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_quick_pipeline_on_an_s3_remote_promoted_arm_comes_back_byte_identical_in_a_fresh_clone(
        quick_flow, s3_bucket: str, tmp_path: Path) -> None:
    """The session's quick flow ran every quick stage with an S3 DVC remote and registry. A copy of its
    repository pushes its outputs to a bucket of its own (other tests point the flow's repository at
    other buckets, some of them unreachable), commits its dvc.lock, registers (GTO versions) and promotes
    vpo-s0 to production; a fresh clone gets byte-identical weights with `vpo registry fetch production`
    and `dvc artifacts get --stage production`, and `gto show` lists the stage."""
    from tests.support.faults import run_vpo
    from vpo.pipeline.engine.storage import configure_dvc_remote

    assert quick_flow.state.is_completed(), quick_flow.state.message
    repo, clone = copy_repo(quick_flow.repo, tmp_path / "repo"), tmp_path / "clone"
    bucket = s3_bucket
    config = repo / "pipelines.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["pipelines"]["route"]["storage"].update(dvc_remote=f"s3://{bucket}/dvc", registry=f"s3://{bucket}/registry")
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    sh(sys.executable, "-m", "vpo.pipeline.cli", "dvc", cwd=repo)  # params.yaml follows (no stage reads storage)
    configure_dvc_remote(repo, f"s3://{bucket}/dvc", name="storage")
    stages = [n for n in yaml.safe_load((repo / "dvc.lock").read_text())["stages"] if n.startswith("route-quick-")]
    sh("dvc", "push", "-r", "storage", *stages, cwd=repo)
    sh("git", "add", "pipelines.yaml", "params.yaml", "dvc.lock", cwd=repo)
    sh("git", "commit", "-qm", "the quick run", cwd=repo)
    for argv in (["stage", "register", "--quick"], ["registry", "promote", "route-quick-vpo-s0", "--stage", "production"]):
        proc = run_vpo(argv, repo, timeout=600, env=GIT_ID)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "route-quick-vpo-s0 v0.0.1" in proc.stdout and "(GTO tag)" in proc.stdout
    sh("git", "clone", "-q", str(repo), str(clone), cwd=tmp_path)  # tags come along; runs/ and the DVC cache do not
    assert not (clone / "runs").exists() and not (clone / ".dvc" / "config.local").exists()
    proc = run_vpo(["registry", "fetch", "production", str(tmp_path / "fetched")], clone, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = repo / "runs" / "route-quick" / "arms" / "vpo-s0" / "model"
    assert files(tmp_path / "fetched") == files(trained) and "dvc artifacts get" in proc.stdout
    sh("dvc", "artifacts", "get", ".", "route-quick-vpo-s0", "--stage", "production", "-o", str(tmp_path / "got"),
       cwd=clone)  # the S3 remote `vpo registry fetch` configured from pipelines.yaml (.dvc/config.local)
    assert files(tmp_path / "got") == files(trained)
    shown = yaml.safe_load(sh("gto", "show", "--json", cwd=clone))
    assert shown["route-quick-vpo-s0"]["stage"]["production"] == "v0.0.1"
    assert shown["route-quick-grpo-s0"]["version"] == "v0.0.1"


def test_promote_remove_takes_the_stage_away_the_gto_way(project: Path, tmp_path: Path, capsys) -> None:
    """`promote KEY --stage S --remove` on a GTO version writes GTO's unassign tag: `gto show` no longer
    lists the stage. Removing a stage the version is not in changes nothing and says so (exit 2)."""
    reg_dir = tmp_path / "registry"
    register(project, reg_dir)
    args = ["--registry", str(reg_dir), "--repo", str(project)]
    assert main([*args, "promote", "q-vpo-s0@v0.0.1", "--stage", "production"]) == 0
    assert "production" in sh("gto", "show", cwd=project)
    capsys.readouterr()
    assert main([*args, "promote", "q-vpo-s0@v0.0.1", "--stage", "production", "--remove"]) == 0
    out = capsys.readouterr().out
    assert "q-vpo-s0 " in out and "left stage production (GTO: a q-vpo-s0#production! tag" in out, out
    shown = sh("gto", "show", cwd=project)
    assert "production" not in shown and "v0.0.1" in shown, shown
    assert not yaml.safe_load(sh("gto", "show", "--json", cwd=project))["q-vpo-s0"]["stage"].get("production")
    assert not (reg_dir / "stages").exists()  # no record of the registry's own stands in for the tag
    assert main([*args, "promote", "q-vpo-s0@v0.0.1", "--stage", "production", "--remove"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not in stage production (its stages: none); nothing to remove" in err


def test_list_marks_versions_known_from_git_tags_only(project: Path, tmp_path: Path, capsys) -> None:
    """A registry without entries for the repository's GTO versions (a clone, a fresh folder): list
    shows the versions marked as such, verify checks their weights against the tag's content hash and
    says so; a registry URL with nothing behind it is an error naming it, not rows from the tags."""
    register(project, tmp_path / "registry")
    empty = tmp_path / "empty-registry"
    empty.mkdir()
    args = ["--repo", str(project)]
    assert main(["--registry", str(empty), *args, "list"]) == 0
    captured = capsys.readouterr()
    assert "v0.0.1 (tag only)" in captured.out and "come from the repository's GTO tags only" in captured.err
    assert main(["--registry", str(empty), *args, "verify"]) == 0
    out = capsys.readouterr().out
    assert "its git tag's content hash" in out and "1/1 entries verified (1 of them from git tags only" in out
    for verb in ("list", "verify", "best"):
        assert main(["--registry", str(tmp_path / "typo"), *args, verb]) == 2
        err = capsys.readouterr().err
        assert f"registry {tmp_path / 'typo'} (--registry) does not exist" in err and err.count("\n") == 1, err


def test_the_cards_fetch_command_runs_as_printed(project: Path, tmp_path: Path) -> None:
    """The model card's command, run by a shell with no virtualenv on PATH from the project's root,
    gets the model back (an unversioned entry: by md5 through DVC's cache)."""
    shutil.copytree(REPO / "bin", project / "bin")
    (project / ".venv").symlink_to(Path(sys.executable).parents[1])
    reg_dir = tmp_path / "registry"
    make_checkpoint(project / MODEL, seed=3)  # not what HEAD's dvc.lock records: no version
    from dvc.repo import Repo

    with Repo(str(project)) as dvc:
        dvc.commit(f"{project}/dvc.yaml:train", force=True)
    entry, why = register(project, reg_dir)
    assert entry.version is None and why
    card = (reg_dir / "entries" / entry.artifact / f"{entry.hash}.md").read_text()
    line = card.split("```bash\n", 1)[1].split("\n", 1)[0]
    assert line.startswith("bin/vpo registry fetch "), card
    done = subprocess.run(["sh", "-c", line], cwd=project, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                          "VPO_REGISTRY": str(reg_dir), **GIT_ID}, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert content_hash(project / "model") == entry.hash
