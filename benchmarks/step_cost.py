"""What one RL step costs against what this CPU can do: matmul throughput, the step's FLOPs, the ratio.

Runs a few :class:`vpo.trainer.VPOTrainer` steps of a saved causal LM (e.g. the chat pipeline's warmed
SmolLM2 base) on the phrase task and splits every step into phases by timing the trainer's own
methods: generation (``_generate_single_turn``), log-prob forward passes (loss, old or reference
log-probs), backward, optimizer and the rest (reward scoring, data, logging). Each phase's FLOPs are
counted from the model's shapes and the token counts of that step (executed: what the padded tensors
cost; useful: real prompt and completion tokens only), and set against the best float32 and bfloat16
matmul rates torch reaches on this machine with the same thread count (the two ceilings: a float32
step can at best reach the first; bf16 matmuls, where the CPU has avx512_bf16 or AMX, the second).

Timings are CPU seconds of this process (``time.process_time``) as well as wall seconds: with one
torch thread the CPU time of the step does not grow when other jobs share the cores, so the ratio
stays meaningful on a busy machine (the wall-clock figures are printed too, with the load average).

    python benchmarks/step_cost.py --model runs/chat-smollm2/base --steps 4 --threads 1 --lora

``--dtype bfloat16`` loads the frozen base in bf16 (LoRA adapters and their optimizer state stay
float32); ``--profile FILE`` writes torch's profile of the generation round of the first measured step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

# -------------------------------------------------------------------------------- matmul ceiling


def matmul_rate(threads: int, shapes: list[tuple[int, int, int]], seconds: float = 1.0,
                dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """GFLOP per CPU second and per wall second of ``a @ b`` in ``dtype`` for each (M, K, N)."""
    torch.set_num_threads(threads)
    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        for _ in range(3):
            a @ b
        flop = 2.0 * m * k * n
        reps, w0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - w0 < seconds or reps < 3:
            a @ b
            reps += 1
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        out[f"{m}x{k}x{n}"] = {"gflop_per_cpu_s": flop * reps / cpu / 1e9 / threads,
                               "gflop_per_wall_s": flop * reps / wall / 1e9}
    return out


# -------------------------------------------------------------------------------- FLOP model


def flop_model(config: Any) -> dict[str, float]:
    """Per-token matmul FLOPs of a decoder-only transformer (forward): layers, LM head, attention."""
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", heads) * head_dim
    inter = config.intermediate_size
    per_layer = h * heads * head_dim + 2 * h * kv + heads * head_dim * h + 3 * h * inter
    return {"layers": 2.0 * config.num_hidden_layers * per_layer, "lm_head": 2.0 * config.vocab_size * h,
            "attn_per_ctx": 4.0 * config.num_hidden_layers * heads * head_dim}


def forward_flops(fm: Mapping[str, float], tokens: float, ctx_sum: float, head_tokens: float) -> float:
    """FLOPs of a forward pass over ``tokens`` positions whose attention spans sum to ``ctx_sum``,
    with the LM head applied to ``head_tokens`` positions."""
    return fm["layers"] * tokens + fm["attn_per_ctx"] * ctx_sum + fm["lm_head"] * head_tokens


# -------------------------------------------------------------------------------- phase timing


class Phases:
    """Accumulates CPU and wall seconds per named phase, and per-step token counts."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any], after: Callable[..., None] | None = None,
             before: Callable[[], None] | None = None) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before()
            c0, w0 = time.process_time(), time.perf_counter()
            out = fn(*args, **kwargs)
            self.cpu[name] += time.process_time() - c0
            self.wall[name] += time.perf_counter() - w0
            if after is not None:
                after(out, *args, **kwargs)
            return out

        return timed

    def take(self) -> dict[str, Any]:
        snap = {"cpu": dict(self.cpu), "wall": dict(self.wall), "counts": dict(self.counts)}
        self.cpu.clear(), self.wall.clear(), self.counts.clear()
        return snap


def _distinct(prompts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    return list(dict.fromkeys(prompts))


def _profiled(fn: Callable[..., Any], path: str, call: int = 2) -> Callable[..., Any]:
    """``fn``, whose ``call``-th call (the first measured step's generation round) runs under torch's
    profiler; the operator table (by self CPU time) is written to ``path``."""
    count = [0]

    def run(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] != call:
            return fn(*args, **kwargs)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fn(*args, **kwargs)
        Path(path).write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
        return out

    return run


def instrument(trainer: Any, phases: Phases, fm: Mapping[str, float], profile: str | None = None) -> None:
    """Time the trainer's generation, log-prob passes, backward, optimizer and reward scoring, and
    add up each pass's FLOPs: ``executed`` (the padded tensors that ran: in generation counted call by
    call, so rows that left the batch and masked cache positions are as they ran; in the log-prob passes
    every row's prompt under TRL's path, each distinct prompt once under the shared-prefix path) and
    ``useful`` (each distinct prompt once and every completion, without padding)."""
    shared = trainer._share_prefix() if hasattr(trainer, "_share_prefix") else False

    executed: list[float] = []  # FLOPs of the forward calls inside the current generation round

    def count_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """What one forward call during generation executes: its tokens, each query's attention span
        (the whole preallocated cache when it is a static one: masked positions are computed too) and
        the LM head rows it keeps."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not executed or ids is None:
            return
        b, q = ids.shape
        cache = kwargs.get("past_key_values")
        past = int(cache.get_seq_length()) if cache is not None else 0
        lengths = {getattr(layer, "max_cache_len", None) for layer in getattr(cache, "layers", [])} - {None}
        span = b * q * max(lengths) if lengths else b * sum(past + j + 1 for j in range(q))
        keep = kwargs.get("logits_to_keep") or q
        executed[0] += forward_flops(fm, b * q, span, b * min(int(keep), q))

    causal_lm = trainer.accelerator.unwrap_model(trainer.model)
    causal_lm = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm
    causal_lm.register_forward_pre_hook(count_forward, with_kwargs=True)

    def before_generate() -> None:
        executed[:] = [0.0]

    def after_generate(out: Any, prompt_ids: Any, *args: Any, **kwargs: Any) -> None:
        lengths = [len(c) for c in out[0]]
        prompts = [tuple(p) for p in prompt_ids]
        distinct = _distinct(prompts)
        useful = sum(forward_flops(fm, len(x), len(x) * (len(x) + 1) / 2, 0) for x in distinct) + sum(
            forward_flops(fm, c, sum(len(x) + t for t in range(c)), c) for x, c in zip(prompts, lengths))
        phases.counts["generate"] += executed[0] if executed else 0.0
        phases.counts["generate_useful"] += useful
        phases.counts["completion_tokens"] += sum(lengths)
        executed.clear()

    def after_logps(out: Any, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int,
                    *args: Any, **kwargs: Any) -> None:
        b, t = input_ids.shape
        c = logits_to_keep
        p = t - c
        rows = [tuple(r[m.bool()].tolist()) for r, m in zip(input_ids[:, :p], attention_mask[:, :p])]
        distinct = _distinct(rows)
        u = len(distinct)
        if shared and u < b:
            ex = forward_flops(fm, u * (p - 1), u * (p - 1) * p / 2, 0) + forward_flops(
                fm, b * (c + 1), b * sum(range(p, t + 1)), b * c)
        else:
            ex = forward_flops(fm, b * t, b * t * (t + 1) / 2, b * c)
        lengths = attention_mask[:, p:].sum(1).tolist()
        useful = sum(forward_flops(fm, len(x), len(x) * (len(x) + 1) / 2, 0) for x in distinct) + sum(
            forward_flops(fm, n, sum(len(x) + j for j in range(1, n + 1)), n) for x, n in zip(rows, lengths))
        phases.counts["logp_forward"] += ex
        phases.counts["logp_forward_useful"] += useful
        if torch.is_grad_enabled():  # this pass is backpropagated
            phases.counts["grad_forward"] += ex
            phases.counts["grad_forward_useful"] += useful

    generate = trainer._generate_single_turn
    if profile is not None:
        generate = _profiled(generate, profile)
    trainer._generate_single_turn = phases.wrap("generate", generate, after_generate, before_generate)
    trainer._get_per_token_logps_and_entropies = phases.wrap(
        "logp_forward", trainer._get_per_token_logps_and_entropies, after_logps)
    trainer._calculate_rewards = phases.wrap("rewards", trainer._calculate_rewards)
    trainer.accelerator.backward = phases.wrap("backward", trainer.accelerator.backward)


class OptimizerTimer:
    """A transformers callback pair around the optimizer step (``on_pre_optimizer_step`` ->
    ``on_optimizer_step``) and the step's total time (``on_step_begin`` -> ``on_step_end``)."""

    def __init__(self, phases: Phases, steps: list[dict[str, Any]]) -> None:
        from transformers import TrainerCallback

        outer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, *a: Any, **k: Any) -> None:
                outer.t0 = (time.process_time(), time.perf_counter())

            def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
                outer.o0 = (time.process_time(), time.perf_counter())

            def on_optimizer_step(self, *a: Any, **k: Any) -> None:
                phases.cpu["optimizer"] += time.process_time() - outer.o0[0]
                phases.wall["optimizer"] += time.perf_counter() - outer.o0[1]

            def on_step_end(self, *a: Any, **k: Any) -> None:
                rec = phases.take()
                rec["step_cpu"] = time.process_time() - outer.t0[0]
                rec["step_wall"] = time.perf_counter() - outer.t0[1]
                steps.append(rec)

        self.callback = _CB()


def step_flops(rec: Mapping[str, Any], trainable_fraction: float) -> dict[str, float]:
    """Executed and useful FLOPs of one step by phase; backward = the backpropagated forward's FLOPs
    once for activation gradients plus once x the trainable share of the weights for weight gradients
    (the usual 6 N D of full training = 2 forward + 4 backward)."""
    c = rec["counts"]
    bwd = 1.0 + 1.0 * trainable_fraction
    return {"generate": c.get("generate", 0.0), "generate_useful": c.get("generate_useful", 0.0),
            "logp_forward": c.get("logp_forward", 0.0), "logp_forward_useful": c.get("logp_forward_useful", 0.0),
            "backward": bwd * c.get("grad_forward", 0.0), "backward_useful": bwd * c.get("grad_forward_useful", 0.0)}


# -------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vpo.chat import model_prompt
    from vpo.tasks.phrase import PhraseTask
    from vpo.trainer import VPOConfig, VPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    task = PhraseTask(n_train=max(64, args.prompts * (args.steps + 1)), n_test=8, seed=0)
    rows = task.load("train")
    data = Dataset.from_list([{**r, "prompt": model_prompt(task, r, args.m, tok)} for r in rows])
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
    rollouts = args.prompts * args.generations
    micro = args.micro_batch or rollouts
    if rollouts % micro:
        raise SystemExit(f"--micro-batch {micro} must divide the {rollouts} rollouts of a step")
    cfg = VPOConfig(output_dir=str(Path(args.out) / "trainer"), bf16=False, use_cpu=True,
                    gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1,
                    dataloader_pin_memory=False, per_device_train_batch_size=micro,
                    gradient_accumulation_steps=rollouts // micro,
                    num_generations=args.generations, max_completion_length=args.max_completion_length,
                    max_steps=args.steps + 1, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                    beta=0.0, temperature=1.0, seed=0, data_seed=0, estimator=args.estimator,
                    num_answers=args.m, num_weights=100, disable_tqdm=True)
    steps: list[dict[str, Any]] = []
    phases = Phases()
    timer = OptimizerTimer(phases, steps)
    trainer_class = VPOTrainer
    if not hasattr(cfg, "share_prompt_prefix"):  # a VPOTrainer without the setting: mix it in here
        from vpo.shared_prefix import SharedPrefixMixin

        trainer_class = type("SharedPrefixVPOTrainer", (SharedPrefixMixin, VPOTrainer), {})
    cfg.share_prompt_prefix = args.shared_prefix
    trainer = trainer_class(model=model, reward=task.reward, args=cfg, train_dataset=data, processing_class=tok,
                         callbacks=[timer.callback], peft_config=peft_config)
    fm = flop_model(model.config)
    instrument(trainer, phases, fm, args.profile)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    # weight gradients cost about one forward per trainable weight: the trainable share of the matmul weights
    matmul_params = fm["layers"] / 2 + fm["lm_head"] / 2
    frac = 1.0 if not args.lora else min(1.0, trainable / matmul_params)
    load0 = os.getloadavg()
    trainer.train()
    measured = steps[1:]  # the first step warms up allocators and kernels
    out_steps = []
    for rec in measured:
        fl = step_flops(rec, frac)
        out_steps.append({**rec, "flops": fl})
    return {"steps": out_steps, "trainable_params": trainable, "total_params": total, "trainable_fraction": frac,
            "flop_model": fm, "load_before": load0, "load_after": os.getloadavg()}


def summarise(res: Mapping[str, Any], ceilings: Mapping[str, float]) -> str:
    """A markdown table: per phase CPU seconds, GFLOP, GFLOP per CPU second and the ratio to each of
    ``ceilings`` (name -> GFLOP per CPU second: the float32 and bfloat16 matmul ceilings)."""
    steps = res["steps"]
    names = list(ceilings)
    lines = ["| phase | CPU s/step | wall s/step | GFLOP/step executed (useful) | GFLOP/CPU-s | "
             + " | ".join(f"of {n} ceiling" for n in names) + " |", "|---|---|---|---|---|" + "---|" * len(names)]
    total_cpu = statistics.median(s["step_cpu"] for s in steps)
    total_flop = statistics.median(sum(v for k, v in s["flops"].items() if not k.endswith("_useful")) for s in steps)
    total_useful = statistics.median(sum(v for k, v in s["flops"].items() if k.endswith("_useful")) for s in steps)
    for ph in ("generate", "logp_forward", "backward", "optimizer", "rewards"):
        cpu = statistics.median(s["cpu"].get(ph, 0.0) for s in steps)
        wall = statistics.median(s["wall"].get(ph, 0.0) for s in steps)
        fl = statistics.median(s["flops"].get(ph, 0.0) for s in steps)
        fu = statistics.median(s["flops"].get(f"{ph}_useful", 0.0) for s in steps)
        flop_cell = f"{fl / 1e9:.1f} ({fu / 1e9:.1f})" if fl else "-"
        if fl and cpu > 0:
            rate = fl / cpu / 1e9
            rate_cells = f"{rate:.1f} | " + " | ".join(f"{rate / c:.0%}" for c in ceilings.values())
        else:
            rate_cells = "- | " + " | ".join("-" for _ in names)
        lines.append(f"| {ph} | {cpu:.2f} | {wall:.2f} | {flop_cell} | {rate_cells} |")
    other = total_cpu - statistics.median(sum(s["cpu"].values()) for s in steps)
    lines.append(f"| other | {other:.2f} | | | |" + " |" * len(names))
    rate = total_flop / total_cpu / 1e9
    urate = total_useful / total_cpu / 1e9
    lines.append(f"| **step** | {total_cpu:.2f} | {statistics.median(s['step_wall'] for s in steps):.2f} | "
                 f"{total_flop / 1e9:.1f} ({total_useful / 1e9:.1f}) | {rate:.1f} (useful {urate:.1f}) | "
                 + " | ".join(f"{rate / c:.0%} (useful {urate / c:.0%})" for c in ceilings.values()) + " |")
    tokens = statistics.median(s["counts"].get("completion_tokens", 0.0) for s in steps)
    lines.append(f"\n{tokens:.0f} completion tokens per step (median)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a saved causal LM folder (e.g. the chat pipeline's base/)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (one more warms up first)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--generations", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--m", type=int, default=3, help="answers per rollout")
    ap.add_argument("--micro-batch", type=int, default=8,
                    help="rollouts per forward/backward (TRL's per_device_train_batch_size; the step accumulates "
                         "gradients over rollouts / micro-batch of them, generated in one round)")
    ap.add_argument("--estimator", default="vpo")
    ap.add_argument("--max-completion-length", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters (r=--lora-r) instead of every weight")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                    help="run each distinct prompt once in generation and in the loss (vpo.shared_prefix)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the frozen base's dtype (LoRA adapters and their optimizer state stay float32)")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="write torch's profile (operators by self CPU time) of the first measured generation round")
    ap.add_argument("--out", default="runs/bench-step-cost")
    ap.add_argument("--json", default=None, help="write the full results here")
    args = ap.parse_args(argv)
    shapes = [(2048, 2048, 2048), (args.prompts * args.generations, 576, 1536), (1024, 576, 1536)]
    ceil = {name: matmul_rate(args.threads, shapes, dtype=getattr(torch, name)) for name in ("float32", "bfloat16")}
    ceilings = {name: max(v["gflop_per_cpu_s"] for v in rates.values()) for name, rates in ceil.items()}
    res = run(args)
    res["matmul"] = ceil
    res["ceilings_gflop_per_cpu_s"] = ceilings
    res["command"] = "python benchmarks/step_cost.py " + " ".join(sys.argv[1:] if argv is None else argv)
    for name, rates in ceil.items():
        print(f"matmul {name}, {args.threads} thread(s): " + ", ".join(
            f"{k}: {v['gflop_per_cpu_s']:.1f} GFLOP/CPU-s ({v['gflop_per_wall_s']:.1f}/wall-s)" for k, v in rates.items()))
    print(f"trainable parameters {res['trainable_params']:,} of {res['total_params']:,}; base {args.dtype}; load "
          f"{res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}")
    print(summarise(res, ceilings))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float))


if __name__ == "__main__":
    main()
