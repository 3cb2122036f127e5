"""Recording stages that ran outside ``dvc repro`` in ``dvc.lock``, so DVC agrees with what is there.

``vpo run`` runs stages itself (the training runs side by side, which two ``dvc repro`` processes
cannot: DVC holds one repository-wide lock). Afterwards, when DVC manages the variant, one
``dvc commit --force <stages>`` records every stage's dependencies, parameters and outputs in
``dvc.lock`` and copies the outputs into the DVC cache -- exactly what ``dvc repro`` would have
recorded -- so a later ``dvc repro`` re-runs nothing and ``dvc status`` is clean. The Prefect flow does
the same for the training runs it fans out.

DVC manages a variant when the settings came from the repository's own ``pipelines.yaml`` (or its
``params.yaml``) beside a ``.dvc`` folder, ``dvc.yaml`` declares every stage that ran (``vpo dvc``), and
``params.yaml`` holds exactly the settings the run used (no ``--set``; ``vpo dvc`` after editing
``pipelines.yaml``). Otherwise nothing is recorded and the log file says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from vpo.pipeline.config import PipelineConfig
    from vpo.pipeline.steps import Step

__all__ = ["declared_stages", "dvc_command", "record_steps", "unmanaged_reason"]


def dvc_command(*args: str) -> list[str]:
    """``dvc ARGS`` of this installation (beside this interpreter), else ``python -m dvc``."""
    exe = Path(sys.executable).with_name("dvc")
    return [str(exe), *args] if exe.is_file() else [sys.executable, "-m", "dvc", *args]


def declared_stages(dvc_yaml: Path) -> set[str]:
    """Stage names a ``dvc.yaml`` declares (``name`` and ``name@key`` for a ``foreach`` stage)."""
    data = yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) or {}
    names: set[str] = set()
    for name, body in (data.get("stages") or {}).items():
        foreach = body.get("foreach") if isinstance(body, dict) else None
        if isinstance(foreach, dict):
            names.update(f"{name}@{key}" for key in foreach)
        elif isinstance(foreach, list):
            names.update(f"{name}@{i}" for i in range(len(foreach)))
        else:
            names.add(name)
    return names


def _normal(data: object) -> object:
    return json.loads(json.dumps(data, sort_keys=True, default=str))


def unmanaged_reason(cfg: PipelineConfig, names: Sequence[str]) -> str | None:
    """Why DVC does not manage these stages of ``cfg`` (None: it does; record them)."""
    from vpo.pipeline.dvc.params import PARAMS_FILE, variant_settings
    from vpo.pipeline.engine.console import command

    repo = cfg.base_dir
    if cfg.source_file is None:
        return "the settings were built in code, not read from a file"
    if not (repo / ".dvc").is_dir() or not (repo / "dvc.yaml").is_file():
        return f"{repo} is not a DVC repository with a dvc.yaml"
    if "--set" in cfg.cli_args():
        return "settings were overridden with --set (dvc.yaml's stages read params.yaml)"
    declared = declared_stages(repo / "dvc.yaml")
    missing = [n for n in names if n not in declared]
    if missing:
        return f"dvc.yaml does not declare {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
    params = repo / PARAMS_FILE
    try:
        recorded = (yaml.safe_load(params.read_text(encoding="utf-8")) or {}).get(cfg.variant)
    except (OSError, yaml.YAMLError) as exc:
        return f"{params} is unreadable ({exc})"
    if _normal(recorded) != _normal(variant_settings(cfg)):
        return (f"{params.name} does not hold this run's settings of {cfg.variant} (regenerate it with "
                f"`{command('dvc')}` after editing pipelines.yaml)")
    return None


def record_steps(cfg: PipelineConfig, steps: Sequence[Step]) -> bool:
    """Record ``steps`` in ``dvc.lock`` with ``dvc commit`` when DVC manages them; True when recorded.
    A failing commit is one warning line (the outputs are intact; ``dvc repro`` would re-run them)."""
    from vpo.pipeline.engine.console import detail, log

    names = [s.dvc_name(cfg.variant) for s in steps]
    if not names:
        return False
    reason = unmanaged_reason(cfg, names)
    if reason is not None:
        detail(f"dvc.lock not updated: {reason}")
        return False
    marker = _marker(cfg, steps)
    if _recorded(cfg) == marker:
        detail(f"dvc.lock: the {len(names)} stages are recorded as they are (nothing ran since the last dvc commit)")
        return True
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run(dvc_command("commit", "--force", *names), cwd=cfg.base_dir, env=env,
                          capture_output=True, text=True, check=False)
    detail(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        error = next((ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if "ERROR" in ln),
                     f"exit code {proc.returncode}")
        log(f"warning: could not record the stages in dvc.lock ({error}); `dvc repro` will run them again")
        return False
    log(f"dvc.lock: recorded {len(names)} stages (dvc commit), so `dvc repro` re-runs nothing")
    _remember(cfg, _marker(cfg, steps))
    return True


def _marker_path(cfg: PipelineConfig) -> Path:
    from vpo.pipeline.config.layout import RunLayout

    return RunLayout.of(cfg).root / ".dvc-recorded.json"


def _marker(cfg: PipelineConfig, steps: Sequence[Step]) -> dict[str, object]:
    """What a ``dvc commit`` of ``steps`` records: the DVC files and each step's own record (its
    settings, code and input hashes and output digest). Equal to the last commit's: nothing to do."""
    from vpo.pipeline.dvc.params import PARAMS_FILE
    from vpo.pipeline.config.layout import RunLayout

    layout = RunLayout.of(cfg)
    files = {name: _sha256(cfg.base_dir / name) for name in ("dvc.yaml", "dvc.lock", PARAMS_FILE)}
    return {"files": files, "steps": {s.dvc_name(cfg.variant): _sha256(layout.state_file(s.stage.name, s.rid))
                                      for s in steps}}


def _sha256(path: Path) -> str | None:
    from vpo.pipeline.engine.state import file_sha256

    return file_sha256(path) if path.is_file() else None


def _recorded(cfg: PipelineConfig) -> object:
    try:
        return json.loads(_marker_path(cfg).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _remember(cfg: PipelineConfig, marker: dict[str, object]) -> None:
    from vpo.atomic import atomic_write_json
    from vpo.pipeline.engine.console import detail

    try:
        atomic_write_json(_marker_path(cfg), marker)
    except OSError as exc:  # the next run commits again: slower, never wrong
        detail(f"dvc.lock: could not remember what was recorded ({exc})")
