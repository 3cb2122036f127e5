"""Reading a stage's inputs (upstream outputs) with one clear error when one is missing or corrupt.

Every reader names the file, what is wrong with it and the command that rebuilds it
(:class:`StageError`, exit code 2), instead of a traceback from pandas, json or numpy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from vpo.pipeline.config import PipelineConfig
from vpo.pipeline.config.layout import RunLayout
from vpo.pipeline.engine.errors import StageError

__all__ = ["load_rows", "read_json", "read_npy", "stage_command"]


def stage_command(cfg: PipelineConfig, stage: str, rid: str | None = None) -> str:
    """The command that (re)builds a stage's output of this variant, for error messages: it runs as
    printed from the current folder (:func:`vpo.pipeline.engine.console.command`), with the settings of this
    run (its config file, preset, variant and ``--set`` values)."""
    from vpo.pipeline.config.names import parse_run_id
    from vpo.pipeline.engine.console import command, shown_path

    words = list(cfg.cli_args())
    for i, word in enumerate(words[:-1]):
        if word in ("--config", "--params"):
            words[i + 1] = shown_path(words[i + 1])
    if words[:2] == ["--config", "pipelines.yaml"]:  # the default of every command
        words = words[2:]
    if rid is not None:
        arm, seed = parse_run_id(rid)
        words += ["--arm", arm, "--seed", str(seed)]
    return command("stage", stage, *words)


def _unreadable(path: Path, exc: BaseException, fix: str) -> StageError:
    return StageError(f"{path} is unreadable ({exc.__class__.__name__}: {str(exc)[:200]}); it is damaged or was "
                      f"cut short: {fix}")


def read_json(path: Path, fix: str) -> Any:
    """JSON from ``path``; a missing or unparseable file is a :class:`StageError` saying ``fix``."""
    if not path.is_file():
        raise StageError(f"{path} is missing: {fix}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc, fix) from None


def read_npy(path: Path, fix: str) -> np.ndarray:
    """An array saved with ``np.save``; missing or torn files are a :class:`StageError` saying ``fix``."""
    if not path.is_file():
        raise StageError(f"{path} is missing: {fix}")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise _unreadable(path, exc, fix) from None


def load_rows(cfg: PipelineConfig, split: str, layout: RunLayout | None = None) -> list[dict[str, Any]]:
    """The problem rows the data stage wrote for ``split``."""
    import pandas as pd

    path = (layout or RunLayout.of(cfg)).data_file(split)
    fix = f"rebuild it with `{stage_command(cfg, 'data')}`"
    if not path.is_file():
        raise StageError(f"{path} is missing: run `{stage_command(cfg, 'data')}` first")
    try:
        payloads = pd.read_parquet(path)["payload"]
        return [json.loads(p) for p in payloads]
    except Exception as exc:  # noqa: BLE001 - pyarrow and json raise many types for a torn file
        raise _unreadable(path, exc, fix) from None
