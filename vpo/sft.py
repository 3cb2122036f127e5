"""The supervised base stage and the format warm-up: teach a policy the answer format.

Two uses of one loop:

* **Tiny base** (no ``init_dir``): a fresh char model over ``task.charset`` is trained on the
  task's demonstrations. The RL arms start from it, so it has to be competent (most samples are
  legal answers in the right tags) yet high-entropy (it has not picked a strategy): for the route
  task the demonstrations mix routes via bonus A, via bonus B and anywhere, blind to lava.
* **Format warm-up** (``init_dir`` = a pretrained chat model): a few steps on the same
  demonstrations, with prompts built by :func:`vpo.chat.model_prompt` (the chat template, the
  m-answer instruction in the user turn), so the model writes the numbered-tag format that the
  reward parses. Optionally LoRA (``lora=LoraSettings(...)``, needs ``peft``), merged back into
  a normal folder at the end. ``eval_rows > 0`` measures :func:`parse_stats` by sampling before
  and after.

Every batch is in either the single-answer or the m-answer format. Plain torch loop: AdamW,
linear warm-up then cosine decay, gradient clipping, loss on completion tokens (and the closing
eos) only, seeded, with a tqdm progress bar.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from vpo.answers import parse_answers
from vpo.chat import has_chat_template, model_prompt
from vpo.tasks import Task
from vpo.tiny import build_tiny_model, count_parameters

__all__ = [
    "SFT_METRICS_FILE",
    "DemoTask",
    "LoraSettings",
    "default_threads",
    "make_batch",
    "measure_parse_rate",
    "parse_stats",
    "train_sft",
]

SFT_METRICS_FILE = "sft_metrics.json"


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters for the warm-up (``peft``): rank ``r``, scale ``alpha``, ``dropout`` and the
    module names they wrap (the attention and MLP projections of Llama/Qwen-style models)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                       "down_proj")

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.target_modules:
            raise ValueError(f"invalid LoRA settings {self}")


class DemoTask(Protocol):
    """A task that can write supervised target completions (the route task does)."""

    charset: str

    def load(self, split: str) -> list[dict[str, Any]]: ...

    def format_prompt(self, row: Any, m: int) -> Any: ...

    def demonstration(self, row: Any, m: int, rng: random.Random) -> str: ...


def make_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], completions: list[str], *,
    prompt_special_tokens: bool = True,
) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``/``labels`` for prompt+completion+eos, with
    labels -100 on the prompt and the padding (loss on the completion and eos only). Prompts
    rendered by a chat template hold their special tokens already (``prompt_special_tokens=False``)."""
    p_ids = tokenizer(prompts, add_special_tokens=prompt_special_tokens)["input_ids"]
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


def parse_stats(task: Any, completions: Sequence[Sequence[str]], m: int) -> dict[str, float]:
    """How well completions follow the m-answer format (numbered tags, parsed strictly: a bare
    untagged answer does not count). ``parse_rate``: fraction with at least one tagged answer;
    ``complete_rate``: with all m; ``distinct_rate``: with m answers distinct under the reward's
    de-duplication key (for m = 1 the same as ``complete_rate``)."""
    reward = task.reward
    flat = [c for group in completions for c in group]
    if not flat:
        raise ValueError("no completions to measure")
    parsed = [parse_answers(c, m, reward.answer_tag) for c in flat]
    n = len(flat)
    return {
        "m": m,
        "completions": n,
        "parse_rate": sum(bool(a) for a in parsed) / n,
        "complete_rate": sum(len(a) == m for a in parsed) / n,
        "distinct_rate": sum(len({reward.dedup_key(x) for x in a}) == m for a in parsed) / n,
    }


def measure_parse_rate(model: Any, tokenizer: PreTrainedTokenizerBase, task: Any,
                       rows: Sequence[Mapping[str, Any]], ms: Sequence[int] = (1, 3), *, n: int = 4,
                       max_new_tokens: int = 96, temperature: float = 1.0, seed: int = 0,
                       batch_size: int = 32) -> dict[str, dict[str, float]]:
    """Sample ``n`` completions per row for each answer count in ``ms`` (prompts from
    :func:`vpo.chat.model_prompt`) and return :func:`parse_stats` per m, keyed ``str(m)``."""
    from vpo.generation import sample

    out: dict[str, dict[str, float]] = {}
    for m in ms:
        prompts = [model_prompt(task, r, m, tokenizer) for r in rows]
        comps = sample(model, tokenizer, prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                       seed=seed + m, batch_size=batch_size)
        out[str(m)] = parse_stats(task, comps, m)
    return out


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
    lora: LoraSettings | None = None,
    eval_rows: int = 0,
    eval_samples: int = 4,
    eval_max_new_tokens: int = 96,
    eval_temperature: float = 1.0,
    on_step: Callable[[int, float], None] | None = None,
) -> Path:
    """Train on the task's demonstrations and save model + tokenizer + ``sft_metrics.json`` in ``out_dir``.

    Starts from ``init_dir`` if given (a pretrained model: the format warm-up), else builds a
    fresh tiny model over ``task.charset`` (``model_size`` overrides :data:`vpo.tiny.DEFAULT_SIZE`).
    A fraction ``p_multi`` of the batches uses the m-answer format, the rest the single-answer
    one. With ``lora`` only LoRA adapters train (merged into the weights before saving).
    ``eval_rows > 0``: the parse rate (:func:`measure_parse_rate` on that many test rows,
    ``eval_samples`` completions each, m = 1 and m) is measured before and after training and
    stored as ``parse_before`` / ``parse_after``. ``steps=0`` just saves the starting model.
    ``out_dir`` may equal ``init_dir``. Returns ``out_dir``.
    ``progress`` draws a tqdm bar; ``on_step(step, loss)`` is called after every step (for callers
    that draw their own progress).
    """
    if steps > 0 and not hasattr(task, "demonstration"):
        raise TypeError(f"task {getattr(task, 'name', task)!r} cannot write demonstrations for SFT")
    if steps < 0 or batch_size < 1:
        raise ValueError(f"need steps >= 0 and batch_size >= 1, got {steps} and {batch_size}")
    if eval_rows < 0 or eval_samples < 1:
        raise ValueError(f"need eval_rows >= 0 and eval_samples >= 1, got {eval_rows} and {eval_samples}")
    if lora is not None and importlib.util.find_spec("peft") is None:
        raise RuntimeError("LoRA warm-up (lora=...) needs the 'peft' package: pip install 'vpo[chat]'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads())
    evaluation = {"rows": eval_rows, "n": eval_samples, "max_new_tokens": eval_max_new_tokens,
                  "temperature": eval_temperature}
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
            lora,
            evaluation,
            on_step,
        )
    finally:
        torch.set_num_threads(prev_threads)


def _with_lora(model: Any, lora: LoraSettings) -> Any:
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in lora.target_modules if t in present]
    if not targets:
        raise ValueError(f"none of the LoRA target modules {list(lora.target_modules)} exist in "
                         f"{type(model).__name__}")
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                     bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


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
    lora: LoraSettings | None,
    evaluation: dict[str, Any],
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
    chat = has_chat_template(tokenizer)
    rows = task.load("train")
    if not rows:
        raise ValueError("the task's train split is empty")
    eval_rows = task.load("test")[: evaluation["rows"]] if evaluation["rows"] else []
    ms = sorted({1, m})

    def parse_now() -> dict[str, dict[str, float]]:
        return measure_parse_rate(model, tokenizer, task, eval_rows, ms, n=evaluation["n"],
                                  max_new_tokens=evaluation["max_new_tokens"],
                                  temperature=evaluation["temperature"], seed=seed)

    parse_before = parse_now() if eval_rows else None
    if lora is not None:
        model = _with_lora(model, lora)
    model.train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in trainable if not (p.ndim >= 2 and "norm" not in n)]
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
        prompts = [str(model_prompt(task, r, mm, tokenizer, render=True)) for r in picked]
        completions = [task.demonstration(r, mm, rng) for r in picked]
        batch = make_batch(tokenizer, prompts, completions, prompt_special_tokens=not chat)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], grad_clip)
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
    del opt
    if lora is not None:
        model = model.merge_and_unload()  # a plain model again: every later stage loads a normal folder

    model.eval()
    parse_after = parse_now() if eval_rows else None
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
        "chat_template": chat,
        "lora": asdict(lora) if lora is not None else None,
        "initial_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "time_s": round(elapsed, 2),
        "completion_tokens": n_tokens,
        "threads": torch.get_num_threads(),
        "losses": [round(x, 5) for x in losses],
        "parse_eval": evaluation if eval_rows else None,
        "parse_before": parse_before,
        "parse_after": parse_after,
    }
    (out / SFT_METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    return out
