"""Stage records: a stage re-runs exactly when its settings, code, inputs or output changed, and says
which; the runner skips what is up to date, records what it built and cleans what killed runs left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vpo.pipeline.engine.state import (
    Fingerprint,
    content_digest,
    describe_changes,
    read_state,
    why_stale,
    write_state,
)

REPO = Path(__file__).resolve().parents[1]


def _record(out: Path, fp: Fingerprint) -> None:
    digest, files = content_digest([out], out)
    write_state(out / "stage.json", fp, digest, files)


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, Fingerprint]:
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "weights.bin").write_bytes(b"\x00" * 64)
    (out / "metrics.json").write_text("{}")
    fp = Fingerprint(params={"trainer": {"learning_rate": 1e-4, "max_steps": 4}, "seed": 0},
                     code={"vpo/trainer.py": "aaa"}, inputs={"base": "d1"})
    _record(out, fp)
    return out, fp


def _state(out: Path) -> dict:
    state = read_state(out / "stage.json")
    assert state is not None
    return state


def test_same_request_intact_output_is_up_to_date(built: tuple[Path, Fingerprint]) -> None:
    out, fp = built
    assert why_stale(_state(out), fp, out, output_exists=True) is None


@pytest.mark.parametrize(("change", "expected"), [
    ({"params": {"trainer": {"learning_rate": 5e-4, "max_steps": 4}, "seed": 0}},
     "trainer.learning_rate changed 0.0001 -> 0.0005"),
    ({"params": {"trainer": {"learning_rate": 1e-4, "max_steps": 4}, "seed": 0, "arm": {"num_answers": 3}}},
     "arm.num_answers set to 3"),
    ({"code": {"vpo/trainer.py": "bbb"}}, "code changed: vpo/trainer.py"),
    ({"inputs": {"base": "d2"}}, "input base changed"),
])
def test_each_kind_of_change_is_named(built: tuple[Path, Fingerprint], change: dict, expected: str) -> None:
    out, fp = built
    new = Fingerprint(**{"params": fp.params, "code": fp.code, "inputs": fp.inputs, **change})
    assert why_stale(_state(out), new, out, output_exists=True) == expected


def test_damaged_or_missing_output_is_stale(built: tuple[Path, Fingerprint]) -> None:
    out, fp = built
    (out / "model" / "weights.bin").write_bytes(b"\x00" * 10)
    assert why_stale(_state(out), fp, out, output_exists=True) == \
        "output file model/weights.bin changed size (64 -> 10 bytes)"
    (out / "model" / "weights.bin").unlink()
    assert why_stale(_state(out), fp, out, output_exists=True) == "output file model/weights.bin is missing"


def test_no_or_unreadable_record(built: tuple[Path, Fingerprint]) -> None:
    out, fp = built
    (out / "stage.json").write_text('{"format": 1, "finger')
    assert read_state(out / "stage.json") is None
    assert why_stale(None, fp, out, output_exists=True) == \
        "no finished output (an earlier run stopped before recording one)"
    assert why_stale(None, fp, out, output_exists=False) == "not built yet"


def test_describe_changes_names_a_few_then_counts() -> None:
    old = {f"k{i}": i for i in range(6)}
    new = {f"k{i}": i + 1 for i in range(6)}
    assert describe_changes(old, new) == ["k0 changed 0 -> 1", "k1 changed 1 -> 2", "k2 changed 2 -> 3",
                                          "3 more setting(s) changed"]


def test_content_digest_ignores_volatile_names_but_not_content(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "a.bin").write_bytes(b"1")
    (out / "summary.json").write_text('{"seconds": 1}')
    d1, _ = content_digest([out], out, exclude=("summary.json",))
    (out / "summary.json").write_text('{"seconds": 2}')
    assert content_digest([out], out, exclude=("summary.json",))[0] == d1
    (out / "a.bin").write_bytes(b"2")
    assert content_digest([out], out, exclude=("summary.json",))[0] != d1


@pytest.mark.slow
def test_runner_skips_records_rebuilds_and_cleans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The data stage through the runner: built and recorded; skipped when nothing changed; rebuilt,
    with the reason, when a setting it reads changed; a setting it does not read changes nothing; a
    temp folder left by a killed run is removed before the stage runs again."""
    from vpo.pipeline.config import load_pipeline
    from vpo.pipeline.config.layout import RunLayout
    from vpo.pipeline.runner import run_step, staleness
    from vpo.pipeline.steps import steps_of

    data = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    data["pipelines"] = {"route": data["pipelines"]["route"]}
    config = tmp_path / "pipelines.yaml"
    config.write_text(yaml.safe_dump(data))

    def step_of(**overrides: object) -> tuple[object, object]:
        cfg = load_pipeline("route", config, quick=True, overrides=overrides or None)
        return cfg, steps_of(cfg, ["data"])[0]

    cfg, step = step_of()
    layout = RunLayout.of(cfg)
    run_step(cfg, step, progress=False)
    assert "[vpo] data: not built yet; running" in capsys.readouterr().out
    state = json.loads(layout.state_file("data").read_text())
    assert state["params"]["task"]["params"]["size"] == 5 and "validation.json" in state["files"]
    assert staleness(cfg, step) is None
    run_step(cfg, step, progress=False)
    assert capsys.readouterr().out.strip() == "[vpo] data: up to date"
    cfg2, step2 = step_of(**{"trainer.learning_rate": 0.5})  # the data stage does not read it
    assert staleness(cfg2, step2) is None
    leftover = layout.root / ".data.tmp-killed"
    leftover.mkdir()
    cfg3, step3 = step_of(**{"task.params.n_test": 17})
    assert staleness(cfg3, step3) == "task.params.n_test changed 16 -> 17"
    run_step(cfg3, step3, progress=False)
    assert "[vpo] data: task.params.n_test changed 16 -> 17; running" in capsys.readouterr().out
    assert not leftover.exists()
    assert json.loads(layout.state_file("data").read_text())["summary"]["rows"]["test"] == 17
    (layout.data / "validation.json").unlink()
    assert staleness(cfg3, step3) == "output file validation.json is missing"


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 6400 vs 6294"),
])
def test_a_full_disk_is_one_clear_error(tmp_path: Path, error: BaseException,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever layer hits the full disk (Python's OSError, torch's writer), the step ends with one
    StageError naming the output folder and what to do."""
    from vpo.pipeline.config import load_pipeline
    from vpo.pipeline.config.layout import arm_runs
    from vpo.pipeline.engine.errors import StageError
    from vpo.pipeline.runner import run_step
    from vpo.pipeline.steps import Step, stage

    data = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    data["pipelines"] = {"route": data["pipelines"]["route"]}
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(data))
    cfg = load_pipeline("route", tmp_path / "pipelines.yaml", quick=True)

    def full(ctx: object) -> dict:
        raise error

    monkeypatch.setattr("vpo.pipeline.stages.train.run", full)
    step = Step(stage("train"), run=arm_runs(cfg)[0])
    with pytest.raises(StageError) as err:
        run_step(cfg, step, progress=False)
    assert str(err.value).startswith("train@grpo-s0: the disk holding ")
    assert "arms/grpo-s0 is full" in str(err.value) and "resumes from the last intact checkpoint" in str(err.value)
    other = RuntimeError("a plain bug")

    def buggy(ctx: object) -> dict:
        raise other

    with pytest.raises(RuntimeError, match="a plain bug"):  # not every error is a full disk
        monkeypatch.setattr("vpo.pipeline.stages.data.run", buggy)
        run_step(cfg, Step(stage("data")), progress=False)


def test_adding_a_seed_leaves_the_existing_runs_up_to_date(tmp_path: Path) -> None:
    """A run's request is its arm's settings and its own seed: another seed in the arm's list does not
    make it stale, while a setting of that arm does."""
    from vpo.pipeline.config import load_pipeline
    from vpo.pipeline.runner import fingerprint
    from vpo.pipeline.steps import steps_of

    def train_fp(**arm: object) -> dict:
        raw = yaml.safe_load((REPO / "pipelines.yaml").read_text(encoding="utf-8"))
        raw["pipelines"]["route"]["storage"] = {"runs_dir": str(tmp_path / "runs"), "registry": str(tmp_path / "r")}
        next(a for a in raw["pipelines"]["route"]["arms"] if a["name"] == "vpo").update(arm)
        path = tmp_path / "pipelines.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        cfg = load_pipeline("route", path)
        step = next(s for s in steps_of(cfg) if s.label == "train@vpo-s0")
        return fingerprint(cfg, step).params

    one = train_fp(seeds=[0])
    assert train_fp(seeds=[0, 1, 2]) == one
    assert train_fp(seeds=[0], num_generations=4) != one
