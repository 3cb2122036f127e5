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
so nothing is normalised twice. TRL's own reward columns are the w*-best answer's dimensions
(0 for an unparseable rollout) weighted by w* as ``reward_weights``, so with m = 1 the ``grpo``
estimator reproduces the stock advantages TRL computed and discarded, bit for bit, under the
config's ``scale_rewards`` and ``multi_objective_aggregation`` (which no other estimator reads).
Per-rollout extras reach the estimator gathered like the rewards: each row's prompt id (``id``
column, else its prompt) and, for ``goal_conditioned_grpo``, its ``goal_weights`` column.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import torch
from accelerate.utils import gather, gather_object
from trl import GRPOConfig, GRPOTrainer

from vpo.advantages import (
    EstimatorInputs,
    RewardBatch,
    get_estimator,
    present_dims,
    sample_weights,
    vpo_scores,
)
from vpo.metrics import reward_diversity
from vpo.rewards import VectorReward, score_set
from vpo.shared_prefix import SharedPrefixMixin
from vpo.trainer_fields import declared

__all__ = ["LowParseRateWarning", "ParseRateError", "VPOConfig", "VPOTrainer", "completion_text",
           "dimension_reward_funcs"]


class LowParseRateWarning(UserWarning):
    """A training step in which few rollouts parsed into the answer format (VPOConfig.min_parse_rate)."""


class ParseRateError(RuntimeError):
    """No rollout parsed for VPOConfig.max_unparsed_steps steps in a row: training cannot learn."""


warnings.simplefilter("always", LowParseRateWarning)  # one per step, never folded into the first


@dataclass
class VPOConfig(GRPOConfig):
    """GRPOConfig plus the advantage estimator and its settings (VPO_SPEC 1.4-1.5, 6): each one's type,
    default, bounds and help are declared once, in :class:`vpo.trainer_fields.VPOFields` (read here
    and by the pipeline's schema, which checks a config's values before TRL is imported)."""

    estimator: str = field(default="vpo", metadata={"help": "Registered advantage estimator (vpo, grpo, gdpo, ...)."})
    num_answers: int = field(**declared("num_answers"))
    num_weights: int = field(**declared("num_weights"))
    weight_alpha: float = field(**declared("weight_alpha"))
    weight_sampler: str = field(**declared("weight_sampler"))
    w_star: list[float] | None = field(**declared("w_star"))
    advantage_eps: float = field(**declared("advantage_eps"))
    max_at_k_k: int | None = field(**declared("max_at_k_k"))
    truncated_scores_zero: bool = field(**declared("truncated_scores_zero"))
    min_parse_rate: float = field(**declared("min_parse_rate"))
    max_unparsed_steps: int = field(**declared("max_unparsed_steps"))
    share_prompt_prefix: bool = field(**declared("share_prompt_prefix"))

    def __post_init__(self) -> None:
        super().__post_init__()
        get_estimator(self.estimator)  # unknown names fail here, before any model is loaded
        for f in fields(self):  # the bounds and choices the fields declare
            value, meta = getattr(self, f.name), f.metadata
            if value is None or not {"choices", "ge", "gt", "le"} & set(meta):
                continue
            value = getattr(value, "value", value)  # TRL turns some strings into enums
            if "choices" in meta and value not in meta["choices"]:
                raise ValueError(f"{f.name} must be one of {', '.join(map(repr, meta['choices']))}, got {value!r}")
            for bound, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                                    ("le", lambda v, b: v <= b, "<=")):
                if bound in meta and not ok(value, meta[bound]):
                    raise ValueError(f"{f.name} must be {word} {meta[bound]}, got {value}")
        if self.reward_weights is not None:
            raise ValueError("VPOConfig takes the scalarisation as w_star (it also becomes TRL's reward_weights); "
                             "leave reward_weights unset")
        trl_defaults = {"scale_rewards": "group", "multi_objective_aggregation": "sum_then_normalize"}
        changed = [k for k, v in trl_defaults.items() if getattr(self, k) != v]
        if changed and self.estimator.lower() != "grpo":
            raise ValueError(f"{', '.join(changed)} only shape the 'grpo' estimator (TRL's stock advantages); "
                             f"estimator {self.estimator!r} would ignore it")
        if self.max_at_k_k is not None and self.estimator.lower() != "max_at_k":
            raise ValueError(f"max_at_k_k only applies to the 'max_at_k' estimator, not {self.estimator!r}")


def completion_text(completion: Any) -> str:
    """TRL passes str completions for text prompts and message lists for chat prompts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"unsupported completion type {type(completion).__name__}")


def _best_rows(sets: Sequence[np.ndarray], w_star: np.ndarray) -> np.ndarray:
    """(N, d): for each rollout the reward vector of its w*-best answer (NaN if the set is empty;
    a zero-padded set yields its zero row, i.e. an unparseable rollout scores 0)."""
    out = np.zeros((len(sets), w_star.shape[0]))
    for i, mat in enumerate(sets):
        if mat.shape[0]:
            out[i] = mat[int(np.argmax(np.nan_to_num(mat) @ w_star))]
        else:
            out[i] = np.nan
    return out


def _prompt_id(row: Mapping[str, Any]) -> Any:
    """A row's prompt identity for per-prompt seeding: its ``id`` column, else its prompt text."""
    return row["id"] if "id" in row else str(row.get("prompt"))


def _row_weights(row: Mapping[str, Any], column: str, d: int, where: int) -> np.ndarray:
    """A row's weighting from ``column`` (a list of d floats, or its JSON text as the pipeline's
    training datasets store lists), checked: d finite non-negative numbers."""
    value = row.get(column)
    if isinstance(value, str):
        value = json.loads(value)
    w = np.asarray(value if value is not None else [], dtype=np.float64)
    if w.shape != (d,) or not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"rollout {where} (row id {row.get('id', '?')}): column {column!r} must hold {d} finite "
                         f"non-negative weights, got {row.get(column)!r}")
    return w


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


class VPOTrainer(SharedPrefixMixin, GRPOTrainer):
    """GRPOTrainer whose advantages come from :mod:`vpo.advantages` on vector-scored answer sets."""

    # TRL's model card and Hub tags (create_model_card, on every checkpoint) name the trainer and paper
    _name = "VPO"
    _tag_names = ("trl", "vpo")
    _paper: ClassVar[dict[str, str]] = {
        "title": "Vector Policy Optimization", "id": "2605.22817",
        "citation": "@misc{vpo2026,\n    title         = {{Vector Policy Optimization}},\n    year          = 2026,\n"
                    "    eprint        = {2605.22817},\n    archivePrefix = {arXiv},\n}"}

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
        self._estimator_inputs = EstimatorInputs.from_config(args, w_star=self._w_star)
        if args.estimator != "vpo":  # a baseline arm: the card and tags name the estimator it trained with
            self._name = f"the {args.estimator} estimator of the VPO trainer"
            self._tag_names = ("trl", "vpo", args.estimator)
            self._paper = {"citation": self._paper["citation"]}
        self._row_weights_column: str | None = getattr(self._estimator, "row_weights_column", None)
        for name in ("train_dataset", "eval_dataset"):
            columns = getattr(kwargs.get(name), "column_names", None)
            if self._row_weights_column and isinstance(columns, list) and self._row_weights_column not in columns:
                raise ValueError(f"estimator {args.estimator!r} scores each rollout with the weighting its prompt shows, "
                                 f"read from the {name} column {self._row_weights_column!r}; build the rows with "
                                 "vpo.advantages.goal_condition_rows")
        self._vpo_row_weights: torch.Tensor | None = None
        self._vpo_prompt_ids: list[Any] | None = None
        self._vpo_calls: dict[str, int] = defaultdict(int)
        self._vpo_call_step: dict[str, int] = {}
        self._vpo_sets: torch.Tensor | None = None
        self._vpo_counts: torch.Tensor | None = None
        self.last_advantages: torch.Tensor | None = None  # global (N,) vector of the latest batch
        self.unparsed_streak = 0  # consecutive training steps in which no rollout parsed
        self.low_parse_steps: list[tuple[int, float]] = []  # (step, parse rate) of every warned step
        self.generated_prompts = 0  # prompt groups generated for training (all ranks), since this trainer began
        self.generation_rounds = 0  # training generation rounds, since this trainer began
        super().__init__(model=model, reward_funcs=dimension_reward_funcs(reward, args.num_answers), args=args,
                         **kwargs)
        # TRL's stock path (logged as `reward`, and what `grpo` reproduces) weights the columns by w*
        self.reward_weights = torch.tensor(self._w_star, dtype=torch.float32)

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
        self._vpo_prompt_ids = list(gather_object([_prompt_id(row) for row in inputs]))
        if self._row_weights_column:
            local_w = np.stack([_row_weights(row, self._row_weights_column, self.vector_reward.dim, base + i)
                                for i, row in enumerate(inputs)])
            self._vpo_row_weights = gather(torch.tensor(local_w, dtype=torch.float64, device=device)).cpu()
        padded = list(self._vpo_sets.numpy())  # an empty set keeps its zero row: TRL sees 0, not "unscorable"
        return torch.tensor(_best_rows(padded, self._w_star), dtype=torch.float32, device=device)

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
        adv = self._estimator(batch, gidx, self._estimator_inputs.for_batch(
            generator=gen, prompt_ids=self._vpo_prompt_ids,
            weights=self._vpo_row_weights if self._row_weights_column else None))
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
        if mode == "train":
            self.generated_prompts += n_total // group
            self.generation_rounds += 1
            self._check_parse_rate(float((self._vpo_counts > 0).to(torch.float64).mean()))
        return out

    def _check_parse_rate(self, rate: float) -> None:
        """``rate``: fraction of the batch's rollouts with at least one parsed answer (1 -
        vpo/frac_unparsed). Warn when it is below ``min_parse_rate``; raise
        :class:`ParseRateError` after ``max_unparsed_steps`` consecutive steps with none parsed."""
        step = self.state.global_step + 1
        self.unparsed_streak = self.unparsed_streak + 1 if rate == 0.0 else 0
        limit = self.args.max_unparsed_steps
        if limit and self.unparsed_streak >= limit:
            raise ParseRateError(
                f"no rollout parsed into the {self.args.num_answers}-answer format for {self.unparsed_streak} "
                f"consecutive training steps (up to step {step}; VPOConfig.max_unparsed_steps={limit}): every "
                "reward is zero, so loss and gradient are zero. Warm the model up on the answer format first "
                "(vpo.sft.train_sft with init_dir=...), raise max_completion_length if answers are cut off, "
                "or set max_unparsed_steps=0 to train anyway.")
        if rate < self.args.min_parse_rate:
            self.low_parse_steps.append((step, rate))
            warnings.warn(
                f"step {step}: only {rate:.0%} of rollouts parsed into the {self.args.num_answers}-answer format "
                f"(VPOConfig.min_parse_rate={self.args.min_parse_rate}); unparsed rollouts score zero",
                LowParseRateWarning, stacklevel=2)
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
                           sampler=self.args.weight_sampler, generator=gen, present=present_dims(batch, gidx, n_groups))
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
