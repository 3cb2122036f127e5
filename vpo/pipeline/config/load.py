"""Loading ``pipelines.yaml``: every problem of a pipeline found before any work starts, reported once.

The file holds named pipelines::

    version: 1
    default: route              # the pipeline used when none is named
    pipelines:
      route: {task: ..., model: ..., arms: [...], trainer: ..., quick: {...}}

Any problem -- an unknown key (with the closest names), a wrong type, a missing local file, a file
that is not UTF-8 -- is collected and raised as ONE :class:`ConfigError` naming the file, the
pipeline, each dotted key path (with its YAML line, or "from --set" for a command-line value) and
what was expected. What a run ends up with is checked too (estimator-specific settings, TRL's batch
rule on the world size). Loading imports nothing heavy: no Prefect, DVC, transformers or TRL.

``quick:`` inside a pipeline is a partial mapping deep-merged on top of it when loading with
``quick=True`` (tests, smoke runs). Mappings merge key by key, other values are replaced, and a
mapping given for ``arms`` merges into the arms by name (``quick: {arms: {vpo: {seeds: [0]}}}``).
Relative paths in the file are resolved against the folder holding the file.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from vpo.pipeline.config.fields import VPOConfigFields
from vpo.pipeline.config.problems import problems as _problems
from vpo.pipeline.config.schema import PipelineConfig, PipelinesFile
from vpo.pipeline.config.settings import arm_batch
from vpo.pipeline.config.source import ConfigError, Source, describe, from_set, loc_to_key, parse

__all__ = ["DEFAULT_PATH", "apply_overrides", "deep_merge", "load_all", "load_pipeline", "pipeline_names",
           "validate"]

DEFAULT_PATH = "pipelines.yaml"


def _read(path: str | os.PathLike[str]) -> Source:
    loaded = parse(path)
    data, p = loaded.data, loaded.path
    if not isinstance(data, Mapping):
        raise ConfigError(p, None, [("", f"expected a mapping with 'pipelines', got {describe(data)}")])
    try:
        PipelinesFile.model_validate(data)
    except ValidationError as exc:
        problems = [loaded.problem(loc, loc_to_key("", loc), msg) for loc, msg in _problems(PipelinesFile, exc)]
        raise ConfigError(p, None, problems) from None
    return loaded


def _task_problems(name: str, params: Mapping[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """Problems with ``task.name`` / ``task.params`` by the task's own parameter schema."""
    from vpo.tasks import available_tasks, check_task_params

    if name not in available_tasks():
        return [(("task", "name"), f"unknown task {name!r}; tasks: {', '.join(available_tasks())}")]
    return [(("task", "params", *loc), msg) for loc, msg in check_task_params(name, params)]


def _run_problems(cfg: PipelineConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """Problems of the settings a run ends up with (an arm's own values over the trainer's): settings
    of one estimator given to another, and batches TRL cannot split into whole prompt groups on the
    world size (from ``trainer.accelerate_config``, else ``WORLD_SIZE``)."""
    out: list[tuple[tuple[str | int, ...], str]] = []
    for i, arm in enumerate(cfg.arms):
        own = arm.model_fields_set

        def where(key: str, i: int = i, own: Any = own) -> tuple[str | int, ...]:
            return ("arms", i, key) if key in own or key not in cfg.trainer.model_fields_set else ("trainer", key)

        if arm.max_at_k_k is not None and arm.estimator != "max_at_k":
            out.append((where("max_at_k_k"), (f"applies to estimator max_at_k only, not {arm.estimator!r} "
                                             f"(arm {arm.name!r})")))
        if arm.estimator != "grpo":
            for key in ("scale_rewards", "multi_objective_aggregation"):
                if getattr(arm, key) != VPOConfigFields.model_fields[key].default:  # TRL's stock value
                    out.append((where(key), (f"applies to estimator grpo (TRL's GRPO) only, not {arm.estimator!r} "
                                            f"(arm {arm.name!r}); set it on the grpo arms")))
        if arm.enabled:
            try:
                arm_batch(cfg, arm)
            except ValueError as exc:
                keys = ("per_device_train_batch_size", "num_generations", "generation_batch_size",
                        "steps_per_generation", "rollout_multiplier")
                loc: tuple[str | int, ...] = ("arms", i) if any(k in own for k in keys) else (
                    ("trainer", "per_device_train_batch_size"))
                out.append((loc, str(exc)))
    return out


def _dotted(body: Mapping[str, Any], loc: Sequence[Any]) -> str:
    """A loc as the dotted key ``--set`` uses (arms by name)."""
    parts: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(part, int) and parts == ["arms"]:
            arms = body.get("arms")
            item = arms[part] if isinstance(arms, list) and part < len(arms) else None
            parts.append(str(item.get("name", part)) if isinstance(item, Mapping) else str(part))
        else:
            parts.append(str(part))
        del i
    return ".".join(parts)



def validate(loaded: Source, name: str, data: Any, origin: str, *, line_prefix: Sequence[Any] | None = None,
              overrides: Sequence[str] = ()) -> PipelineConfig:
    """Validate one pipeline body. ``origin`` says where its values come from (base, quick or params)
    and ``overrides`` which dotted keys ``--set`` gave, so errors point at the right lines (or say
    "from --set"); ``line_prefix`` is the body's key path in the file (default ``pipelines.<name>``)."""
    prefix = f"pipelines.{name}"
    where = list(line_prefix) if line_prefix is not None else ["pipelines", name]
    if not isinstance(data, Mapping):
        raise ConfigError(loaded.path, name, [loaded.problem(where, prefix, "expected a mapping")])
    body = {k: v for k, v in data.items() if k != "quick"}
    if "name" in body and body["name"] != name:
        raise ConfigError(loaded.path, name, [loaded.problem([*where, "name"], f"{prefix}.name",
                                                             "must match the key")])
    body["name"] = name

    def located(loc: Sequence[Any], message: str) -> tuple[str, str]:
        key_text = loc_to_key(prefix, loc)
        if overrides and from_set(_dotted(body, loc), overrides):
            return (f"{key_text} (from --set)", message)
        if origin == "quick":  # point at the quick: entry when it set this key, else the base key
            return loaded.problem([*where, "quick", *loc], key_text, message)
        return loaded.problem([*where, *loc], key_text, message)

    sources = {"base": "", "quick": "its quick settings", "params": "its params settings"}[origin]
    extra = " and ".join(x for x in (sources, "--set" if overrides else "") if x)
    label = f"{name} (with {extra})" if extra else name
    problems: list[tuple[str, str]] = []
    cfg = None
    try:
        cfg = PipelineConfig.model_validate(body, context={"base_dir": loaded.path.parent})
    except ValidationError as exc:
        problems = [located(loc, msg) for loc, msg in _problems(PipelineConfig, exc)]
    task = body.get("task")
    if isinstance(task, Mapping) and isinstance(task.get("name"), str) and isinstance(task.get("params", {}), Mapping):
        task_problems = _task_problems(task["name"], task.get("params", {}))
        problems += [located(loc, msg) for loc, msg in task_problems]
        if cfg is not None and not task_problems and from_set("task", overrides):
            problems += [located(loc, msg) for loc, msg in _build_problems(cfg)]
    if cfg is not None:
        cfg._source_file = loaded.path  # relative paths (the accelerate config) resolve against the file
        problems += [located(loc, msg) for loc, msg in _run_problems(cfg)]
    if problems:
        raise ConfigError(loaded.path, label, problems)
    assert cfg is not None
    cfg._source_file = loaded.path
    cfg._loaded = loaded
    cfg._origin = origin
    cfg._raw = copy.deepcopy(body)
    cfg._overrides = tuple(overrides)
    return cfg


def _build_problems(cfg: PipelineConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """Problems the task finds when it is built from its parameters (a missing data file...): checked
    when the config loads if ``--set`` changed the task, so they are not found only once a stage runs."""
    from vpo.tasks import get_task

    try:
        get_task(cfg.task.name, **cfg.task.params)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        text = str(exc)
        key = next((k for k in cfg.task.params if k in text), None)
        return [(("task", "params", key) if key else ("task", "params"),
                 f"task {cfg.task.name!r} rejected its parameters: {exc}")]
    return []


def _variant(
    loaded: Source, name: str, *, quick: bool, overrides: Mapping[str, Any] | None
) -> tuple[PipelineConfig, PipelineConfig | None]:
    """Validate the base pipeline and its quick variant; return (requested config, other variant)."""
    raw = loaded.data["pipelines"][name]
    base = validate(loaded, name, raw, "base")
    quick_raw = raw.get("quick") if isinstance(raw, Mapping) else None
    quick_cfg = None
    if quick_raw is not None:
        if not isinstance(quick_raw, Mapping):
            raise ConfigError(
                loaded.path,
                name,
                [
                    loaded.problem(
                        ["pipelines", name, "quick"], f"pipelines.{name}.quick", "expected a mapping"
                    )
                ],
            )
        try:
            merged = deep_merge(
                {k: v for k, v in raw.items() if k != "quick"}, quick_raw, path=f"pipelines.{name}.quick"
            )
        except ValueError as exc:
            raise ConfigError(loaded.path, name, [("", str(exc))]) from None
        quick_cfg = validate(loaded, name, merged, "quick")
        quick_cfg._quick = True
    chosen = quick_cfg if (quick and quick_cfg is not None) else base
    if overrides:
        chosen = apply_overrides(chosen, overrides)
    return chosen, quick_cfg


def apply_overrides(cfg: PipelineConfig, overrides: Mapping[str, Any]) -> PipelineConfig:
    """``cfg`` with dotted-key overrides (``{"trainer.max_steps": 10, "arms.vpo.num_answers": 3}``)
    applied and everything validated again; one :class:`ConfigError` names every problem, a value that
    came from ``--set`` as such (not by a line of the file)."""
    if not overrides:
        return cfg
    loaded = cfg._loaded
    if loaded is None:
        raise ValueError("overrides need a config loaded from a file")
    nested: dict[str, Any] = {}
    current = copy.deepcopy(cfg._raw) or cfg.model_dump(mode="python", exclude_unset=True)
    current.pop("name", None)
    try:
        for key, value in overrides.items():
            _set_dotted(nested, key, value)
        merged = deep_merge(current, nested, path=f"pipelines.{cfg.name}")
    except ValueError as exc:
        raise ConfigError(loaded.path, cfg.name, [("", f"{exc} (from --set)")]) from None
    line_prefix = [cfg.variant] if cfg._origin == "params" else None
    out = validate(loaded, cfg.name, merged, cfg._origin, line_prefix=line_prefix,
                    overrides=(*cfg._overrides, *overrides))
    out._quick = cfg.quick
    out._cli = (*cfg._cli, *(a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")))
    return out



def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = target
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {part!r} is not a mapping")  # noqa: TRY004 (-> ConfigError)
    node[parts[-1]] = value


def deep_merge(base: Any, override: Any, *, path: str = "") -> Any:
    """Merge ``override`` onto ``base``: mappings key by key, other values replaced. A mapping merged
    onto a list of named mappings (``arms``) updates the items by name."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        out = dict(base)
        for key, value in override.items():
            sub = f"{path}.{key}" if path else str(key)
            out[key] = deep_merge(base[key], value, path=sub) if key in base else copy.deepcopy(value)
        return out
    if (
        isinstance(base, list)
        and isinstance(override, Mapping)
        and all(isinstance(item, Mapping) and "name" in item for item in base)
    ):
        by_name = {item["name"]: i for i, item in enumerate(base)}
        out_list = [dict(item) for item in base]
        for name, value in override.items():
            if name not in by_name:
                raise ValueError(
                    f"{path}.{name}: no item named {name!r} (have: {', '.join(map(str, by_name))})"
                )
            if not isinstance(value, Mapping):
                raise ValueError(  # noqa: TRY004 (reported as a ConfigError)
                    f"{path}.{name}: expected a mapping of overrides, got {type(value).__name__}"
                )
            out_list[by_name[name]] = deep_merge(out_list[by_name[name]], value, path=f"{path}.{name}")
        return out_list
    return copy.deepcopy(override)



def pipeline_names(path: str | os.PathLike[str] = DEFAULT_PATH) -> list[str]:
    """Names of the pipelines in the file, in file order (default first if declared)."""
    loaded = _read(path)
    names = list(loaded.data["pipelines"])
    default = loaded.data.get("default")
    if default in names:
        names.remove(default)
        names.insert(0, default)
    return names


def load_pipeline(
    name: str | None = None,
    path: str | os.PathLike[str] = DEFAULT_PATH,
    *,
    quick: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> PipelineConfig:
    """Load and validate pipeline ``name`` (default: the file's ``default``) from ``path``.

    ``quick=True`` applies the pipeline's ``quick:`` overrides (an error if it has none);
    ``overrides`` maps dotted keys (``"trainer.steps"``, ``"arms.vpo.m"``) to values applied last.
    The quick variant is validated even when not requested, so a broken one fails early.
    Raises :class:`ConfigError` for every problem.
    """
    loaded = _read(path)
    pipelines = loaded.data["pipelines"]
    name = name or loaded.data.get("default") or next(iter(pipelines))
    if name not in pipelines:
        raise ConfigError(
            loaded.path, name, [("pipelines", f"no pipeline named {name!r}; defined: {', '.join(pipelines)}")]
        )
    if quick and not (isinstance(pipelines[name], Mapping) and pipelines[name].get("quick") is not None):
        raise ConfigError(
            loaded.path,
            name,
            [(f"pipelines.{name}.quick", "quick=True but the pipeline has no 'quick:' section")],
        )
    chosen, _ = _variant(loaded, name, quick=quick, overrides=None)
    chosen._cli = ("--config", str(loaded.path), "--pipeline", name, *(("--quick",) if quick else ()))
    return apply_overrides(chosen, overrides) if overrides else chosen


def load_all(
    path: str | os.PathLike[str] = DEFAULT_PATH, *, quick: bool = False
) -> dict[str, PipelineConfig]:
    """Load every pipeline of the file (quick variants where asked and defined); all problems of all
    pipelines are reported together in one :class:`ConfigError`."""
    loaded = _read(path)
    out: dict[str, PipelineConfig] = {}
    problems: list[tuple[str, str]] = []
    for name in loaded.data["pipelines"]:
        try:
            out[name], _ = _variant(loaded, name, quick=quick, overrides=None)
        except ConfigError as exc:
            problems += [(k, f"[{exc.pipeline}] {m}") for k, m in exc.problems]
    if problems:
        raise ConfigError(loaded.path, None, problems)
    return out
