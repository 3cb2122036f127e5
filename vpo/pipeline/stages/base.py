"""Stage ``base``: the starting policy every arm trains from and the evaluation compares against.

Either the embedded char-level model, built over the task's characters and taught the answer
format by supervised fine-tuning (``model.builder: tiny``), or a Hugging Face model (hub id or local
folder, ``model.path_or_id``), saved into ``base/`` so every later stage loads the same files, and
optionally fine-tuned on the task's demonstrations (``sft``).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vpo.atomic import atomic_dir, atomic_write_json
from vpo.pipeline.engine.console import log, progress
from vpo.pipeline.engine.context import StageContext
from vpo.pipeline.engine.errors import StageError

__all__ = ["check_tokenizer", "run"]


def check_tokenizer(tok: Any, where: str) -> None:
    """Generation needs an EOS token (and padding, which falls back to EOS)."""
    if tok.eos_token_id is None:
        raise StageError(f"{where}: the tokenizer has no eos_token (generation needs one to stop); set one "
                         "(tokenizer.eos_token = ...) and save the tokenizer again")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token


def _pretrained(ctx: StageContext, folder: Path) -> str:
    """Save the configured pretrained model into ``folder`` (a GGUF file is imported once into the
    runs folder's model cache first); returns where it came from."""
    cfg = ctx.cfg
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.model.gguf is not None:
        from vpo.models import import_gguf

        g = cfg.model.gguf
        path = cfg.resolve_path(g.path) if g.path else None
        from vpo.pipeline.engine.locking import shared_cache_lock

        name = f"{Path(g.file or str(path)).stem}-{cfg.model.dtype}"
        with shared_cache_lock(ctx.layout.model_cache(name), f"the model cache {name}"):  # variants share it
            cache = import_gguf(ctx.layout.model_cache(name), path, package=g.package, file=g.file,
                                dtype=cfg.model.dtype, progress=False)
            check_tokenizer(AutoTokenizer.from_pretrained(str(cache)), f"GGUF model {name!r}")
            shutil.copytree(cache, folder, dirs_exist_ok=True)
        return f"gguf:{g.package + '/' if g.package else ''}{g.file or g.path}"
    src = cfg.model_source
    kw = {"revision": cfg.model.revision, "trust_remote_code": cfg.model.trust_remote_code}
    tok = AutoTokenizer.from_pretrained(src, **kw)
    check_tokenizer(tok, f"model {cfg.model.path_or_id!r}")  # before the (large) model is loaded
    model = AutoModelForCausalLM.from_pretrained(src, dtype=cfg.model.dtype, **kw)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(cfg.model.path_or_id)


def _parse_line(sft: dict[str, Any]) -> str:
    """``num_answers=1 0.00 -> 0.95, num_answers=3 0.00 -> 0.80`` from the warm-up's before/after parse check."""
    before, after = sft.get("parse_before") or {}, sft.get("parse_after") or {}
    return ", ".join(f"num_answers={m} {before.get(m, {}).get('parse_rate', float('nan')):.2f} -> "
                     f"{after[m]['parse_rate']:.2f}" for m in sorted(after, key=int))


def run(ctx: StageContext) -> dict[str, Any]:
    """Build ``base/`` (model, tokenizer, ``summary.json``)."""
    from vpo.sft import LoraSettings, train_sft

    cfg, task = ctx.cfg, ctx.task
    out = ctx.layout.base
    sft = cfg.sft
    m = max(a.num_answers for a in cfg.enabled_arms)
    warm_up = {"lr": sft.lr, "seed": cfg.seed, "m": m, "progress": False,
               "lora": LoraSettings(r=sft.lora.r, alpha=sft.lora.alpha, dropout=sft.lora.dropout,
                                    target_modules=tuple(sft.lora.target_modules)) if sft.lora else None,
               "eval_rows": sft.parse_check.rows, "eval_samples": sft.parse_check.samples,
               "eval_max_new_tokens": sft.parse_check.max_new_tokens,
               "eval_temperature": sft.parse_check.temperature}
    t0 = time.time()
    with atomic_dir(out) as tmp:  # the old base/ stays whole until the new one is complete
        if cfg.model.builder == "tiny":
            from vpo.tiny import build_char_tokenizer

            check_tokenizer(build_char_tokenizer(task.charset), f"the tiny builder (task {cfg.task.name!r})")
            steps = sft.steps if sft.enabled else 0
            with _sft_bar(ctx, steps) as on_step:
                train_sft(task, tmp, steps=steps, batch_size=sft.batch_size,
                          model_size=dict(cfg.model.builder_params) or None, on_step=on_step, **warm_up)
            source = "tiny"
        else:
            source = _pretrained(ctx, tmp)
            if sft.enabled and hasattr(task, "demonstration"):
                with _sft_bar(ctx, sft.steps) as on_step:
                    train_sft(task, tmp, steps=sft.steps, batch_size=sft.batch_size, init_dir=tmp, on_step=on_step,
                              **warm_up)
        info: dict[str, Any] = {"seconds": round(time.time() - t0, 1), "source": source}
        sft_metrics = tmp / "sft_metrics.json"
        if sft_metrics.is_file():  # written by train_sft a moment ago
            info["sft"] = json.loads(sft_metrics.read_text())
        atomic_write_json(tmp / ctx.layout.base_summary.name, info)
    sft_info = info.get("sft") or {}
    parse = _parse_line(sft_info) if sft_info.get("parse_after") else ""
    ctx.outcome((f"SFT {sft_info['steps']} steps, final loss {sft_info['final_loss']:.3f}"
                 if sft_info.get("steps") else f"{info['source']}, no SFT")
                + (f"; warm-up parse rate {parse}" if parse else ""))
    after = sft_info.get("parse_after") or {}
    low = {m: r["parse_rate"] for m, r in after.items() if r["parse_rate"] < cfg.trainer.min_parse_rate}
    if low:
        log(f"base: warning: after the warm-up the parse rate is {', '.join(f'{v:.0%} at num_answers={m}' for m, v in low.items())}"
            f" (below trainer.min_parse_rate {cfg.trainer.min_parse_rate:.0%}): unparsed rollouts score zero, so RL "
            "learns little; raise sft.steps or sft.lr")
    return {k: v for k, v in info.items() if k != "sft"} | {"parse_after": sft_info.get("parse_after")}


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
