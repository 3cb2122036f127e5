"""The estimators, each registered with the inputs it reads: VPO and its baselines.

Every one is ``fn(batch, groups, inputs) -> (N,) float64`` (see :mod:`vpo.advantages.registry`).
Those scoring one scalar per rollout use its first answer (an empty rollout scores 0), scalarised
by w* renormalised over the group's present dimensions unless said otherwise.
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache

import numpy as np
import torch

from vpo.advantages.batching import (
    ArrayLike,
    Groups,
    RewardBatch,
    by_group_size,
    clean,
    contiguous_size,
    group_sum,
    group_table,
    group_zscore,
    masked_normalise,
    padded,
    present_dims,
)
from vpo.advantages.registry import EstimatorInputs, register_estimator
from vpo.advantages.weights import (
    GOAL_WEIGHTS_COLUMN,
    fixed_weights,
    gamma_draws,
    prompt_weights,
    sample_weights,
    weight_matrix,
)

__all__ = [
    "gdpo_advantage",
    "goal_conditioned_grpo_advantage",
    "grpo_advantage",
    "grpo_passk_advantage",
    "grpo_population_std_advantage",
    "max_at_k_advantage",
    "max_at_k_scores",
    "maxrl_advantage",
    "multi_rlvr_advantage",
    "random_weight_grpo_advantage",
    "random_weight_grpo_per_rollout_advantage",
    "vpo_advantage",
    "vpo_scores",
]

_SCALE_REWARDS = ("group", "batch", "none")
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
_TRL_EPS = 1e-4  # TRL's GRPOTrainer adds this fixed constant to the std
_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A per-thread float64 work array reused across calls (grown, never shrunk): the estimator's
    multi-MB temporaries would otherwise be freshly mapped and page-faulted by the allocator on
    every call, which costs more than the arithmetic on them. Never returned to a caller."""
    size = math.prod(shape)
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size)
        setattr(_SCRATCH, name, buf)
    return buf[:size].reshape(shape)


# -- VPO ---------------------------------------------------------------------------------------------
def _mean_max(batch: RewardBatch, gidx: torch.Tensor, n_groups: int, g: np.ndarray, total: np.ndarray) -> torch.Tensor:
    """R_hat per rollout: mean over k of (max over real answers of g_k . r) / total_k, where g is
    (G, d, K) and total (G, K) (a total of 0 contributes 0); an empty rollout scores 0."""
    values = batch.values.detach().cpu().numpy().astype(np.float64, copy=False)
    rows = batch.rows.detach().cpu().numpy()
    n, big_m, d = values.shape
    num = g.shape[2]
    cleaned = np.nan_to_num(values, nan=0.0) if np.isnan(values).any() else values
    all_rows = bool(rows.all())
    nonneg = all_rows or cleaned.min(initial=0.0) >= 0
    if not all_rows and nonneg:  # padding rows score 0: never above a real answer (w, r >= 0); empty -> 0
        cleaned = cleaned * rows[:, :, None]
    size = contiguous_size(gidx, n_groups)
    if size:  # TRL's layout: one (S*M, d) @ (d, K) product per group
        dots = np.matmul(cleaned.reshape(n_groups, size * big_m, d), g,
                         out=_scratch("dots", (n_groups, size * big_m, num))).reshape(n, big_m, num)
    else:
        dots = np.matmul(cleaned, g[gidx.numpy()])
    if not nonneg:
        dots = np.where(rows[:, :, None], dots, -np.inf)
    best = _scratch("best", (n, num))
    np.copyto(best, dots[:, 0])
    for j in range(1, big_m):
        np.maximum(best, dots[:, j], out=best)
    if not nonneg:
        best[~rows.any(axis=1)] = 0.0
    inv = np.zeros_like(total)
    np.divide(1.0, total, out=inv, where=total > 0)
    if size:
        scores = np.matmul(best.reshape(n_groups, size, num), inv[:, :, None]).reshape(n)
    else:
        scores = np.einsum("nk,nk->n", best, inv[gidx.numpy()])
    return torch.from_numpy(scores / num)


def vpo_scores(batch: RewardBatch, gidx: torch.Tensor, n_groups: int, weights: torch.Tensor) -> torch.Tensor:
    """R_hat per rollout: mean over K of max over real answers of w_k . r. ``weights`` is (G, K, d)
    already masked to each group's present dims. A rollout with no answers scores 0."""
    w = weights.detach().cpu().to(torch.float64).numpy()
    return _mean_max(batch, gidx, n_groups, np.ascontiguousarray(w.transpose(0, 2, 1)), w.sum(axis=2))


@register_estimator("vpo", uses=("weights", "num_weights", "alpha", "sampler", "generator", "eps"))
def vpo_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """VPO advantage (VPO_SPEC 1.3-1.5): per prompt group K weightings w ~ Dir(alpha) over the
    group's present dimensions, shared by its rollouts; score = mean_k max_answers w_k . r; group
    z-score with the population std, 0 where std < eps (the authors'). ``weights`` (K, d), if
    given, replaces sampling for every group (masked and renormalised to each group's present
    dims). With d = 1 every weighting is w = 1, so one suffices (and the reduction to
    ``grpo_population_std`` is exact)."""
    gidx, n_groups = groups.index, groups.count
    present = present_dims(batch, gidx, n_groups)  # (G, d)
    mask = None if bool(present.all()) else present.numpy()
    if inputs.weights is not None:
        w = weight_matrix(inputs.weights, None, batch.d, "K, d")
        g = np.broadcast_to(w.T[None], (n_groups, batch.d, w.shape[0]))
        g = g * mask[:, :, None] if mask is not None else np.ascontiguousarray(g)
    elif batch.d == 1:
        g = np.ones((n_groups, 1, 1))
    else:
        g = gamma_draws(n_groups, inputs.num_weights, batch.d, alpha=inputs.alpha, sampler=inputs.sampler,
                        generator=inputs.generator, present=mask,
                        out=_scratch("draws", (n_groups, batch.d, inputs.num_weights)))
    total = np.matmul(np.ones((1, batch.d)), g)[:, 0, :]  # (G, K) sums over present dims (absent are 0)
    return group_zscore(_mean_max(batch, gidx, n_groups, g, total), gidx, n_groups, inputs.eps)


# -- scalar baselines --------------------------------------------------------------------------------
def _first_answer_scalar(batch: RewardBatch, w: torch.Tensor) -> torch.Tensor:
    """w . r of each rollout's first answer (0 for an empty rollout); w is (N, d) per rollout."""
    first = clean(batch)[:, 0, :]
    return torch.where(batch.rows[:, 0], (first * w).sum(-1), torch.zeros(batch.n, dtype=torch.float64))


def _w_star_per_rollout(batch: RewardBatch, gidx: torch.Tensor, n_groups: int, w_star: ArrayLike | None) -> torch.Tensor:
    """(N, d): w* (default: the mean) renormalised over each rollout's group's present dims."""
    present = present_dims(batch, gidx, n_groups)
    return masked_normalise(fixed_weights(w_star, batch.d)[None], present)[gidx]


def _w_star_scalar(batch: RewardBatch, groups: Groups, w_star: ArrayLike | None) -> torch.Tensor:
    """w* . r of each rollout's first answer; 0 for an empty rollout."""
    return _first_answer_scalar(batch, _w_star_per_rollout(batch, groups.index, groups.count, w_star))


def _nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample std ignoring NaN (NaN for fewer than 2 values), in the operation order of TRL's
    ``nanstd`` so the float32 results agree bit for bit."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    bessel = count / (count - 1)
    var *= torch.where(count > 1, bessel, torch.full_like(bessel, float("nan")))
    std = torch.sqrt(var)
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


@register_estimator("grpo", uses=("w_star", "scale_rewards", "aggregation"))
def grpo_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """TRL's stock GRPO advantage (``GRPOTrainer``, TRL 1.16), bit for bit, in float32 as TRL.

    Reward columns: the first answer's d dimensions (NaN = absent; an empty rollout has 0 on its
    group's present dims), weighted by ``w_star`` as TRL's ``reward_weights`` (default ones, TRL's
    default; not renormalised). ``aggregation="sum_then_normalize"``: r = nansum(w * columns),
    (r - nanmean_g) / (nanstd_g + 1e-4) with the sample std of the group (``scale_rewards="group"``)
    or of the batch (``"batch"``), or r - nanmean_g (``"none"``). ``"normalize_then_sum"`` (TRL's
    GDPO): each column z-scored in its group, w-weighted nansum, z-scored over the batch. A rollout
    whose columns are all NaN gets 0. Not ``eps``: TRL's 1e-4 is fixed.
    """
    scale_rewards, aggregation = inputs.scale_rewards, inputs.aggregation
    if scale_rewards not in _SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {_SCALE_REWARDS}, got {scale_rewards!r}")
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    gidx, n_groups = groups.index, groups.count
    present = present_dims(batch, gidx, n_groups)[gidx]
    empty = torch.where(present, 0.0, float("nan")).to(torch.float64)
    cols = torch.where(batch.rows[:, :1], batch.values[:, 0, :], empty).to(torch.float32)
    w = (torch.ones(batch.d) if inputs.w_star is None else fixed_weights(inputs.w_star, batch.d)).to(torch.float32)
    unscorable = torch.isnan(cols).all(dim=1)
    table = group_table(gidx, n_groups)[0]
    if aggregation == "sum_then_normalize":
        rewards = (cols * w.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = float("nan")
        grouped = padded(rewards, table)
        mean = torch.nanmean(grouped, dim=1)[gidx]
        if scale_rewards == "batch":
            std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            std = _nanstd(grouped, dim=1)[gidx] if table.shape[1] > 1 else torch.zeros_like(rewards)
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + _TRL_EPS)
    else:
        grouped = padded(cols, table)  # (G, S, d)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = _nanstd(grouped, dim=1, keepdim=True) if table.shape[1] > 1 else torch.zeros_like(mean_k)
        per_dim = ((grouped - mean_k) / (std_k + _TRL_EPS)).reshape(-1, batch.d)
        real = table.reshape(-1) < batch.n
        normalised = torch.empty_like(cols)
        normalised[table.reshape(-1)[real]] = per_dim[real]
        rewards = (normalised * w.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = float("nan")
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        adv = (rewards - torch.nanmean(rewards)) / (std + _TRL_EPS)
    return torch.nan_to_num(adv, nan=0.0).to(torch.float64)


@register_estimator("grpo_population_std", uses=("w_star", "eps"))
def grpo_population_std_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """Scalar GRPO normalised as VPO: z-score (population std, ``eps``) of the first answer's w*.r
    (w* default: mean over present dims). VPO with d = 1, m = 1 equals it bit for bit."""
    return group_zscore(_w_star_scalar(batch, groups, inputs.w_star), groups.index, groups.count, inputs.eps)


@register_estimator("gdpo", uses=("w_star", "eps"))
def gdpo_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """GDPO: z-score each present dimension of the first answer within its group, take the
    w*-weighted sum, then z-score that sum over the whole batch (as TRL/NeMo RL's GDPO, with the
    population std and ``eps``)."""
    gidx, n_groups, eps = groups.index, groups.count, inputs.eps
    first = torch.where(batch.rows[:, :1], clean(batch)[:, 0, :], torch.zeros((), dtype=torch.float64))
    per_dim = group_zscore(first, gidx, n_groups, eps)  # (N, d): each dimension normalised in its group
    combined = (per_dim * _w_star_per_rollout(batch, gidx, n_groups, inputs.w_star)).sum(-1)
    return group_zscore(combined, torch.zeros_like(gidx), 1, eps)


@register_estimator("multi_rlvr", uses=("w_star", "eps"))
def multi_rlvr_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """Multi-RLVR: z-score of the sum over the (de-duplicated) set of w*.r; no random weights."""
    gidx, n_groups = groups.index, groups.count
    w = _w_star_per_rollout(batch, gidx, n_groups, inputs.w_star)  # (N, d)
    per_answer = torch.einsum("nmd,nd->nm", clean(batch), w) * batch.rows
    return group_zscore(per_answer.sum(dim=1), gidx, n_groups, inputs.eps)


def _weighted_grpo(batch: RewardBatch, groups: Groups, w: np.ndarray | torch.Tensor, eps: float,
                   unbiased: bool) -> torch.Tensor:
    """Group z-score of w_i . r of each rollout's first answer, w_i (N, d) renormalised over the
    group's present dims."""
    gidx, n_groups = groups.index, groups.count
    present = present_dims(batch, gidx, n_groups)[gidx]
    w = masked_normalise(torch.as_tensor(np.asarray(w, dtype=np.float64)), present)
    return group_zscore(_first_answer_scalar(batch, w), gidx, n_groups, eps, unbiased=unbiased)


@register_estimator("random_weight_grpo", uses=("weights", "alpha", "seed", "prompt_ids", "eps"))
def random_weight_grpo_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """Random-weighting GRPO as the authors define it: one w ~ Dir(alpha) per prompt, fixed across
    epochs by (``seed``, prompt id) (:func:`~vpo.advantages.prompt_weights`; ``prompt_ids``
    default to the group ids), shared by the prompt's rollouts and not shown in the prompt; the
    first answer's w . r is z-scored in its group with the sample std (verl's GRPO, as their
    code). ``weights`` (N, d) replaces the seeded draw."""
    if inputs.weights is not None:
        w = weight_matrix(inputs.weights, batch.n, batch.d, "N, d")
    else:
        ids = list(inputs.prompt_ids) if inputs.prompt_ids is not None else groups.id_list()
        if len(ids) != batch.n:
            raise ValueError(f"{batch.n} reward sets but {len(ids)} prompt ids")
        present = present_dims(batch, groups.index, groups.count)[groups.index]
        w = prompt_weights(ids, batch.d, seed=inputs.seed, alpha=inputs.alpha, present=present)
    return _weighted_grpo(batch, groups, w, inputs.eps, unbiased=True)


@register_estimator("random_weight_grpo_per_rollout", uses=("weights", "alpha", "sampler", "generator", "eps"))
def random_weight_grpo_per_rollout_advantage(batch: RewardBatch, groups: Groups,
                                             inputs: EstimatorInputs) -> torch.Tensor:
    """Random-weighting GRPO, per-rollout variant: a fresh w ~ Dir(alpha) for every rollout at
    every call (``weights`` (N, d) may be given instead), population-std z-score of the first
    answer's w . r."""
    if inputs.weights is not None:
        w = weight_matrix(inputs.weights, batch.n, batch.d, "N, d")
    else:
        present = present_dims(batch, groups.index, groups.count)[groups.index]  # (N, d)
        w = sample_weights(batch.n, 1, batch.d, alpha=inputs.alpha, sampler=inputs.sampler,
                           generator=inputs.generator, present=present)[:, 0, :].numpy()
    return _weighted_grpo(batch, groups, w, inputs.eps, unbiased=False)


@register_estimator("goal_conditioned_grpo", uses=("weights", "eps"), row_weights_column=GOAL_WEIGHTS_COLUMN)
def goal_conditioned_grpo_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """Goal-conditioned GRPO (the authors' baseline): the reward of each rollout is w . r of its
    first answer under the weighting its prompt shows, ``weights`` (N, d) (one row per rollout,
    from the ``goal_weights`` column :func:`~vpo.advantages.goal_condition_rows` writes),
    z-scored in its group with the sample std (verl's GRPO)."""
    if inputs.weights is None:
        raise ValueError("goal_conditioned_grpo needs the weighting each prompt shows: weights=(N, d), one row per "
                         f"rollout (VPOTrainer passes the dataset column {GOAL_WEIGHTS_COLUMN!r} that "
                         "vpo.advantages.goal_condition_rows writes)")
    return _weighted_grpo(batch, groups, weight_matrix(inputs.weights, batch.n, batch.d, "N, d"), inputs.eps,
                          unbiased=True)


@lru_cache(maxsize=64)
def _max_at_k_coefficients(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ascending ranks i = 1..n: C(i-1, k-1) / C(n, k) (i is the max of its subset) and
    C(i-2, k-2) / C(n, k) (i is the max of a subset holding a lower rank), exactly rounded."""
    total = math.comb(n, k)
    own = [math.comb(i - 1, k - 1) / total for i in range(1, n + 1)]
    other = [math.comb(i - 2, k - 2) / total if i >= 2 and k >= 2 else 0.0 for i in range(1, n + 1)]
    return torch.tensor(own, dtype=torch.float64), torch.tensor(other, dtype=torch.float64)


def max_at_k_scores(values: ArrayLike, k: int) -> torch.Tensor:
    """Max@k (Bagirov et al. 2025) per-sample reward for groups of n scalar rewards (..., n):
    s_i = sum of max(S) over the k-subsets S holding i, / C(n, k). Weighting grad log p(y_i) by s_i
    is an unbiased gradient of E[max of k samples]; sum_i s_i = k * best@k. Ties need no care."""
    x = torch.as_tensor(np.asarray(values, dtype=np.float64))
    n = x.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"max@k needs 1 <= k <= n, got k={k}, n={n}")
    own, other = _max_at_k_coefficients(n, k)
    ordered, order = torch.sort(x, dim=-1, stable=True)
    weighted = other * ordered
    higher = weighted.flip(-1).cumsum(-1).flip(-1) - weighted  # sum over ranks above i
    return torch.empty_like(x).scatter_(-1, order, own * ordered + higher)


@register_estimator("max_at_k", uses=("k", "w_star", "eps"))
def max_at_k_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """Max@k (Bagirov et al. 2025, the authors' ``max_at_k``): :func:`max_at_k_scores` of the first
    answer's w*.r in each group of n, then the group z-score with the sample std. ``k`` defaults
    to max(2, n // 2) as the authors; 1 <= k <= n - 1 (k = n collapses to 0 after centring). A
    group of one gets 0."""
    s = _w_star_scalar(batch, groups, inputs.w_star)
    out = torch.zeros(batch.n, dtype=torch.float64)
    for size, idx in by_group_size(groups.index, groups.count):
        if size < 2:
            continue
        kk = max(2, size // 2) if inputs.k is None else int(inputs.k)
        if not 1 <= kk <= size - 1:
            raise ValueError(f"max_at_k needs 1 <= k <= n - 1; got k={kk} for groups of n={size} rollouts "
                             "(k = n makes every centred advantage 0)")
        raw = max_at_k_scores(s[idx], kk)
        local = torch.arange(idx.shape[0]).repeat_interleave(size)
        out[idx.reshape(-1)] = group_zscore(raw.reshape(-1), local, idx.shape[0], inputs.eps, unbiased=True)
    return out


@register_estimator("grpo_passk", uses=("w_star", "eps"))
def grpo_passk_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """verl's ``grpo_passk`` (Pass@k training, arXiv 2503.19595): in each group only the rollout with
    the highest first-answer w*.r gets an advantage, (r_max - r_second) / (sample std + eps); all
    others 0 (a tie at the top gives 0). Groups need at least 2 rollouts."""
    s = _w_star_scalar(batch, groups, inputs.w_star)
    out = torch.zeros(batch.n, dtype=torch.float64)
    for size, idx in by_group_size(groups.index, groups.count):
        if size < 2:
            raise ValueError(f"grpo_passk needs at least 2 rollouts per group, a group has {size}")
        x = s[idx]
        top, where = torch.topk(x, 2, dim=1)
        out[idx.gather(1, where[:, :1]).reshape(-1)] = (top[:, 0] - top[:, 1]) / (x.std(dim=1) + inputs.eps)
    return out


@register_estimator("maxrl", uses=("w_star", "eps"))
def maxrl_advantage(batch: RewardBatch, groups: Groups, inputs: EstimatorInputs) -> torch.Tensor:
    """MaxRL (Tajwar et al.): (s - mean_g) / (mean_g + eps) on the first answer's w*.r; 0 when the
    group has no spread."""
    gidx, n_groups, eps = groups.index, groups.count, inputs.eps
    s = _w_star_scalar(batch, groups, inputs.w_star)
    count = group_sum(torch.ones_like(s), gidx, n_groups)
    mean = group_sum(s, gidx, n_groups) / count
    centred = s - mean[gidx]
    spread = torch.sqrt(group_sum(centred * centred, gidx, n_groups) / count)
    adv = centred / (mean[gidx] + eps)
    return torch.where(spread[gidx] < eps, torch.zeros_like(adv), adv)
