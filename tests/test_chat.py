"""Model-facing prompts: conversations for chat tokenizers, the old text for the char model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vpo.chat import has_chat_template, model_prompt, render_prompt, task_messages, tokenize_prompts
from vpo.generation import generate_batch, load_policy, sample
from vpo.search import ModelProposer
from vpo.sft import make_batch
from vpo.tasks import Task
from vpo.tasks.phrase import SYSTEM_PROMPT, PhraseTask
from vpo.tasks.route import RouteTask
from vpo.tiny import build_char_tokenizer, build_tiny_model

# a ChatML-like template written with characters the char tokenizer knows
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/]\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
CHARSET = PhraseTask().charset


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chat_tok() -> Any:
    tok = build_char_tokenizer(CHARSET)
    tok.chat_template = TEMPLATE
    return tok


def test_char_model_prompts_are_unchanged() -> None:
    """Without a chat template every prompt is exactly task.format_prompt (byte for byte)."""
    tok = build_char_tokenizer(CHARSET)
    assert not has_chat_template(tok)
    route, phrase = RouteTask(n_train=3, n_test=3), PhraseTask(n_train=3, n_test=3)
    for task in (route, phrase):
        for row in task.load("test"):
            for m in (1, 3):
                assert model_prompt(task, row, m, tok) == task.format_prompt(row, m)
                assert model_prompt(task, row, m, tok, render=True) == task.format_prompt(row, m)
    assert model_prompt(route, route.load("test")[0], 3, tok).endswith("\n?3>")


def test_chat_prompt_has_system_turn_and_instruction_in_user_turn() -> None:
    tok = chat_tok()
    task = PhraseTask(n_train=2, n_test=2)
    row = task.load("test")[0]
    msgs = model_prompt(task, row, 3, tok)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"] == SYSTEM_PROMPT
    assert msgs[1]["content"] == task.format_prompt(row, 3)
    assert msgs[1]["content"].startswith(row["prompt"]) and "<answer_3>...</answer_3>" in msgs[1]["content"]
    text = model_prompt(task, row, 1, tok, render=True)
    assert text == (f"[system]{SYSTEM_PROMPT}[/]\n[user]{row['prompt']}\n"
                    "Give your final answer inside <answer_1></answer_1>.[/]\n[assistant]")
    # the route task has no system prompt: one user turn with its compact prompt
    route = RouteTask(n_train=2, n_test=2)
    rrow = route.load("test")[0]
    assert task_messages(route, rrow, 3) == [{"role": "user", "content": f"{rrow['prompt']}\n?3>"}]


def test_chat_rows_and_custom_messages() -> None:
    tok = chat_tok()
    task = PhraseTask(n_train=2, n_test=2)
    row = {**task.load("test")[0], "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    msgs = model_prompt(task, row, 2, tok)
    assert msgs[0] == {"role": "system", "content": "S"}  # the row's own system turn wins
    assert msgs[1]["content"].startswith("U\n\nADDITIONAL INSTRUCTION: Give 2 genuinely")

    class Custom(PhraseTask):
        def chat_messages(self, row: Any, m: int) -> list[dict[str, Any]]:
            return [{"role": "user", "content": f"custom {m}"}]

    assert model_prompt(Custom(n_train=2, n_test=2), row, 2, tok, render=True) == "[user]custom 2[/]\n[assistant]"

    class NoUser(PhraseTask):
        def chat_messages(self, row: Any, m: int) -> list[dict[str, Any]]:
            return [{"role": "system", "content": "x"}]

    with pytest.raises(ValueError, match="no user turn"):
        model_prompt(NoUser(n_train=2, n_test=2), row, 2, tok)
    with pytest.raises(ValueError, match="chat template"):
        render_prompt([{"role": "user", "content": "x"}], build_char_tokenizer(CHARSET))


def test_base_task_default_messages_wrap_format_prompt() -> None:
    class Plain(Task):
        name = "plain"

        def __init__(self) -> None:
            from vpo.rewards import VectorReward

            self.reward = VectorReward()

    msgs = task_messages(Plain(), {"id": "x", "prompt": "Say hi."}, 1)
    assert msgs == [{"role": "user", "content": "Say hi.\nGive your final answer inside <answer_1></answer_1>."}]


def test_rendered_prompts_get_no_second_bos() -> None:
    tok = chat_tok()
    conv = [{"role": "user", "content": "hi"}]
    plain = tokenize_prompts(tok, ["hi"])["input_ids"][0]
    chat = tokenize_prompts(tok, [conv])["input_ids"][0]
    assert plain[0] == tok.bos_token_id  # the char tokenizer adds BOS to plain text
    assert chat == tok(render_prompt(conv, tok), add_special_tokens=False)["input_ids"]
    assert tok.bos_token_id not in chat
    with pytest.raises(ValueError, match="mixing"):
        tokenize_prompts(tok, ["hi", conv])
    # the warm-up batches tokenize rendered prompts the same way
    batch = make_batch(tok, [render_prompt(conv, tok)], ["<answer_1>x</answer_1>"], prompt_special_tokens=False)
    assert batch["input_ids"][0, : len(chat)].tolist() == chat


def test_sampling_accepts_conversations(tmp_path) -> None:
    path = build_tiny_model(tmp_path / "m", CHARSET, seed=0, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model, tok = load_policy(path)
    tok.chat_template = TEMPLATE
    convs = [[{"role": "user", "content": "ab"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "c"}]]
    gen = generate_batch(model, tok, convs, n=2, max_new_tokens=3, temperature=0.0)
    expect = tok([render_prompt(c, tok) for c in convs], add_special_tokens=False, padding=True,
                 return_tensors="pt")["input_ids"]
    assert torch.equal(gen.prompt_ids[::2], expect)
    a = sample(model, tok, convs, n=2, max_new_tokens=5, temperature=1.0, seed=3)
    assert len(a) == 2 and all(len(x) == 2 for x in a)
    assert a == sample(model, tok, convs, n=2, max_new_tokens=5, temperature=1.0, seed=3)


def test_model_proposer_wraps_plain_prompts_for_chat_models() -> None:
    tok = chat_tok()
    seen: list[Any] = []

    def fake(model: Any, tk: Any, prompts: list[Any], *args: Any, **kw: Any) -> list[list[str]]:
        seen.append(prompts)
        return [["ok"] for _ in prompts]

    prop = ModelProposer("/ckpt", sample_fn=fake, load=False, tokenizer=tok, chat=True, system_message="S")
    assert prop.propose(["q1"], seed=0) == ["ok"]
    assert seen[-1] == ["[system]S[/]\n[user]q1[/]\n[assistant]"]
    ModelProposer("/ckpt", sample_fn=fake, load=False, tokenizer=tok, chat=False).propose(["q1"], seed=0)
    assert seen[-1] == ["q1"]
    # the default sampler gets the conversation itself (it renders without a second BOS)
    calls: list[Any] = []

    def default_like(model: Any, tk: Any, prompts: list[Any], *args: Any, **kw: Any) -> list[list[str]]:
        calls.append(prompts)
        return [["x"] for _ in prompts]

    auto = ModelProposer("/ckpt", load=False, tokenizer=tok)
    auto._sample_fn = default_like  # what _resolve would install, keeping the default-sampler path
    auto.propose(["q2"], seed=1)
    assert calls[-1] == [[{"role": "user", "content": "q2"}]]
