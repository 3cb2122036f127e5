"""Advantage estimators: VPO and its baselines behind one signature and one registry.

Every estimator is ``fn(reward_sets, group_ids, *, weights=None, num_weights=100, alpha=1.0,
sampler="dirichlet", generator=None, eps=1e-6, w_star=None) -> torch.Tensor`` and returns one
advantage per rollout (float64). ``reward_sets`` holds one (m_i, d) matrix per rollout (m_i may
be 0: an unparseable rollout scores 0); NaN marks an absent dimension, ignored by every
scalarisation. Everything is vectorised over groups: rollouts are padded into an (N, M, d)
tensor with a row mask and group statistics use scatter sums, never a Python loop per group.

VPO (VPO_SPEC 1.3-1.5): per prompt group draw K weightings w ~ Dir(alpha) over the group's
present dimensions, shared by all of its rollouts; score = mean_k max_answers w_k . r; the
advantage is the group z-score with population std, eps 1e-6, and 0 where std < eps.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

__all__ = [
    "ESTIMATORS",
    "RewardBatch",
    "as_reward_batch",
    "gdpo_advantage",
    "get_estimator",
    "group_index",
    "group_zscore",
    "grpo_advantage",
    "masked_normalise",
    "maxrl_advantage",
    "multi_rlvr_advantage",
    "present_dims",
    "random_weight_grpo_advantage",
    "register_estimator",
    "sample_weights",
    "vpo_advantage",
    "vpo_scores",
]

ArrayLike = np.ndarray | torch.Tensor | Sequence[Sequence[float]]


class Estimator(Protocol):
    def __call__(
        self,
        reward_sets: Any,
        group_ids: Any,
        *,
        weights: ArrayLike | None = None,
        num_weights: int = 100,
        alpha: float = 1.0,
        sampler: str = "dirichlet",
        generator: torch.Generator | None = None,
        eps: float = 1e-6,
        w_star: ArrayLike | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class RewardBatch:
    """Padded reward sets: ``values`` (N, M, d) float64 with NaN = absent dimension (padding rows
    are 0 on present dims), ``rows`` (N, M) bool marking real answers."""

    values: torch.Tensor
    rows: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.values.shape[0])

    @property
    def d(self) -> int:
        return int(self.values.shape[2])


def as_reward_batch(reward_sets: Any) -> RewardBatch:
    """Pad a sequence of (m_i, d) matrices into a :class:`RewardBatch`.

    A 3-D array (N, M, d) is taken as N full sets of M answers; a 2-D array (N, d) as N single
    answers. A sequence may mix m_i (including 0); all matrices must share d.
    """
    if isinstance(reward_sets, RewardBatch):
        return reward_sets
    if isinstance(reward_sets, (np.ndarray, torch.Tensor)):
        t = torch.as_tensor(np.asarray(reward_sets, dtype=np.float64) if isinstance(reward_sets, np.ndarray)
                            else reward_sets.detach().cpu().to(torch.float64))
        if t.ndim == 2:
            t = t[:, None, :]
        if t.ndim != 3:
            raise ValueError(f"reward_sets array must be (N, M, d) or (N, d), got shape {tuple(t.shape)}")
        return RewardBatch(t, torch.ones(t.shape[:2], dtype=torch.bool))
    mats = [np.asarray(r, dtype=np.float64) for r in reward_sets]
    if not mats:
        raise ValueError("reward_sets is empty")
    dims = {m.shape[1] for m in mats if m.ndim == 2 and m.shape[0] > 0}
    for i, m in enumerate(mats):
        if m.ndim != 2 and not (m.ndim == 1 and m.size == 0):
            raise ValueError(f"reward_sets[{i}] must be an (m_i, d) matrix, got shape {m.shape}")
    if len(dims) > 1:
        raise ValueError(f"reward_sets mix dimensionalities {sorted(dims)}; pad absent dimensions with NaN")
    if not dims:
        dims = {max((m.shape[1] for m in mats if m.ndim == 2), default=1)}
    d = dims.pop()
    big_m = max(1, max(m.shape[0] if m.ndim == 2 else 0 for m in mats))
    values = np.zeros((len(mats), big_m, d))
    rows = np.zeros((len(mats), big_m), dtype=bool)
    lengths = np.array([m.shape[0] if m.ndim == 2 else 0 for m in mats])
    rows[np.arange(big_m)[None, :] < lengths[:, None]] = True
    nonempty = [m for m in mats if m.ndim == 2 and m.shape[0] > 0]
    if nonempty:
        values[rows] = np.concatenate(nonempty, axis=0)
    return RewardBatch(torch.from_numpy(values), torch.from_numpy(rows))


def group_index(group_ids: Any) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to contiguous indices 0..G-1 (first-seen order)."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.cpu().tolist()
    elif isinstance(group_ids, np.ndarray):
        group_ids = group_ids.tolist()
    mapping: dict[Hashable, int] = {}
    idx = [mapping.setdefault(g if not isinstance(g, list) else tuple(g), len(mapping)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.long), len(mapping)


def _group_sum(x: torch.Tensor, gidx: torch.Tensor, n_groups: int) -> torch.Tensor:
    out = torch.zeros((n_groups,) + tuple(x.shape[1:]), dtype=x.dtype)
    return out.index_add_(0, gidx, x)


def group_zscore(scores: torch.Tensor, gidx: torch.Tensor, n_groups: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO normalisation: (s - mean_g) / (std_g + eps) with population std; 0 where std_g < eps."""
    scores = scores.to(torch.float64)
    count = _group_sum(torch.ones_like(scores), gidx, n_groups)
    mean = _group_sum(scores, gidx, n_groups) / count
    centred = scores - mean[gidx]
    std = torch.sqrt(_group_sum(centred * centred, gidx, n_groups) / count)
    adv = centred / (std[gidx] + eps)
    return torch.where(std[gidx] < eps, torch.zeros_like(adv), adv)


def present_dims(batch: RewardBatch, gidx: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(G, d) bool: a dimension is present in a group if any real answer there has it non-NaN."""
    finite = (~torch.isnan(batch.values)) & batch.rows[:, :, None]
    per_rollout = finite.any(dim=1).to(torch.float64)
    present = _group_sum(per_rollout, gidx, n_groups) > 0
    none = ~present.any(dim=1)
    if none.any():  # a group without any real answer: treat all dims as present (scores are 0 anyway)
        present[none] = True
    return present


def _fixed_weights(w_star: ArrayLike | None, d: int) -> torch.Tensor:
    if w_star is None:
        return torch.full((d,), 1.0 / d, dtype=torch.float64)
    w = torch.as_tensor(np.asarray(w_star, dtype=np.float64))
    if w.shape != (d,):
        raise ValueError(f"w_star has shape {tuple(w.shape)}, expected ({d},)")
    if (w < 0).any() or not torch.isfinite(w).all():
        raise ValueError("w_star must be finite and non-negative")
    return w


def masked_normalise(w: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Zero absent dims and renormalise to the simplex. w: (..., d); present broadcastable."""
    w = w * present.to(w.dtype)
    total = w.sum(dim=-1, keepdim=True)
    return w / torch.where(total > 0, total, torch.ones((), dtype=w.dtype))  # all-zero rows stay 0


def _seed_from(generator: torch.Generator | None) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


def sample_weights(
    n_groups: int,
    num_weights: int,
    d: int,
    *,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw (n_groups, K, d) weightings, each row ~ Dir(alpha) (before masking absent dims).

    ``dirichlet``: iid Gamma(alpha) draws normalised. ``sobol``: one scrambled Sobol set of K
    points shared in structure, randomised per group by a Cranley-Patterson shift, mapped through
    the Gamma(alpha) inverse CDF (quasi-Monte-Carlo; lower variance of the K-average). Both are
    deterministic given ``generator``. Unnormalised Gamma draws are returned normalised over all
    d dims; masking to present dims and renormalising keeps them Dirichlet on the subset.
    """
    if num_weights < 1:
        raise ValueError(f"num_weights must be >= 1, got {num_weights}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if sampler == "dirichlet":
        if alpha == 1.0:
            u = torch.rand((n_groups, num_weights, d), generator=generator, dtype=torch.float64)
            g = -torch.log1p(-u)  # Exp(1) = Gamma(1)
        else:
            rng = np.random.default_rng(_seed_from(generator))
            g = torch.from_numpy(rng.standard_gamma(alpha, size=(n_groups, num_weights, d)))
    elif sampler == "sobol":
        engine = torch.quasirandom.SobolEngine(dimension=d, scramble=True, seed=_seed_from(generator))
        base = engine.draw(num_weights, dtype=torch.float64)  # (K, d)
        shift = torch.rand((n_groups, 1, d), generator=generator, dtype=torch.float64)
        u = torch.remainder(base[None] + shift, 1.0).clamp(1e-12, 1 - 1e-12)
        if alpha == 1.0:
            g = -torch.log1p(-u)
        else:
            from scipy.special import gammaincinv

            g = torch.from_numpy(gammaincinv(alpha, u.numpy()))
    else:
        raise ValueError(f"unknown sampler {sampler!r}; expected 'dirichlet' or 'sobol'")
    return g / g.sum(dim=-1, keepdim=True)


def _clean(batch: RewardBatch) -> torch.Tensor:
    """Values with NaN -> 0 (absent dims carry zero weight anyway)."""
    return torch.nan_to_num(batch.values, nan=0.0)


def vpo_scores(
    batch: RewardBatch,
    gidx: torch.Tensor,
    n_groups: int,
    weights: torch.Tensor,
) -> torch.Tensor:
    """R_hat per rollout: mean over K of max over real answers of w_k . r. ``weights`` is (G, K, d)
    already masked to each group's present dims. A rollout with no answers scores 0."""
    n, big_m, d = batch.values.shape
    size = n // n_groups if n_groups and n % n_groups == 0 else 0
    if size and torch.equal(gidx, torch.arange(n) // size):
        # usual layout (TRL): contiguous groups of equal size -> one (S*M, d) @ (d, K) product per group
        dots = torch.bmm(_clean(batch).reshape(n_groups, size * big_m, d), weights.transpose(1, 2))
        dots = dots.reshape(n, big_m, -1)  # (N, M, K)
    else:
        dots = torch.einsum("nmd,nkd->nmk", _clean(batch), weights[gidx])  # (N, M, K)
    best = dots.masked_fill(~batch.rows[:, :, None], float("-inf")).amax(dim=1)  # (N, K)
    best = torch.where(torch.isfinite(best), best, torch.zeros_like(best))  # empty rollout -> 0
    # Shifted mean: exact when all K values agree (d=1 reduces bit-for-bit to GRPO's scalar).
    low = best.min(dim=1).values
    return low + (best - low[:, None]).mean(dim=1)


def _prep(reward_sets: Any, group_ids: Any) -> tuple[RewardBatch, torch.Tensor, int]:
    batch = as_reward_batch(reward_sets)
    gidx, n_groups = group_index(group_ids)
    if gidx.numel() != batch.n:
        raise ValueError(f"{batch.n} reward sets but {gidx.numel()} group ids")
    return batch, gidx, n_groups


def vpo_advantage(
    reward_sets: Any,
    group_ids: Any,
    *,
    weights: ArrayLike | None = None,
    num_weights: int = 100,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    generator: torch.Generator | None = None,
    eps: float = 1e-6,
    w_star: ArrayLike | None = None,
) -> torch.Tensor:
    """VPO advantage (VPO_SPEC 1.3-1.5). ``weights`` (K, d), if given, replaces sampling for every
    group (masked and renormalised to each group's present dims). ``w_star`` is unused."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)  # (G, d)
    if weights is not None:
        w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
        if w.ndim != 2 or w.shape[1] != batch.d:
            raise ValueError(f"weights must be (K, {batch.d}), got {tuple(w.shape)}")
        w = w[None].expand(n_groups, -1, -1)
    else:
        w = sample_weights(n_groups, num_weights, batch.d, alpha=alpha, sampler=sampler, generator=generator)
    w = masked_normalise(w, present[:, None, :])
    return group_zscore(vpo_scores(batch, gidx, n_groups, w), gidx, n_groups, eps)


def _first_answer_scalar(batch: RewardBatch, w: torch.Tensor) -> torch.Tensor:
    """w . r of each rollout's first answer (0 for an empty rollout); w is (N, d) per rollout."""
    first = _clean(batch)[:, 0, :]
    return torch.where(batch.rows[:, 0], (first * w).sum(-1), torch.zeros(batch.n, dtype=torch.float64))


def grpo_advantage(
    reward_sets: Any,
    group_ids: Any,
    *,
    weights: ArrayLike | None = None,
    num_weights: int = 100,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    generator: torch.Generator | None = None,
    eps: float = 1e-6,
    w_star: ArrayLike | None = None,
) -> torch.Tensor:
    """Scalar GRPO: z-score of w*.r of the first answer (w* default: mean over present dims)."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)
    w = masked_normalise(_fixed_weights(w_star, batch.d)[None], present)[gidx]
    return group_zscore(_first_answer_scalar(batch, w), gidx, n_groups, eps)


def gdpo_advantage(
    reward_sets: Any,
    group_ids: Any,
    *,
    weights: ArrayLike | None = None,
    num_weights: int = 100,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    generator: torch.Generator | None = None,
    eps: float = 1e-6,
    w_star: ArrayLike | None = None,
) -> torch.Tensor:
    """GDPO: z-score each present dimension of the first answer within its group, take the
    w*-weighted sum, then z-score that sum over the whole batch (as TRL/NeMo RL's GDPO)."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)
    first = torch.where(batch.rows[:, :1], _clean(batch)[:, 0, :], torch.zeros((), dtype=torch.float64))
    per_dim = group_zscore(first, gidx, n_groups, eps)  # (N, d): each dimension normalised in its group
    w = masked_normalise(_fixed_weights(w_star, batch.d)[None], present)[gidx]
    combined = (per_dim * w).sum(-1)
    return group_zscore(combined, torch.zeros_like(gidx), 1, eps)


def multi_rlvr_advantage(
    reward_sets: Any,
    group_ids: Any,
    *,
    weights: ArrayLike | None = None,
    num_weights: int = 100,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    generator: torch.Generator | None = None,
    eps: float = 1e-6,
    w_star: ArrayLike | None = None,
) -> torch.Tensor:
    """Multi-RLVR: z-score of the sum over the (de-duplicated) set of w*.r; no random weights."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)
    w = masked_normalise(_fixed_weights(w_star, batch.d)[None], present)[gidx]  # (N, d)
    per_answer = torch.einsum("nmd,nd->nm", _clean(batch), w) * batch.rows
    return group_zscore(per_answer.sum(dim=1), gidx, n_groups, eps)


def random_weight_grpo_advantage(
    reward_sets: Any,
    group_ids: Any,
    *,
    weights: ArrayLike | None = None,
    num_weights: int = 100,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    generator: torch.Generator | None = None,
    eps: float = 1e-6,
    w_star: ArrayLike | None = None,
) -> torch.Tensor:
    """Random-weighting GRPO: one answer, a fresh w ~ Dir(alpha) per rollout (``weights`` (N, d)
    may be given instead), then the group z-score."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)[gidx]  # (N, d)
    if weights is not None:
        w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
        if w.shape != (batch.n, batch.d):
            raise ValueError(f"weights must be (N={batch.n}, d={batch.d}), got {tuple(w.shape)}")
    else:
        w = sample_weights(batch.n, 1, batch.d, alpha=alpha, sampler=sampler, generator=generator)[:, 0, :]
    w = masked_normalise(w, present)
    return group_zscore(_first_answer_scalar(batch, w), gidx, n_groups, eps)


def maxrl_advantage(
    reward_sets: Any,
    group_ids: Any,
    *,
    weights: ArrayLike | None = None,
    num_weights: int = 100,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    generator: torch.Generator | None = None,
    eps: float = 1e-6,
    w_star: ArrayLike | None = None,
) -> torch.Tensor:
    """MaxRL (Tajwar et al.): (s - mean_g) / (mean_g + eps) on the first answer's w*.r; 0 when the
    group has no spread."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)
    w = masked_normalise(_fixed_weights(w_star, batch.d)[None], present)[gidx]
    s = _first_answer_scalar(batch, w)
    count = _group_sum(torch.ones_like(s), gidx, n_groups)
    mean = _group_sum(s, gidx, n_groups) / count
    centred = s - mean[gidx]
    spread = torch.sqrt(_group_sum(centred * centred, gidx, n_groups) / count)
    adv = centred / (mean[gidx] + eps)
    return torch.where(spread[gidx] < eps, torch.zeros_like(adv), adv)


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Register an estimator under ``name`` (lower-case; duplicates are an error)."""

    def deco(fn: Estimator) -> Estimator:
        key = name.lower()
        if key in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[key] = fn
        return fn

    return deco


def get_estimator(name: str) -> Estimator:
    """Look up an estimator by name (case-insensitive)."""
    try:
        return ESTIMATORS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown advantage estimator {name!r}; available: {', '.join(sorted(ESTIMATORS))}") from None


for _name, _fn in (
    ("vpo", vpo_advantage),
    ("grpo", grpo_advantage),
    ("gdpo", gdpo_advantage),
    ("multi_rlvr", multi_rlvr_advantage),
    ("random_weight_grpo", random_weight_grpo_advantage),
    ("maxrl", maxrl_advantage),
):
    register_estimator(_name)(_fn)
