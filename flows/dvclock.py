"""Stage records of ``dvc.lock`` exchanged between checkouts (the work-pool mode of the flow).

A training run on another machine returns what ``dvc commit`` recorded for its stage there (the
checksums of its code, inputs, parameters and outputs); the flow writes that record into its own
``dvc.lock`` and pulls the outputs it names from the DVC remote, so ``dvc status`` and ``dvc repro`` see
exactly what the worker produced. The flow hands the records of the inputs (data, rewards, base) to
the worker the same way. The file is rewritten whole (temporary file and rename).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from vpo.atomic import atomic_write_text

__all__ = ["merge_entries", "read_entries"]


def _load(repo: Path) -> dict[str, Any]:
    path = repo / "dvc.lock"
    if not path.is_file():
        return {"schema": "2.0", "stages": {}}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    data.setdefault("schema", "2.0")
    data.setdefault("stages", {})
    return data


def read_entries(repo: str | Path, stages: Sequence[str]) -> dict[str, Any]:
    """The ``dvc.lock`` records of ``stages`` (a KeyError names a stage DVC has not recorded)."""
    recorded = _load(Path(repo))["stages"]
    missing = [s for s in stages if s not in recorded]
    if missing:
        raise KeyError(f"dvc.lock in {repo} records no stage {', '.join(missing)}")
    return {s: recorded[s] for s in stages}


def merge_entries(repo: str | Path, entries: Mapping[str, Any]) -> None:
    """Write ``entries`` (stage name -> record) into the repository's ``dvc.lock``, replacing those
    stages' records and keeping every other one."""
    repo = Path(repo)
    data = _load(repo)
    data["stages"].update({name: entry for name, entry in entries.items()})
    atomic_write_text(repo / "dvc.lock", yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
