"""Advantage estimators: VPO and its baselines, each registered under a name with the inputs it reads.

Three jobs, one module each: :mod:`~vpo.advantages.batching` pads reward sets into one batch and
computes group statistics, :mod:`~vpo.advantages.weights` draws and checks weightings (and writes
a prompt's weighting into the prompt for goal conditioning), :mod:`~vpo.advantages.estimators`
holds the estimators, registered by :func:`register_estimator` (:mod:`~vpo.advantages.registry`).

Every estimator is called as ``est(reward_sets, group_ids, inputs=None, **changes) ->
torch.Tensor`` with one float64 advantage per rollout; ``inputs`` is an :class:`EstimatorInputs`
(the trainer builds it once from its VPOConfig), ``changes`` replace single inputs by name.
``reward_sets`` holds one (m_i, d) matrix per rollout (m_i may be 0: an unparseable rollout scores
0); NaN marks an absent dimension, ignored by every scalarisation.

VPO (VPO_SPEC 1.3-1.5): per prompt group draw K weightings w ~ Dir(alpha) over the group's
present dimensions, shared by all of its rollouts; score = mean_k max_answers w_k . r; the
advantage is the group z-score with population std, eps 1e-6, and 0 where std < eps (the authors'
VPO). With d = 1 and m = 1 it equals ``grpo_population_std`` bit for bit; TRL's ``grpo`` (sample
std, eps 1e-4) is smaller by a factor of about sqrt((n - 1) / n).

Goal-conditioned GRPO is the one estimator that needs more than rewards: each prompt shows its
weighting (:func:`goal_condition_rows` writes it into the prompt and into the ``goal_weights``
column) and the estimator scores w . r with that same weighting (``weights``, one row per rollout).
"""

from vpo.advantages.batching import (
    ArrayLike,
    Groups,
    RewardBatch,
    as_reward_batch,
    group_index,
    group_zscore,
    masked_normalise,
    present_dims,
)
from vpo.advantages.estimators import _nanstd as _nanstd  # TRL's nanstd (tests check it against TRL's)
from vpo.advantages.estimators import (
    gdpo_advantage,
    goal_conditioned_grpo_advantage,
    grpo_advantage,
    grpo_passk_advantage,
    grpo_population_std_advantage,
    max_at_k_advantage,
    max_at_k_scores,
    maxrl_advantage,
    multi_rlvr_advantage,
    random_weight_grpo_advantage,
    random_weight_grpo_per_rollout_advantage,
    vpo_advantage,
    vpo_scores,
)
from vpo.advantages.registry import (
    ESTIMATORS,
    Estimator,
    EstimatorFn,
    EstimatorInputs,
    get_estimator,
    register_estimator,
)
from vpo.advantages.weights import (
    GOAL_WEIGHTS_COLUMN,
    goal_condition_rows,
    goal_prompt,
    prompt_weights,
    sample_weights,
)

__all__ = [
    "ESTIMATORS",
    "GOAL_WEIGHTS_COLUMN",
    "ArrayLike",
    "Estimator",
    "EstimatorFn",
    "EstimatorInputs",
    "Groups",
    "RewardBatch",
    "as_reward_batch",
    "gdpo_advantage",
    "get_estimator",
    "goal_condition_rows",
    "goal_conditioned_grpo_advantage",
    "goal_prompt",
    "group_index",
    "group_zscore",
    "grpo_advantage",
    "grpo_passk_advantage",
    "grpo_population_std_advantage",
    "masked_normalise",
    "max_at_k_advantage",
    "max_at_k_scores",
    "maxrl_advantage",
    "multi_rlvr_advantage",
    "present_dims",
    "prompt_weights",
    "random_weight_grpo_advantage",
    "random_weight_grpo_per_rollout_advantage",
    "register_estimator",
    "sample_weights",
    "vpo_advantage",
    "vpo_scores",
]
