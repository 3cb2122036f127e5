"""Seconds, achieved FLOP/s and peak memory of GRPO (m=1) and VPO (m=3) training steps, generation and
training timed apart, with the memory plan's estimate beside each, on a model built from a shipped
``config.json`` with random weights (no download).

Each arm trains ``--warmup + --steps`` optimizer steps on ``--prompts`` prompts of ``--prompt-len``
random tokens x ``--generations`` rollouts; every rollout is exactly its arm's completion length
(``--completion-len`` x m, or ``--completion-total``: EOS is suppressed), scored by a synthetic vector
reward (d = ``--dims``: the answer's share of token ids in each residue class mod d; the completion
split into m answers). ``--train-only`` replaces generation by random completions of that length
(the training step alone, e.g. at a preset's shape: ``--preset code-qwen-1gpu-lora --arm vpo`` reads
the arm's batch, lengths, checkpointing and LoRA from ``pipelines.yaml``). Two engines run the step:

* ``trl``: :class:`vpo.trainer.VPOTrainer` (TRL's GRPOTrainer, transformers generation);
* ``manual``: the step by hand with torch/transformers (and peft for LoRA) only: ``model.generate``,
  :func:`vpo.rewards.score_set`, the registered estimator from :mod:`vpo.advantages`, the on-policy
  DAPO policy-gradient loss through a chunked LM head, AdamW. For GPU machines without TRL. With
  ``--accelerate`` (under ``accelerate launch``) the model and optimizer go through
  ``Accelerator.prepare`` (FSDP or DeepSpeed from the launch config) and the loss through the wrapped
  model's forward.

``auto`` picks ``trl`` when TRL is importable, else ``manual``. The model is built on the device
(``torch.device`` context), bf16 weights and autocast on CUDA, float32 on CPU. Per arm: seconds per
step and its generation / scoring / training parts, achieved TFLOP/s of generation and training (the
plan's FLOPs of this exact step over the measured seconds) and MFU against a dense matmul measured in
the same run (bf16 on CUDA), peak memory (``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` on CUDA; on CPU the peak RSS, reset before each arm through
``/proc/self/clear_refs``, minus the RSS before the model was built) against the plan
(:mod:`vpo.memory`, given the same settings), and the library versions.

Run from the repository root (the script puts the checkout on ``sys.path``; no install of vpo needed)::

    # CPU, tiny (seconds):
    python benchmarks/gpu_step.py --model smollm2-135m --layers 2 --hidden 64 --vocab 512 --steps 2
    # one GPU (about a minute):
    python benchmarks/gpu_step.py --model qwen2.5-0.5b --device cuda --steps 3 --prompts 8 --generations 8 \\
        --prompt-len 256 --completion-len 256 --json runs/bench-gpu-step.json
    # the training step alone at a preset arm's shape:
    python benchmarks/gpu_step.py --device cuda --train-only --preset code-qwen-1gpu-lora --arm vpo --steps 2
    # everything GPU-side in one go (JSON + markdown table): bash benchmarks/gpu_check.sh
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if (REPO / "vpo" / "__init__.py").is_file() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # a checkout's own vpo, installed or not

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from vpo.memory import (
    Device,
    LoraShape,
    MemoryPlan,
    ModelShape,
    Parallel,
    TrainSettings,
    known_gpu,
    plan_step,
    ram,
    scale_shape,
    shape_config,
)
from vpo.requirements import installed_version
from vpo.rewards import VectorReward

CONFIGS = REPO / "vpo" / "data" / "model_configs"
PIPELINES = REPO / "pipelines.yaml"
MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct", "qwen2.5-0.5b": "Qwen2.5-0.5B-Instruct",
          "qwen2.5-1.5b": "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-7b": "Qwen2.5-Coder-7B-Instruct"}
PAD, EOS = 0, 1
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VERSIONS = ("torch", "transformers", "accelerate", "peft", "trl", "deepspeed", "vllm", "flash-attn", "numpy",
            "tokenizers", "vpo")
"""Distributions whose versions a report names (None: not installed)."""
DEFAULT_NUM_ANSWERS = 1
"""m of a preset arm that does not set ``num_answers`` (the pipeline's default, vpo/pipeline/settings.py)."""


@dataclass(frozen=True)
class Arm:
    """One measured arm: its name, advantage estimator and answers per rollout m."""

    name: str
    estimator: str
    m: int


ARMS = {"grpo": Arm("grpo", "grpo", 1), "vpo": Arm("vpo", "vpo", 3)}
DEFAULTS = {"model": "smollm2-135m", "prompts": 2, "generations": 4, "prompt_len": 32, "completion_len": 32, "lora_r": 0}
"""Step shape without ``--preset`` (a preset's own shape wins over these, the command line over both)."""


# ------------------------------------------------------------------------------ model and data


def config_path(model: str) -> Path:
    """The shipped ``config.json`` of a short name or hub id (matched on the model name), or a path."""
    if model.endswith(".json"):
        return Path(model)
    stem = MODELS.get(model, model.rstrip("/").split("/")[-1])
    found = [p for p in sorted(CONFIGS.glob("*.json")) if p.stem.lower() == stem.lower()]
    return found[0] if found else CONFIGS / f"{stem}.json"


def load_shape(model: str, layers: int | None, hidden: int | None, vocab: int | None) -> ModelShape:
    """The shipped config (or a config.json path), scaled down by the overrides."""
    path = config_path(model)
    if not path.is_file():
        raise SystemExit(f"error: no model config {path} (known: {', '.join(MODELS)}, a hub id with a config in "
                         f"{CONFIGS}, or a config.json path)")
    shape = scale_shape(ModelShape.from_config(json.loads(path.read_text()), name=path.stem), layers=layers,
                        hidden=hidden)
    return replace(shape, vocab_size=int(vocab)) if vocab is not None else shape


def build_model(shape: ModelShape, dtype: torch.dtype, device: str, seed: int) -> Any:
    """The architecture with random weights (transformers' own initialisation), in ``dtype``, allocated
    and initialised on ``device`` (no CPU copy first)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**shape_config(shape), pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
                               use_cache=True)
    if shape.attention_bias and shape.model_type != "qwen2":
        cfg.attention_bias = True
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    where = {p.device.type for p in model.parameters()}
    if where != {torch.device(device).type}:
        raise SystemExit(f"error: the model was built on {sorted(where)}, not on {device}")
    return model


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


def completion_tokens(args: argparse.Namespace, m: int) -> int:
    """Tokens per rollout of an m-answer arm: ``--completion-total``, else ``--completion-len`` x m."""
    return args.completion_total or args.completion_len * m


# ---------------------------------------------------------------------------------- a preset's shape


def preset_shape(name: str, arm: str | None, path: Path = PIPELINES) -> dict[str, Any]:
    """One arm of a ``pipelines.yaml`` preset as this script's settings: model config, batch (TRL's
    semantics, the arm's rollout multiplier applied), lengths, checkpointing, LoRA, precision. Read as
    YAML, without the pipeline package; a setting the preset leaves to a default is an error naming it."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    pipelines = doc.get("pipelines") or {}
    if name not in pipelines:
        raise SystemExit(f"error: {path}: no pipeline {name!r} (known: {', '.join(pipelines)})")
    preset = pipelines[name]
    arms = [a for a in preset.get("arms") or [] if a.get("enabled", True)]
    chosen = next((a for a in arms if a.get("name") == arm), None) if arm else (arms[0] if arms else None)
    if chosen is None:
        raise SystemExit(f"error: {path}: pipelines.{name} has no enabled arm {arm!r} "
                         f"(arms: {', '.join(str(a.get('name')) for a in arms)})")
    own = {k: v for k, v in chosen.items() if k not in ("name", "seeds", "enabled", "rollout_multiplier")}
    trainer = {**(preset.get("trainer") or {}), **own}
    needed = ("per_device_train_batch_size", "num_generations", "gradient_accumulation_steps", "max_prompt_length",
              "max_completion_length")
    missing = [k for k in needed if trainer.get(k) is None]
    if missing:
        raise SystemExit(f"error: {path}: pipelines.{name} (arm {chosen['name']}) does not set "
                         f"{', '.join('trainer.' + k for k in missing)}; pass the shape explicitly instead")
    model_id = (preset.get("model") or {}).get("path_or_id")
    if not model_id:
        raise SystemExit(f"error: {path}: pipelines.{name}.model has no path_or_id (a hub model) to take a shape from")
    config = config_path(str(model_id))
    if not config.is_file():
        raise SystemExit(f"error: no shipped config.json for {model_id} in {CONFIGS}")
    mult = int(chosen.get("rollout_multiplier", 1))
    generations = int(trainer["num_generations"]) * mult
    micro = int(trainer["per_device_train_batch_size"]) * mult
    completions = micro * int(trainer["gradient_accumulation_steps"])
    if completions % generations:
        raise SystemExit(f"error: pipelines.{name} arm {chosen['name']}: {completions} completions per step are "
                         f"not whole groups of {generations}")
    lora = trainer.get("lora") or {}
    return {"model": str(config), "arm": Arm(str(chosen["name"]), str(chosen["estimator"]).lower(),
                                             int(trainer.get("num_answers", DEFAULT_NUM_ANSWERS))),
            "generations": generations, "micro_batch": micro, "prompts": completions // generations,
            "prompt_len": int(trainer["max_prompt_length"]), "completion_total": int(trainer["max_completion_length"]),
            "gradient_checkpointing": bool(trainer.get("gradient_checkpointing", False)),
            "lora_r": int(lora.get("r", 0)), "lora_alpha": lora.get("alpha"),
            "lora_targets": tuple(lora.get("target_modules") or LORA_TARGETS),
            "bf16": trainer.get("bf16"), "learning_rate": trainer.get("learning_rate")}


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
    """Peak memory of one arm: CUDA allocator peaks (allocated and reserved), or peak RSS above the RSS
    at :meth:`start`."""

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

    def cuda_peaks(self) -> tuple[int | None, int | None]:
        """(max_memory_allocated, max_memory_reserved) since :meth:`start`; None on CPU."""
        if self.device != "cuda":
            return None, None
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    @property
    def kind(self) -> str:
        if self.device == "cuda":
            return "torch.cuda.max_memory_allocated"
        whole = "" if self.reset_ok else " (peak not resettable: whole process)"
        return "peak RSS minus RSS before the model" + whole


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: str, dtype: torch.dtype, n: int, repeats: int = 10) -> dict[str, Any]:
    """Dense ``n x n`` matmul FLOP/s on ``device`` in ``dtype``: the best of three rounds of ``repeats``
    products after a warm-up (the denominator of MFU, measured in the same run as the steps)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del a, b
    return {"dtype": str(dtype).removeprefix("torch."), "n": n, "repeats": repeats,
            "tflops": float(f"{2.0 * n**3 * repeats / best / 1e12:.4g}")}


def versions() -> dict[str, str | None]:
    """Installed versions of the libraries the step uses (None: not installed), CUDA and cuDNN."""
    out: dict[str, str | None] = {"python": sys.version.split()[0], **{d: installed_version(d) for d in VERSIONS}}
    out["torch_cuda"] = torch.version.cuda
    out["cudnn"] = str(torch.backends.cudnn.version()) if torch.cuda.is_available() else None
    return out


# ------------------------------------------------------------------------------------ the plan


def plan_for(shape: ModelShape, args: argparse.Namespace, arm: Arm, device: str, dev_memory: int) -> MemoryPlan:
    """The memory plan with exactly this run's settings (no vLLM: generation is transformers')."""
    batch = args.prompts * args.generations
    micro = args.micro_batch or batch
    settings = TrainSettings(
        per_device_train_batch_size=micro, num_generations=args.generations,
        max_completion_length=completion_tokens(args, arm.m), max_prompt_length=args.prompt_len,
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
        dev = Device("CPU", dev_memory, "cpu", args.matmul["tflops"] * 1e12, None)
    lora = LoraShape(r=args.lora_r, target_modules=tuple(args.lora_targets)) if args.lora_r else None
    return plan_step(shape, settings, parallel=Parallel(), device=dev, lora=lora)


# ----------------------------------------------------------------------------------- the engines


def _lora_config(args: argparse.Namespace) -> Any:
    from peft import LoraConfig

    alpha = args.lora_alpha or 2 * args.lora_r
    return LoraConfig(r=args.lora_r, lora_alpha=alpha, target_modules=list(args.lora_targets), lora_dropout=0.0,
                      task_type="CAUSAL_LM")


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


def _wrapped_logps(model: Any, seq: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) through the (FSDP/DeepSpeed-wrapped) model's own forward: the completion positions'
    logits only (``logits_to_keep``), as the wrappers gather and reshard the weights in their forward."""
    c = targets.size(1)
    logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), logits_to_keep=c + 1).logits[:, :-1].float()
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _accelerator(args: argparse.Namespace, micro: int, accumulation: int) -> Any:
    """An Accelerator from the ``accelerate launch`` environment, with the DeepSpeed config's ``auto``
    entries filled from this run (no dataloader to infer them from)."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = micro
        ds["gradient_accumulation_steps"] = accumulation
        ds["train_batch_size"] = micro * accumulation * accelerator.num_processes
        if ds.get("gradient_clipping") == "auto":
            ds["gradient_clipping"] = 1.0
        ds.setdefault("zero_allow_untested_optimizer", True)  # torch's AdamW, as TRL's trainer passes it
    return accelerator


def run_manual(model: Any, tok: Any, arm: Arm, args: argparse.Namespace, device: str,
               prompts: torch.Tensor) -> list[dict[str, float]]:
    """One optimizer step per iteration by hand: generate (or, ``--train-only``, draw random completions),
    score, advantages, DAPO loss, AdamW. Returns each step's seconds: total, generation, scoring, training."""
    from vpo.advantages import RewardBatch, get_estimator
    from vpo.rewards import score_set

    reward = SyntheticReward(args.dims)
    est = get_estimator(arm.estimator)
    g, c, lp = args.generations, completion_tokens(args, arm.m), args.prompt_len
    batch = args.prompts * g
    micro = args.micro_batch or batch
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, fused=device == "cuda" or None)
    accelerator = _accelerator(args, micro, batch // micro) if args.accelerate else None
    if accelerator is not None:
        model, opt = accelerator.prepare(model, opt)
        args.accelerate_type = str(accelerator.distributed_type).split(".")[-1]
    else:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        head = base.get_output_embeddings().weight
        backbone = base.model
        rows = max(1, (4096 * 32768) // base.config.vocab_size)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    draw = torch.Generator().manual_seed(args.seed + 1)
    times = []
    for step in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        ids = prompts[(step * args.prompts) % len(prompts):][:args.prompts].repeat_interleave(g, 0).to(device)
        if args.train_only:
            completions = torch.randint(2, tok.vocab_size, (batch, c), generator=draw).to(device)
            out = torch.cat([ids, completions], dim=1)
        else:
            model.eval()
            generator = accelerator.unwrap_model(model) if accelerator is not None else model
            with torch.no_grad(), autocast:
                out = generator.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                         temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=c, min_new_tokens=c,
                                         pad_token_id=PAD, eos_token_id=EOS)
            completions = out[:, lp:]
        _sync(device)
        t_gen = time.perf_counter()
        texts = tok.batch_decode(completions.cpu(), skip_special_tokens=True)
        sets = [score_set(reward, text, {}, arm.m) for text in texts]
        rb = RewardBatch(torch.tensor(np.stack([s.matrix for s in sets]), dtype=torch.float64),
                         torch.arange(arm.m)[None, :] < torch.tensor([s.n_valid for s in sets])[:, None])
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        adv = est(rb, torch.arange(batch) // g, num_weights=100, generator=gen).to(device=device, dtype=torch.float32)
        t_score = time.perf_counter()
        model.train()
        mask = (completions != PAD).float()
        total = mask.sum().clamp(min=1)
        for i in range(0, batch, micro):
            seq = out[i:i + micro]
            with autocast:
                if accelerator is not None:
                    logp = _wrapped_logps(model, seq, completions[i:i + micro])
                else:
                    hidden = backbone(input_ids=seq, attention_mask=torch.ones_like(seq)).last_hidden_state
                    logp = _chunk_logps(hidden[:, lp - 1:-1], head, completions[i:i + micro], rows)
            ratio = torch.exp(logp - logp.detach())  # 1 on-policy; its gradient is the policy gradient
            loss = -(adv[i:i + micro, None] * ratio * mask[i:i + micro]).sum() / total
            if accelerator is not None:
                accelerator.backward(loss)
            else:
                loss.backward()
        if accelerator is not None:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t1 = time.perf_counter()
        times.append({"total": t1 - t0, "generation": t_gen - t0, "scoring": t_score - t_gen, "training": t1 - t_score})
    if accelerator is not None:
        accelerator.free_memory()
    return times


def run_trl(model: Any, tok: Any, arm: Arm, args: argparse.Namespace, device: str,
            prompts: torch.Tensor) -> list[dict[str, float]]:
    """The same steps through :class:`vpo.trainer.VPOTrainer` (TRL generation with transformers); the
    generation and scoring parts are timed around the trainer's own ``_generate`` and
    ``_generate_and_score_completions``."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from vpo.trainer import VPOConfig, VPOTrainer

    g, c = args.generations, completion_tokens(args, arm.m)
    batch = args.prompts * g
    micro = args.micro_batch or batch
    steps = args.warmup + args.steps
    texts = tok.batch_decode(prompts)
    rows = [{"prompt": texts[i % len(texts)], "id": i} for i in range(args.prompts * steps)]
    times: list[dict[str, float]] = []
    parts = {"generation": 0.0, "scoring": 0.0}

    def timed(fn: Any, key: str, inner: str | None = None) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            _sync(device)
            t0, before = time.perf_counter(), parts.get(inner, 0.0) if inner else 0.0
            try:
                return fn(*a, **kw)
            finally:
                _sync(device)
                spent = time.perf_counter() - t0
                parts[key] += spent - ((parts[inner] - before) if inner else 0.0)
        return wrapper

    class Timer(TrainerCallback):
        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            _sync(device)
            parts.update(generation=0.0, scoring=0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            _sync(device)
            total = time.perf_counter() - self.t0
            times.append({"total": total, "generation": parts["generation"], "scoring": parts["scoring"],
                          "training": total - parts["generation"] - parts["scoring"]})

    with tempfile.TemporaryDirectory(prefix="vpo-gpu-step-") as out:
        cfg = VPOConfig(output_dir=out, estimator=arm.estimator, num_answers=arm.m, num_weights=100,
                        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
                        num_generations=g, max_completion_length=c, generation_kwargs={"min_new_tokens": c},
                        learning_rate=args.lr, beta=0.0, max_steps=steps, bf16=device == "cuda",
                        use_cpu=device != "cuda", gradient_checkpointing=args.gradient_checkpointing,
                        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                        dataloader_pin_memory=False, truncated_scores_zero=False, min_parse_rate=0.0,
                        max_unparsed_steps=0, seed=args.seed, data_seed=args.seed, shuffle_dataset=False)
        trainer = VPOTrainer(model=model, reward=SyntheticReward(args.dims), args=cfg,
                             train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Timer()],
                             peft_config=_lora_config(args) if args.lora_r else None)
        trainer._generate = timed(trainer._generate, "generation")
        trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "scoring",
                                                        inner="generation")
        trainer.train()
        del trainer
    return times


# ------------------------------------------------------------------------------------------ main


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _rate(flops: float, seconds: float) -> float | None:
    """TFLOP/s to 4 significant digits (None where nothing ran)."""
    return _sig(flops / seconds / 1e12) if seconds > 0 and flops > 0 else None


def run_arm(arm: Arm, shape: ModelShape, args: argparse.Namespace, device: str, meter: Meter) -> dict[str, Any]:
    """Build the model, run the arm's steps, measure; the plan's estimate and FLOPs beside."""
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
        from peft import get_peft_model

        if args.gradient_checkpointing:
            model.enable_input_require_grads()
        model = get_peft_model(model, _lora_config(args))
    run = run_trl if args.engine_used == "trl" else run_manual
    times = run(model, tok, arm, args, device, prompts)
    peak = meter.peak()
    allocated, reserved = meter.cuda_peaks()
    del model
    gc.collect()
    measured = times[args.warmup:] or times
    sec = statistics.median(t["total"] for t in measured)
    part = {k: statistics.median(t[k] for t in measured) for k in ("generation", "scoring", "training")}
    c = completion_tokens(args, arm.m)
    tokens = args.prompts * args.generations * c
    plan = plan_for(shape, args, arm, device, total_ram)
    totals = plan.phase_totals
    if args.train_only:  # no generation phase ran: the larger of a training micro-step and the optimizer step
        phase = max(("training", "optimizer step"), key=lambda k: totals[k])
        estimate = totals[phase] + (0 if device == "cuda" else plan.runtime)
    else:
        phase = plan.peak_phase
        estimate = plan.allocated_peak if device == "cuda" else plan.peak
    flops = {"generation": 0.0 if args.train_only else plan.flops["generation"], "training": plan.flops["training"]}
    achieved = {"generation": _rate(flops["generation"], part["generation"]),
                "training": _rate(flops["training"], part["training"])}
    peak_tflops = args.matmul["tflops"]
    return {"arm": arm.name, "estimator": arm.estimator, "m": arm.m, "engine": args.engine_used, "device": device,
            "mode": "train-only" if args.train_only else "generate+train",
            "accelerate": getattr(args, "accelerate_type", None),
            "steps": len(measured), "seconds_per_step": round(sec, 4),
            "seconds_per_step_all": [round(t["total"], 4) for t in times],
            "seconds_spread": [round(min(t["total"] for t in measured), 4), round(max(t["total"] for t in measured), 4)],
            # significant digits, not decimals: a tiny run's milliseconds keep the precision its rates have
            "generation_seconds": _sig(part["generation"]), "scoring_seconds": _sig(part["scoring"]),
            "training_seconds": _sig(part["training"]),
            "prompt_tokens": args.prompt_len, "completion_tokens": c, "sequences_per_step": args.prompts * args.generations,
            "micro_batch": args.micro_batch or args.prompts * args.generations,
            "generated_tokens_per_step": 0 if args.train_only else tokens,
            "tokens_per_second": round(tokens / sec, 2),
            "generation_tokens_per_second": (None if args.train_only or part["generation"] <= 0
                                             else round(tokens / part["generation"], 2)),
            "seconds_per_token": sec / tokens, "flops_per_step": {k: float(v) for k, v in flops.items()},
            "achieved_tflops": achieved,
            "mfu": {k: (_sig(v / peak_tflops) if v is not None and peak_tflops else None) for k, v in achieved.items()},
            "peak_memory": int(peak), "peak_memory_kind": meter.kind,
            "max_memory_allocated": allocated, "max_memory_reserved": reserved,
            "plan_peak": int(estimate), "plan_phase": phase,
            "plan_over_measured": round(estimate / peak, 3) if peak > 0 else None,
            "plan_over_reserved": round(estimate / reserved, 3) if reserved else None,
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
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help=f"{', '.join(MODELS)}, a hub id with a shipped config, or a config.json path "
                         "(default smollm2-135m)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (tiny CPU runs)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="smaller hidden size (intermediate and heads scale with it)")
    ap.add_argument("--vocab", type=int, default=None, help="smaller vocabulary (tiny CPU runs)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--engine", choices=("auto", "trl", "manual"), default="auto",
                    help="trl: VPOTrainer; manual: torch/transformers only (auto: trl when importable)")
    ap.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=None, help="default: grpo vpo")
    ap.add_argument("--preset", default=None,
                    help="take the shape of one arm of this pipelines.yaml preset (model, batch, lengths, "
                         "checkpointing, LoRA); with --arm")
    ap.add_argument("--arm", default=None, help="the preset's arm (default: its first enabled one)")
    ap.add_argument("--pipelines", default=str(PIPELINES), help="the pipelines file --preset reads")
    ap.add_argument("--train-only", action="store_true",
                    help="no generation: random completions of the arm's length, then score, advantages, train")
    ap.add_argument("--accelerate", action="store_true",
                    help="manual engine through accelerate's Accelerator (run under `accelerate launch`)")
    ap.add_argument("--steps", type=int, default=3, help="measured optimizer steps per arm")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per optimizer step (default 2)")
    ap.add_argument("--generations", type=int, default=None, help="rollouts per prompt, G (default 4)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="per_device_train_batch_size (default: the whole step in one micro-batch)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 32)")
    ap.add_argument("--completion-len", type=int, default=None,
                    help="tokens per answer; an m-answer arm generates m x (default 32)")
    ap.add_argument("--completion-total", type=int, default=None,
                    help="tokens per rollout whatever m is (TRL's max_completion_length); overrides --completion-len")
    ap.add_argument("--dims", type=int, default=4, help="reward dimensions d")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--lora-r", type=int, default=None, help="train LoRA adapters of this rank instead of every weight")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--matmul-size", type=int, default=None,
                    help="n of the n x n matmul that measures the device's peak (default: 8192 on CUDA, 512 on CPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isolate", choices=("auto", "process", "none"), default="auto",
                    help="process: each arm in a fresh subprocess (clean peak RSS; auto on CPU); none: all arms here")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    args.lora_alpha, args.lora_targets = None, LORA_TARGETS
    if args.preset:  # the preset's shape, except what the command line sets itself
        if args.arms:
            ap.error("--preset takes one arm: use --arm")
        shape = preset_shape(args.preset, args.arm, Path(args.pipelines))
        for key in ("model", "generations", "micro_batch", "prompts", "prompt_len", "completion_total", "lora_r"):
            if getattr(args, key) is None:
                setattr(args, key, shape[key])
        args.lora_alpha, args.lora_targets = shape["lora_alpha"], shape["lora_targets"]
        args.gradient_checkpointing = args.gradient_checkpointing or shape["gradient_checkpointing"]
        args.arm_specs = [shape["arm"]]
        args.arms = [shape["arm"].name]
    else:
        if args.arm:
            ap.error("--arm needs --preset")
        args.arms = args.arms or list(ARMS)
        args.arm_specs = [ARMS[name] for name in args.arms]
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if (args.prompts * args.generations) % (args.micro_batch or 1):
        ap.error("--micro-batch must divide --prompts x --generations")
    if args.accelerate and args.engine == "trl":
        ap.error("--accelerate drives the manual engine (TRL's trainer does its own accelerate)")
    if args.accelerate and not args.train_only:
        ap.error("--accelerate needs --train-only (generation through FSDP/DeepSpeed wrappers is the trainer's job)")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    has_trl = importlib.util.find_spec("trl") is not None
    args.engine_used = "manual" if args.accelerate else (
        args.engine if args.engine != "auto" else ("trl" if has_trl else "manual"))
    if args.engine_used == "trl" and not has_trl:
        raise SystemExit("error: --engine trl but TRL is not installed; use --engine manual")
    shape = load_shape(args.model, args.layers, args.hidden, args.vocab)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    args.matmul = matmul_peak(device, dtype, args.matmul_size or (8192 if device == "cuda" else 512),
                              repeats=20 if device == "cuda" else 4)
    isolate = args.isolate if args.isolate != "auto" else ("process" if device == "cpu" and len(args.arms) > 1
                                                           else "none")
    if isolate == "process" and len(args.arms) > 1:
        results = [_arm_in_subprocess(name, argv) for name in args.arms]
    else:
        meter = Meter(device)
        results = [run_arm(arm, shape, args, device, meter) for arm in args.arm_specs]
    for r in results:
        r["memory_isolated"] = isolate == "process" or len(args.arms) == 1 or device == "cuda"
    by = {r["arm"]: r for r in results}
    card = torch.cuda.get_device_name(0) if device == "cuda" else f"{platform.processor() or 'CPU'}, " \
        f"{torch.get_num_threads()} torch threads"
    scaled = [f"{k} {v}" for k, v in (("layers", args.layers), ("hidden", args.hidden), ("vocab", args.vocab)) if v]
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "arm_specs", "matmul")}
    settings["lora_targets"] = list(args.lora_targets)
    report = {"model": shape.name + (f" scaled to {', '.join(scaled)}" if scaled else ""),
              "parameters": shape.parameters, "layers": shape.num_layers, "hidden": shape.hidden_size,
              "vocab": shape.vocab_size, "device": card, "engine": args.engine_used,
              "mode": "train-only" if args.train_only else "generate+train", "preset": args.preset,
              "matmul": args.matmul, "versions": versions(), "settings": settings, "arms": results,
              "vpo_over_grpo_per_token": (round(by["vpo"]["seconds_per_token"] / by["grpo"]["seconds_per_token"], 3)
                                          if {"vpo", "grpo"} <= set(by) else None),
              "torch": torch.__version__, "python": sys.version.split()[0]}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        report["gpu"] = {"name": props.name, "memory": props.total_memory,
                         "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count()}
    if _is_main_process():
        print(json.dumps(report, indent=2, default=str))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        _summary(report)
    return report


def _is_main_process() -> bool:
    """Rank 0 of an ``accelerate launch`` / torchrun run, or a plain run."""
    return os.environ.get("RANK", "0") == "0"


def _summary(report: Mapping[str, Any]) -> None:
    print(f"\n{report['model']} ({report['parameters'] / 1e6:.1f}M parameters) on {report['device']}, "
          f"engine {report['engine']}, {report['mode']}; {report['matmul']['dtype']} matmul "
          f"{report['matmul']['tflops']:.3g} TFLOP/s", file=sys.stderr)
    for r in report["arms"]:
        mfu = r["mfu"]["training"]
        print(f"  {r['arm']:<5} m={r['m']}: {r['seconds_per_step']:.3f} s/step (median of {r['steps']}: generation "
              f"{r['generation_seconds']:.3f}, scoring {r['scoring_seconds']:.3f}, training {r['training_seconds']:.3f}), "
              f"training MFU {mfu if mfu is not None else '-'}, peak {r['peak_memory'] / 2**20:.0f} MiB, "
              f"plan {r['plan_peak'] / 2**20:.0f} MiB (x{r['plan_over_measured']})", file=sys.stderr)
    if report["vpo_over_grpo_per_token"] is not None:
        print(f"  VPO / GRPO seconds per generated token: {report['vpo_over_grpo_per_token']}", file=sys.stderr)


if __name__ == "__main__":
    main()
