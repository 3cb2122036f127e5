"""The estimator registry: what each estimator declares it reads is what it reads, its inputs come from
VPOConfig once, and a new estimator registers with one decorator."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch

from vpo.advantages import (
    ESTIMATORS,
    EstimatorInputs,
    Groups,
    RewardBatch,
    get_estimator,
    group_zscore,
    register_estimator,
)

N_GROUPS, SIZE, M, D = 3, 6, 2, 3
_RNG = np.random.default_rng(0)
SETS = [_RNG.random((M, D)).round(3) for _ in range(N_GROUPS * SIZE)]
GIDS = [g for g in range(N_GROUPS) for _ in range(SIZE)]
BASE_WEIGHTS = np.full((len(SETS), D), 1 / D)  # goal_conditioned_grpo needs its rows
OTHER_WEIGHTS = _RNG.dirichlet(np.ones(D), size=len(SETS))

# an input's value in a second call, different from the first call's in a way every reader notices
CHANGED = {
    "num_weights": 7, "alpha": 0.3, "sampler": "sobol", "eps": 0.5, "w_star": np.array([0.7, 0.2, 0.1]), "k": 2,
    "seed": 5, "scale_rewards": "batch", "aggregation": "normalize_then_sum", "generator": 1,
    "prompt_ids": [f"p{i}" for i in range(len(SETS))], "weights": OTHER_WEIGHTS,
}


def _advantages(name: str, **changes: object) -> torch.Tensor:
    """The estimator on the fixed batch, with a fresh generator (seed 0 unless changed)."""
    seed = changes.pop("generator", 0)
    base = {"weights": BASE_WEIGHTS} if name == "goal_conditioned_grpo" else {}
    return get_estimator(name)(SETS, GIDS, **{**base, **changes, "generator": torch.Generator().manual_seed(seed)})


def test_changes_cover_every_input() -> None:
    assert set(CHANGED) == {f.name for f in fields(EstimatorInputs)}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_each_estimator_reads_exactly_the_inputs_it_declares(name: str) -> None:
    """Changing an input the estimator declares changes its advantages; changing any other does not."""
    est = get_estimator(name)
    assert est.uses and est.uses <= set(CHANGED), est.uses
    base = _advantages(name)
    for key, value in CHANGED.items():
        changed = _advantages(name, **{key: value})
        if key in est.uses:
            assert not torch.allclose(changed, base), f"{name} declares {key} but ignores it"
        else:
            assert torch.equal(changed, base), f"{name} reads {key} without declaring it"


def test_inputs_come_from_vpo_config_under_its_field_names(tmp_path) -> None:
    from vpo.trainer import VPOConfig

    cpu = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "report_to": "none"}
    cfg = VPOConfig(**cpu, estimator="max_at_k", num_weights=7, weight_alpha=0.5,
                    weight_sampler="sobol", advantage_eps=1e-3, w_star=[0.5, 0.5], max_at_k_k=3, seed=11)
    inputs = EstimatorInputs.from_config(cfg, w_star=np.array([0.9, 0.1]))
    assert (inputs.num_weights, inputs.alpha, inputs.sampler, inputs.eps, inputs.k, inputs.seed) == (
        7, 0.5, "sobol", 1e-3, 3, 11)
    assert inputs.w_star.tolist() == [0.9, 0.1]  # an override wins over the config's
    assert (inputs.scale_rewards, inputs.aggregation) == ("group", "sum_then_normalize")
    assert inputs.generator is inputs.prompt_ids is inputs.weights is None  # per batch, never from the config
    # the defaults are VPOConfig's, but for the seed: a direct call has no run seed
    default, from_default = EstimatorInputs(), EstimatorInputs.from_config(VPOConfig(**cpu))
    for f in fields(EstimatorInputs):
        if "config" in f.metadata and f.name != "seed":
            assert getattr(from_default, f.name) == getattr(default, f.name), f.name
    batch = inputs.for_batch(generator=torch.Generator(), prompt_ids=["a"])
    assert batch.num_weights == 7 and batch.prompt_ids == ["a"] and inputs.prompt_ids is None


def test_register_a_new_estimator_with_one_decorator() -> None:
    try:
        @register_estimator("Test_Mean_Reward", uses=("eps",))
        def mean_reward(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
            """The group z-score of each rollout's mean answer reward."""
            scores = torch.nan_to_num(batch.values).sum(-1).sum(-1) / batch.rows.sum(-1).clamp(min=1)
            return group_zscore(scores, groups.index, groups.count, inputs.eps)

        assert get_estimator("test_mean_reward") is mean_reward and mean_reward.uses == {"eps"}
        assert mean_reward.__name__ == "mean_reward" and "mean answer reward" in mean_reward.__doc__
        adv = mean_reward([np.array([[1.0, 1.0]]), np.zeros((0, 2))], ["a", "a"], EstimatorInputs(eps=1e-3))
        assert adv[0] > 0 > adv[1]
    finally:
        ESTIMATORS.pop("test_mean_reward", None)
    with pytest.raises(ValueError, match="unknown input"):
        register_estimator("test_bad", uses=("epsilon",))
    assert "test_bad" not in ESTIMATORS


def test_an_unknown_input_is_named() -> None:
    with pytest.raises(TypeError, match=r"unknown estimator input\(s\) epsilon; known: .*eps"):
        get_estimator("vpo")(SETS, GIDS, epsilon=1e-3)
