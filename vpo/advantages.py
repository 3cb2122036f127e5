"""Advantage estimators: VPO and its baselines behind one signature and one registry.

Every estimator is ``fn(reward_sets, group_ids, *, weights=None, num_weights=100, alpha=1.0,
sampler="dirichlet", generator=None, eps=1e-6, w_star=None, k=None, prompt_ids=None, seed=0,
scale_rewards="group", aggregation="sum_then_normalize") -> torch.Tensor`` and returns one
advantage per rollout (float64); each uses the settings its docstring names and ignores the rest.
``reward_sets`` holds one (m_i, d) matrix per rollout (m_i may be 0: an unparseable rollout scores
0); NaN marks an absent dimension, ignored by every scalarisation. Everything is vectorised over
groups: rollouts are padded into an (N, M, d) tensor with a row mask and group statistics use
scatter sums or a padded (groups, size) table, never a Python loop per group.

VPO (VPO_SPEC 1.3-1.5): per prompt group draw K weightings w ~ Dir(alpha) over the group's
present dimensions, shared by all of its rollouts; score = mean_k max_answers w_k . r; the
advantage is the group z-score with population std, eps 1e-6, and 0 where std < eps (the authors'
VPO). With d = 1 and m = 1 it equals ``grpo_population_std`` bit for bit; TRL's ``grpo`` (sample
std, eps 1e-4) is smaller by a factor of about sqrt((n - 1) / n).

Goal-conditioned GRPO is the one estimator that needs more than rewards: each prompt shows its
weighting (:func:`goal_condition_rows` writes it into the prompt and into the ``goal_weights``
column) and the estimator scores w . r with that same weighting (``weights``, one row per rollout).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
import torch

__all__ = [
    "ESTIMATORS",
    "GOAL_WEIGHTS_COLUMN",
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

ArrayLike = np.ndarray | torch.Tensor | Sequence[Sequence[float]]

#: Dataset column holding each prompt's goal weighting (a list of d floats, or its JSON text).
GOAL_WEIGHTS_COLUMN = "goal_weights"

_SCALE_REWARDS = ("group", "batch", "none")
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
_TRL_EPS = 1e-4  # TRL's GRPOTrainer adds this fixed constant to the std


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
        k: int | None = None,
        prompt_ids: Sequence[Hashable] | None = None,
        seed: int = 0,
        scale_rewards: str = "group",
        aggregation: str = "sum_then_normalize",
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
    if isinstance(reward_sets, list) and reward_sets and all(isinstance(r, np.ndarray) for r in reward_sets):
        try:  # the common case, every set a full (M, d) matrix: one stack, no padding
            full = np.array(reward_sets, dtype=np.float64)
        except ValueError:
            full = None
        if full is not None and full.ndim == 3 and full.shape[1] > 0:
            return RewardBatch(torch.from_numpy(full), torch.ones(full.shape[:2], dtype=torch.bool))
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
        group_ids = group_ids.detach().cpu().numpy()
    arr = group_ids if isinstance(group_ids, np.ndarray) else None
    if arr is None and isinstance(group_ids, list) and group_ids and isinstance(group_ids[0], (int, np.integer)):
        arr = np.asarray(group_ids)
    if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iub":
        _, first, inverse = np.unique(arr, return_index=True, return_inverse=True)
        rank = np.empty(first.size, dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(first.size)
        return torch.from_numpy(rank[inverse.reshape(-1)]), int(first.size)
    if isinstance(group_ids, np.ndarray):
        group_ids = group_ids.tolist()
    mapping: dict[Hashable, int] = {}
    idx = [mapping.setdefault(g if not isinstance(g, list) else tuple(g), len(mapping)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.long), len(mapping)


def _group_sum(x: torch.Tensor, gidx: torch.Tensor, n_groups: int) -> torch.Tensor:
    out = torch.zeros((n_groups,) + tuple(x.shape[1:]), dtype=x.dtype)
    return out.index_add_(0, gidx, x)


def _contiguous_size(gidx: torch.Tensor, n_groups: int) -> int:
    """S if the batch is G contiguous groups of S rollouts each (TRL's layout), else 0."""
    n = gidx.numel()
    if not n_groups or n % n_groups:
        return 0
    size = n // n_groups
    return size if torch.equal(gidx, torch.arange(n) // size) else 0


def _group_table(gidx: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, S_max) rollout indices of each group in batch order, padded with N (one past the last
    rollout), and the (G,) group sizes."""
    n = gidx.numel()
    sizes = torch.bincount(gidx, minlength=n_groups)
    order = torch.argsort(gidx, stable=True)
    starts = torch.cumsum(sizes, 0) - sizes
    table = torch.full((n_groups, int(sizes.max()) if n else 0), n, dtype=torch.long)
    table[gidx[order], torch.arange(n) - starts[gidx[order]]] = order
    return table, sizes


def group_zscore(scores: torch.Tensor, gidx: torch.Tensor, n_groups: int, eps: float = 1e-6, *,
                 unbiased: bool = False) -> torch.Tensor:
    """(s - mean_g) / (std_g + eps), 0 where std_g < eps. Population std (VPO, as the authors) by
    default; ``unbiased=True`` uses the sample std (n - 1), as verl's GRPO; a group of one gets 0."""
    scores = scores.to(torch.float64)
    size = _contiguous_size(gidx, n_groups)
    if size:  # TRL's layout: plain reductions over a (G, S) view
        x = scores.reshape((n_groups, size) + tuple(scores.shape[1:]))
        centred = x - x.mean(dim=1, keepdim=True)
        sq = (centred * centred).sum(dim=1, keepdim=True)
        if unbiased:
            std = torch.sqrt(sq / (size - 1)) if size > 1 else torch.zeros_like(sq)
        else:
            std = torch.sqrt(sq / size)
        adv = centred / (std + eps)
        return torch.where(std < eps, torch.zeros_like(adv), adv).reshape(scores.shape)
    count = _group_sum(torch.ones_like(scores), gidx, n_groups)
    mean = _group_sum(scores, gidx, n_groups) / count
    centred = scores - mean[gidx]
    sq = _group_sum(centred * centred, gidx, n_groups)
    if unbiased:
        std = torch.where(count > 1, torch.sqrt(sq / (count - 1).clamp(min=1)), torch.zeros_like(sq))
    else:
        std = torch.sqrt(sq / count)
    adv = centred / (std[gidx] + eps)
    return torch.where(std[gidx] < eps, torch.zeros_like(adv), adv)


def present_dims(batch: RewardBatch, gidx: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(G, d) bool: a dimension is present in a group if any real answer there has it non-NaN."""
    if not np.isnan(batch.values.detach().cpu().numpy()).any():  # nothing absent anywhere
        return torch.ones((n_groups, batch.d), dtype=torch.bool)
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


def _weight_matrix(weights: ArrayLike, rows: int | None, d: int, what: str) -> np.ndarray:
    """Given weightings as a float64 (rows, d) array (any number of rows if ``rows`` is None):
    finite and non-negative, or a clear error."""
    w = np.asarray(weights.detach().cpu() if isinstance(weights, torch.Tensor) else weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] != d or (rows is not None and w.shape[0] != rows):
        raise ValueError(f"weights must be ({what}) = ({rows if rows is not None else 'K'}, {d}), got {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        bad = np.argwhere(~np.isfinite(w) | (w < 0))[0]
        raise ValueError(f"weights must be finite and non-negative; row {bad[0]}, dimension {bad[1]} is {w[tuple(bad)]}")
    return w


def masked_normalise(w: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Zero absent dims and renormalise to the simplex. w: (..., d); present broadcastable."""
    w = w * present.to(w.dtype)
    total = w.sum(dim=-1, keepdim=True)
    return w / torch.where(total > 0, total, torch.ones((), dtype=w.dtype))  # all-zero rows stay 0


# -- Dirichlet sampling --------------------------------------------------------------------------
def _seed_from(generator: torch.Generator | None) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


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


def _exponentials(seed: int, shape: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray:
    """Exp(1) = Gamma(1) draws -log(u) with u = (b + 1/2) / 2^32 from 32 random bits b (SFC64):
    each in (1.2e-10, 22.9], never 0, at half the random bits (and time) of 53-bit uniforms."""
    size = math.prod(shape)
    bits = np.random.SFC64(seed).random_raw((size + 1) // 2).view(np.uint32)[:size]
    x = np.empty(size) if out is None else out.reshape(size)
    np.add(bits, 0.5, out=x)
    np.log(x, out=x)
    np.subtract(32 * math.log(2.0), x, out=x)
    return x.reshape(shape)


def _log_gammas(rng: np.random.Generator, alpha: float, shape: tuple[int, ...] | int) -> np.ndarray:
    """log of Gamma(alpha) draws. Below alpha = 1 they are built in log space as
    log G(alpha + 1) + log(U) / alpha (G(a) = G(a + 1) U^(1/a)), so no draw underflows to 0 however
    small alpha is (a Gamma(0.001) variate is below 1e-308 about half the time)."""
    if alpha >= 1.0:
        return np.log(np.maximum(rng.standard_gamma(alpha, size=shape), np.finfo(np.float64).tiny))
    g = np.maximum(rng.standard_gamma(alpha + 1.0, size=shape), np.finfo(np.float64).tiny)
    return np.log(g) + np.log1p(-rng.random(size=shape)) / alpha  # 1 - U in (0, 1]: finite log


def _log_gamma_quantiles(alpha: float, u: np.ndarray) -> np.ndarray:
    """log of the Gamma(alpha) inverse CDF at u, in log space where the quantile underflows:
    P(alpha, x) ~ x^alpha / Gamma(alpha + 1) as x -> 0 gives log x = (log u + lgamma(alpha + 1)) / alpha."""
    from scipy.special import gammaincinv, gammaln

    x = gammaincinv(alpha, u)
    with np.errstate(divide="ignore"):
        return np.where(x < 1e-250, (np.log(u) + gammaln(alpha + 1.0)) / alpha, np.log(x))


def _from_log(logg: np.ndarray, present: np.ndarray | None, axis: int) -> np.ndarray:
    """exp(logg) rescaled along ``axis`` so each weighting's largest present entry is 1 (absent
    entries 0): the same direction on the simplex, with no underflow of the whole weighting."""
    if present is not None:
        logg = np.where(present, logg, -np.inf)
    return np.exp(logg - logg.max(axis=axis, keepdims=True))


def _gamma_draws(
    n_groups: int,
    num_weights: int,
    d: int,
    *,
    alpha: float,
    sampler: str,
    generator: torch.Generator | None,
    present: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """(G, d, K) positive draws whose (group, k) columns, divided by their sum over the group's
    present dims, are K iid Dir(alpha) weightings on those dims; absent dims (``present`` (G, d)
    False) are 0. Unnormalised so the estimator divides K maxima instead of K x d weights.
    ``out`` (G, d, K) receives the alpha = 1 draws (the common case) if given."""
    if num_weights < 1:
        raise ValueError(f"num_weights must be >= 1, got {num_weights}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    mask = None if present is None else np.asarray(present, dtype=bool)[:, :, None]
    if sampler == "dirichlet":
        if alpha == 1.0:
            g = _exponentials(_seed_from(generator), (n_groups, d, num_weights), out)
            return g if mask is None else np.multiply(g, mask, out=g)
        logg = _log_gammas(np.random.default_rng(_seed_from(generator)), alpha, (n_groups, d, num_weights))
    elif sampler == "sobol":
        engine = torch.quasirandom.SobolEngine(dimension=d, scramble=True, seed=_seed_from(generator))
        base = engine.draw(num_weights, dtype=torch.float64).numpy().T  # (d, K)
        shift = torch.rand((n_groups, d, 1), generator=generator, dtype=torch.float64).numpy()
        u = np.add(base[None], shift, out=out if alpha == 1.0 else None)  # in [0, 2): wrap to [0, 1)
        u -= u >= 1.0  # (np.remainder is ~10x slower)
        np.clip(u, 1e-12, 1 - 1e-12, out=u)
        if alpha == 1.0:
            np.negative(np.log1p(np.negative(u, out=u), out=u), out=u)
            return u if mask is None else np.multiply(u, mask, out=u)
        logg = _log_gamma_quantiles(alpha, u)
    else:
        raise ValueError(f"unknown sampler {sampler!r}; expected 'dirichlet' or 'sobol'")
    return _from_log(logg, mask, axis=1)


def sample_weights(
    n_groups: int,
    num_weights: int,
    d: int,
    *,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    generator: torch.Generator | None = None,
    present: ArrayLike | None = None,
) -> torch.Tensor:
    """Draw (n_groups, K, d) weightings, each row ~ Dir(alpha) over the group's ``present`` dims
    ((n_groups, d) bool; default all), absent dims 0; the draws :func:`vpo_advantage` uses.

    ``dirichlet``: iid Gamma(alpha) draws normalised (alpha = 1: exponentials from 32-bit
    uniforms; alpha < 1: built in log space, so no row is NaN for any alpha > 0). ``sobol``: one
    scrambled Sobol set of K points, randomised per group by a Cranley-Patterson shift, mapped
    through the Gamma(alpha) inverse CDF (quasi-Monte-Carlo; lower variance of the K-average).
    Both are deterministic given ``generator``.
    """
    mask = None if present is None else np.asarray(
        present.detach().cpu() if isinstance(present, torch.Tensor) else present, dtype=bool)
    if mask is not None and mask.shape != (n_groups, d):
        raise ValueError(f"present must be ({n_groups}, {d}), got {mask.shape}")
    if mask is not None and not mask.any(axis=1).all():
        raise ValueError(f"present row {int(np.flatnonzero(~mask.any(axis=1))[0])} has no present dimension")
    g = _gamma_draws(n_groups, num_weights, d, alpha=alpha, sampler=sampler, generator=generator, present=mask)
    w = g / g.sum(axis=1, keepdims=True)
    return torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1)))


def _stable_key(prompt_id: Hashable) -> int:
    """A 64-bit key of a prompt id's text, the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(str(prompt_id).encode("utf-8"), digest_size=8).digest(), "little")


def prompt_weights(prompt_ids: Sequence[Hashable], d: int, *, seed: int = 0, alpha: float = 1.0,
                   present: ArrayLike | None = None) -> np.ndarray:
    """(len(prompt_ids), d) weightings w ~ Dir(alpha), one per prompt, a pure function of
    (seed, prompt id): a prompt gets the same weighting in every epoch, on every rank and in every
    process. Ids are keyed by their text (``3`` and ``"3"`` agree). ``present`` (n, d) bool
    restricts a row to its present dims (absent 0)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    cache: dict[int, np.ndarray] = {}
    logg = np.empty((len(prompt_ids), d))
    for i, pid in enumerate(prompt_ids):
        key = _stable_key(pid)
        if key not in cache:
            cache[key] = _log_gammas(np.random.default_rng([int(seed), key]), alpha, d)
        logg[i] = cache[key]
    mask = None
    if present is not None:
        mask = np.asarray(present.detach().cpu() if isinstance(present, torch.Tensor) else present, dtype=bool)
        if mask.shape != logg.shape:
            raise ValueError(f"present must be {logg.shape}, got {mask.shape}")
        if not mask.any(axis=1).all():
            raise ValueError(f"prompt {prompt_ids[int(np.flatnonzero(~mask.any(axis=1))[0])]!r} has no present dimension")
    g = _from_log(logg, mask, axis=1)
    return g / g.sum(axis=1, keepdims=True)


# -- goal conditioning: the weighting reaches the prompt and the reward ----------------------------
def goal_prompt(prompt: Any, weights: ArrayLike, names: Sequence[str]) -> Any:
    """``prompt`` with its goal weighting appended: text prompts at the end, chat prompts (a list
    of role/content dicts) at the end of the last user message. Dimensions of weight 0 (absent)
    are not listed. The input is never mutated."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(names),):
        raise ValueError(f"goal weights have shape {w.shape}, the reward has {len(names)} dimensions")
    lines = "\n".join(f"- {name}: {wi:.2f}" for name, wi in zip(names, w) if wi > 0)
    block = ("Objective weights (higher = more important); your reward is the weighted sum of the "
             f"objectives:\n{lines}")
    if isinstance(prompt, str):
        return f"{prompt.rstrip()}\n\n{block}"
    if not isinstance(prompt, list) or not all(isinstance(msg, Mapping) for msg in prompt):
        raise TypeError(f"prompt must be a str or a list of chat messages, got {type(prompt).__name__}")
    messages = [dict(msg) for msg in prompt]
    for msg in reversed(messages):
        if msg.get("role") == "user":
            msg["content"] = f"{str(msg.get('content', '')).rstrip()}\n\n{block}"
            return messages
    raise ValueError("chat prompt has no user message to attach the goal weights to")


def goal_condition_rows(
    rows: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    *,
    seed: int,
    alpha: float = 1.0,
    present: Callable[[Mapping[str, Any]], ArrayLike] | None = None,
    id_key: str = "id",
    prompt_key: str = "prompt",
) -> list[dict[str, Any]]:
    """Goal-conditioned GRPO's prompt transform, task-independent: each row's already formatted
    ``prompt`` gains its weighting w = :func:`prompt_weights` (row id, ``seed``, ``alpha``; over
    ``present(row)`` dims if given) and the row gains the column ``goal_weights`` (w as a list),
    which VPOTrainer hands to ``goal_conditioned_grpo`` so the reward is scored with the very
    weighting the prompt shows. Returns new rows."""
    ids = []
    for i, row in enumerate(rows):
        if id_key not in row or prompt_key not in row:
            raise KeyError(f"goal_condition_rows: row {i} has no {id_key if id_key not in row else prompt_key!r} column")
        ids.append(row[id_key])
    mask = None if present is None else np.stack([np.asarray(present(row), dtype=bool) for row in rows])
    w = prompt_weights(ids, len(names), seed=seed, alpha=alpha, present=mask)
    return [{**row, prompt_key: goal_prompt(row[prompt_key], wi, names), GOAL_WEIGHTS_COLUMN: wi.tolist()}
            for row, wi in zip(rows, w)]


# -- VPO ---------------------------------------------------------------------------------------------
def _clean(batch: RewardBatch) -> torch.Tensor:
    """Values with NaN -> 0 (absent dims carry zero weight anyway)."""
    return torch.nan_to_num(batch.values, nan=0.0)


def _mean_max(batch: RewardBatch, gidx: torch.Tensor, n_groups: int, g: np.ndarray, total: np.ndarray) -> torch.Tensor:
    """R_hat per rollout: mean over k of (max over real answers of g_k . r) / total_k, where g is
    (G, d, K) and total (G, K) (a total of 0 contributes 0); an empty rollout scores 0."""
    values = batch.values.detach().cpu().numpy().astype(np.float64, copy=False)
    rows = batch.rows.detach().cpu().numpy()
    n, big_m, d = values.shape
    num = g.shape[2]
    clean = np.nan_to_num(values, nan=0.0) if np.isnan(values).any() else values
    all_rows = bool(rows.all())
    nonneg = all_rows or clean.min(initial=0.0) >= 0
    if not all_rows and nonneg:  # padding rows score 0: never above a real answer (w, r >= 0); empty -> 0
        clean = clean * rows[:, :, None]
    size = _contiguous_size(gidx, n_groups)
    if size:  # TRL's layout: one (S*M, d) @ (d, K) product per group
        dots = np.matmul(clean.reshape(n_groups, size * big_m, d), g,
                         out=_scratch("dots", (n_groups, size * big_m, num))).reshape(n, big_m, num)
    else:
        dots = np.matmul(clean, g[gidx.numpy()])
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


def vpo_scores(
    batch: RewardBatch,
    gidx: torch.Tensor,
    n_groups: int,
    weights: torch.Tensor,
) -> torch.Tensor:
    """R_hat per rollout: mean over K of max over real answers of w_k . r. ``weights`` is (G, K, d)
    already masked to each group's present dims. A rollout with no answers scores 0."""
    w = weights.detach().cpu().to(torch.float64).numpy()
    return _mean_max(batch, gidx, n_groups, np.ascontiguousarray(w.transpose(0, 2, 1)), w.sum(axis=2))


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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """VPO advantage (VPO_SPEC 1.3-1.5). ``weights`` (K, d), if given, replaces sampling for every
    group (masked and renormalised to each group's present dims). With d = 1 every weighting is
    w = 1, so one suffices (and the reduction to ``grpo_population_std`` is exact). Uses
    weights, num_weights, alpha, sampler, generator, eps."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)  # (G, d)
    mask = None if bool(present.all()) else present.numpy()
    if weights is not None:
        w = _weight_matrix(weights, None, batch.d, "K, d")
        g = np.broadcast_to(w.T[None], (n_groups, batch.d, w.shape[0]))
        g = g * mask[:, :, None] if mask is not None else np.ascontiguousarray(g)
    elif batch.d == 1:
        g = np.ones((n_groups, 1, 1))
    else:
        g = _gamma_draws(n_groups, num_weights, batch.d, alpha=alpha, sampler=sampler, generator=generator,
                         present=mask, out=_scratch("draws", (n_groups, batch.d, num_weights)))
    total = np.matmul(np.ones((1, batch.d)), g)[:, 0, :]  # (G, K) sums over present dims (absent are 0)
    return group_zscore(_mean_max(batch, gidx, n_groups, g, total), gidx, n_groups, eps)


# -- scalar baselines --------------------------------------------------------------------------------
def _first_answer_scalar(batch: RewardBatch, w: torch.Tensor) -> torch.Tensor:
    """w . r of each rollout's first answer (0 for an empty rollout); w is (N, d) per rollout."""
    first = _clean(batch)[:, 0, :]
    return torch.where(batch.rows[:, 0], (first * w).sum(-1), torch.zeros(batch.n, dtype=torch.float64))


def _w_star_scalar(batch: RewardBatch, gidx: torch.Tensor, n_groups: int, w_star: ArrayLike | None) -> torch.Tensor:
    """w* . r of each rollout's first answer, w* (default: the mean) renormalised over the group's
    present dims; 0 for an empty rollout."""
    present = present_dims(batch, gidx, n_groups)
    w = masked_normalise(_fixed_weights(w_star, batch.d)[None], present)[gidx]
    return _first_answer_scalar(batch, w)


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


def _padded(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (N, ...) laid out as (G, S_max, ...) by the group table, NaN in the padding."""
    pad = torch.full((1,) + tuple(x.shape[1:]), float("nan"), dtype=x.dtype)
    return torch.cat([x, pad])[table]


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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """TRL's stock GRPO advantage (``GRPOTrainer``, TRL 1.16), bit for bit, in float32 as TRL.

    Reward columns: the first answer's d dimensions (NaN = absent; an empty rollout has 0 on its
    group's present dims), weighted by ``w_star`` as TRL's ``reward_weights`` (default ones, TRL's
    default; not renormalised). ``aggregation="sum_then_normalize"``: r = nansum(w * columns),
    (r - nanmean_g) / (nanstd_g + 1e-4) with the sample std of the group (``scale_rewards="group"``)
    or of the batch (``"batch"``), or r - nanmean_g (``"none"``). ``"normalize_then_sum"`` (TRL's
    GDPO): each column z-scored in its group, w-weighted nansum, z-scored over the batch. A rollout
    whose columns are all NaN gets 0. Uses w_star, scale_rewards, aggregation (not ``eps``: TRL's
    1e-4 is fixed).
    """
    if scale_rewards not in _SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {_SCALE_REWARDS}, got {scale_rewards!r}")
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)[gidx]
    empty = torch.where(present, 0.0, float("nan")).to(torch.float64)
    cols = torch.where(batch.rows[:, :1], batch.values[:, 0, :], empty).to(torch.float32)
    w = (torch.ones(batch.d) if w_star is None else _fixed_weights(w_star, batch.d)).to(torch.float32)
    unscorable = torch.isnan(cols).all(dim=1)
    table = _group_table(gidx, n_groups)[0]
    if aggregation == "sum_then_normalize":
        rewards = (cols * w.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = float("nan")
        grouped = _padded(rewards, table)
        mean = torch.nanmean(grouped, dim=1)[gidx]
        if scale_rewards == "batch":
            std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            std = _nanstd(grouped, dim=1)[gidx] if table.shape[1] > 1 else torch.zeros_like(rewards)
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + _TRL_EPS)
    else:
        grouped = _padded(cols, table)  # (G, S, d)
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


def grpo_population_std_advantage(
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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Scalar GRPO normalised as VPO: z-score (population std, ``eps``) of w*.r of the first answer
    (w* default: mean over present dims). VPO with d = 1, m = 1 equals it bit for bit. Uses w_star, eps."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    return group_zscore(_w_star_scalar(batch, gidx, n_groups, w_star), gidx, n_groups, eps)


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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """GDPO: z-score each present dimension of the first answer within its group, take the
    w*-weighted sum, then z-score that sum over the whole batch (as TRL/NeMo RL's GDPO, with the
    population std and ``eps``). Uses w_star, eps."""
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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Multi-RLVR: z-score of the sum over the (de-duplicated) set of w*.r; no random weights.
    Uses w_star, eps."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)
    w = masked_normalise(_fixed_weights(w_star, batch.d)[None], present)[gidx]  # (N, d)
    per_answer = torch.einsum("nmd,nd->nm", _clean(batch), w) * batch.rows
    return group_zscore(per_answer.sum(dim=1), gidx, n_groups, eps)


def _weighted_grpo(batch: RewardBatch, gidx: torch.Tensor, n_groups: int, w: np.ndarray | torch.Tensor,
                   eps: float, unbiased: bool) -> torch.Tensor:
    """Group z-score of w_i . r of each rollout's first answer, w_i (N, d) renormalised over the
    group's present dims."""
    present = present_dims(batch, gidx, n_groups)[gidx]
    w = masked_normalise(torch.as_tensor(np.asarray(w, dtype=np.float64)), present)
    return group_zscore(_first_answer_scalar(batch, w), gidx, n_groups, eps, unbiased=unbiased)


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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Random-weighting GRPO as the authors define it: one w ~ Dir(alpha) per prompt, fixed across
    epochs by (``seed``, prompt id) (:func:`prompt_weights`; ``prompt_ids`` default to the group
    ids), shared by the prompt's rollouts and not shown in the prompt; the first answer's w . r is
    z-scored in its group with the sample std (verl's GRPO, as their code). ``weights`` (N, d)
    replaces the seeded draw. Uses weights, alpha, seed, prompt_ids, eps."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    if weights is not None:
        w = _weight_matrix(weights, batch.n, batch.d, "N, d")
    else:
        ids = list(prompt_ids) if prompt_ids is not None else (
            group_ids.tolist() if isinstance(group_ids, (np.ndarray, torch.Tensor)) else list(group_ids))
        if len(ids) != batch.n:
            raise ValueError(f"{batch.n} reward sets but {len(ids)} prompt ids")
        w = prompt_weights(ids, batch.d, seed=seed, alpha=alpha, present=present_dims(batch, gidx, n_groups)[gidx])
    return _weighted_grpo(batch, gidx, n_groups, w, eps, unbiased=True)


def random_weight_grpo_per_rollout_advantage(
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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Random-weighting GRPO, per-rollout variant: a fresh w ~ Dir(alpha) for every rollout at
    every call (``weights`` (N, d) may be given instead), population-std z-score of the first
    answer's w . r. Uses weights, alpha, sampler, generator, eps."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    present = present_dims(batch, gidx, n_groups)[gidx]  # (N, d)
    if weights is not None:
        w = _weight_matrix(weights, batch.n, batch.d, "N, d")
    else:
        w = sample_weights(batch.n, 1, batch.d, alpha=alpha, sampler=sampler, generator=generator,
                           present=present)[:, 0, :].numpy()
    return _weighted_grpo(batch, gidx, n_groups, w, eps, unbiased=False)


def goal_conditioned_grpo_advantage(
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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Goal-conditioned GRPO (the authors' baseline): the reward of each rollout is w . r of its
    first answer under the weighting its prompt shows, ``weights`` (N, d) (one row per rollout,
    from the ``goal_weights`` column :func:`goal_condition_rows` writes), z-scored in its group
    with the sample std (verl's GRPO). Uses weights, eps."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    if weights is None:
        raise ValueError("goal_conditioned_grpo needs the weighting each prompt shows: weights=(N, d), one row per "
                         f"rollout (VPOTrainer passes the dataset column {GOAL_WEIGHTS_COLUMN!r} that "
                         "vpo.advantages.goal_condition_rows writes)")
    return _weighted_grpo(batch, gidx, n_groups, _weight_matrix(weights, batch.n, batch.d, "N, d"), eps,
                          unbiased=True)


goal_conditioned_grpo_advantage.row_weights_column = GOAL_WEIGHTS_COLUMN  # type: ignore[attr-defined]


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


def _by_group_size(gidx: torch.Tensor, n_groups: int) -> list[tuple[int, torch.Tensor]]:
    """[(size, (groups of that size, size) rollout indices)] for every group size in the batch."""
    table, sizes = _group_table(gidx, n_groups)
    return [(int(s), table[sizes == s][:, : int(s)]) for s in torch.unique(sizes).tolist()]


def max_at_k_advantage(
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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Max@k (Bagirov et al. 2025, the authors' ``max_at_k``): :func:`max_at_k_scores` of the first
    answer's w*.r in each group of n, then the group z-score with the sample std. ``k`` defaults
    to max(2, n // 2) as the authors; 1 <= k <= n - 1 (k = n collapses to 0 after centring). A
    group of one gets 0. Uses k, w_star, eps."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    s = _w_star_scalar(batch, gidx, n_groups, w_star)
    out = torch.zeros(batch.n, dtype=torch.float64)
    for size, idx in _by_group_size(gidx, n_groups):
        if size < 2:
            continue
        kk = max(2, size // 2) if k is None else int(k)
        if not 1 <= kk <= size - 1:
            raise ValueError(f"max_at_k needs 1 <= k <= n - 1; got k={kk} for groups of n={size} rollouts "
                             "(k = n makes every centred advantage 0)")
        raw = max_at_k_scores(s[idx], kk)
        local = torch.arange(idx.shape[0]).repeat_interleave(size)
        out[idx.reshape(-1)] = group_zscore(raw.reshape(-1), local, idx.shape[0], eps, unbiased=True)
    return out


def grpo_passk_advantage(
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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """verl's ``grpo_passk`` (Pass@k training, arXiv 2503.19595): in each group only the rollout with
    the highest first-answer w*.r gets an advantage, (r_max - r_second) / (sample std + eps); all
    others 0 (a tie at the top gives 0). Groups need at least 2 rollouts. Uses w_star, eps."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    s = _w_star_scalar(batch, gidx, n_groups, w_star)
    out = torch.zeros(batch.n, dtype=torch.float64)
    for size, idx in _by_group_size(gidx, n_groups):
        if size < 2:
            raise ValueError(f"grpo_passk needs at least 2 rollouts per group, a group has {size}")
        x = s[idx]
        top, where = torch.topk(x, 2, dim=1)
        out[idx.gather(1, where[:, :1]).reshape(-1)] = (top[:, 0] - top[:, 1]) / (x.std(dim=1) + eps)
    return out


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
    k: int | None = None,
    prompt_ids: Sequence[Hashable] | None = None,
    seed: int = 0,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """MaxRL (Tajwar et al.): (s - mean_g) / (mean_g + eps) on the first answer's w*.r; 0 when the
    group has no spread. Uses w_star, eps."""
    batch, gidx, n_groups = _prep(reward_sets, group_ids)
    s = _w_star_scalar(batch, gidx, n_groups, w_star)
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
    ("grpo_population_std", grpo_population_std_advantage),
    ("gdpo", gdpo_advantage),
    ("multi_rlvr", multi_rlvr_advantage),
    ("random_weight_grpo", random_weight_grpo_advantage),
    ("random_weight_grpo_per_rollout", random_weight_grpo_per_rollout_advantage),
    ("goal_conditioned_grpo", goal_conditioned_grpo_advantage),
    ("max_at_k", max_at_k_advantage),
    ("grpo_passk", grpo_passk_advantage),
    ("maxrl", maxrl_advantage),
):
    register_estimator(_name)(_fn)
