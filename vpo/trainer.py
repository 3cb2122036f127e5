"""VPOTrainer: TRL's GRPOTrainer with the advantage estimator replaced, nothing else.

TRL 1.16 has no advantage hook (trl#4525), so the subclass overrides two methods
(../shared/notes/trl.md section 2):

* ``_calculate_rewards`` parses each completion into at most m answers, scores them with a
  :class:`~vpo.rewards.VectorReward` into an (m, d) matrix, gathers all ranks' matrices and
  stashes them; it returns TRL's usual (N, F) matrix with one column per reward dimension (the
  value of each rollout's w*-best answer) so TRL's per-function logging keeps working.
* ``_generate_and_score_completions`` lets TRL generate and build its batch, then replaces the
  stock advantages by the registered estimator's, computed on the gathered batch with a
  ``torch.Generator`` seeded from (seed, step, mode, call) so every rank draws the same weights,
  and hands each rank its slice.

The estimators return group z-scores already; TRL's loss uses ``inputs["advantages"]`` as is,
so nothing is normalised twice (``scale_rewards`` only affects the discarded stock path).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather
from trl import GRPOConfig, GRPOTrainer

from vpo.advantages import (
    RewardBatch,
    get_estimator,
    masked_normalise,
    present_dims,
    sample_weights,
    vpo_scores,
)
from vpo.metrics import reward_diversity
from vpo.rewards import VectorReward, score_set

__all__ = ["VPOConfig", "VPOTrainer", "completion_text", "dimension_reward_funcs"]


@dataclass
class VPOConfig(GRPOConfig):
    """GRPOConfig plus the advantage estimator and its settings (VPO_SPEC 1.4-1.5, 6)."""

    estimator: str = field(default="vpo", metadata={"help": "Registered advantage estimator (vpo, grpo, gdpo, ...)."})
    num_answers: int = field(default=3, metadata={"help": "m: answers per rollout (1 = single-answer format)."})
    num_weights: int = field(default=100, metadata={"help": "K: Dirichlet weightings per prompt group."})
    weight_alpha: float = field(default=1.0, metadata={"help": "Dirichlet concentration alpha."})
    weight_sampler: str = field(default="dirichlet", metadata={"help": "'dirichlet' (iid) or 'sobol' (QMC)."})
    w_star: list[float] | None = field(default=None, metadata={"help": "Fixed scalarisation for baselines/logging."})
    advantage_eps: float = field(default=1e-6, metadata={"help": "eps of the group z-score."})
    truncated_scores_zero: bool = field(
        default=True,
        metadata={"help": "A completion cut at max_completion_length (no EOS) scores as unparseable (all zero). "
                  "Without it token-mean losses reward never stopping: answers are parsed from the text, so "
                  "trailing junk is free and long rollouts carry more tokens."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        get_estimator(self.estimator)  # unknown names fail here, before any model is loaded
        if self.num_answers < 1:
            raise ValueError(f"num_answers must be >= 1, got {self.num_answers}")
        if self.num_weights < 1:
            raise ValueError(f"num_weights must be >= 1, got {self.num_weights}")
        if self.weight_alpha <= 0:
            raise ValueError(f"weight_alpha must be > 0, got {self.weight_alpha}")
        if self.weight_sampler not in ("dirichlet", "sobol"):
            raise ValueError(f"weight_sampler must be 'dirichlet' or 'sobol', got {self.weight_sampler!r}")


def completion_text(completion: Any) -> str:
    """TRL passes str completions for text prompts and message lists for chat prompts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"unsupported completion type {type(completion).__name__}")


def _best_rows(sets: Sequence[np.ndarray], w_star: np.ndarray) -> np.ndarray:
    """(N, d): for each rollout the reward vector of its w*-best answer (zeros if it has none)."""
    out = np.zeros((len(sets), w_star.shape[0]))
    for i, mat in enumerate(sets):
        if mat.shape[0]:
            out[i] = mat[int(np.argmax(np.nan_to_num(mat) @ w_star))]
        else:
            out[i] = np.nan
    return out


def dimension_reward_funcs(reward: VectorReward, m: int) -> list[Any]:
    """One TRL reward function per dimension (value of the rollout's w*-best answer, None if absent).

    VPOTrainer computes all dimensions in one pass and never calls these; they exist so the
    same reward also plugs into a stock GRPOTrainer (sum/normalise over functions = GRPO/GDPO).
    """
    w_star = np.asarray(reward.w_star(), dtype=np.float64)

    def make(j: int, name: str) -> Any:
        def fn(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
            rows = [{k: v[i] for k, v in kwargs.items() if isinstance(v, list)} for i in range(len(completions))]
            mats = [score_set(reward, completion_text(c), r, m).matrix for c, r in zip(completions, rows)]
            best = _best_rows(mats, w_star)
            return [None if np.isnan(v) else float(v) for v in best[:, j]]

        fn.__name__ = name
        return fn

    return [make(j, name) for j, name in enumerate(reward.names)]


class VPOTrainer(GRPOTrainer):
    """GRPOTrainer whose advantages come from :mod:`vpo.advantages` on vector-scored answer sets."""

    def __init__(self, model: Any, reward: VectorReward, args: VPOConfig, **kwargs: Any) -> None:
        if not isinstance(args, VPOConfig):
            raise TypeError("VPOTrainer needs a VPOConfig")
        if "reward_funcs" in kwargs:
            raise TypeError("pass the vector reward as `reward=`; VPOTrainer builds its own reward_funcs")
        self.vector_reward = reward
        self._w_star = np.asarray(args.w_star if args.w_star is not None else reward.w_star(), dtype=np.float64)
        if self._w_star.shape != (reward.dim,):
            raise ValueError(f"w_star has {self._w_star.shape[0]} entries, the reward has {reward.dim} dimensions")
        self._estimator = get_estimator(args.estimator)
        self._vpo_calls: dict[str, int] = defaultdict(int)
        self._vpo_call_step: dict[str, int] = {}
        self._vpo_sets: torch.Tensor | None = None
        self._vpo_counts: torch.Tensor | None = None
        self.last_advantages: torch.Tensor | None = None  # global (N,) vector of the latest batch
        super().__init__(model=model, reward_funcs=dimension_reward_funcs(reward, args.num_answers), args=args,
                         **kwargs)

    # -- rewards -----------------------------------------------------------------------------
    def _calculate_rewards(self, inputs: list[dict[str, Any]], prompts: list[Any], completions: list[Any],
                           completion_ids_list: list[Any]) -> torch.Tensor:
        m = self.args.num_answers
        device = self.accelerator.device
        base = self.accelerator.process_index * len(prompts)
        texts = [completion_text(c) for c in completions]
        if self.args.truncated_scores_zero:
            stop = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            texts = [t if len(ids) and int(ids[-1]) in stop else "" for t, ids in zip(texts, completion_ids_list)]
        if hasattr(self.vector_reward, "prefetch"):  # e.g. code_tests: run the whole batch in parallel first
            self.vector_reward.prefetch(texts, inputs, m)
        scored = [
            score_set(self.vector_reward, text, row, m, where=f"rollout {base + i} (row id {row.get('id', '?')})")
            for i, (text, row) in enumerate(zip(texts, inputs))
        ]
        local = torch.tensor(np.stack([s.matrix for s in scored]), dtype=torch.float32, device=device)
        counts = torch.tensor([s.n_valid for s in scored], dtype=torch.long, device=device)
        self._vpo_sets = gather(local).cpu().to(torch.float64)  # (N, m, d)
        self._vpo_counts = gather(counts).cpu()
        sets = self._set_list()
        return torch.tensor(_best_rows(sets, self._w_star), dtype=torch.float32, device=device)

    def _set_list(self) -> list[np.ndarray]:
        assert self._vpo_sets is not None and self._vpo_counts is not None
        vals = self._vpo_sets.numpy()
        return [vals[i, : int(c)] for i, c in enumerate(self._vpo_counts.tolist())]

    def _generator(self, mode: str) -> torch.Generator:
        """Same seed on every rank: (seed, global step, mode, call index within the step). The call
        index restarts at every step, so a run resumed from a checkpoint draws the same weights."""
        step = self.state.global_step
        if self._vpo_call_step.get(mode) != step:
            self._vpo_call_step[mode] = step
            self._vpo_calls[mode] = 0
        call = self._vpo_calls[mode]
        self._vpo_calls[mode] += 1
        seed = (self.args.seed * 1_000_003 + self.state.global_step * 7_919 + call * 104_729
                + (0 if mode == "train" else 15_485_863)) % (2**63 - 1)
        return torch.Generator().manual_seed(seed)

    # -- advantages --------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        assert self._vpo_sets is not None and self._vpo_counts is not None
        n_total, m, _ = self._vpo_sets.shape
        rows = torch.arange(m)[None, :] < self._vpo_counts[:, None]
        batch = RewardBatch(self._vpo_sets, rows)
        gidx = torch.arange(n_total) // group
        gen = self._generator(mode)
        log_gen = torch.Generator()
        log_gen.set_state(gen.get_state())  # vpo/* metrics redraw the very weights the estimator uses
        adv = self._estimator(batch, gidx, num_weights=self.args.num_weights, alpha=self.args.weight_alpha,
                              sampler=self.args.weight_sampler, generator=gen, eps=self.args.advantage_eps,
                              w_star=self._w_star)
        self.last_advantages = adv.clone()
        n_local = out["prompt_ids"].size(0)
        start = self.accelerator.process_index * n_local
        device = out["advantages"].device
        out["advantages"] = adv[start:start + n_local].to(device=device, dtype=out["advantages"].dtype)
        out["vpo_row_id"] = torch.arange(start, start + n_local, device=device)
        # the completions table shows the advantages actually used
        logs = self._logs["advantages"]
        for _ in range(min(n_total, len(logs))):
            logs.pop()
        logs.extend(adv.tolist())
        self._log_vpo_metrics(mode, batch, gidx, group, log_gen)
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, minus metrics with no value in this logging window. TRL averages each metric over
        its non-NaN values and reports None when there are none (e.g. ``rewards/<dim>/mean`` or
        ``vpo/dim/<dim>`` when no rollout parsed an answer); every logger then warns about the None
        ("Trainer is attempting to log a value of None"). A metric without a value is left out of
        that step instead."""
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        for key in [k for k, vals in metrics.items() if not any(not math.isnan(v) for v in vals)]:  # all NaN, or none
            del metrics[key]
        super().log(logs, start_time)

    def _log_vpo_metrics(self, mode: str, batch: RewardBatch, gidx: torch.Tensor, group: int,
                         gen: torch.Generator) -> None:
        """vpo/* metrics, identical on all ranks (computed from gathered data). ``gen`` starts in the
        state the estimator's generator had, so expected_max / group_std describe the R_hat the VPO
        advantages were computed from."""
        metrics = self._metrics[mode]
        n_groups = int(gidx.max().item()) + 1
        counts = batch.rows.sum(1).to(torch.float64)
        metrics["vpo/pool_size"].append(counts.mean().item())
        metrics["vpo/frac_unparsed"].append((counts == 0).to(torch.float64).mean().item())
        w = sample_weights(n_groups, self.args.num_weights, batch.d, alpha=self.args.weight_alpha,
                           sampler=self.args.weight_sampler, generator=gen)
        w = masked_normalise(w, present_dims(batch, gidx, n_groups)[:, None, :])
        scores = vpo_scores(batch, gidx, n_groups, w)
        self.last_vpo_scores = scores
        metrics["vpo/expected_max"].append(scores.mean().item())
        mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gidx, scores) / group
        var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gidx, (scores - mean[gidx]) ** 2) / group
        std = var.sqrt()
        metrics["vpo/group_std"].append(std.mean().item())
        metrics["vpo/frac_zero_std_groups"].append((std < self.args.advantage_eps).to(torch.float64).mean().item())
        sets = self._set_list()
        best = _best_rows(sets, self._w_star)
        scalar_best = np.nan_to_num(np.nan_to_num(best) @ self._w_star)
        metrics["vpo/scalar_best_in_set"].append(float(scalar_best.mean()))
        first = np.array([float(np.nan_to_num(s[0]) @ self._w_star) if len(s) else 0.0 for s in sets])
        metrics["vpo/scalar_first_answer"].append(float(first.mean()))
        g_np = gidx.numpy()
        div_group, div_set = [], []
        for g in range(n_groups):
            pool = [s for i in np.flatnonzero(g_np == g) for s in sets[i]]
            div_group.append(reward_diversity(np.array(pool)) if len(pool) > 1 else 0.0)
        for s in sets:
            if len(s) > 1:
                div_set.append(reward_diversity(s))
        metrics["vpo/reward_diversity"].append(float(np.mean(div_group)))
        metrics["vpo/diversity_within_set"].append(float(np.mean(div_set)) if div_set else 0.0)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-absent dimension has no mean
            dim_means = np.nanmean(best, axis=0)
        for name, val in zip(self.vector_reward.names, dim_means):
            metrics[f"vpo/dim/{name}"].append(float(val) if np.isfinite(val) else float("nan"))
