"""Reads ``problems.yaml``, the embedded code problems as written, into checked :class:`ProblemSpec` s.

A bad entry is one error naming the file, the line of the offending key and the problem's id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = ["SOURCE", "ProblemSourceError", "ProblemSpec", "load_problems"]

SOURCE = Path(__file__).with_name("problems.yaml")


class ProblemSourceError(ValueError):
    """An entry of the problem file that cannot be built, with its file and line."""


class ProblemSpec(BaseModel):
    """One problem as written: a call problem has an ``entry_point`` and ``starter``, a stdin/stdout
    problem neither; ``tests`` is a Python expression of ``r`` giving the test inputs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9]+(-[a-z0-9]+)*$")
    title: str = Field(min_length=1)
    difficulty: Literal["easy", "medium", "hard"]
    tags: list[str] = []
    entry_point: str | None = Field(default=None, pattern=r"^[A-Za-z_]\w*$")
    starter: str = ""
    statement: str = Field(min_length=1)
    solutions: dict[str, str] = Field(min_length=1)
    tests: str
    _where: tuple[str, dict[str, int]] = PrivateAttr(default=("<problem>", {}))

    def where(self, key: str = "") -> str:
        """``file:line`` of this entry's ``key`` (of the entry itself if it has no such key)."""
        path, lines = self._where
        return f"{path}:{lines.get(key, lines.get('', 0))}"

    @field_validator("statement", "title")
    @classmethod
    def _stripped(cls, text: str) -> str:
        return text.strip()

    @field_validator("starter")
    @classmethod
    def _one_final_newline(cls, text: str) -> str:
        return text.strip() + "\n" if text.strip() else ""

    @field_validator("solutions")
    @classmethod
    def _code_ends_in_newline(cls, solutions: dict[str, str]) -> dict[str, str]:
        return {name: code.strip() + "\n" for name, code in solutions.items()}

    @field_validator("tests")
    @classmethod
    def _an_expression(cls, text: str) -> str:
        try:
            compile(f"({text})", "<tests>", "eval")
        except SyntaxError as exc:
            raise ValueError(f"not a Python expression: {exc.msg} (its line {exc.lineno})") from None
        return text

    @model_validator(mode="after")
    def _kind(self) -> ProblemSpec:
        if bool(self.entry_point) != bool(self.starter):
            raise ValueError("a call problem has both entry_point and starter, a stdin/stdout problem neither")
        for text in (self.title, self.statement, self.starter, *self.solutions.values()):
            if not text.isascii():
                raise ValueError(f"non-ASCII text: {next(c for c in text if not c.isascii())!r}")
        return self


def _key_lines(node: yaml.Node) -> dict[str, int]:
    """1-based line of each key of a mapping node."""
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(key.value): key.start_mark.line + 1 for key, _ in node.value}


def load_problems(path: Path = SOURCE) -> list[ProblemSpec]:
    """Every problem of ``path`` in file order, validated; ids are unique."""
    text = path.read_text(encoding="utf-8")
    try:
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise ProblemSourceError(f"{path}:{mark.line + 1 if mark else '?'}: not valid YAML: {exc.problem}") from None
    if not isinstance(data, list) or not isinstance(root, yaml.SequenceNode):
        raise ProblemSourceError(f"{path}:1: expected a list of problems, got {type(data).__name__}")
    problems: list[ProblemSpec] = []
    seen: dict[str, int] = {}
    for raw, node in zip(data, root.value):
        start, lines = node.start_mark.line + 1, _key_lines(node)
        name = repr(raw.get("id")) if isinstance(raw, dict) else "?"
        try:
            spec = ProblemSpec.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = str(err["loc"][0]) if err["loc"] else ""
            where = f"{key}: " if key else ""
            raise ProblemSourceError(f"{path}:{lines.get(key, start)}: problem {name}: {where}{err['msg']}") from None
        if spec.id in seen:
            raise ProblemSourceError(f"{path}:{start}: problem {name}: id already used at line {seen[spec.id]}")
        seen[spec.id] = start
        spec._where = (str(path), {"": start, **lines})
        problems.append(spec)
    return problems
