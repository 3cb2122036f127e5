"""Multi-answer format: instruction, robust parsing, de-duplication, padding and set scoring."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from vpo import answers as ans
from vpo.rewards import RewardError, VectorReward, score_set


def test_instruction_plain_and_chat() -> None:
    p = ans.add_instruction("Solve it.", 3)
    assert p.startswith("Solve it.\n") and "<answer_3>" in p and "genuinely different" in p
    chat = [{"role": "system", "content": "fmt"}, {"role": "user", "content": "Q?"}]
    out = ans.add_instruction(chat, 2)
    assert chat[1]["content"] == "Q?"  # not mutated
    assert out[0] == chat[0] and "ADDITIONAL INSTRUCTION" in out[1]["content"] and "<answer_2>" in out[1]["content"]
    with pytest.raises(ValueError, match="no user message"):
        ans.add_instruction([{"role": "system", "content": "x"}], 2)
    with pytest.raises(TypeError):
        ans.add_instruction(42, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ans.multi_answer_instruction(0)


def test_append_to_prompt_is_the_one_way_text_reaches_a_prompt() -> None:
    """Text prompts get the text after the separator; chat prompts at the end of the last user turn
    (a later assistant turn and the system turn untouched); the code task and goal conditioning use it."""
    assert ans.append_to_prompt("Q?  ", "T") == "Q?\n\nT"
    assert ans.append_to_prompt("Q?", "T", separator="\n") == "Q?\nT"
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}]
    out = ans.append_to_prompt(chat, "T", chat_label="NOTE: ")
    assert out == [chat[0], {"role": "user", "content": "Q?\n\nNOTE: T"}, chat[2]] and chat[1]["content"] == "Q?"
    with pytest.raises(ValueError, match="no user message to attach the goal to"):
        ans.append_to_prompt(chat[:1], "T", what="the goal")
    assert ans.numbered_tags(2, "x") == "<x_1>...</x_1>, <x_2>...</x_2>"
    with pytest.raises(ValueError, match="m must be >= 1"):
        ans.numbered_tags(0)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("think <answer_1>a</answer_1> <answer_2>b</answer_2> <answer_3>c</answer_3>", ["a", "b", "c"]),
        ("no tags at all", []),  # missing
        ("<answer_2>b</answer_2><answer_1>a</answer_1>", ["a", "b"]),  # out of order -> index order
        ("<answer_1>a</answer_1><answer_4>d</answer_4>", ["a"]),  # extra index beyond m
        ("<answer_1>a</answer_1><answer_1>z</answer_1>", ["a"]),  # repeated index: first wins
        ("<answer_1>a</answer_1><answer_2>truncated", ["a"]),  # unclosed
        ("<answer_1> </answer_1><answer_2>\n b \n</answer_2>", ["b"]),  # empty + whitespace
        ("<answer_1>x <answer_2>y</answer_2> z</answer_1>", ["y"]),  # nested: outer dropped, inner kept
        ("<answer_1>a</answer_2>", []),  # mismatched close
        ("<answer_1 >a</answer_1 >", ["a"]),
    ],
)
def test_parse_answers(text: str, expected: list[str]) -> None:
    assert ans.parse_answers(text, 3) == expected


def test_parse_answers_custom_tag_and_m() -> None:
    assert ans.parse_answers("<r_1>RD</r_1><r_2>DR</r_2>", 1, tag="r") == ["RD"]
    with pytest.raises(ValueError):
        ans.parse_answers("x", 0)


def test_parse_code_answers_tagged_and_fenced() -> None:
    tagged = "<answer_1>```python\nprint(1)\n```</answer_1><answer_2>print(2)</answer_2>"
    assert ans.parse_code_answers(tagged, 3) == ["print(1)", "print(2)"]
    fenced = "```python\na=1\n```\n---\n```python\nb=2\n```\n---\n```\nc=3\n```\n```py\nd=4\n```"
    assert ans.parse_code_answers(fenced, 3) == ["a=1", "b=2", "c=3"]


def test_ast_key_and_dedup() -> None:
    a = "def f(x):\n    return x+1  # comment\n"
    b = "def f( x ):\n\n    return (x + 1)\n"
    c = "def f(x):\n    return x+2\n"
    assert ans.python_ast_key(a) == ans.python_ast_key(b) != ans.python_ast_key(c)
    assert ans.python_ast_key("def (") == "txt:def ("
    assert ans.dedup([a, b, c], key=ans.python_ast_key) == [0, 2]
    assert ans.dedup(["x  y", "x y", "z"], key=ans.text_key) == [0, 2]
    assert ans.vector_key(np.array([np.nan, 1.0])) == ans.vector_key(np.array([np.nan, 1.0]))


def test_pad_rows_keeps_absent_dims_nan() -> None:
    rows = np.array([[1.0, np.nan]])
    out = ans.pad_rows(rows, 3, present=np.array([True, False]))
    assert out.shape == (3, 2)
    np.testing.assert_array_equal(out[1:, 0], [0.0, 0.0])
    assert np.isnan(out[:, 1]).all()
    with pytest.raises(ValueError, match="do not fit"):
        ans.pad_rows(np.zeros((4, 2)), 3)


class LetterReward(VectorReward):
    """Toy reward: dim j = 1 if answer contains letter j ('a', 'b', 'c'); dims beyond row['n'] absent."""

    names = ("a", "b", "c")

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        out = np.array([[float(ch in a) for ch in "abc"] for a in answers])
        out[:, ~self.present(row)] = np.nan
        return out

    def present(self, row: Mapping[str, Any]) -> np.ndarray:
        return np.arange(3) < row.get("n", 3)


def test_score_set_dedups_text_and_vectors_and_pads() -> None:
    r = LetterReward()
    text = "<answer_1>a</answer_1><answer_2>a </answer_2><answer_3>xa</answer_3>"
    s = score_set(r, text, {}, 3)
    # answer 2 is the same text, answer 3 has the same reward vector -> one distinct answer
    assert s.n_valid == 1 and s.answers == ("a",)
    np.testing.assert_array_equal(s.matrix, [[1, 0, 0], [0, 0, 0], [0, 0, 0]])
    s = score_set(r, "<answer_1>ab</answer_1><answer_2>c</answer_2>", {"n": 2}, 3)
    assert s.n_valid == 2
    assert np.isnan(s.matrix[:, 2]).all() and s.matrix[2, 0] == 0.0
    empty = score_set(r, "garbage", {}, 3)
    assert empty.n_valid == 0 and (empty.matrix == 0).all()


def test_single_answer_without_tags_is_taken_whole() -> None:
    assert LetterReward().parse("  abc ", 1) == ["abc"]
    assert LetterReward().parse("<answer_1>ab", 1) == []  # an unclosed tag is not a plain answer


class BadReward(LetterReward):
    def __init__(self, value: Any) -> None:
        self.value = value

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        return np.asarray(self.value, dtype=float)


@pytest.mark.parametrize(
    "value,match",
    [([[1.0, 0.0]], r"shape \(1, 2\), expected \(1, 3\)"), ([[1.0, np.inf, 0]], "not a finite number"),
     ([[1.0, np.nan, 0]], "dimension 1"), ([[1.5, 0, 0]], "in \\[0, 1\\]")],
)
def test_reward_contract_errors_name_the_problem(value: Any, match: str) -> None:
    with pytest.raises(RewardError, match=match):
        score_set(BadReward(value), "<answer_1>a</answer_1>", {}, 2, where="row 7")
