"""The estimator registry: ``@register_estimator(name, uses=...)`` on a function of (rewards, groups,
inputs), and :class:`EstimatorInputs`, the one bundle of settings an estimator may read.

An estimator is written as ``fn(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) ->
torch.Tensor`` (one float64 advantage per rollout) and declares the inputs it reads. The decorator
returns a callable :class:`Estimator` that also takes raw reward sets and group ids, with any
input given by keyword: ``est(reward_sets, group_ids, inputs)`` or ``est(sets, gids, eps=1e-4)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from vpo.advantages.batching import ArrayLike, Groups, RewardBatch, as_reward_batch

__all__ = ["ESTIMATORS", "Estimator", "EstimatorFn", "EstimatorInputs", "get_estimator", "register_estimator"]


@dataclass(frozen=True, eq=False)
class EstimatorInputs:
    """Everything an estimator reads besides the rewards and the groups: the run's settings, built
    once from a VPOConfig (:meth:`from_config`), and three per-batch extras (:meth:`for_batch`).
    Each estimator declares which of them it uses and ignores the rest. The defaults are
    VPOConfig's (``seed`` aside: a direct call has no run seed)."""

    # settings: ``config`` names the VPOConfig field each is read from
    num_weights: int = field(default=100, metadata={"config": "num_weights"})  # K weightings per prompt group
    alpha: float = field(default=1.0, metadata={"config": "weight_alpha"})  # Dirichlet concentration
    sampler: str = field(default="dirichlet", metadata={"config": "weight_sampler"})  # or "sobol" (quasi-MC)
    eps: float = field(default=1e-6, metadata={"config": "advantage_eps"})  # eps of the z-score
    w_star: ArrayLike | None = field(default=None, metadata={"config": "w_star"})  # (d,) fixed scalarisation
    k: int | None = field(default=None, metadata={"config": "max_at_k_k"})  # k of max@k; None: max(2, n // 2)
    seed: int = field(default=0, metadata={"config": "seed"})  # fixes each prompt's weighting (random_weight_grpo)
    scale_rewards: str = field(default="group", metadata={"config": "scale_rewards"})  # TRL's, grpo only
    aggregation: str = field(default="sum_then_normalize", metadata={"config": "multi_objective_aggregation"})
    # one batch's: set by for_batch, never from the config
    generator: torch.Generator | None = None  # seeds this batch's weight draws
    prompt_ids: Sequence[Hashable] | None = None  # (N,) prompt of each rollout; None: its group id
    weights: ArrayLike | None = None  # given weightings: (K, d) for vpo, (N, d) one per rollout otherwise

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> EstimatorInputs:
        """The settings of ``config`` (a VPOConfig, or anything with its field names); ``overrides``
        replace single inputs (the trainer passes the w* it resolved from the reward)."""
        values = {f.name: getattr(config, f.metadata["config"]) for f in fields(cls) if "config" in f.metadata}
        values = {k: getattr(v, "value", v) for k, v in values.items()}  # TRL keeps some strings as enums
        return cls(**{**values, **overrides})

    def for_batch(self, *, generator: torch.Generator | None = None, prompt_ids: Sequence[Hashable] | None = None,
                  weights: ArrayLike | None = None) -> EstimatorInputs:
        """These settings with one batch's generator, prompt ids and given weightings."""
        return dataclasses.replace(self, generator=generator, prompt_ids=prompt_ids, weights=weights)

    def replace(self, **changes: Any) -> EstimatorInputs:
        """These inputs with some replaced by name; an unknown name is a TypeError that lists the known."""
        unknown = sorted(set(changes) - _INPUT_NAMES)
        if unknown:
            raise TypeError(f"unknown estimator input(s) {', '.join(unknown)}; known: {', '.join(sorted(_INPUT_NAMES))}")
        return dataclasses.replace(self, **changes)


_INPUT_NAMES = frozenset(f.name for f in fields(EstimatorInputs))
_DEFAULT_INPUTS = EstimatorInputs()

EstimatorFn = Callable[[RewardBatch, Groups, EstimatorInputs], torch.Tensor]


class Estimator:
    """A registered estimator: ``est(reward_sets, group_ids, inputs=None, **changes)`` pads the reward
    sets, indexes the groups and calls the function with ``inputs`` (default
    ``EstimatorInputs()``) updated by ``changes``. ``uses`` names the inputs it reads;
    ``row_weights_column`` the dataset column the trainer passes as per-rollout ``weights``."""

    def __init__(self, name: str, fn: EstimatorFn, uses: Sequence[str], row_weights_column: str | None) -> None:
        self.name, self.fn, self.uses, self.row_weights_column = name, fn, frozenset(uses), row_weights_column
        functools.update_wrapper(self, fn)

    def __call__(self, reward_sets: Any, group_ids: Any, inputs: EstimatorInputs | None = None,
                 **changes: Any) -> torch.Tensor:
        inputs = inputs if inputs is not None else _DEFAULT_INPUTS
        if changes:
            inputs = inputs.replace(**changes)
        batch = as_reward_batch(reward_sets)
        return self.fn(batch, Groups.of(group_ids, batch.n), inputs)

    def __repr__(self) -> str:
        return f"<estimator {self.name!r} uses {', '.join(sorted(self.uses))}>"


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, *, uses: Sequence[str] = (),
                       row_weights_column: str | None = None) -> Callable[[EstimatorFn], Estimator]:
    """Register ``fn(batch, groups, inputs)`` under ``name`` (lower-case; a taken name is an error)
    as an :class:`Estimator` reading the inputs named in ``uses``."""
    key = name.lower()
    unknown = sorted(set(uses) - _INPUT_NAMES)
    if unknown:
        raise ValueError(f"estimator {name!r} uses unknown input(s) {', '.join(unknown)}")

    def deco(fn: EstimatorFn) -> Estimator:
        if key in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[key] = Estimator(key, fn, uses, row_weights_column)
        return ESTIMATORS[key]

    return deco


def get_estimator(name: str) -> Estimator:
    """Look up an estimator by name (case-insensitive)."""
    try:
        return ESTIMATORS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown advantage estimator {name!r}; available: {', '.join(sorted(ESTIMATORS))}") from None
