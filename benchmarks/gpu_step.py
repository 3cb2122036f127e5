"""Seconds, tokens per second and peak memory of GRPO (m=1) and VPO (m=3) training steps, with the
memory plan's estimate beside each, on a model built from a shipped ``config.json`` with random
weights (no download).

Each arm trains ``--warmup + --steps`` optimizer steps on ``--prompts`` prompts of ``--prompt-len``
random tokens x ``--generations`` rollouts; every rollout is exactly its arm's completion length
(``--completion-len`` x m: EOS is suppressed), scored by a synthetic vector reward (d = ``--dims``:
the answer's share of token ids in each residue class mod d; the completion split into m answers).
Two engines run the same step:

* ``trl``: :class:`vpo.trainer.VPOTrainer` (TRL's GRPOTrainer, transformers generation);
* ``manual``: the step by hand with torch/transformers (and peft for LoRA) only: ``model.generate``,
  :func:`vpo.rewards.score_set`, the registered estimator from :mod:`vpo.advantages`, the on-policy
  DAPO policy-gradient loss through a chunked LM head, AdamW. For GPU machines without TRL.

``auto`` picks ``trl`` when TRL is importable, else ``manual``. bf16 weights and autocast on CUDA,
float32 on CPU. Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, else the peak RSS
(``ru_maxrss``, reset before each arm through ``/proc/self/clear_refs``) minus the RSS before the
model was built. The plan (:mod:`vpo.memory`) is given the same settings.

    # CPU, tiny (seconds):
    python benchmarks/gpu_step.py --model smollm2-135m --layers 2 --hidden 64 --vocab 512 --steps 2
    # CPU, SmolLM2-135M size:
    OMP_NUM_THREADS=1 python benchmarks/gpu_step.py --model smollm2-135m --steps 3 --prompts 2 --generations 4
    # one GPU (under 10 minutes):
    python benchmarks/gpu_step.py --model qwen2.5-0.5b --device cuda --steps 5 --prompts 8 --generations 8 \\
        --prompt-len 256 --completion-len 256 --json runs/bench-gpu-step.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vpo.memory import (
    Device,
    LoraShape,
    ModelShape,
    Parallel,
    TrainSettings,
    cpu_flops,
    known_gpu,
    plan_step,
    ram,
    scale_shape,
    shape_config,
)
from vpo.rewards import VectorReward

CONFIGS = Path(__file__).resolve().parents[1] / "vpo" / "data" / "model_configs"
MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct", "qwen2.5-0.5b": "Qwen2.5-0.5B-Instruct",
          "qwen2.5-1.5b": "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-7b": "Qwen2.5-Coder-7B-Instruct"}
ARMS = {"grpo": ("grpo", 1), "vpo": ("vpo", 3)}
PAD, EOS = 0, 1
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------ model and data


def load_shape(model: str, layers: int | None, hidden: int | None, vocab: int | None) -> ModelShape:
    """The shipped config (or a config.json path), scaled down by the overrides."""
    path = Path(model) if model.endswith(".json") else CONFIGS / f"{MODELS.get(model, model)}.json"
    if not path.is_file():
        raise SystemExit(f"error: no model config {path} (known: {', '.join(MODELS)}, or a config.json path)")
    shape = scale_shape(ModelShape.from_config(json.loads(path.read_text()), name=path.stem), layers=layers,
                        hidden=hidden)
    if vocab is not None:
        from dataclasses import replace

        shape = replace(shape, vocab_size=int(vocab))
    return shape


def build_model(shape: ModelShape, dtype: torch.dtype, device: str, seed: int) -> Any:
    """The architecture with random weights (transformers' own initialisation), in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**shape_config(shape), pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
                               use_cache=True)
    if shape.attention_bias and shape.model_type != "qwen2":
        cfg.attention_bias = True
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.to(device)


def build_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer whose ids are the words ``t<id>`` (``<pad>`` 0, ``<eos>`` 1): text
    prompts and decoded completions map one to one onto token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, vocab)}}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def prompt_ids(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """``n`` prompts of exactly ``length`` random non-special token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=gen)


class SyntheticReward(VectorReward):
    """d dimensions: for each answer, the share of its tokens whose id is j mod d. A completion is
    split into m answers of equal length. Cheap, deterministic, and answers differ."""

    def __init__(self, dims: int) -> None:
        self.names = tuple(f"r{j}" for j in range(dims))

    def parse(self, completion: str, m: int) -> list[str]:
        words = completion.split()
        if not words:
            return []
        size = max(1, len(words) // m)
        return [" ".join(words[i * size:(i + 1) * size if i < m - 1 else len(words)]) for i in range(m)
                if words[i * size:(i + 1) * size if i < m - 1 else len(words)]]

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        d = self.dim
        out = np.zeros((len(answers), d))
        for i, answer in enumerate(answers):
            ids = [int(w[1:]) for w in answer.split() if w.startswith("t") and w[1:].isdigit()]
            if ids:
                out[i] = np.bincount(np.asarray(ids) % d, minlength=d) / len(ids)
        return out


# ----------------------------------------------------------------------------------- measuring


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _trim() -> None:
    """Give freed heap memory back to the OS (glibc), so a later arm's peak starts from a low mark."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Meter:
    """Peak memory of one arm: CUDA allocator peak, or peak RSS above the RSS at :meth:`start`."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = 0
        self.reset_ok = True

    def start(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            _trim()
            self.reset_ok = _reset_peak_rss()
            self.base = _rss()

    def peak(self) -> int:
        if self.device == "cuda":
            return torch.cuda.max_memory_allocated() - self.base
        return _peak_rss() - self.base

    @property
    def kind(self) -> str:
        if self.device == "cuda":
            return "torch.cuda.max_memory_allocated"
        whole = "" if self.reset_ok else " (peak not resettable: whole process)"
        return "peak RSS minus RSS before the model" + whole


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ the plan


def plan_for(shape: ModelShape, args: argparse.Namespace, m: int, device: str, dev_memory: int) -> Any:
    """The memory plan with exactly this run's settings."""
    batch = args.prompts * args.generations
    micro = args.micro_batch or batch
    settings = TrainSettings(
        per_device_train_batch_size=micro, num_generations=args.generations,
        max_completion_length=args.completion_len * m, max_prompt_length=args.prompt_len,
        gradient_accumulation_steps=batch // micro, gradient_checkpointing=args.gradient_checkpointing,
        bf16=device == "cuda", param_dtype="bfloat16" if device == "cuda" else "float32",
        optim="adamw_torch_fused" if device == "cuda" or args.engine_used == "trl" else "adamw_torch",
        # what the run's VPOConfig leaves at TRL's values: one generation round per step, no vLLM, no KL
        generation_batch_size=None, steps_per_generation=None, num_iterations=1, fp16=False, use_vllm=False,
        vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=False, beta=0.0,
        ds3_gather_for_generation=True, cast_lm_head_to_fp32=False)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        known = known_gpu(props.name, props.total_memory)
        dev = Device(props.name, props.total_memory, "cuda", known.flops if known else None,
                     known.bandwidth if known else None)
    else:
        dev = Device("CPU", dev_memory, "cpu", args.cpu_flops, None)
    lora = LoraShape(r=args.lora_r, target_modules=LORA_TARGETS) if args.lora_r else None
    return plan_step(shape, settings, parallel=Parallel(), device=dev, lora=lora)


# ----------------------------------------------------------------------------------- the engines


def _lora(model: Any, r: int) -> Any:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(LORA_TARGETS),
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
    """log p(target) of ``hidden @ weight.T`` computed ``rows`` tokens at a time, each chunk's logits
    recomputed in the backward pass (what TRL's fused LM head does, without TRL)."""
    from torch.utils.checkpoint import checkpoint

    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = (h @ weight.t()).float()
        return logits.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    flat_h, flat_t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    parts = [checkpoint(piece, flat_h[i:i + rows], flat_t[i:i + rows], use_reentrant=False)
             for i in range(0, flat_h.size(0), rows)]
    return torch.cat(parts).view(targets.shape)


def run_manual(model: Any, tok: Any, estimator: str, m: int, args: argparse.Namespace, device: str,
               prompts: torch.Tensor) -> list[float]:
    """One optimizer step per iteration by hand: generate, score, advantages, DAPO loss, AdamW."""
    from vpo.advantages import RewardBatch, get_estimator
    from vpo.rewards import score_set

    reward = SyntheticReward(args.dims)
    est = get_estimator(estimator)
    g, c, lp = args.generations, args.completion_len * m, args.prompt_len
    batch = args.prompts * g
    micro = args.micro_batch or batch
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, fused=device == "cuda" or None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings().weight
    backbone = base.model
    rows = max(1, (4096 * 32768) // base.config.vocab_size)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    times = []
    for step in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        ids = prompts[(step * args.prompts) % len(prompts):][:args.prompts].repeat_interleave(g, 0).to(device)
        model.eval()
        with torch.no_grad(), autocast:
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=c, min_new_tokens=c, pad_token_id=PAD,
                                 eos_token_id=EOS)
        completions = out[:, lp:]
        texts = tok.batch_decode(completions.cpu(), skip_special_tokens=True)
        sets = [score_set(reward, text, {}, m) for text in texts]
        rb = RewardBatch(torch.tensor(np.stack([s.matrix for s in sets]), dtype=torch.float64),
                         torch.arange(m)[None, :] < torch.tensor([s.n_valid for s in sets])[:, None])
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        adv = est(rb, torch.arange(batch) // g, num_weights=100, generator=gen).to(device=device, dtype=torch.float32)
        model.train()
        mask = (completions != PAD).float()
        total = mask.sum().clamp(min=1)
        for i in range(0, batch, micro):
            seq = out[i:i + micro]
            with autocast:
                hidden = backbone(input_ids=seq, attention_mask=torch.ones_like(seq)).last_hidden_state[:, lp - 1:-1]
                logp = _chunk_logps(hidden, head, completions[i:i + micro], rows)
            ratio = torch.exp(logp - logp.detach())  # 1 on-policy; its gradient is the policy gradient
            loss = -(adv[i:i + micro, None] * ratio * mask[i:i + micro]).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def run_trl(model: Any, tok: Any, estimator: str, m: int, args: argparse.Namespace, device: str,
            prompts: torch.Tensor) -> list[float]:
    """The same steps through :class:`vpo.trainer.VPOTrainer` (TRL generation with transformers)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from vpo.trainer import VPOConfig, VPOTrainer

    g, c = args.generations, args.completion_len * m
    batch = args.prompts * g
    micro = args.micro_batch or batch
    steps = args.warmup + args.steps
    texts = tok.batch_decode(prompts)
    rows = [{"prompt": texts[i % len(texts)], "id": i} for i in range(args.prompts * steps)]
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            _sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            _sync(device)
            times.append(time.perf_counter() - self.t0)

    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=list(LORA_TARGETS),
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory(prefix="vpo-gpu-step-") as out:
        cfg = VPOConfig(output_dir=out, estimator=estimator, num_answers=m, num_weights=100,
                        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
                        num_generations=g, max_completion_length=c, generation_kwargs={"min_new_tokens": c},
                        learning_rate=args.lr, beta=0.0, max_steps=steps, bf16=device == "cuda",
                        use_cpu=device != "cuda", gradient_checkpointing=args.gradient_checkpointing,
                        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                        dataloader_pin_memory=False, truncated_scores_zero=False, min_parse_rate=0.0,
                        max_unparsed_steps=0, seed=args.seed, data_seed=args.seed, shuffle_dataset=False)
        trainer = VPOTrainer(model=model, reward=SyntheticReward(args.dims), args=cfg,
                             train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Timer()],
                             peft_config=peft_config)
        trainer.train()
        del trainer
    return times


# ------------------------------------------------------------------------------------------ main


def run_arm(name: str, shape: ModelShape, args: argparse.Namespace, device: str, meter: Meter) -> dict[str, Any]:
    """Build the model, run the arm's steps, measure; the plan's estimate beside."""
    estimator, m = ARMS[name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = build_tokenizer(shape.vocab_size)
    prompts = prompt_ids(max(args.prompts, 8), args.prompt_len, shape.vocab_size, args.seed)
    total_ram = ram()[0]
    meter.start()
    model = build_model(shape, dtype, device, args.seed)
    if args.gradient_checkpointing and args.engine_used == "manual":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = True  # generation in eval mode still uses the cache
    if args.lora_r and args.engine_used == "manual":
        if args.gradient_checkpointing:
            model.enable_input_require_grads()
        model = _lora(model, args.lora_r)
    run = run_trl if args.engine_used == "trl" else run_manual
    times = run(model, tok, estimator, m, args, device, prompts)
    peak = meter.peak()
    del model
    gc.collect()
    measured = times[args.warmup:] or times
    sec = statistics.median(measured)
    tokens = args.prompts * args.generations * args.completion_len * m
    plan = plan_for(shape, args, m, device, total_ram)
    estimate = plan.allocated_peak if device == "cuda" else plan.peak
    return {"arm": name, "estimator": estimator, "m": m, "engine": args.engine_used, "device": device,
            "steps": len(measured), "seconds_per_step": round(sec, 4),
            "seconds_per_step_all": [round(t, 4) for t in times],
            "seconds_spread": [round(min(measured), 4), round(max(measured), 4)],
            "generated_tokens_per_step": tokens, "tokens_per_second": round(tokens / sec, 2),
            "seconds_per_token": sec / tokens, "peak_memory": int(peak), "peak_memory_kind": meter.kind,
            "plan_peak": int(estimate), "plan_over_measured": round(estimate / peak, 3) if peak > 0 else None,
            "plan_seconds_per_step": round(plan.step_seconds, 4) if plan.seconds else None,
            "plan_components": plan.components}


def _arm_in_subprocess(name: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """Run one arm in a fresh interpreter (its own peak RSS) and return its result."""
    import subprocess

    words = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="vpo-gpu-step-arm-") as tmp:
        out = Path(tmp) / "arm.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *_without(words, ("--arms", "--json", "--isolate")),
               "--arms", name, "--json", str(out), "--isolate", "none"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"error: arm {name} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())["arms"][0]


def _without(words: Sequence[str], options: Sequence[str]) -> list[str]:
    """``words`` minus each option in ``options`` and its values."""
    out, skip = [], False
    for w in words:
        if w.startswith("--"):
            skip = w.split("=", 1)[0] in options
        if not skip:
            out.append(w)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help=f"{', '.join(MODELS)} or a config.json path")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (tiny CPU runs)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="smaller hidden size (intermediate and heads scale with it)")
    ap.add_argument("--vocab", type=int, default=None, help="smaller vocabulary (tiny CPU runs)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--engine", choices=("auto", "trl", "manual"), default="auto",
                    help="trl: VPOTrainer; manual: torch/transformers only (auto: trl when importable)")
    ap.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS))
    ap.add_argument("--steps", type=int, default=3, help="measured optimizer steps per arm")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    ap.add_argument("--generations", type=int, default=4, help="rollouts per prompt (G)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="per_device_train_batch_size (default: the whole step in one micro-batch)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--completion-len", type=int, default=32, help="tokens per answer; an m-answer arm generates m x")
    ap.add_argument("--dims", type=int, default=4, help="reward dimensions d")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--lora-r", type=int, default=0, help="train LoRA adapters of this rank instead of every weight")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isolate", choices=("auto", "process", "none"), default="auto",
                    help="process: each arm in a fresh subprocess (clean peak RSS; auto on CPU); none: all arms here")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if (args.prompts * args.generations) % (args.micro_batch or 1):
        ap.error("--micro-batch must divide --prompts x --generations")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    has_trl = importlib.util.find_spec("trl") is not None
    args.engine_used = args.engine if args.engine != "auto" else ("trl" if has_trl else "manual")
    if args.engine_used == "trl" and not has_trl:
        raise SystemExit("error: --engine trl but TRL is not installed; use --engine manual")
    args.cpu_flops = cpu_flops() if device == "cpu" else None
    shape = load_shape(args.model, args.layers, args.hidden, args.vocab)
    isolate = args.isolate if args.isolate != "auto" else ("process" if device == "cpu" and len(args.arms) > 1
                                                           else "none")
    if isolate == "process" and len(args.arms) > 1:
        results = [_arm_in_subprocess(name, argv) for name in args.arms]
    else:
        meter = Meter(device)
        results = [run_arm(name, shape, args, device, meter) for name in args.arms]
    for r in results:
        r["memory_isolated"] = isolate == "process" or len(args.arms) == 1 or device == "cuda"
    by = {r["arm"]: r for r in results}
    card = torch.cuda.get_device_name(0) if device == "cuda" else f"{platform.processor() or 'CPU'}, " \
        f"{torch.get_num_threads()} torch threads"
    scaled = [f"{k} {v}" for k, v in (("layers", args.layers), ("hidden", args.hidden), ("vocab", args.vocab)) if v]
    report = {"model": shape.name + (f" scaled to {', '.join(scaled)}" if scaled else ""),
              "parameters": shape.parameters, "layers": shape.num_layers, "hidden": shape.hidden_size,
              "vocab": shape.vocab_size, "device": card, "engine": args.engine_used,
              "settings": {k: v for k, v in vars(args).items() if k not in ("cpu_flops", "json")},
              "arms": results, "vpo_over_grpo_per_token": (round(by["vpo"]["seconds_per_token"]
                                                                 / by["grpo"]["seconds_per_token"], 3)
                                                           if {"vpo", "grpo"} <= set(by) else None),
              "torch": torch.__version__, "python": sys.version.split()[0]}
    print(json.dumps(report, indent=2, default=str))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    _summary(report)
    return report


def _summary(report: Mapping[str, Any]) -> None:
    print(f"\n{report['model']} ({report['parameters'] / 1e6:.1f}M parameters) on {report['device']}, "
          f"engine {report['engine']}", file=sys.stderr)
    for r in report["arms"]:
        print(f"  {r['arm']:<5} m={r['m']}: {r['seconds_per_step']:.3f} s/step (median of {r['steps']}), "
              f"{r['tokens_per_second']:.1f} generated tokens/s, peak {r['peak_memory'] / 2**20:.0f} MiB, "
              f"plan {r['plan_peak'] / 2**20:.0f} MiB (x{r['plan_over_measured']})", file=sys.stderr)
    if report["vpo_over_grpo_per_token"] is not None:
        print(f"  VPO / GRPO seconds per generated token: {report['vpo_over_grpo_per_token']}", file=sys.stderr)


if __name__ == "__main__":
    main()
