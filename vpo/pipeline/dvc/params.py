"""``params.yaml``: the settings each DVC-managed variant runs with, and loading a variant back from it.

``vpo dvc`` writes one entry per declared variant (:func:`variant_settings`) with a digest of where it
came from (:func:`settings_digest`); a DVC stage loads its variant with :func:`load_variant`, which
refuses a file generated from another version of ``pipelines.yaml``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vpo.pipeline.config.load import DEFAULT_PATH, apply_overrides, load_pipeline, validate
from vpo.pipeline.config.schema import RUN_INDEPENDENT_ARM_KEYS, PipelineConfig
from vpo.pipeline.config.source import ConfigError, Source, parse
from vpo.pipeline.engine.console import command

__all__ = ["PARAMS_FILE", "load_variant", "settings_digest", "variant_settings"]

PARAMS_FILE = "params.yaml"
"""The generated per-variant settings DVC stages read (``dvc exp run -S <variant>.<key>=<value>``)."""


def variant_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The entry of one variant in ``params.yaml``: its pipeline name, preset and what it sets
    (:meth:`PipelineConfig.explicit_settings`; its description stays in ``pipelines.yaml``). Which runs
    an arm has (its ``seeds``, ``enabled``) is under ``runs.<arm>``, apart from ``arms.<arm>``: a train
    stage's DVC params are its arm's settings, so adding a seed leaves the arm's other runs unchanged."""
    data = cfg.explicit_settings()
    arms, runs = {}, {}
    for name, own in data["arms"].items():
        arms[name] = {k: v for k, v in own.items() if k not in RUN_INDEPENDENT_ARM_KEYS}
        run = {k: v for k, v in own.items() if k in RUN_INDEPENDENT_ARM_KEYS}
        if run:
            runs[name] = run
    out: dict[str, Any] = {"pipeline": cfg.name, "quick": cfg.quick}
    for key, value in data.items():
        out[key] = arms if key == "arms" else value
        if key == "arms" and runs:
            out["runs"] = runs
    return out


def _join_runs(entry: dict[str, Any], loaded: Source, variant: str) -> dict[str, Any]:
    """A params.yaml entry in the pipelines.yaml form: ``runs.<arm>`` merged back into ``arms.<arm>``."""
    runs = entry.pop("runs", None) or {}
    arms = entry.get("arms")
    if not isinstance(runs, Mapping) or not isinstance(arms, Mapping):
        raise ConfigError(loaded.path, variant, [loaded.problem([variant, "runs"], f"{variant}.runs",
                                                                "expected a mapping of arm names (and arms one)")])
    unknown = [name for name in runs if name not in arms]
    if unknown:
        raise ConfigError(loaded.path, variant, [loaded.problem([variant, "runs", unknown[0]],
                                                                f"{variant}.runs.{unknown[0]}",
                                                                f"no arm of that name; arms: {', '.join(arms)}")])
    entry["arms"] = {name: {**(own if isinstance(own, Mapping) else {}), **(runs.get(name) or {})}
                     if isinstance(own, Mapping) else own for name, own in arms.items()}
    return entry


def settings_digest(settings: Mapping[str, Any]) -> str:
    """A stable short hash of a settings mapping (canonical JSON; 16 hex digits tell versions of one
    file apart and keep ``dvc exp show``'s column narrow)."""
    import hashlib

    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_variant(variant: str, params_path: str | os.PathLike[str] = PARAMS_FILE, *,
                 config_path: str | os.PathLike[str] | None = None,
                 overrides: Mapping[str, Any] | None = None) -> PipelineConfig:
    """Load one variant from the generated ``params.yaml`` (what ``dvc.yaml``'s stages run).

    The file may have been changed by ``dvc exp run -S`` (that is its purpose); it must still have
    been generated from the current ``pipelines.yaml`` (``config_path``, default: beside it), or
    editing ``pipelines.yaml`` without regenerating would silently run the old settings: then one
    :class:`ConfigError` says to regenerate.
    """
    loaded = parse(params_path)
    data = loaded.data
    if not isinstance(data, Mapping) or variant not in data or not isinstance(data[variant], Mapping):
        names = [k for k, v in data.items() if isinstance(v, Mapping) and "pipeline" in v] if isinstance(
            data, Mapping) else []
        message = f"no variant named {variant!r} in this file; variants: {', '.join(names) or 'none'}"
        raise ConfigError(loaded.path, None, [(variant, message)])
    entry = dict(data[variant])
    name, quick = entry.pop("pipeline", None), entry.pop("quick", False)
    if not isinstance(name, str) or not isinstance(quick, bool):
        raise ConfigError(loaded.path, variant, [loaded.problem([variant], variant,
                                                                "needs 'pipeline' (a name) and 'quick' (true/false)")])
    source = Path(config_path) if config_path is not None else loaded.path.parent / DEFAULT_PATH
    generated = (data.get("generated_from") or {}).get(variant)
    pipeline = load_pipeline(name, source, quick=quick)
    if generated != settings_digest(variant_settings(pipeline)):
        raise ConfigError(loaded.path, variant, [("generated_from", (
            f"{loaded.path.name} was generated from another version of {source.name}'s pipeline {name!r}; "
            f"regenerate it (and dvc.yaml) with `{command('dvc')}` so DVC stages run what {source.name} says"))])
    entry = _join_runs(entry, loaded, variant)
    cfg = validate(loaded, name, {**entry, "description": pipeline.description}, "params", line_prefix=[variant])
    cfg._quick = quick
    cfg._cli = ("--params", str(loaded.path), "--variant", variant, "--config", str(source.resolve()))
    return apply_overrides(cfg, overrides) if overrides else cfg

