"""The supervised base stage: teach a tiny policy the answer format on a diverse route mixture.

The RL arms start from this checkpoint, so it has to be competent (most samples are legal routes
in the right tags) yet high-entropy (it has not picked a strategy): the targets come from
``task.demonstration(row, m, rng)``, which for the route task mixes routes via bonus A, via
bonus B and anywhere, blind to lava, and every batch is in either the single-answer or the
m-answer format. Plain torch loop: AdamW, linear warm-up then cosine decay, gradient clipping,
loss on completion tokens (and the closing eos) only, seeded, with a tqdm progress bar.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from vpo.tasks import Task
from vpo.tiny import build_tiny_model, count_parameters

__all__ = ["SFT_METRICS_FILE", "DemoTask", "default_threads", "make_batch", "train_sft"]

SFT_METRICS_FILE = "sft_metrics.json"


class DemoTask(Protocol):
    """A task that can write supervised target completions (the route task does)."""

    charset: str

    def load(self, split: str) -> list[dict[str, Any]]: ...

    def format_prompt(self, row: Any, m: int) -> Any: ...

    def demonstration(self, row: Any, m: int, rng: random.Random) -> str: ...


def make_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], completions: list[str]
) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``/``labels`` for prompt+completion+eos, with
    labels -100 on the prompt and the padding (loss on the completion and eos only)."""
    p_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    c_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    seqs, labels = [], []
    for p, c in zip(p_ids, c_ids, strict=True):
        full = list(p) + list(c) + [tokenizer.eos_token_id]
        seqs.append(full)
        labels.append([-100] * len(p) + full[len(p) :])
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels, strict=True)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
        lab[i, : len(s)] = torch.tensor(lb)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": lab}


def default_threads() -> int:
    """Torch threads for the CPU loop: OMP_NUM_THREADS if set, else the cores, at most 2 (a tiny
    model gains little from more, and oversubscribed cores slow it down by an order of magnitude)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return min(2, int(env))
    return min(2, os.cpu_count() or 1)


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up to ``lr`` then cosine decay to 10% of it."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def train_sft(
    task: Task | DemoTask,
    out_dir: str | Path,
    steps: int = 700,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    m: int = 3,
    *,
    p_multi: float = 0.5,
    init_dir: str | Path | None = None,
    model_size: dict[str, Any] | None = None,
    warmup: int = 20,
    weight_decay: float = 0.01,
    grad_clip: float = 1.0,
    threads: int | None = None,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> Path:
    """Train the supervised base and save model + tokenizer + ``sft_metrics.json`` in ``out_dir``.

    Starts from ``init_dir`` if given, else builds a fresh tiny model over ``task.charset``
    (``model_size`` overrides :data:`vpo.tiny.DEFAULT_SIZE`). A fraction ``p_multi`` of the
    batches uses the m-answer format, the rest the single-answer one. ``steps=0`` just saves the
    starting model (an untrained base). ``out_dir`` may equal ``init_dir``. Returns ``out_dir``.
    ``progress`` draws a tqdm bar; ``on_step(step, loss)`` is called after every step (for callers
    that draw their own progress).
    """
    if steps > 0 and not hasattr(task, "demonstration"):
        raise TypeError(f"task {getattr(task, 'name', task)!r} cannot write demonstrations for SFT")
    if steps < 0 or batch_size < 1:
        raise ValueError(f"need steps >= 0 and batch_size >= 1, got {steps} and {batch_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads())
    try:
        return _train(
            task,
            out,
            steps,
            batch_size,
            lr,
            seed,
            m,
            p_multi,
            init_dir,
            model_size,
            warmup,
            weight_decay,
            grad_clip,
            progress,
            on_step,
        )
    finally:
        torch.set_num_threads(prev_threads)


def _train(
    task: Any,
    out: Path,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    m: int,
    p_multi: float,
    init_dir: str | Path | None,
    model_size: dict[str, Any] | None,
    warmup: int,
    weight_decay: float,
    grad_clip: float,
    progress: bool,
    on_step: Callable[[int, float], None] | None = None,
) -> Path:
    """The training loop behind :func:`train_sft` (threads already set)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)

    built = None
    if init_dir is None:
        built = build_tiny_model(out / "_init", task.charset, seed=seed, **(model_size or {}))
        init_dir = built
    tokenizer = AutoTokenizer.from_pretrained(str(init_dir))
    model = AutoModelForCausalLM.from_pretrained(str(init_dir))
    model.train()
    rows = task.load("train")
    if not rows:
        raise ValueError("the task's train split is empty")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )
    losses: list[float] = []
    n_tokens = 0
    start = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="sft", unit="step")
    for step in range(steps):
        mm = m if rng.random() < p_multi else 1
        picked = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        prompts = [str(task.format_prompt(r, mm)) for r in picked]
        completions = [task.demonstration(r, mm, rng) for r in picked]
        batch = make_batch(tokenizer, prompts, completions)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(loss.item())
        n_tokens += int((batch["labels"] != -100).sum())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", m=mm)
        if on_step is not None:
            on_step(step + 1, losses[-1])
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start

    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if built is not None:
        shutil.rmtree(built, ignore_errors=True)
    tail = losses[-max(1, min(20, len(losses) // 5)) :]
    metrics = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "m": m,
        "p_multi": p_multi,
        "parameters": count_parameters(model),
        "initial_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "time_s": round(elapsed, 2),
        "completion_tokens": n_tokens,
        "threads": torch.get_num_threads(),
        "losses": [round(x, 5) for x in losses],
    }
    (out / SFT_METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    return out
