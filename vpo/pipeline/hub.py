"""Optional upload of each run's final model to the Hugging Face Hub (``trainer.push_to_hub``).

It runs after registration, so what is on the Hub is what the registry holds (the final model, not
the resume checkpoints the Trainer's own ``push_to_hub`` would upload while training). Without a
token (``HF_TOKEN`` or ``hf auth login``) nothing is uploaded and one line says so: a missing
credential never fails a run and is never silent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vpo.pipeline.console import log
from vpo.pipeline.errors import StageError
from vpo.pipeline.layout import ArmRun, RunLayout

__all__ = ["hub_repo_id", "hub_token", "push_runs"]


def hub_token() -> str | None:
    """The Hugging Face token the hub client would use (``HF_TOKEN``, or the one ``hf auth login`` saved)."""
    from huggingface_hub import get_token

    return get_token()


def hub_repo_id(prefix: str, rid: str) -> str:
    """``<prefix>-<arm>-s<seed>``: one Hub repo per training run."""
    return f"{prefix}-{rid}"


def push_runs(cfg: Any, layout: RunLayout, runs: Sequence[ArmRun], hashes: Sequence[str]) -> list[str]:
    """Upload every run's final model folder to its Hub repo (created if missing); returns the repo ids
    uploaded to (empty when the setting is off or no token is available)."""
    tr = cfg.trainer
    if not tr.push_to_hub:
        return []
    token = hub_token()
    repos = [hub_repo_id(tr.hub_model_id, r.rid) for r in runs]
    if not token:
        log(f"push_to_hub: no Hugging Face token (set HF_TOKEN or run `hf auth login`); skipped uploading "
            f"{len(repos)} run(s) to {tr.hub_model_id}-<run>")
        return []
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    done = []
    for run, repo, digest in zip(runs, repos, hashes):
        try:
            api.create_repo(repo, private=tr.hub_private_repo, exist_ok=True, repo_type="model")
            api.upload_folder(folder_path=str(layout.arm_model(run.rid)), repo_id=repo, repo_type="model",
                              commit_message=f"vpo {cfg.variant} {run.rid} (registry hash {digest[:12]})")
        except Exception as exc:  # noqa: BLE001 (HTTP, auth and network errors alike: one clear line)
            raise StageError(f"push_to_hub: uploading {run.rid} to {repo} failed ({exc.__class__.__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); the registry entry is "
                             f"kept, run `vpo stage register` again to retry") from None
        done.append(repo)
    log(f"push_to_hub: uploaded {len(done)} run(s): {', '.join(done)}")
    return done
