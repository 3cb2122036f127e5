"""Stage ``base``: the starting policy every arm trains from and the evaluation compares against.

Either the embedded char-level model, built over the task's characters and taught the answer
format by supervised fine-tuning (``model.builder: tiny``), or a Hugging Face model (hub id or local
folder, ``model.path_or_id``), saved into ``base/`` so every later stage loads the same files, and
optionally fine-tuned on the task's demonstrations (``sft``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vpo.pipeline.console import progress
from vpo.pipeline.context import StageContext
from vpo.pipeline.errors import StageError
from vpo.pipeline.storage import atomic_dir, atomic_write_json

__all__ = ["check_tokenizer", "run"]


def check_tokenizer(tok: Any, where: str) -> None:
    """Generation needs an EOS token (and padding, which falls back to EOS)."""
    if tok.eos_token_id is None:
        raise StageError(f"{where}: the tokenizer has no eos_token (generation needs one to stop); set one "
                         "(tokenizer.eos_token = ...) and save the tokenizer again")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token


def run(ctx: StageContext) -> dict[str, Any]:
    """Build ``base/`` (model, tokenizer, ``summary.json``)."""
    cfg, task = ctx.cfg, ctx.task
    out = ctx.layout.base
    t0 = time.time()
    with atomic_dir(out) as tmp:  # the old base/ stays whole until the new one is complete
        if cfg.model.builder == "tiny":
            from vpo.sft import train_sft
            from vpo.tiny import build_char_tokenizer

            check_tokenizer(build_char_tokenizer(task.charset), f"the tiny builder (task {cfg.task.name!r})")
            sft = cfg.sft
            steps = sft.steps if sft.enabled else 0
            with _sft_bar(ctx, steps) as on_step:
                train_sft(task, tmp, steps=steps, batch_size=sft.batch_size, lr=sft.lr, seed=cfg.seed,
                          model_size=dict(cfg.model.builder_params) or None, progress=False, on_step=on_step)
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            src = cfg.model_source
            kw = {"revision": cfg.model.revision, "trust_remote_code": cfg.model.trust_remote_code}
            tok = AutoTokenizer.from_pretrained(src, **kw)
            check_tokenizer(tok, f"model {cfg.model.path_or_id!r}")  # before the (large) model is loaded
            model = AutoModelForCausalLM.from_pretrained(src, dtype=cfg.model.dtype, **kw)
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            if cfg.sft.enabled and hasattr(task, "demonstration"):
                from vpo.sft import train_sft

                with _sft_bar(ctx, cfg.sft.steps) as on_step:
                    train_sft(task, tmp, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr,
                              seed=cfg.seed, init_dir=tmp, progress=False, on_step=on_step)
        info: dict[str, Any] = {"seconds": round(time.time() - t0, 1),
                                "source": cfg.model.builder or cfg.model.path_or_id}
        sft_metrics = tmp / "sft_metrics.json"
        if sft_metrics.is_file():  # written by train_sft a moment ago
            info["sft"] = json.loads(sft_metrics.read_text())
        atomic_write_json(tmp / ctx.layout.base_summary.name, info)
    sft_info = info.get("sft") or {}
    ctx.outcome(f"SFT {sft_info['steps']} steps, final loss {sft_info['final_loss']:.3f}"
                if sft_info.get("steps") else f"{info['source']}, no SFT")
    return info


@contextmanager
def _sft_bar(ctx: StageContext, steps: int) -> Iterator[Callable[[int, float], None] | None]:
    """The SFT progress bar (loss beside the count), or no callback when bars are off."""
    if not ctx.progress or steps <= 0:
        yield None
        return
    with progress("base: sft", steps) as bar:
        def on_step(step: int, loss: float) -> None:
            bar.numbers({"loss": loss})
            bar.update(to=step)

        yield on_step
