"""End to end: the README's main command on the quick preset (`vpo run --quick`, search included), run
as a user runs it, once per test session in a scratch repository (conftest ``quick_repo``). Every
stage's declared output must exist and hold numbers for every arm; the printed table must be the
evaluation's table. Tests that run `vpo` again do it in a copy, retraining only the arms they check."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.repos import QuickRun

VPO = Path(sys.executable).with_name("vpo")


@pytest.fixture
def quick_run(quick_repo: QuickRun) -> tuple[Path, str]:
    """The session's `vpo run --quick` (conftest ``quick_repo``): its run folder and what it printed.
    Read-only; a test that writes works on ``quick_repo.copy``."""
    return quick_repo.run, quick_repo.stdout


def test_every_stage_output_exists(quick_run: tuple[Path, str]) -> None:
    run, _ = quick_run
    for rel in ("data/train.parquet", "data/test.parquet", "base/config.json", "base/model.safetensors", "eval/metrics.json",
                "eval/best_at_k.png", "eval/table.md", "registry.json", "search/curves.json",
                "search/curves.png", "search/selection.json", "search/table.md"):
        assert (run / rel).is_file(), rel
    for arm in ("grpo-s0", "vpo-s0", "grpo_x3-s0", "max_at_k-s0"):
        assert (run / "arms" / arm / "model" / "model.safetensors").is_file(), arm
        history = json.loads((run / "arms" / arm / "history.json").read_text())
        assert len(history) >= 1


def test_metrics_cover_every_arm_and_k(quick_run: tuple[Path, str]) -> None:
    run, stdout = quick_run
    metrics = json.loads((run / "eval" / "metrics.json").read_text())
    assert {"grpo-s0", "vpo-s0", "grpo_x3-s0", "max_at_k-s0"} <= set(metrics["runs"])
    for rid, r in metrics["runs"].items():
        for k in (1, 3, 5):
            for key in ("best_at_k", "expected_weighted_best_at_k"):
                value = r[key][str(k)]
                assert math.isfinite(value) and 0.0 <= value <= 1.0, (rid, key, k, value)
    oracle = metrics["oracle"]["prompt_only_best_at_k"]  # the route task's reference ceiling
    values = [oracle[str(k)] for k in metrics["k"]]
    assert values == sorted(values) and 0.0 < values[0] <= metrics["oracle"]["full_information"] <= 1.0
    table = (run / "eval" / "table.md").read_text().strip()
    assert table in stdout  # the final printed table is the evaluation's table
    assert "Oracle (mean scalar; answers chosen from the prompt alone" in table
    assert all(f"| {arm} |" in table for arm in ("vpo", "grpo", "grpo_x3", "max_at_k"))
    assert (run / "search" / "table.md").read_text().strip() in stdout  # and then the search table


def test_console_is_one_line_per_stage_event_and_the_log_file_has_the_rest(quick_run: tuple[Path, str]) -> None:
    """What `vpo run --quick` prints (here to a pipe: bars print plain lines): a start and a done line
    per stage, each bar's last state, the tables once, the log file's path -- no library chatter (raw
    metric dicts, weight-loading bars, None-metric warnings). The log file in logs/ holds everything."""
    run, stdout = quick_run
    lines = stdout.splitlines()
    labels = ["data", "rewards", "base", "train@grpo-s0", "train@vpo-s0", "train@grpo_x3-s0", "train@max_at_k-s0",
              "evaluate", "search", "register"]
    for label in labels:
        assert sum(ln.startswith(f"[vpo] {label}: ") and ln.endswith("; running") for ln in lines) == 1, label
        assert sum(ln.startswith(f"[vpo] {label}: done in ") for ln in lines) == 1, label
    results = json.loads((run / "search" / "results.json").read_text())  # arm -> one result per problem
    n_search = sum(len(v) for arm, v in results.items() if "/" not in arm)  # best-of-k rows are not searches
    n_policies = len(json.loads((run / "eval" / "metrics.json").read_text())["runs"])  # base m=1, m=3, each run
    for bar in ("base: sft: 150/150", "train@vpo-s0: 4/4", f"evaluate: {n_policies}/{n_policies}",
                f"search: {n_search}/{n_search}"):
        assert any(ln.startswith(bar) for ln in lines), bar
    assert "parse " in next(ln for ln in lines if ln.startswith("train@vpo-s0: 4/4"))
    for noise in ("{'loss'", "Loading weights", "Writing model shards", "attempting to log", "Warning", "Traceback"):
        assert noise not in stdout, noise
    table = (run / "eval" / "table.md").read_text().strip()
    assert stdout.count(table.splitlines()[0]) == 1  # the evaluation table is printed once
    # a bar's intermediate states come every PLAIN_BAR_INTERVAL_S, so their number depends on the machine's speed
    fixed = [ln for ln in lines if not re.match(r"^\S.*: \d+/\d+ \w+ +\d+% in \d+ s", ln) or " 100% in " in ln]
    # 4 of them state each train run's batch (prompts, completions), 5 the search's arms side by side
    assert len(fixed) < 81, len(fixed)
    log_line = lines[-1]
    assert log_line.startswith("[vpo] full log: "), log_line
    log = run.parents[1] / log_line.removeprefix("[vpo] full log: ").split(" (")[0]  # the rerun wrote one too
    assert log.parent == run / "logs" and log.name.endswith("-run.log"), log_line
    text = log.read_text()
    assert "[vpo] train@vpo-s0: done in" in text and table.splitlines()[0] in text
    # every training log record: in the run's own log when it trained in its own process (side by side)
    own = list((run / "logs").glob("*-stage-train-vpo-s0.log"))
    record = own[0].read_text() if "training runs, 2 at once" in stdout else text
    assert "train@vpo-s0 step 4: {" in record and '"vpo/frac_unparsed"' in record


def test_search_spent_equal_budgets(quick_run: tuple[Path, str]) -> None:
    run, _ = quick_run
    selection = json.loads((run / "search" / "selection.json").read_text())
    assert len(selection["problems"]) == 2
    results = json.loads((run / "search" / "results.json").read_text())
    m_of = {"grpo": 1, "vpo": 3, "grpo_x3": 1, "max_at_k": 1}
    assert set(results) == {name for arm in m_of for name in (arm, f"{arm}/best_of_k")}
    for name, per_problem in results.items():
        assert [r["problem_id"] for r in per_problem] == selection["problems"], name
        for r in per_problem:  # every arm gets the same candidate budget, spent m at a time
            assert r["budget"] == 6 and r["candidates"] <= 6, (name, r["candidates"])
            assert r["m"] == m_of[name.split("/")[0]], name
            calls = -(-6 // r["m"])  # budget counts answer slots: 6 calls of 1 answer, 2 calls of 3
            assert r["iterations"] <= calls and (r["solved"] or r["iterations"] == calls), (name, r["iterations"])


def test_quick_preset_learns(quick_run: tuple[Path, str]) -> None:
    """The quick preset is small but real: its base parses its own answers, every arm's loss is
    non-zero at some step, almost every rollout parses, and every arm's weights moved."""
    from safetensors.torch import load_file

    run, _ = quick_run
    metrics = json.loads((run / "eval" / "metrics.json").read_text())
    assert metrics["runs"]["base-m1"]["parse_rate"] > 0.7 and metrics["runs"]["base-m3"]["parse_rate"] > 0.4
    base = load_file(str(run / "base" / "model.safetensors"))
    for arm in ("grpo-s0", "vpo-s0", "grpo_x3-s0", "max_at_k-s0"):
        logs = [r for r in json.loads((run / "arms" / arm / "history.json").read_text()) if "loss" in r]
        assert any(abs(r["loss"]) > 1e-6 for r in logs), (arm, [r["loss"] for r in logs])
        unparsed = sum(r["vpo/frac_unparsed"] for r in logs) / len(logs)
        assert unparsed < 0.5, (arm, unparsed)
        weights = load_file(str(run / "arms" / arm / "model" / "model.safetensors"))
        moved = max(float((weights[k] - base[k]).abs().max()) for k in base)
        assert moved > 0, f"{arm}: weights equal the base's"


def test_weights_and_metrics_do_not_depend_on_running_side_by_side(quick_repo: QuickRun, tmp_path: Path) -> None:
    """The quick preset's training and search run once more from the session run's data, rewards and base,
    the other way round (one after another if they ran side by side, else two at once; one torch thread
    per run both times): every arm's weights are byte-identical, and so are the evaluation of every policy
    and every arm's search (which problems it searches depends on every arm's evaluation, so all four
    arms run)."""
    import hashlib

    run, stdout = quick_repo.run, quick_repo.stdout
    side_by_side = "4 training runs, 2 at once" in stdout
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(quick_repo.repo / "pipelines.yaml", other / "pipelines.yaml")
    for stage in ("data", "rewards", "base"):
        shutil.copytree(run / stage, other / "runs" / "route-quick" / stage)
    proc = _vpo(["run", "--quick", "--set", f"execution.max_parallel={1 if side_by_side else 2}"], other)
    assert "[vpo] base: up to date" in proc.stdout
    assert ("4 training runs, 2 at once" in proc.stdout) is not side_by_side, proc.stdout[-3000:]
    assert ("[vpo] search: 4 arms, 2 at once" in proc.stdout) is not side_by_side, proc.stdout[-3000:]
    assert ("[vpo] search: 4 arms, 2 at once" in stdout) is side_by_side
    ours = other / "runs" / "route-quick"
    for arm in ("grpo-s0", "vpo-s0", "grpo_x3-s0", "max_at_k-s0"):
        digests = {hashlib.sha256((root / "arms" / arm / "model" / "model.safetensors").read_bytes()).hexdigest()
                   for root in (run, ours)}
        assert len(digests) == 1, f"{arm}: weights differ between side-by-side and one-after-another training"

    def results(path: Path) -> dict[str, Any]:  # every policy's metrics, without its wall time
        runs = json.loads(path.read_text())["runs"]
        return {rid: {k: v for k, v in m.items() if k != "seconds"} for rid, m in runs.items()}

    assert results(ours / "eval" / "metrics.json") == results(run / "eval" / "metrics.json")
    for name in ("results.json", "selection.json", "table.md"):
        assert (ours / "search" / name).read_bytes() == (run / "search" / name).read_bytes()


def _vpo(argv: list[str], cwd: Path, *, rc: int = 0) -> subprocess.CompletedProcess[str]:
    """`vpo ARGV --config pipelines.yaml` in ``cwd`` with one torch thread; asserts its exit code."""
    proc = subprocess.run([str(VPO), *argv, "--config", "pipelines.yaml"], cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_a_rerun_with_nothing_to_do_starts_no_stage_process(quick_repo: QuickRun, tmp_path: Path) -> None:
    """The same command again in a copy of the session's run: every stage says it is up to date, and no
    `vpo stage` process is started for a training run or a search (the check comes before a process
    per arm)."""
    from tests.support.procs import Descendants

    repo = quick_repo.copy(tmp_path / "repo")
    again = subprocess.Popen([str(VPO), "run", "--quick", "--config", "pipelines.yaml"], cwd=repo,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    with Descendants(again.pid, interval_s=0.05) as watch:
        out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out[-3000:]
    for label in ("data", "rewards", "base", "train@grpo-s0", "train@vpo-s0", "train@grpo_x3-s0", "train@max_at_k-s0",
                  "evaluate", "search"):
        assert f"[vpo] {label}: up to date" in out, out[-3000:]
    started = list(watch.seen.values())
    assert not [cmd for cmd in started if " stage " in cmd], started


def test_rerun_redoes_only_what_changed_and_says_why(quick_repo: QuickRun, tmp_path: Path) -> None:
    """A second `vpo run --quick` in a copy, with one arm's training setting changed
    (`arms.vpo.max_steps=5`): data, rewards, base and the other arms are up to date; that arm retrains,
    saying why, to the new step count; evaluation reruns because one of its inputs changed."""
    repo = quick_repo.copy(tmp_path / "repo")
    run = repo / "runs" / "route-quick"
    base_before = (run / "base" / "model.safetensors").stat().st_mtime_ns
    out = _vpo(["run", "--quick", "--no-search", "--set", "arms.vpo.max_steps=5"], repo).stdout
    for stage in ("data", "rewards", "base", "train@grpo-s0", "train@grpo_x3-s0", "train@max_at_k-s0"):
        assert f"[vpo] {stage}: up to date" in out, out[-3000:]
    assert "[vpo] train@vpo-s0: arm.max_steps set to 5; retraining" in out, out[-3000:]
    assert json.loads((run / "arms" / "vpo-s0" / "metrics.json").read_text())["max_steps"] == 5
    evaluate = next(ln for ln in out.splitlines() if ln.startswith("[vpo] evaluate: "))
    assert evaluate.endswith("input train@vpo-s0 changed; running"), evaluate
    assert (run / "base" / "model.safetensors").stat().st_mtime_ns == base_before


def test_report_to_reaches_the_trainer_end_to_end(quick_repo: QuickRun, tmp_path: Path) -> None:
    """`trainer.report_to: [dvclive, tensorboard]` from the command line, one arm's stage in a copy: the
    arm retrains (its settings changed) and both trackers get its training curves, TensorBoard's kept in
    the run folder, the resume state gone."""
    pytest.importorskip("tensorboardX")
    repo = quick_repo.copy(tmp_path / "repo")
    run = repo / "runs" / "route-quick"
    proc = _vpo(["stage", "train", "--quick", "--arm", "vpo", "--seed", "0",
                 "--set", "trainer.report_to=[dvclive, tensorboard]"], repo)
    assert "train@vpo-s0: trainer.report_to changed" in proc.stdout, proc.stdout[-2000:]
    tags = _event_tags(run / "arms" / "vpo-s0" / "tensorboard")
    assert {"train/loss", "train/vpo/expected_max", "train/vpo/frac_unparsed"} <= tags, sorted(tags)
    assert (run / "arms" / "vpo-s0" / "live" / "plots" / "metrics" / "vpo" / "expected_max.tsv").is_file()
    assert not (run / "arms" / "vpo-s0" / "trainer").exists()  # resume state gone, the curves kept


def _event_tags(folder: Path) -> set[str]:
    """Scalar tags in the TensorBoard event files under ``folder`` (TFRecord framing, Event protos)."""
    import struct

    from tensorboardX.proto import event_pb2

    tags: set[str] = set()
    for path in folder.rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            tags |= {v.tag for v in event.summary.value}
            pos += 12 + length + 4
    return tags


def test_one_arms_search_beside_the_others_refuses_another_requests_checkpoint(
        quick_repo: QuickRun, tmp_path: Path) -> None:
    """`vpo stage search --arm vpo` (what the search stage starts per arm) finds a checkpoint of another
    search: one error line naming it and the command that starts afresh, exit 2, no traceback."""
    repo = quick_repo.copy(tmp_path / "repo")
    ck_dir = repo / "runs" / "route-quick" / "search" / "checkpoints"
    ck_dir.mkdir()
    stale = ck_dir / "vpo.search.json"
    stale.write_text(json.dumps({"version": 1, "fingerprint": {"seed": 12345}, "step": 0, "problems": []}))
    proc = _vpo(["stage", "search", "--quick", "--arm", "vpo"], repo, rc=2)
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert f"{stale}: checkpoint" in errors[0] and "vpo stage search --pipeline route --quick" in errors[0]
