"""Train one arm (estimator x m x seed) from a base checkpoint with :class:`VPOTrainer`.

Resumable: checkpoints every ``save_steps`` under ``<out>/trainer/checkpoint-*``; a rerun resumes
from the newest complete one (optimizer, scheduler, RNG, step and data position are restored by
the HF Trainer; a checkpoint torn by a kill during its save is skipped). Metrics go to
``<out>/metrics.json`` and, through DVCLive, to ``<out>/live`` so ``dvc plots`` / ``dvc exp show``
see them. The final model folder is swapped in atomically (:func:`vpo.storage.atomic_dir`), then
``history.json`` and, last, ``metrics.json`` (the "arm finished" marker) are written by rename.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from vpo.rewards import VectorReward
from vpo.storage import atomic_dir, atomic_write_json
from vpo.tasks import Task

__all__ = ["ProgressFileCallback", "checkpoint_problem", "latest_checkpoint", "train_arm"]

_CHECKPOINT_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth")


class ProgressFileCallback(TrainerCallback):
    """Writes ``{"step", "max_steps", "logs"}`` to a JSON file at every log: the orchestrator
    (a separate process) reads it to publish progress artifacts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.history: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kw: Any) -> None:
        if logs:
            self.history.append({"step": state.global_step, **{k: v for k, v in logs.items()
                                                               if isinstance(v, (int, float))}})
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": state.global_step, "max_steps": state.max_steps,
                                   "last": self.history[-1] if self.history else {}}))
        os.replace(tmp, self.path)


def checkpoint_problem(path: Path) -> str | None:
    """Why ``checkpoint-N`` cannot be resumed from (None when it is complete): the HF Trainer writes
    trainer_state.json last, so a parseable one naming step N, with weights, optimizer, scheduler and
    RNG state beside it, means the save finished."""
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        return "no trainer_state.json (the save was interrupted)"
    try:
        step = int(json.loads(state_file.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable trainer_state.json ({exc.__class__.__name__})"
    if f"checkpoint-{step}" != path.name:
        return f"trainer_state.json is for step {step}"
    if not any(path.glob("*.safetensors")) and not (path / "pytorch_model.bin").is_file():
        return "no model weights"
    missing = [f for f in _CHECKPOINT_FILES if not (path / f).is_file()]
    return f"missing {', '.join(missing)}" if missing else None


def latest_checkpoint(trainer_dir: Path) -> Path | None:
    """The newest complete ``checkpoint-N`` folder (see :func:`checkpoint_problem`), if any; newer
    torn ones are reported in the log and skipped."""
    if not trainer_dir.is_dir():
        return None
    found = [p for p in trainer_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    for path in sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print(f"[vpo] skipping incomplete checkpoint {path}: {problem}", flush=True)
    return None


def _dataset(task: Task, rows: Sequence[Mapping[str, Any]], m: int) -> Any:
    from datasets import Dataset

    records = []
    for r in rows:
        rec = {k: (json.dumps(v) if isinstance(v, (dict, list)) and k != "prompt" else v) for k, v in r.items()}
        rec["prompt"] = task.format_prompt(r, m)
        records.append(rec)
    return Dataset.from_list(records)


def _decode_row(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        if isinstance(v, str) and k != "prompt" and v[:1] in "[{":
            try:
                out[k] = json.loads(v)
                continue
            except json.JSONDecodeError:
                pass
        out[k] = v
    return out


def train_arm(
    task: Task,
    rows: Sequence[Mapping[str, Any]],
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    estimator: str,
    m: int,
    num_generations: int,
    seed: int,
    steps: int,
    prompts_per_step: int,
    lr: float,
    beta: float = 0.0,
    temperature: float = 1.0,
    max_completion_length: int = 64,
    num_weights: int = 100,
    alpha: float = 1.0,
    sampler: str = "dirichlet",
    loss_type: str = "dapo",
    gradient_accumulation_steps: int = 1,
    save_steps: int = 25,
    logging_steps: int = 1,
    use_vllm: bool = False,
    bf16: bool | None = None,
    progress: bool = True,
    extra_args: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Train one arm and return its summary metrics (also written to ``<out>/metrics.json``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vpo.trainer import VPOConfig, VPOTrainer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer_dir = out / "trainer"
    cuda = torch.cuda.is_available()
    bf16 = cuda if bf16 is None else bf16
    cfg = VPOConfig(
        output_dir=str(trainer_dir),
        bf16=bf16,
        use_cpu=not cuda,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=2,
        logging_steps=logging_steps,
        dataloader_pin_memory=False,
        per_device_train_batch_size=prompts_per_step * num_generations,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=beta,
        temperature=temperature,
        loss_type=loss_type,
        seed=seed,
        data_seed=seed,
        estimator=estimator,
        num_answers=m,
        num_weights=num_weights,
        weight_alpha=alpha,
        weight_sampler=sampler,
        use_vllm=use_vllm,
        disable_tqdm=not progress,
        **dict(extra_args or {}),
    )
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    reward = _RowDecodingReward(task.reward)
    progress_cb = ProgressFileCallback(out / "progress.json")
    callbacks: list[Any] = [progress_cb]
    try:
        from dvclive import Live
        from transformers.integrations import DVCLiveCallback

        callbacks.append(DVCLiveCallback(live=Live(dir=str(out / "live"), save_dvc_exp=False, dvcyaml=None,
                                                   report=None)))
    except ImportError:  # dvclive is a dependency; tolerate its absence in stripped installs
        pass
    trainer = VPOTrainer(model=model, reward=reward, args=cfg, train_dataset=_dataset(task, rows, m),
                         processing_class=tok, callbacks=callbacks)
    resume = latest_checkpoint(trainer_dir)
    t0 = time.time()
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    elapsed = time.time() - t0
    from vpo.stages import published_mode

    with atomic_dir(out / "model") as tmp:
        published_mode(tmp)
        trainer.save_model(str(tmp))
        tok.save_pretrained(str(tmp))
    logs = [rec for rec in trainer.state.log_history if "loss" in rec]
    tail = logs[-max(1, len(logs) // 4):]
    keys = sorted({k for rec in tail for k in rec if k.startswith(("vpo/", "reward", "entropy", "loss"))})
    summary: dict[str, Any] = {
        "estimator": estimator, "m": m, "num_generations": num_generations, "seed": seed, "steps": steps,
        "train_seconds": round(elapsed, 1), "resumed_from": resume.name if resume else None,
        "final": {k: float(sum(r[k] for r in tail if r.get(k) is not None) / max(1, sum(r.get(k) is not None
                                                                                       for r in tail)))
                  for k in keys},
    }
    # the whole run's log (restored from the checkpoint on resume), not only this process's part
    history = [{"step": rec.get("step"), **{k: v for k, v in rec.items() if isinstance(v, (int, float))
                                              and not isinstance(v, bool)}}
               for rec in trainer.state.log_history]
    atomic_write_json(out / "history.json", history)
    atomic_write_json(out / "metrics.json", summary)  # last: its presence marks the arm as trained
    return summary


class _RowDecodingReward(VectorReward):
    """Delegates to a task reward after decoding JSON-encoded nested row fields (HF datasets
    stores ragged nested lists poorly, so the training dataset carries them as JSON strings)."""

    def __init__(self, inner: VectorReward) -> None:
        self._inner = inner
        self.names = inner.names
        self.answer_tag = inner.answer_tag

    def w_star(self) -> Any:
        return self._inner.w_star()

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> Any:
        return self._inner.score(answers, _decode_row(row))

    def present(self, row: Mapping[str, Any]) -> Any:
        return self._inner.present(_decode_row(row))

    def parse(self, completion: str, m: int) -> list[str]:
        return self._inner.parse(completion, m)

    def prefetch(self, completions: Sequence[str], rows: Sequence[Mapping[str, Any]], m: int) -> None:
        if hasattr(self._inner, "prefetch"):
            self._inner.prefetch(completions, [_decode_row(r) for r in rows], m)

    def dedup_key(self, answer: str) -> Any:
        return self._inner.dedup_key(answer)
