"""The settings :class:`vpo.trainer.VPOConfig` adds to TRL's ``GRPOConfig``, declared once, without TRL.

One line per setting says its type, its bounds and its default; the docstring under it is its help.
:class:`vpo.trainer.VPOConfig` takes each field's default, help and bounds from here
(:func:`declared`), and the pipeline's schema of every VPOConfig field
(:mod:`vpo.pipeline.config.fields`) inherits this class, so a value is checked the same way in a
``pipelines.yaml`` and in code. :func:`ours` marks a default the project chose (with its reason)
where a reader might expect another one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, WrapValidator

__all__ = ["OURS", "Float", "VPOFields", "declared", "ours"]

OURS = "ours"
"""The key under which :func:`ours` keeps a default's reason (in the field's ``json_schema_extra``)."""


def ours(default: Any, why: str) -> Any:
    """A default the project chose, and why (where TRL's, or a reader's first guess, differs)."""
    return Field(default=default, json_schema_extra={OURS: why})


def _keep_int(value: Any, handler: Any) -> Any:
    """A float setting given as an integer stays an integer (``save_steps: 2`` is not written back as 2.0,
    so settings, their records and their hashes read as written)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return handler(value)


Float = Annotated[float, WrapValidator(_keep_int), PlainSerializer(lambda v: v, return_type=Any)]
"""A float setting (an integer given for it stays an integer)."""


class VPOFields(BaseModel):
    """The estimator's and the trainer's own settings (VPO_SPEC 1.4-1.5, 6)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    num_answers: Annotated[int, Field(ge=1)] = ours(1, "the format every estimator takes; an m-answer arm says so")
    """Answers per rollout (1 = the single-answer format)."""
    num_weights: Annotated[int, Field(ge=1)] = 100
    """K: Dirichlet weightings per prompt group."""
    weight_alpha: Annotated[Float, Field(gt=0)] = 1.0
    """Dirichlet concentration alpha."""
    weight_sampler: Literal["dirichlet", "sobol"] = "dirichlet"
    """'dirichlet' (iid) or 'sobol' (QMC)."""
    w_star: list[Float] | None = None
    """Fixed scalarisation for baselines/logging."""
    advantage_eps: Annotated[Float, Field(gt=0)] = 1e-6
    """eps of the group z-score."""
    max_at_k_k: Annotated[int, Field(ge=1)] | None = None
    """k of the max_at_k estimator (default max(2, n // 2), as the authors)."""
    truncated_scores_zero: bool = True
    """A completion cut at max_completion_length (no EOS) scores as unparseable (all zero). Without it
    token-mean losses reward never stopping: answers are parsed from the text, so trailing junk is free
    and long rollouts carry more tokens."""
    min_parse_rate: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.2
    """Warn (LowParseRateWarning) when the fraction of a step's rollouts with at least one parsed answer
    is below this; 0 disables the warning."""
    max_unparsed_steps: Annotated[int, Field(ge=0)] = 5
    """Raise ParseRateError after this many consecutive generation batches (one per training step unless
    steps_per_generation > 1) in which no rollout parsed (all rewards zero, so loss and gradient are
    zero); 0 disables the check."""
    share_prompt_prefix: bool = True
    """Run each distinct prompt once in generation and in the loss's forward (its KV cache is shared by
    the group's rollouts); equal to TRL's path to float rounding. Used on one process without gradient
    checkpointing or vLLM; TRL's path otherwise."""


def _constraints(items: Any) -> dict[str, Any]:
    """The bounds (``ge``/``gt``/``le``/``lt``) among annotation metadata, ``Field(...)`` inside included."""
    out: dict[str, Any] = {}
    for item in items:
        out.update(_constraints(getattr(item, "metadata", None) or ()))
        out.update({b: getattr(item, b) for b in ("ge", "gt", "le", "lt") if getattr(item, b, None) is not None})
    return out


def declared(name: str) -> dict[str, Any]:
    """The ``dataclasses.field`` arguments of :class:`VPOFields`' setting ``name`` for VPOConfig: its
    default, and its help, bounds (``ge``/``gt``/``le``/``lt``) and choices as TRL-style metadata."""
    info = VPOFields.model_fields[name]
    meta: dict[str, Any] = {"help": " ".join((info.description or "").split()), **_constraints(info.metadata)}
    for arg in (info.annotation, *get_args(info.annotation)):
        if get_origin(arg) is Literal:
            meta["choices"] = list(get_args(arg))
        if get_origin(arg) is Annotated:
            meta.update(_constraints(get_args(arg)[1:]))
    return {"default": info.default, "metadata": meta}
