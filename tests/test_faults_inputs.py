"""Faults: bad inputs. Each gives one clear error naming the file, row or key and what was expected
(exit 2 through the CLI, one ``error:`` line, no traceback), and the earlier artifacts of the run
folder stay byte-identical.

Inputs broken: pipelines.yaml (unknown key, wrong type, missing model path, invalid YAML, bad
``--set``), dataset rows (missing or mistyped fields), reward functions (wrong dimension, NaN, inf;
through the rewards stage, the trainer and evaluation), unparseable model outputs (scored 0),
tokenizers without an EOS token (hub/local model and the tiny builder), incomplete checkpoints
(base for train, policies for evaluate, arms for register, torn trainer checkpoints for resume).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.faults import (
    RUN_NAME,
    VPO,
    copy_prepared,
    load_cfg,
    prepared_run,
    run_vpo,
    run_wrapper,
    torch_threads,
    tree_digest,
)

ARM_RUNS = ("grpo-s0", "vpo-s0", "grpo_x3-s0", "max_at_k-s0")


@dataclass
class Work:
    """A copy of a prepared run: its folder, config file and run folder."""

    folder: Path
    config: Path
    run: Path

    def digest(self) -> dict[str, str]:
        """Hashes of every artifact in the folder (lock files and temps excluded)."""
        return tree_digest(self.folder, skip_hidden=True)

    def fake_arms(self) -> None:
        """Arm outputs as the train stage leaves them (the base weights stand in for trained ones)."""
        for rid in ARM_RUNS:
            arm = self.run / "arms" / rid
            shutil.copytree(self.run / "base", arm / "model")
            (arm / "metrics.json").write_text(json.dumps({"final": {}, "steps": 0}))


def _run(cfg: Any, stage: str, rid: str | None = None) -> dict[str, Any]:
    """Run one step of ``cfg``'s plan in this process (as `vpo stage --force` does, without the lock)."""
    from vpo.pipeline.runner import run_step
    from vpo.pipeline.steps import steps_of

    step = next(s for s in steps_of(cfg, [stage]) if rid is None or s.rid == rid)
    with torch_threads(1):
        return run_step(cfg, step, progress=False, force=True)


def _work(tmp_path: Path, factory: pytest.TempPathFactory, task: str = "route") -> Work:
    config = copy_prepared(prepared_run(factory.getbasetemp(), task=task), tmp_path / "work")
    return Work(config.parent, config, config.parent / "runs" / RUN_NAME)


@pytest.fixture
def work(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Work:
    """A fresh copy of the prepared route run (data, rewards, base)."""
    return _work(tmp_path, tmp_path_factory)


def _assert_clean_error(proc: Any, *fragments: str) -> str:
    """Exit 2, exactly one ``error:`` line containing every fragment, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    text = proc.stderr[proc.stderr.index("error:") :]
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    return text


# --------------------------------------------------------------------------- pipelines.yaml


def _edit_yaml(config: Path, edit: str) -> None:
    data = yaml.safe_load(config.read_text())
    pipe = data["pipelines"]["route"]
    if edit == "unknown_key":
        pipe["trainer"]["stepz"] = 3
    elif edit == "wrong_type":
        pipe["trainer"]["max_steps"] = "many"
    elif edit == "missing_model":
        pipe["model"] = {"path_or_id": "./models/does-not-exist"}
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    if edit == "bad_yaml":
        config.write_text(config.read_text() + "    broken: [unclosed\n")


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        ("unknown_key", ["pipelines.route.trainer.stepz (line ", "unknown key; did you mean max_steps"]),
        ("wrong_type", ["pipelines.route.trainer.max_steps (line ", "expected a valid integer", "'many'"]),
        (
            "missing_model",
            [
                "pipelines.route.model.path_or_id (line ",
                "local model folder './models/does-not-exist' does not exist",
            ],
        ),
        ("bad_yaml", ["not valid YAML: line "]),
    ],
)
def test_malformed_pipelines_yaml(work: Work, edit: str, fragments: list[str]) -> None:
    """`vpo run` on a broken pipelines.yaml: exit 2 naming the file and key, nothing touched."""
    before = work.digest()
    _edit_yaml(work.config, edit)
    after_edit = {k: v for k, v in work.digest().items() if k != "pipelines.yaml"}
    proc = run_vpo(["run", "--quick", "--config", str(work.config)], work.folder, timeout=120)
    _assert_clean_error(proc, f"error: invalid pipeline config in {work.config}", *fragments)
    assert {k: v for k, v in work.digest().items() if k != "pipelines.yaml"} == after_edit
    assert set(before) - {"pipelines.yaml"} == set(after_edit)


@pytest.mark.parametrize(
    ("setting", "fragments"),
    [
        ("trainer.stepz=3", ["pipelines.route.trainer.stepz (from --set): unknown key"]),
        ("trainer.max_steps=-1", ["pipelines.route.trainer.max_steps (from --set): expected greater than 0"]),
        ("trainer.max_steps", ["--set expects KEY=VALUE, got 'trainer.max_steps'"]),
    ],
)
def test_bad_command_line_override(work: Work, setting: str, fragments: list[str]) -> None:
    """A bad ``--set`` is a config error too: exit 2 naming the key."""
    before = work.digest()
    proc = run_vpo(
        ["stage", "data", "--quick", "--config", "pipelines.yaml", "--set", setting], work.folder, timeout=120
    )
    _assert_clean_error(proc, *fragments)
    assert work.digest() == before


# --------------------------------------------------------------------------- dataset rows


@pytest.mark.parametrize(
    ("defect", "fragments"),
    [
        (
            "missing_prompt",
            ["dataset split 'train', row 5: missing field(s) ['prompt']", "got fields ['budget', 'grid',"],
        ),
        (
            "int_prompt",
            [
                (
                    "dataset split 'train', row 5 (id 'route-train-0-00005'): field 'prompt' must be a non-empty "
                    "string, got int '12345'"
                )
            ],
        ),
        (
            "none_id",
            [
                (
                    "dataset split 'train', row 5 (id None): field 'id' must be a non-empty string or an integer, "
                    "got NoneType"
                )
            ],
        ),
        (
            "not_mapping",
            ["dataset split 'train', row 5: expected a mapping with 'id' and 'prompt' fields, got list"],
        ),
    ],
)
@pytest.mark.slow
def test_bad_dataset_rows(work: Work, defect: str, fragments: list[str]) -> None:
    """A task/source yielding a broken row: the data stage names the split, row, id and field."""
    before = work.digest()
    proc = run_wrapper(
        [
            "stage",
            "data",
            "--quick",
            "--config",
            "pipelines.yaml",
            "--set",
            "task.name=faultbadrows",
            "--set",
            f"task.params.defect={defect}",
        ],
        work.folder,
        timeout=120,
    )
    _assert_clean_error(proc, *fragments)
    assert work.digest() == before


# --------------------------------------------------------------------------- reward functions


@pytest.mark.slow
def test_reward_inf_in_rewards_stage(work: Work) -> None:
    """A reward returning inf for a reference answer: the rewards stage names the row and entry."""
    before = work.digest()
    proc = run_wrapper(
        [
            "stage",
            "rewards",
            "--quick",
            "--config",
            "pipelines.yaml",
            "--set",
            "task.name=faultbadreward",
            "--set",
            "task.params.defect=inf",
        ],
        work.folder,
        timeout=120,
    )
    text = _assert_clean_error(
        proc,
        "reference answers of train row id 'route-train-0-00000': reward value ",
        " at answer 0, dimension 1 is not a finite number in [0, 1]",
    )
    assert "inf" in text.split("reward value ")[1].split(" at answer")[0]
    assert work.digest() == before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("defect", "fragment"),
    [
        ("dim", ", 3), expected ("),
        ("nan", "at answer 0, dimension 1 is not a finite number in [0, 1]"),
    ],
)
def test_broken_reward_through_the_trainer(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    defect: str,
    fragment: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The train stage with a reward breaking its contract on rollouts: RewardError naming the
    rollout and its row id; no arm output is published, earlier artifacts unchanged."""
    from vpo.rewards import RewardError

    w = _work(tmp_path, tmp_path_factory, task="faulttoy")
    before = tree_digest(w.run / "data"), tree_digest(w.run / "rewards"), tree_digest(w.run / "base")
    cfg = load_cfg(w.config, **{"task.name": "faultbadreward", "task.params.defect": defect})
    with torch_threads(1), pytest.raises(RewardError) as err:
        _run(cfg, "train", "vpo-s0")
    msg = str(err.value)
    assert msg.startswith("rollout ") and "(row id route-train-0-" in msg and fragment in msg, msg
    assert defect != "nan" or "reward value nan" in msg.replace("np.float64(", ""), msg
    assert (
        tree_digest(w.run / "data"),
        tree_digest(w.run / "rewards"),
        tree_digest(w.run / "base"),
    ) == before
    arm = w.run / "arms" / "vpo-s0"
    assert not (arm / "model").exists() and not (arm / "metrics.json").exists()


def test_broken_reward_in_evaluation_names_the_problem() -> None:
    """Evaluation validates every scored answer too."""
    from tests.support.faults import BadRewardTask
    from vpo.evaluate import score_completions
    from vpo.rewards import RewardError

    task = BadRewardTask(defect="dim", n_train=8, n_test=8)
    rows = task.load("test")[:2]
    with pytest.raises(RewardError, match=r"evaluation of problem route-test-0-00000: reward returned shape"):
        score_completions(task, rows, [["<r1>RRDD</r1>"], ["UU"]], m=1)


# --------------------------------------------------------------------------- unparseable outputs

GARBAGE = [
    "",
    " ",
    "\x00\x01\xff",
    "🙂" * 50,
    "<r_1>",
    "</r_1>RR<r_1>",
    "<r_1><r_2>RD</r_2></r_1>",
    "<r_1>RRDD",
    "<r_1>XYZ</r_1>",
    "R" * 5000,
    "<r_1>" + "D" * 300 + "</r_1>",
    "<r_9>RRRRRDDDDD</r_9>",
    "<answer_1>RR</answer_1>",
    "?3>",
    "\n" * 40,
    "<r_1>RRDD</r_1>",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.one_of(
        st.text(max_size=120), st.sampled_from(GARBAGE), st.text(alphabet="<>/r123UDLRX_\n ", max_size=80)
    ),
    m=st.integers(1, 3),
)
def test_unparseable_outputs_score_zero_and_never_crash(text: str, m: int) -> None:
    """Any completion text scores to an (m, 4) matrix in [0, 1]; unparsed rollouts are all zeros."""
    from vpo.rewards import score_set

    task = _route_task()
    row = task.load("test")[0]
    scored = score_set(task.reward, text, row, m)
    assert scored.matrix.shape == (m, 4)
    assert np.all((scored.matrix >= 0) & (scored.matrix <= 1))
    assert np.all(scored.matrix[scored.n_valid :] == 0)
    if not any(c in text for c in "UDLR"):
        assert not scored.matrix.any(), "a completion without any move scored above 0"


_ROUTE: list[Any] = []


def _route_task() -> Any:
    if not _ROUTE:
        from vpo.tasks import get_task

        _ROUTE.append(get_task("route", n_train=8, n_test=8))
    return _ROUTE[0]


def test_unparseable_outputs_through_evaluate_stage(work: Work, monkeypatch: pytest.MonkeyPatch) -> None:
    """The evaluate stage on policies that emit only garbage: it completes with zeros everywhere."""
    import vpo.generation

    def garbage(model: Any, tokenizer: Any, prompts: list[str], n: int = 1, **kw: Any) -> list[list[str]]:
        return [[GARBAGE[(i + j) % len(GARBAGE)] for j in range(n)] for i in range(len(prompts))]

    monkeypatch.setattr(vpo.generation, "sample", garbage)
    work.fake_arms()
    _run(load_cfg(work.config), "evaluate")
    metrics = json.loads((work.run / "eval" / "metrics.json").read_text())
    assert sorted(metrics["runs"]) == sorted(["base-m1", "base-m3", *ARM_RUNS])
    for rid, res in metrics["runs"].items():
        assert all(v == 0.0 for v in res["best_at_k"].values()), (rid, res["best_at_k"])
        assert all(v == 0.0 for v in res["pass_at_k"].values()) and res["first_answer_mean"] == 0.0


# --------------------------------------------------------------------------- tokenizers


@pytest.mark.slow
def test_local_model_whose_tokenizer_has_no_eos(work: Work) -> None:
    """`vpo stage base` from a local model folder whose tokenizer lacks an EOS token."""
    model = work.folder / "models" / "no-eos"
    shutil.copytree(work.run / "base", model)
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    del tok_cfg["eos_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    data = yaml.safe_load(work.config.read_text())
    data["pipelines"]["route"]["model"] = {"path_or_id": "./models/no-eos"}
    work.config.write_text(yaml.safe_dump(data, sort_keys=False))
    before = work.digest()
    proc = run_vpo(["stage", "base", "--quick", "--config", "pipelines.yaml"], work.folder, timeout=180)
    _assert_clean_error(
        proc, "model './models/no-eos': the tokenizer has no eos_token (generation needs one to stop)"
    )
    assert work.digest() == before


def test_tiny_builder_tokenizer_without_eos(work: Work, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny builder path checks its tokenizer before SFT starts; base/ is left as it was."""
    import vpo.tiny
    from vpo.pipeline.engine.errors import StageError

    original = vpo.tiny.build_char_tokenizer

    def no_eos(charset: str) -> Any:
        tok = original(charset)
        tok.eos_token = None
        return tok

    monkeypatch.setattr(vpo.tiny, "build_char_tokenizer", no_eos)
    before = work.digest()
    with pytest.raises(
        StageError, match=r"the tiny builder \(task 'route'\): the tokenizer has no eos_token"
    ):
        _run(load_cfg(work.config), "base")
    assert work.digest() == before


# --------------------------------------------------------------------------- incomplete checkpoints


@pytest.mark.slow
def test_train_with_truncated_base_weights(work: Work) -> None:
    """A base model whose safetensors file was cut short: train refuses before loading it."""
    weights = work.run / "base" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    before = work.digest()
    proc = run_vpo(["stage", "train", "--quick", "--config", "pipelines.yaml"], work.folder, timeout=120)
    _assert_clean_error(
        proc,
        f"base model: incomplete checkpoint {work.run / 'base'}: model.safetensors is truncated",
        f"rebuild it with `{VPO} stage base --pipeline route --quick`",
    )
    assert work.digest() == before
    assert not (work.run / "arms").exists()


@pytest.mark.slow
def test_evaluate_with_an_arm_model_missing_its_config(work: Work) -> None:
    """evaluate checks every policy folder before sampling anything."""
    work.fake_arms()
    (work.run / "arms" / "vpo-s0" / "model" / "config.json").unlink()
    before = work.digest()
    proc = run_vpo(["stage", "evaluate", "--quick", "--config", "pipelines.yaml"], work.folder, timeout=120)
    _assert_clean_error(
        proc,
        "policy vpo-s0: incomplete checkpoint",
        "no model config (config.json or adapter_config.json)",
        f"retrain it with `{VPO} stage train --pipeline route --quick --arm vpo --seed 0`",
    )
    assert work.digest() == before and not (work.run / "eval").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        ("empty_weights", "empty weight files: model.safetensors"),
        ("no_tokenizer", "no tokenizer files"),
        ("no_metrics", "grpo_x3-s0/metrics.json is missing"),
    ],
)
def test_register_refuses_incomplete_arms(work: Work, damage: str, fragment: str) -> None:
    """register checks every arm before registering any: nothing reaches the registry."""
    work.fake_arms()
    arm = work.run / "arms" / "grpo_x3-s0"
    if damage == "empty_weights":
        (arm / "model" / "model.safetensors").write_bytes(b"")
    elif damage == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (arm / "model" / name).unlink()
    else:
        (arm / "metrics.json").unlink()
    before = work.digest()
    proc = run_vpo(["stage", "register", "--quick", "--config", "pipelines.yaml"], work.folder, timeout=120)
    _assert_clean_error(
        proc, fragment, f"retrain it with `{VPO} stage train --pipeline route --quick --arm grpo_x3 --seed 0`"
    )
    assert work.digest() == before
    assert not (work.folder / "registry").exists() and not (work.run / "registry.json").exists()


def test_resume_skips_torn_and_truncated_trainer_checkpoints(tmp_path: Path) -> None:
    """latest_checkpoint returns the newest intact checkpoint and says why newer ones were skipped:
    missing files, an interrupted save, a truncated weights file or optimizer archive (full disk)."""
    import torch
    from safetensors.torch import save_file

    from vpo.pipeline.engine.checkpoints import checkpoint_problem, latest_checkpoint

    def make(
        step: int,
        *,
        state: str | None = None,
        files: tuple[str, ...] = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"),
        cut: str | None = None,
    ) -> Path:
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        for f in files:
            if f.endswith(".safetensors"):
                save_file({"w": torch.arange(64, dtype=torch.float32)}, str(ckpt / f))
            else:
                torch.save({"step": step, "state": torch.ones(32)}, ckpt / f)
        if cut:
            data = (ckpt / cut).read_bytes()
            (ckpt / cut).write_bytes(data[: len(data) // 2])
        (ckpt / "trainer_state.json").write_text(
            json.dumps({"global_step": step}) if state is None else state
        )
        return ckpt

    good = make(2)
    cases = {
        make(4, state='{"global_step": 4, "log_hist'): "unreadable trainer_state.json",
        make(6, state=json.dumps({"global_step": 5})): "trainer_state.json is for step 5",
        make(8, files=("model.safetensors", "optimizer.pt")): "missing scheduler.pt, rng_state.pth",
        make(10, files=("optimizer.pt", "scheduler.pt", "rng_state.pth")): "no model weights",
        make(14, cut="model.safetensors"): "model.safetensors is truncated",
        make(16, cut="optimizer.pt"): "optimizer.pt is not a complete archive",
    }
    (make(12) / "trainer_state.json").unlink()
    cases[tmp_path / "checkpoint-12"] = "no trainer_state.json"
    assert checkpoint_problem(good) is None
    for path, why in cases.items():
        problem = checkpoint_problem(path)
        assert problem is not None and problem.startswith(why), (path.name, problem)
    assert latest_checkpoint(tmp_path) == good
    assert latest_checkpoint(tmp_path / "nothing-here") is None


# --------------------------------------------------------------------------- corrupt stage outputs


@pytest.mark.slow
@pytest.mark.parametrize(("damage", "stage", "fragments"), [
    ("data/train.parquet", "rewards",
     ["data/train.parquet is unreadable", f"rebuild it with `{VPO} stage data --pipeline route --quick`"]),
    ("arms/grpo_x3-s0/metrics.json", "register",
     ["arms/grpo_x3-s0/metrics.json is unreadable", "--arm grpo_x3 --seed 0`"]),
])
def test_a_truncated_stage_output_is_named_with_its_fix(work: Work, damage: str, stage: str,
                                                         fragments: list[str]) -> None:
    """A torn upstream file (a kill or full disk mid-write outside our atomic writes, a bad copy):
    one error naming the file and the command that rebuilds it, nothing else touched."""
    work.fake_arms()
    path = work.run / damage
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])
    before = work.digest()
    proc = run_vpo(["stage", stage, "--quick", "--config", "pipelines.yaml", "--force"], work.folder, timeout=180)
    _assert_clean_error(proc, *fragments)
    assert work.digest() == before


@pytest.mark.slow
def test_a_damaged_arm_model_is_retrained_not_skipped(work: Work) -> None:
    """A finished arm whose model file was cut short: the train stage sees it through the arm's
    record (file sizes) and retrains instead of answering "already trained"."""
    proc = run_vpo(["stage", "train", "--quick", "--config", "pipelines.yaml", "--arm", "grpo", "--seed", "0",
                    "--set", "trainer.max_steps=1"], work.folder, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    weights = work.run / "arms" / "grpo-s0" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = run_vpo(["stage", "train", "--quick", "--config", "pipelines.yaml", "--arm", "grpo", "--seed", "0",
                    "--set", "trainer.max_steps=1"], work.folder, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[vpo] train@grpo-s0: output file model/model.safetensors changed size" in proc.stdout
    assert "; retraining" in proc.stdout and weights.stat().st_size > 1000
