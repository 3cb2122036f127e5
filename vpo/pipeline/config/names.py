"""The names a run is known by: the variant (run folder, DVC stage prefix, params.yaml key) and the run
id of one training run. The one owner of both formats (:mod:`vpo.pipeline.config.layout` builds paths from them)."""

from __future__ import annotations

import re

__all__ = ["parse_run_id", "run_id", "variant_name"]

_RUN_ID = re.compile(r"^(?P<arm>[a-z0-9][a-z0-9_-]*)-s(?P<seed>-?\d+)$")


def variant_name(pipeline: str, quick: bool) -> str:
    """``route`` or ``route-quick``: the run folder's name, the DVC stage-name prefix and the key of
    the variant in ``params.yaml``."""
    return f"{pipeline}-quick" if quick else pipeline


def run_id(arm: str, seed: int) -> str:
    """``<arm>-s<seed>``: one training run (an arm's estimator and settings with one RL seed)."""
    return f"{arm}-s{seed}"


def parse_run_id(rid: str) -> tuple[str, int]:
    """(arm, seed) of a run id made by :func:`run_id`."""
    m = _RUN_ID.match(rid)
    if not m:
        raise ValueError(f"not a run id (<arm>-s<seed>): {rid!r}")
    return m["arm"], int(m["seed"])
