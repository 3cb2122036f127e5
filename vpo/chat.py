"""Model-facing prompts: chat models get conversations, plain models get text.

Every stage (training dataset, evaluation and search sampling, the supervised warm-up) turns a
task row into a prompt through :func:`model_prompt`, so all of them see the same thing:

* tokenizer **with** a chat template: a list of ``{"role", "content"}`` messages, from the task's
  ``chat_messages(row, m)`` when it has one (a system prompt, few-shot turns, ...), else one user
  turn holding ``task.format_prompt(row, m)``. Either way the m-answer instruction sits inside the
  last user turn. ``render=True`` returns the template's text with the generation prompt (what
  sampling feeds the model); TRL gets the messages and renders them itself the same way.
* tokenizer **without** one (the embedded char model, base models): ``task.format_prompt(row, m)``
  unchanged.

A rendered template already holds the special tokens it needs, so it is tokenized with
``add_special_tokens=False`` (:func:`tokenize_prompts`), as TRL does; otherwise a BOS-adding
tokenizer would put a second BOS in front.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "Messages",
    "default_messages",
    "has_chat_template",
    "is_conversation",
    "model_prompt",
    "render_prompt",
    "task_messages",
    "tokenize_prompts",
]

Messages = list[dict[str, Any]]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` renders conversations (a non-empty ``chat_template``)."""
    return bool(getattr(tokenizer, "chat_template", None))


def is_conversation(prompt: Any) -> bool:
    """A list of role/content mappings (what TRL calls a conversational prompt)."""
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(msg, Mapping) and "role" in msg and "content" in msg for msg in prompt)


def _check_messages(messages: Any, where: str) -> Messages:
    if not is_conversation(messages):
        raise TypeError(f"{where}: expected a list of {{'role', 'content'}} messages, got {type(messages).__name__}")
    out = [dict(msg) for msg in messages]
    if not any(msg["role"] == "user" for msg in out):
        raise ValueError(f"{where}: the conversation has no user turn")
    return out


def default_messages(task: Any, row: Mapping[str, Any], m: int) -> Messages:
    """The conversation for tasks without their own ``chat_messages``: the task's
    ``system_prompt`` (if it has one and the row's prompt has no system turn) then the user turn
    ``task.format_prompt(row, m)``; a row whose prompt is already a conversation is formatted as
    one (the task appends the instruction to its last user turn)."""
    prompt = row["prompt"]
    where = f"task {getattr(task, 'name', '?')!r}, row {row.get('id', '?')!r}"
    if is_conversation(prompt):
        messages = _check_messages(task.format_prompt(row, m), where)
    else:
        text = task.format_prompt(row, m)
        if not isinstance(text, str):
            return _check_messages(text, where)
        messages = [{"role": "user", "content": text}]
    system = getattr(task, "system_prompt", None)
    if system and not any(msg["role"] == "system" for msg in messages):
        messages.insert(0, {"role": "system", "content": str(system)})
    return messages


def task_messages(task: Any, row: Mapping[str, Any], m: int) -> Messages:
    """The conversational prompt of ``row`` asking for m answers (see the module docstring)."""
    custom = getattr(task, "chat_messages", None)
    if callable(custom):
        return _check_messages(custom(row, m), f"{type(task).__name__}.chat_messages (row {row.get('id', '?')!r})")
    return default_messages(task, row, m)


def render_prompt(prompt: str | Messages, tokenizer: Any) -> str:
    """The text a model is fed: a conversation rendered by the tokenizer's chat template with the
    generation prompt (the assistant turn opened); plain text unchanged."""
    if isinstance(prompt, str):
        return prompt
    if not has_chat_template(tokenizer):
        raise ValueError("a conversational prompt needs a tokenizer with a chat template "
                         "(tokenizer.chat_template is empty)")
    return str(tokenizer.apply_chat_template(_check_messages(prompt, "prompt"), tokenize=False,
                                             add_generation_prompt=True))


def model_prompt(task: Any, row: Mapping[str, Any], m: int, tokenizer: Any, *, render: bool = False
                 ) -> str | Messages:
    """The one prompt builder every stage uses: messages (or, with ``render``, their rendered
    text) for tokenizers with a chat template, ``task.format_prompt(row, m)`` otherwise."""
    if not has_chat_template(tokenizer):
        return task.format_prompt(row, m)
    messages = task_messages(task, row, m)
    return render_prompt(messages, tokenizer) if render else messages


def tokenize_prompts(tokenizer: Any, prompts: Sequence[str | Messages], **kwargs: Any) -> dict[str, Any]:
    """Tokenize prompts for generation: conversations are rendered and tokenized without added
    special tokens (the template has them), plain text with them. One kind per call."""
    conv = [not isinstance(p, str) for p in prompts]
    if any(conv) and not all(conv):
        raise ValueError("mixing plain-text and conversational prompts in one call is not supported")
    if any(conv):
        texts = [render_prompt(p, tokenizer) for p in prompts]
        return tokenizer(texts, add_special_tokens=False, **kwargs)
    return tokenizer(list(prompts), **kwargs)
