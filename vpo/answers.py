"""The multi-answer rollout format: instruct, parse, de-duplicate and pad a set of m answers.

One VPO rollout is a shared prefix followed by m numbered answers, ``<answer_1>..</answer_1>`` etc.
(VPO_SPEC section 1.2). Parsing is deliberately strict about structure (an unclosed or
nested tag does not count as an answer) and lenient about whitespace, so that a truncated
or malformed rollout scores what it actually delivered and nothing more.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

DEFAULT_TAG = "answer"

ChatPrompt = list[dict[str, Any]]


def numbered_tags(m: int, tag: str = DEFAULT_TAG) -> str:
    """``<tag_1>...</tag_1>, ..., <tag_m>...</tag_m>``: the numbered answer tags of an m-answer format."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    return ", ".join(f"<{tag}_{i}>...</{tag}_{i}>" for i in range(1, m + 1))


def multi_answer_instruction(m: int, tag: str = DEFAULT_TAG) -> str:
    """The instruction appended to a prompt asking for m genuinely different answers in numbered tags."""
    tags = numbered_tags(m, tag)
    if m == 1:
        return f"Give your final answer inside <{tag}_1></{tag}_1>."
    return (
        f"Give {m} genuinely different answers, each one complete on its own, "
        f"in numbered tags: {tags}. Later answers should differ from earlier ones."
    )


def append_to_prompt(prompt: str | ChatPrompt, text: str, *, separator: str = "\n\n", chat_label: str = "",
                     what: str = "the text") -> str | ChatPrompt:
    """``prompt`` with ``text`` appended: a text prompt after ``separator``; a chat prompt (a list of
    role/content dicts) at the end of its last user message, after a blank line and ``chat_label``.
    The input is never mutated; ``what`` names the text in the error for a chat without a user turn."""
    if isinstance(prompt, str):
        return f"{prompt.rstrip()}{separator}{text}"
    if not isinstance(prompt, list) or not all(isinstance(msg, Mapping) for msg in prompt):
        raise TypeError(f"prompt must be a str or a list of chat messages, got {type(prompt).__name__}")
    messages = [dict(msg) for msg in prompt]
    for msg in reversed(messages):
        if msg.get("role") == "user":
            msg["content"] = f"{str(msg.get('content', '')).rstrip()}\n\n{chat_label}{text}"
            return messages
    raise ValueError(f"chat prompt has no user message to attach {what} to")


def add_instruction(prompt: str | ChatPrompt, m: int, tag: str = DEFAULT_TAG) -> str | ChatPrompt:
    """Return ``prompt`` with the m-answer instruction added.

    Plain prompts get the instruction on a new line. Chat prompts (a list of role/content
    dicts) get it appended to the last user message, as an "ADDITIONAL INSTRUCTION" so that a
    format spec living in the system prompt stays authoritative (VPO_SPEC 1.2, ToolRL).
    The input is never mutated.
    """
    return append_to_prompt(prompt, multi_answer_instruction(m, tag), separator="\n",
                            chat_label="ADDITIONAL INSTRUCTION: ", what="the multi-answer instruction")


def parse_answers(text: str, m: int, tag: str = DEFAULT_TAG) -> list[str]:
    """Extract answers ``<tag_i>...</tag_i>`` for i in 1..m, in index order.

    Rules: indices outside 1..m are ignored (extra answers); the first occurrence of an index
    wins; an opening tag without its closing tag does not count (unclosed = truncated); an
    answer whose content contains another answer tag is malformed (nested) and dropped while
    the inner one is still parsed; empty or whitespace-only answers are dropped. Returns the
    stripped contents, at most m of them.
    """
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    t = re.escape(tag)
    any_tag = re.compile(rf"</?{t}_\d+\s*>")
    found: dict[int, str] = {}
    for match in re.finditer(rf"<{t}_(\d+)\s*>(.*?)</{t}_\1\s*>", text, flags=re.DOTALL):
        _consider(found, match, any_tag, m)
    # Nested answers are swallowed by the outer non-greedy match; parse inside dropped ones.
    for match in re.finditer(rf"<{t}_(\d+)\s*>", text):
        idx = int(match.group(1))
        if idx in found or not 1 <= idx <= m:
            continue
        inner = re.compile(rf"<{t}_{idx}\s*>(.*?)</{t}_{idx}\s*>", flags=re.DOTALL).match(text, match.start())
        if inner is not None and not any_tag.search(inner.group(1)):
            content = inner.group(1).strip()
            if content:
                found[idx] = content
    return [found[i] for i in sorted(found)]


def _consider(found: dict[int, str], match: re.Match[str], any_tag: re.Pattern[str], m: int) -> None:
    idx = int(match.group(1))
    content = match.group(2)
    if not 1 <= idx <= m or idx in found or any_tag.search(content):
        return
    content = content.strip()
    if content:
        found[idx] = content


_PY_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", flags=re.DOTALL)


def parse_code_answers(text: str, m: int, tag: str = DEFAULT_TAG) -> list[str]:
    """Extract up to m Python programs: one fenced block per numbered answer tag if tags are
    present, otherwise fenced blocks in order (the LiveCodeBench ``---``-separated layout)."""
    tagged = parse_answers(text, m, tag)
    sources = tagged if tagged else [text]
    programs: list[str] = []
    for src in sources:
        blocks = _PY_BLOCK.findall(src)
        if tagged:
            code = blocks[0] if blocks else src
            if code.strip():
                programs.append(code.strip("\n"))
        else:
            programs.extend(b.strip("\n") for b in blocks if b.strip())
    return programs[:m]


def python_ast_key(code: str) -> str:
    """A key equal for programs with the same AST (comments, formatting and docstring-free
    whitespace differences vanish). Unparseable code keys on its stripped text."""
    try:
        return "ast:" + ast.dump(ast.parse(code), annotate_fields=False, include_attributes=False)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "txt:" + code.strip()


def dedup(items: Sequence[Any], key: Callable[[Any], Hashable] = lambda x: x) -> list[int]:
    """Indices of the first occurrence of each distinct ``key(item)``, in order."""
    seen: set[Hashable] = set()
    keep: list[int] = []
    for i, item in enumerate(items):
        k = key(item)
        if k not in seen:
            seen.add(k)
            keep.append(i)
    return keep


def text_key(answer: str) -> str:
    """Identical-text key: whitespace runs collapsed, ends stripped."""
    return " ".join(answer.split())


def vector_key(row: np.ndarray) -> tuple[float | None, ...]:
    """Identical-reward key; an absent (NaN) dimension keys as None so two NaNs compare equal."""
    return tuple(None if np.isnan(v) else round(float(v), 12) for v in np.asarray(row, dtype=float))


def pad_rows(rows: np.ndarray, m: int, present: np.ndarray | None = None) -> np.ndarray:
    """Pad an (n, d) matrix with zero rows to (m, d); absent dimensions (``present`` False) stay
    NaN in the padding so they never enter a scalarisation. Rows beyond m are an error."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"expected an (n, d) matrix, got shape {rows.shape}")
    n, d = rows.shape
    if n > m:
        raise ValueError(f"{n} answers do not fit in a set of m={m}")
    pad = np.zeros((m - n, d))
    if present is not None:
        present = np.asarray(present, dtype=bool)
        if present.shape != (d,):
            raise ValueError(f"present mask has shape {present.shape}, expected ({d},)")
        pad[:, ~present] = np.nan
    return np.concatenate([rows, pad], axis=0)
