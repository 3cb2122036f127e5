"""A validation error turned into what a user reads: the key, what was expected and what was given.

An unknown key names where it moved (a renamed setting), or the closest keys, or for ``trainer:`` and
an arm where TRL documents its settings; the member errors of a union become one "expected A or B".
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from vpo.pipeline.config.fields import RESERVED, TRL_DOCS
from vpo.pipeline.config.schema import PIPELINE_ONLY, ArmConfig, TrainerConfig, _ArmOwn, _TrainerOwn
from vpo.pipeline.config.source import describe

__all__ = ["problems"]


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The pydantic model class found by following ``loc`` through fields (list indices skipped)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if (
            not (isinstance(current, type) and issubclass(current, BaseModel))
            or part not in current.model_fields
        ):
            return None
        current = _unwrap(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    for arg in getattr(annotation, "__args__", ()) or ():
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation



_MOVED: dict[tuple[str, str], str] = {
    ("TrainerConfig", "steps"): "max_steps",
    ("TrainerConfig", "lr"): "learning_rate",
    ("TrainerConfig", "alpha"): "weight_alpha",
    ("TrainerConfig", "sampler"): "weight_sampler",
    ("TrainerConfig", "generation_backend"): "use_vllm (true/false)",
    ("TrainerConfig", "vllm_server_url"): "vllm_server_base_url",
    ("TrainerConfig", "prompts_per_step"): (
        "per_device_train_batch_size, TRL's completions per device per micro-step (prompts_per_step x "
        "num_generations on one process gives the same step); see gradient_accumulation_steps and "
        "generation_batch_size / steps_per_generation"),
    ("ArmConfig", "prompts_per_step"): "per_device_train_batch_size (completions: prompts x num_generations)",
    ("ArmConfig", "m"): "num_answers",
    ("DatasetConfig", "source"): "task.params.source (the task reads its rows)",
    ("DatasetConfig", "format"): "task.params.format (the task reads its rows)",
    ("SearchConfig", "params"): "search.n_problems / prompt_mode / baseline / database (typed keys)",
}
"""Keys that were renamed (to TRL's / VPOConfig's names) or moved: the error says where they went."""


def _unknown_key(owner: type[BaseModel] | None, key: str) -> str:
    """The message for an unknown key of ``owner``: where it moved, or the closest names."""
    name = owner.__name__ if owner is not None else ""
    if (name, key) in _MOVED:
        return f"unknown key: now {_MOVED[name, key]}"
    if owner is None:
        return "unknown key"
    if owner in (TrainerConfig, ArmConfig):
        if key in RESERVED:
            return f"set by the pipeline, not in the config: {RESERVED[key]}"
        if owner is TrainerConfig and key in _ArmOwn.model_fields:
            return f"a setting of each arm: arms.<name>.{key}"
        if owner is ArmConfig and key in _TrainerOwn.model_fields:
            return f"a setting of the whole pipeline: trainer.{key}"
    close = _closest(key, list(owner.model_fields))
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    if owner in (TrainerConfig, ArmConfig):
        section = "trainer" if owner is TrainerConfig else "arms"
        own = ", ".join(k.split(".", 1)[1] for k in PIPELINE_ONLY if k.startswith(f"{section}."))
        return (f"unknown key{hint} ({section}: takes any field of TRL's GRPOConfig ({TRL_DOCS}) or "
                f"vpo.trainer.VPOConfig, plus {own})")
    return f"unknown key{hint}; allowed keys: {', '.join(owner.model_fields)}"


def _closest(key: str, names: Sequence[str], n: int = 3) -> list[str]:
    """The names most like ``key`` (difflib's ratio, also against each run of a name's ``_``-separated
    words, so ``stpes`` finds ``max_steps`` and ``vllm_gpu_memory`` finds ``vllm_gpu_memory_utilization``)."""
    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    def scores(name: str) -> tuple[float, float]:
        parts = name.split("_")
        runs = ["_".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
        best = max(ratio(key, r) for r in runs)
        return best, 0.7 * best + 0.3 * ratio(key, name)  # (close enough?, rank: the whole name counts too)

    scored = sorted(((*scores(nm), nm) for nm in names), key=lambda x: -x[1])
    return [nm for best, _, nm in scored if best >= 0.75][:n]


def _format_error(model: type[BaseModel], err: Mapping[str, Any]) -> str:
    kind = err["type"]
    loc = err["loc"]
    if kind == "extra_forbidden":
        return _unknown_key(_model_at(model, loc[:-1]), str(loc[-1]))
    if kind == "missing":
        return "required key is missing"
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ")
    msg = re.sub(r"^Input should be ", "expected ", msg)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        msg = "expected a mapping"
    if kind == "none_required":
        msg = "expected null: a Python object, it cannot be set in a YAML file"
    if "input" in err and kind not in ("value_error", "assertion_error"):
        msg += f", got {describe(err['input'])}"
    return msg


def _field_loc(model: type[BaseModel], loc: Sequence[Any]) -> tuple[Any, ...]:
    """``loc`` cut after the first field whose value is not a settings section: a union type reports
    one error per member, with the member's name appended, which is no key of the file."""
    current: Any = model
    for i, part in enumerate(loc):
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return tuple(loc)
        current = _unwrap(current.model_fields[part].annotation)
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return tuple(loc[: i + 1])
    return tuple(loc)


def problems(model: type[BaseModel], exc: ValidationError) -> list[tuple[tuple[Any, ...], str]]:
    """(loc, message) per key: the member errors of a union become one "expected A or B, got X"."""
    grouped: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for err in exc.errors():
        grouped.setdefault(_field_loc(model, err["loc"]), []).append(err)
    out = []
    for loc, errs in grouped.items():
        messages = list(dict.fromkeys(_format_error(model, {**e, "loc": loc if len(errs) > 1 else e["loc"]})
                                      for e in errs))
        if len(messages) > 1:
            got = f", got {describe(errs[0]['input'])}" if "input" in errs[0] else ""
            parts = [m.removesuffix(got).removeprefix("expected ") for m in messages]
            messages = ["expected " + " or ".join(dict.fromkeys(parts)) + got]
        out.append((loc, messages[0]))
    return out

