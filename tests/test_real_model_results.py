"""benchmarks/real_model.py's bookkeeping, without a model: a results folder belongs to one config
digest, a result counts once its result.json (written last) names that digest, the missing runs are
what is left to do, and the report tabulates whatever is there (mean ± std over seeds) and says what is
missing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vpo.pipeline.config import load_pipeline

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("real_model", REPO / "benchmarks" / "real_model.py")
assert _spec is not None and _spec.loader is not None
real_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_model)


@pytest.fixture(scope="module")
def cfg() -> object:
    return load_pipeline("chat-smollm2", REPO / "pipelines.yaml")


def _eval(best: float, m: int = 1) -> dict[str, object]:
    ks = ["1", "3", "6", "12"]
    return {"m": m, "n_chains": 12 // m, "n_problems": 50, "k": [1, 3, 6, 12], "pool": "rollouts",
            "best_at_k": {k: best + 0.01 * i for i, k in enumerate(ks)},
            "pass_at_k": {k: 0.1 * i for i, k in enumerate(ks)},
            "expected_weighted_best_at_k": {k: best + 0.02 * i for i, k in enumerate(ks)},
            "first_answer_mean": best, "parse_rate": 0.9, "reward_diversity": 0.5,
            "distinct_vectors_per_problem": 3.0}


def _result(folder: Path, name: str, digest: str, best: float, curve: bool = True) -> None:
    out = folder / name
    out.mkdir(parents=True)
    (out / "eval.json").write_text(json.dumps(_eval(best)))
    if curve:
        (out / "curve.json").write_text(json.dumps([{"step": s, "reward": 0.1 * s, "vpo/frac_unparsed": 0.1,
                                                     "loss": 0.01} for s in range(1, 6)]))
    (out / "result.json").write_text(json.dumps({"name": name, "digest": digest}))


def test_a_folder_holds_one_configs_results(tmp_path: Path, cfg: object) -> None:
    record = real_model.config_record(cfg)
    assert record["runs"] == ["grpo-s0", "grpo-s1", "vpo-s0", "vpo-s1", "max_at_k-s0", "max_at_k-s1"]
    assert "execution" not in record["settings"] and "storage" not in record["settings"]
    real_model.claim_folder(tmp_path, record)
    real_model.claim_folder(tmp_path, record)  # the same settings again: fine
    other = real_model.config_record(load_pipeline("chat-smollm2", REPO / "pipelines.yaml",
                                                   overrides={"trainer.max_steps": 7}))
    assert other["digest"] != record["digest"]
    with pytest.raises(SystemExit, match=r"other settings .*differing: trainer.max_steps"):
        real_model.claim_folder(tmp_path, other)
    # where and how runs execute is not what they compute: same digest
    moved = load_pipeline("chat-smollm2", REPO / "pipelines.yaml", overrides={"execution.max_parallel": 1})
    assert real_model.config_record(moved)["digest"] == record["digest"]


def test_a_result_counts_once_finished_with_this_digest(tmp_path: Path) -> None:
    _result(tmp_path, "grpo-s0", "abc", 0.5)
    assert real_model.finished(tmp_path, "grpo-s0", "abc")
    assert not real_model.finished(tmp_path, "grpo-s0", "other")  # another config's
    (tmp_path / "vpo-s0").mkdir()
    (tmp_path / "vpo-s0" / "eval.json").write_text("{}")  # interrupted before result.json
    assert not real_model.finished(tmp_path, "vpo-s0", "abc")


def test_the_report_tabulates_what_is_there_and_names_what_is_missing(tmp_path: Path, cfg: object) -> None:
    record = real_model.config_record(cfg)
    real_model.claim_folder(tmp_path, record)
    digest = record["digest"]
    _result(tmp_path, "base-m1", digest, 0.40, curve=False)
    _result(tmp_path, "grpo-s0", digest, 0.50)
    _result(tmp_path, "grpo-s1", digest, 0.60)
    _result(tmp_path, "vpo-s0", "stale", 0.90)  # another config's result: not counted
    text = real_model.report(SimpleNamespace(results=str(tmp_path)))
    row = next(line for line in text.splitlines() if line.startswith("| grpo |"))
    assert "| 2 |" in row and "0.550 ± 0.050" in row  # best@1 over the two seeds
    assert "| base-m1 |" in text and "| vpo |" not in text
    assert "missing: vpo-s0, vpo-s1, max_at_k-s0, max_at_k-s1" in text
    train = next(line for line in text.splitlines() if line.startswith("| grpo | 2 | 5 |"))
    assert "0.300 ± 0.000 | 0.300 ± 0.000 | 0.900 ± 0.000" in train  # reward over the first and last 10 steps, parsed
    assert (tmp_path / "best_at_k.png").stat().st_size > 0 and (tmp_path / "learning_curves.png").stat().st_size > 0
    assert (tmp_path / "table.md").read_text() == text


def test_vectors_round_trip_through_json() -> None:
    vectors = np.array([[[[1.0, np.nan], [np.nan, np.nan]]]])
    back = real_model._vectors_array(json.loads(json.dumps(real_model._vectors_json(vectors))))
    assert np.array_equal(np.isnan(back), np.isnan(vectors)) and back[0, 0, 0, 0] == 1.0


@pytest.mark.parametrize("how", ["pipeline", "variant"])
def test_a_job_loads_the_very_config_its_run_loaded(tmp_path: Path, how: str) -> None:
    """The child process of each result gets the run's own options (file, pipeline or variant, preset,
    overrides), so it computes under the digest the folder was claimed with."""
    if how == "pipeline":
        argv = ["run", "--pipeline", "chat-smollm2", "--quick", "--set", "trainer.max_steps=3"]
    else:
        argv = ["run", "--variant", "route-quick", "--config", str(REPO / "pipelines.yaml"), "--set", "seed=5"]
    run_cfg = real_model.load(real_model.parser().parse_args(argv))
    job_argv = real_model._job_argv(run_cfg, tmp_path, "x-s0", 1)
    assert job_argv[2:8] == ["job", "x-s0", "--results", str(tmp_path), "--threads", "1"]
    job_args = real_model.parser().parse_args(job_argv[2:])
    job_cfg = real_model.load(job_args)
    assert job_args.name == "x-s0" and job_args.results == str(tmp_path)
    assert real_model.config_record(job_cfg)["digest"] == real_model.config_record(run_cfg)["digest"]
    assert (job_cfg.trainer.max_steps, job_cfg.seed) == ((3, 0) if how == "pipeline" else (run_cfg.trainer.max_steps, 5))


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *argv], check=True, capture_output=True, text=True).stdout


def test_a_finished_result_is_committed_alone_and_a_held_lock_is_not_fatal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each finished result is committed by itself (whatever else is staged stays out of it); when git
    cannot commit (the index locked by another command) the run goes on and says so."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.invalid")
    _git(repo, "config", "user.name", "t")
    (repo / "other.txt").write_text("staged, not mine\n")
    _git(repo, "add", "other.txt")
    monkeypatch.setattr(real_model, "REPO", repo)
    folder = repo / "benchmarks" / "results" / "x"
    _result(folder, "grpo-s0", "abc", 0.5)
    assert real_model._git_commit(folder / "grpo-s0", "Real-model results: grpo-s0")
    assert sorted(_git(repo, "show", "--name-only", "--format=", "HEAD").split()) == [
        f"benchmarks/results/x/grpo-s0/{f}" for f in ("curve.json", "eval.json", "result.json")]
    assert "other.txt" in _git(repo, "diff", "--cached", "--name-only")
    assert real_model._git_commit(folder / "grpo-s0", "again")  # nothing new: no empty commit
    assert _git(repo, "rev-list", "--count", "HEAD").strip() == "1"
    _result(folder, "vpo-s0", "abc", 0.6)
    (repo / ".git" / "index.lock").write_text("")
    assert not real_model._git_commit(folder / "vpo-s0", "Real-model results: vpo-s0", attempts=2, pause=0.01)
    assert "could not commit benchmarks/results/x/vpo-s0" in capsys.readouterr().out
    (repo / ".git" / "index.lock").unlink()
    assert real_model._git_commit(folder, "the next start")  # the whole folder: what was left out comes in
    assert "benchmarks/results/x/vpo-s0/result.json" in _git(repo, "show", "--name-only", "--format=", "HEAD")


def test_a_phase_counts_the_cpu_of_the_child_it_waited_for() -> None:
    """The train phase runs in a child process: its CPU time is the result's CPU time too."""
    import sys

    times: dict[str, float] = {}
    with real_model._timed(times, "train"):
        busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
        subprocess.run([sys.executable, "-c", busy], check=True)
    assert set(times) == {"train_s", "train_cpu_s"}
    assert times["train_cpu_s"] >= 0.3 and times["train_s"] >= 0.0
