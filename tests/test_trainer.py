"""VPOTrainer on a locally built tiny model: real TRL training steps on CPU, no downloads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.trainers import LetterReward, config, tiny_model_dir, toy_dataset

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


def _load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def test_config_rejects_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="unknown advantage estimator"):
        config(tmp_path, estimator="ppo")
    with pytest.raises(ValueError, match="num_answers"):
        config(tmp_path, num_answers=0)
    with pytest.raises(ValueError, match="weight_sampler"):
        config(tmp_path, weight_sampler="halton")
    with pytest.raises(ValueError, match="leave reward_weights unset"):
        config(tmp_path, reward_weights=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="scale_rewards only shape the 'grpo' estimator"):
        config(tmp_path, estimator="vpo", scale_rewards="batch")
    with pytest.raises(ValueError, match="multi_objective_aggregation only shape"):
        config(tmp_path, estimator="max_at_k", multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="max_at_k_k only applies"):
        config(tmp_path, estimator="grpo", max_at_k_k=2)
    with pytest.raises(ValueError, match="max_at_k_k must be >= 1"):
        config(tmp_path, estimator="max_at_k", max_at_k_k=0)
    config(tmp_path, estimator="grpo", scale_rewards="none", multi_objective_aggregation="normalize_then_sum")


def test_short_training_run_changes_parameters_and_logs_vpo_metrics(tmp_path: Path, model_dir: Path) -> None:
    from vpo.trainer import VPOTrainer

    torch.manual_seed(0)
    model, tok = _load(model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = VPOTrainer(model=model, reward=LetterReward(), args=config(tmp_path, max_steps=3),
                         train_dataset=toy_dataset(8), processing_class=tok)
    trainer.train()
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert len(changed) == len(before), "every parameter should move after 3 steps"
    logged = {k for rec in trainer.state.log_history for k in rec}
    for key in ("vpo/pool_size", "vpo/expected_max", "vpo/group_std", "vpo/reward_diversity",
                "vpo/dim/has_a", "vpo/dim/has_c", "rewards/has_a/mean", "loss"):
        assert key in logged, key
    pool = [rec["vpo/pool_size"] for rec in trainer.state.log_history if "vpo/pool_size" in rec]
    assert all(0 <= p <= 2 for p in pool)
    # the logged R_hat are the ones behind the advantages (same weights): z-scoring them per group
    # gives the advantages the last step trained on
    from vpo.advantages import group_zscore

    group = trainer.num_generations
    gidx = torch.arange(trainer.last_vpo_scores.numel()) // group
    rebuilt = group_zscore(trainer.last_vpo_scores, gidx, trainer.last_vpo_scores.numel() // group, 1e-6)
    assert torch.allclose(rebuilt, trainer.last_advantages.to(rebuilt.dtype), atol=1e-9)


@pytest.mark.parametrize("share", [False, True])
def test_loss_uses_exactly_our_advantages_after_shuffle(tmp_path: Path, model_dir: Path, share: bool) -> None:
    """Rows are shuffled and split by TRL (with a shared prompt prefix: by whole prompt groups);
    vpo_row_id re-identifies them. The loss TRL computes must equal the on-policy GRPO loss rebuilt by
    hand from OUR advantages."""
    from vpo.trainer import VPOTrainer

    checks: list[tuple[float, float]] = []
    groups: list[list[int]] = []

    class Checking(VPOTrainer):
        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            loss = super()._compute_loss(model, inputs)
            expected_adv = self.last_advantages[inputs["vpo_row_id"].cpu()].to(inputs["advantages"].dtype)
            assert torch.equal(inputs["advantages"].cpu(), expected_adv)
            has_tokens = (inputs["completion_mask"].sum(-1) > 0).to(torch.float64)
            # loss_type grpo, ratio == 1 on-policy, beta == 0: per-sequence mean of -A, batch mean, / accumulation
            hand = -(expected_adv.to(torch.float64) * has_tokens).mean() / self.current_gradient_accumulation_steps
            checks.append((float(loss.detach()), float(hand)))
            groups.append(sorted(inputs["vpo_row_id"].cpu().tolist()))
            return loss

    torch.manual_seed(1)
    model, tok = _load(model_dir)
    cfg = config(tmp_path, loss_type="grpo", gradient_accumulation_steps=2, per_device_train_batch_size=4,
                 steps_per_generation=2, max_steps=2, estimator="vpo", share_prompt_prefix=share)
    trainer = Checking(model=model, reward=LetterReward(), args=cfg, train_dataset=toy_dataset(8),
                       processing_class=tok)
    trainer.train()
    assert len(checks) == 4  # 2 optimizer steps x 2 micro-batches
    for got, hand in checks:
        assert got == pytest.approx(hand, abs=1e-6)
    whole = [ids == list(range(ids[0], ids[0] + 4)) and ids[0] % 4 == 0 for ids in groups]  # G = 4 rows per prompt
    if share:  # a micro-batch of 4 rows is one whole group, so its z-scored advantages sum to zero
        assert all(whole), groups
        assert all(abs(h) < 1e-6 for _, h in checks)
    else:  # TRL's row shuffle mixes groups across micro-batches
        assert not all(whole), groups
        assert any(abs(h) > 1e-4 for _, h in checks), "advantages should not all vanish"


def test_estimator_arm_changes_advantages(tmp_path: Path, model_dir: Path) -> None:
    """Same data through the trainer with grpo vs multi_rlvr gives the registry's numbers."""
    from vpo.advantages import get_estimator
    from vpo.trainer import VPOTrainer

    for name in ("grpo", "multi_rlvr"):
        torch.manual_seed(2)
        model, tok = _load(model_dir)
        trainer = VPOTrainer(model=model, reward=LetterReward(), args=config(tmp_path / name, estimator=name,
                                                                             max_steps=1),
                             train_dataset=toy_dataset(8), processing_class=tok)
        trainer.train()
        sets = trainer._set_list()
        gids = np.arange(len(sets)) // 4
        ref = get_estimator(name)(sets, gids, w_star=trainer._w_star)
        torch.testing.assert_close(trainer.last_advantages, ref)


@pytest.mark.parametrize(("scale_rewards", "aggregation"), [("group", "sum_then_normalize"),
                                                            ("batch", "sum_then_normalize"),
                                                            ("none", "sum_then_normalize"),
                                                            ("group", "normalize_then_sum")])
def test_grpo_is_trls_stock_advantage_bit_for_bit(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                  scale_rewards: str, aggregation: str) -> None:
    """GRPOTrainer computes its stock advantages from the same reward columns before VPOTrainer
    replaces them: with m = 1 the `grpo` estimator's are identical, bit for bit."""
    from trl import GRPOTrainer

    from vpo.trainer import VPOTrainer

    stock: list[torch.Tensor] = []
    original = GRPOTrainer._generate_and_score_completions

    def recording(self: Any, inputs: Any) -> Any:
        out = original(self, inputs)
        stock.append(out["advantages"].detach().clone())
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", recording)
    ours: list[torch.Tensor] = []

    class Recording(VPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            ours.append(self.last_advantages.clone())
            return out

    torch.manual_seed(4)
    model, tok = _load(model_dir)
    # short completions without EOS score as unparseable: groups mix empty rollouts (0 on present
    # dims), rows lacking a dimension (NaN) and groups without spread
    cfg = config(tmp_path, estimator="grpo", num_answers=1, max_steps=2, scale_rewards=scale_rewards,
                 multi_objective_aggregation=aggregation, w_star=[0.5, 0.3, 0.2], truncated_scores_zero=True,
                 max_completion_length=8, per_device_train_batch_size=16)
    trainer = Recording(model=model, reward=LetterReward(), args=cfg, train_dataset=toy_dataset(8),
                        processing_class=tok)
    trainer.train()
    assert (trainer._vpo_counts == 0).any() and (trainer._vpo_counts > 0).any()
    assert trainer._vpo_sets.isnan().any()
    assert len(stock) == len(ours) == 2
    for theirs, mine in zip(stock, ours):
        assert theirs.dtype == torch.float32
        assert torch.equal(theirs, mine.to(torch.float32))
        assert torch.equal(mine, mine.to(torch.float32).to(torch.float64))  # computed in float32, as TRL
    assert any(bool((a != 0).any()) for a in ours), "rewards should vary within some group"


def test_every_new_estimator_trains_in_vpo_trainer(tmp_path: Path, model_dir: Path) -> None:
    """Each arm runs a real training step; the deterministic ones reproduce the registry's numbers
    from the gathered rewards, prompt ids, seed and goal weights the trainer passed."""
    from datasets import Dataset

    from vpo.advantages import GOAL_WEIGHTS_COLUMN, get_estimator, goal_condition_rows
    from vpo.trainer import VPOTrainer

    reward = LetterReward()
    goal = Dataset.from_list(goal_condition_rows(toy_dataset(8).to_list(), reward.names, seed=3,
                                                 present=reward.present))
    runs = {"max_at_k": {"max_at_k_k": 3}, "grpo_passk": {}, "random_weight_grpo": {},
            "random_weight_grpo_per_rollout": {}, "grpo_population_std": {}, "goal_conditioned_grpo": {}}
    for name, extra in runs.items():
        torch.manual_seed(6)
        model, tok = _load(model_dir)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        dataset = goal if name == "goal_conditioned_grpo" else toy_dataset(8)
        trainer = VPOTrainer(model=model, reward=reward, args=config(tmp_path / name, estimator=name, num_answers=1,
                                                                     max_steps=1, **extra),
                             train_dataset=dataset, processing_class=tok)
        trainer.train()
        adv = trainer.last_advantages
        assert adv is not None and torch.isfinite(adv).all(), name
        assert any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters()), name
        sets = trainer._set_list()
        gids = np.arange(len(sets)) // 4
        if name == "random_weight_grpo_per_rollout":  # fresh weights from the step's generator
            continue
        weights = None
        if name == "goal_conditioned_grpo":
            by_id = {r["id"]: r[GOAL_WEIGHTS_COLUMN] for r in goal}
            weights = np.array([by_id[i] for i in trainer._vpo_prompt_ids])
            np.testing.assert_array_equal(trainer._vpo_row_weights.numpy(), weights)
        ref = get_estimator(name)(sets, gids, w_star=trainer._w_star, k=extra.get("max_at_k_k"), seed=3,
                                  prompt_ids=trainer._vpo_prompt_ids, weights=weights)
        torch.testing.assert_close(adv, ref, msg=name)


def test_goal_conditioned_needs_the_weights_column(tmp_path: Path, model_dir: Path) -> None:
    from vpo.trainer import VPOTrainer, _row_weights

    model, tok = _load(model_dir)
    with pytest.raises(ValueError, match="train_dataset column 'goal_weights'"):
        VPOTrainer(model=model, reward=LetterReward(), args=config(tmp_path, estimator="goal_conditioned_grpo"),
                   train_dataset=toy_dataset(8), processing_class=tok)
    np.testing.assert_array_equal(_row_weights({"w": "[0.25, 0.75]"}, "w", 2, 0), [0.25, 0.75])  # JSON text
    with pytest.raises(ValueError, match=r"rollout 5 \(row id p1\): column 'w' must hold 2"):
        _row_weights({"id": "p1", "w": [0.5, -0.5]}, "w", 2, 5)


@pytest.mark.integration
def test_two_process_torchrun_ranks_agree(tmp_path: Path, model_dir: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with socket.socket() as sock:  # torchrun's --master_port 0 hangs with gloo here; pick a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "tests.support.trainers", str(model_dir), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert len(r0) == len(r1) >= 2
    for a, b in zip(r0, r1):
        assert a["world"] == b["world"] == 2
        assert a["sets"] == b["sets"]  # both ranks see the same gathered reward matrices
        assert a["advantages"] == b["advantages"]  # ...and draw the same weights
        assert a["prompt_ids"] == b["prompt_ids"] and len(a["prompt_ids"]) == len(a["advantages"])  # gathered too
        assert sorted(a["local_rows"] + b["local_rows"]) == list(range(len(a["advantages"])))
        assert set(a["local_rows"]).isdisjoint(b["local_rows"])


def test_truncated_completions_score_zero(tmp_path: Path, model_dir: Path) -> None:
    """With truncated_scores_zero a completion without EOS is an empty set; with it off it is scored."""
    from vpo.trainer import VPOTrainer

    seen = {}
    for flag in (True, False):
        torch.manual_seed(5)
        model, tok = _load(model_dir)
        trainer = VPOTrainer(model=model, reward=LetterReward(),
                             args=config(tmp_path / str(flag), max_steps=1, max_completion_length=4,
                                         truncated_scores_zero=flag),
                             train_dataset=toy_dataset(8), processing_class=tok)
        trainer.train()
        seen[flag] = trainer._vpo_counts.clone()
    # 4 tokens rarely contain EOS: almost everything is truncated, so the flag empties those sets
    assert seen[True].sum() < seen[False].sum()
    assert (seen[True] <= seen[False]).all()


class _NoAnswers(LetterReward):
    """Parses nothing: every rollout is an empty set, so every per-dimension metric has no value."""

    def parse(self, completion: str, m: int) -> list[str]:
        return []


def test_no_none_metric_reaches_a_logger(tmp_path: Path, model_dir: Path) -> None:
    """A logging step in which no rollout parsed an answer: TRL would report rewards/<dim>/mean and
    vpo/dim/<dim> as None, which every logger (DVCLive, TensorBoard) warns about; VPOTrainer leaves
    them out, and everything a logger callback receives is a number."""
    from transformers import TrainerCallback

    from vpo.trainer import VPOTrainer

    received: list[dict[str, Any]] = []

    class Recorder(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            received.append(dict(logs or {}))

    torch.manual_seed(0)
    model, tok = _load(model_dir)
    trainer = VPOTrainer(model=model, reward=_NoAnswers(), args=config(tmp_path, max_steps=2),
                         train_dataset=toy_dataset(8), processing_class=tok, callbacks=[Recorder()])
    trainer.train()
    steps = [rec for rec in received if "loss" in rec]
    assert len(steps) == 2 and all(rec["vpo/frac_unparsed"] == 1.0 for rec in steps)
    bad = {k for rec in received for k, v in rec.items() if v is None}
    assert not bad, f"None values reached the loggers: {sorted(bad)}"
    # vpo/dim/<dim> (mean over parsed answers) has no value and is left out; TRL's rewards/<dim>/mean
    # is the w*-best row TRL sees, where an unparsed rollout scores 0 (so it is 0, never None)
    assert not any(k.startswith("vpo/dim/") for rec in steps for k in rec)
    assert all(rec[k] == 0.0 for rec in steps for k in rec if k.startswith("rewards/has_") and k.endswith("/mean"))


def test_lora_through_trl_trains_the_adapter_and_merges_into_the_base(tmp_path: Path, model_dir: Path) -> None:
    """A peft config reaches TRL's GRPOTrainer through VPOTrainer: only adapter weights train, the loss
    is not zero, and the merged model differs from the base where the adapter sits."""
    from peft import LoraConfig, PeftModel

    from vpo.trainer import VPOTrainer

    torch.manual_seed(0)
    model, tok = _load(model_dir)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = VPOTrainer(model=model, reward=LetterReward(), args=config(tmp_path, max_steps=3, learning_rate=5e-2),
                         train_dataset=toy_dataset(8), processing_class=tok, peft_config=lora)
    assert isinstance(trainer.model, PeftModel)
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    losses = [rec["loss"] for rec in trainer.state.log_history if "loss" in rec]
    assert losses and any(abs(x) > 0 for x in losses), losses
    moved = [n for n, p in trainer.model.named_parameters() if "lora_B" in n and not torch.equal(adapters[n], p)]
    assert moved, "no adapter weight moved"
    frozen = [n for n, p in trainer.model.named_parameters() if "lora_" not in n and p.requires_grad]
    assert frozen == [], "base weights were trainable"
    merged = trainer.model.merge_and_unload()
    changed = {n for n, p in merged.named_parameters() if not torch.equal(base[n], p.detach())}
    assert changed and all(("q_proj" in n or "v_proj" in n) and n.endswith("weight") for n in changed), changed


@pytest.mark.timeout(900)
def test_lora_run_resumes_from_its_checkpoints_and_publishes_the_merged_model(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The train stage with trainer.lora: checkpoints hold the adapter; a run killed inside a save resumes
    from the last intact one, a run killed while publishing publishes its last checkpoint merged onto the
    base, and both end with the same merged model (a plain HF folder), the adapter beside it."""
    import signal

    from safetensors.torch import load_file

    from tests.support.faults import RUN_NAME, copy_prepared, prepared_run, start_wrapper, wait_for

    args = ["stage", "train", "--quick", "--config", "pipelines.yaml", "--arm", "vpo", "--seed", "0",
            "--set", "trainer.max_steps=6", "--set", "trainer.save_steps=2", "--set", "arms.vpo.max_completion_length=32",
            "--set", "trainer.lora={r: 4, alpha: 8, save_adapter: true}", "--set", "trainer.learning_rate=0.01"]
    prepared = prepared_run(tmp_path_factory.getbasetemp(), task="faulttoy")
    runs = {name: copy_prepared(prepared, tmp_path / name).parent for name in ("killed_in_save", "killed_in_publish")}
    markers = {name: tmp_path / f"{name}.paused" for name in runs}
    procs = {
        "killed_in_save": start_wrapper(args, runs["killed_in_save"], tmp_path / "a.log", pause_in_save=4,
                                        marker=markers["killed_in_save"]),
        "killed_in_publish": start_wrapper(args, runs["killed_in_publish"], tmp_path / "b.log", pause_in_publish=True,
                                           marker=markers["killed_in_publish"]),
    }
    for name, proc in procs.items():
        wait_for(markers[name], proc, 600, tmp_path / ("a.log" if name == "killed_in_save" else "b.log"))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    arm = {name: folder / "runs" / RUN_NAME / "arms" / "vpo-s0" for name, folder in runs.items()}
    checkpoint = arm["killed_in_save"] / "trainer" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    logs = {}
    for name, log in (("killed_in_save", "a2.log"), ("killed_in_publish", "b2.log")):
        proc = start_wrapper(args, runs[name], tmp_path / log)
        assert proc.wait(600) == 0, (tmp_path / log).read_text()[-3000:]
        logs[name] = (tmp_path / log).read_text()
    assert "resuming from checkpoint-2 (step 2 of 6)" in logs["killed_in_save"]
    assert "checkpoint-6 is at the requested 6 steps; publishing its weights" in logs["killed_in_publish"]
    weights = {}
    for name, folder in arm.items():
        model = folder / "model"
        assert not (model / "adapter_config.json").exists() and (folder / "adapter" / "adapter_config.json").is_file()
        weights[name] = load_file(str(model / "model.safetensors"))
        assert not any("lora" in k for k in weights[name])
        metrics = json.loads((folder / "metrics.json").read_text())
        assert metrics["merged"] is True and metrics["lora"]["r"] == 4 and metrics["lora"]["save_adapter"] is True
        assert not (folder / "trainer").exists()
    base = load_file(str(runs["killed_in_save"] / "runs" / RUN_NAME / "base" / "model.safetensors"))
    a, b = weights["killed_in_save"], weights["killed_in_publish"]
    assert sorted(a) == sorted(b) == sorted(base)
    assert any(not torch.equal(a[k], base[k]) for k in base), "the merged model equals the base"
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff == 0.0, f"resumed and republished merged models differ by {diff}"
