"""A config file as read: its data, its YAML node tree for line numbers, and the one error it raises.

:class:`ConfigError` lists every problem of a file with its dotted key path and YAML line ("from
--set" for a command-line value). YAML is read with numbers in exponent form (``1e-4``) as numbers,
in the file and in ``--set`` values; a key written twice and a file that is not UTF-8 are errors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ConfigError", "Source", "describe", "from_set", "load_yaml", "loc_to_key", "parse", "read_text"]


class ConfigError(ValueError):
    """An invalid ``pipelines.yaml``: one exception listing every problem with file, pipeline and key."""

    def __init__(
        self, file: str | os.PathLike[str], pipeline: str | None, problems: Sequence[tuple[str, str]]
    ):
        self.file = str(file)
        self.pipeline = pipeline
        self.problems = list(problems)
        where = f"{self.file}" + (f", pipeline {pipeline!r}" if pipeline else "")
        lines = [f"invalid pipeline config in {where}: {len(self.problems)} problem(s)"]
        lines += [f"  - {key}: {msg}" if key else f"  - {msg}" for key, msg in self.problems]
        super().__init__("\n".join(lines))



class Source:
    """A parsed file: raw data plus the composed node tree for line numbers."""

    def __init__(self, path: Path, data: Any, root: yaml.Node | None):
        self.path = path
        self.data = data
        self.root = root

    def problem(self, keys: Sequence[Any], key_text: str, message: str) -> tuple[str, str]:
        line = _yaml_line(self.root, keys)
        return (f"{key_text} (line {line})" if line else key_text, message)



def _yaml_line(root: yaml.Node | None, keys: Sequence[Any]) -> int | None:
    """1-based line of the deepest node reachable along ``keys`` in a composed YAML tree."""
    node, line = root, None
    for key in keys:
        if node is None:
            break
        line = node.start_mark.line + 1
        nxt = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(key):
                    nxt = v
                    line = k.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            nxt = node.value[key]
        node = nxt
    if node is not None:
        line = node.start_mark.line + 1
    return line



def _duplicate_keys(node: yaml.Node | None, path: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(key, message) for every mapping key written twice (YAML keeps the last one silently)."""
    found: list[tuple[str, str]] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = str(k.value) if isinstance(k, yaml.ScalarNode) else "?"
            if key in seen:
                message = (f"duplicate key: already set on line {seen[key]}; YAML would keep only the last "
                           "value, so remove one of them")
                found.append((".".join((*path, key)) + f" (line {k.start_mark.line + 1})", message))
            else:
                seen[key] = k.start_mark.line + 1
            found += _duplicate_keys(v, (*path, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, (*path[:-1], f"{path[-1]}[{i}]") if path else (f"[{i}]",))
    return found


class _Loader(yaml.SafeLoader):
    """YAML as pipelines.yaml and ``--set`` values are read: PyYAML's safe loader, where a number in
    exponent form without a dot (``1e-4``, as users write learning rates) is a float, as in YAML 1.2,
    not the string YAML 1.1 makes of it."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_yaml(text: str) -> Any:
    """Parse YAML text with :class:`_Loader` (``1e-4`` is a number)."""
    return yaml.load(text, Loader=_Loader)


def read_text(path: Path) -> str:
    """A config file's text; one :class:`ConfigError` when it is unreadable or not UTF-8 (naming the
    first bad byte's line and column)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(path, None, [("", f"cannot read the file: {exc.strerror or exc}")]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(path, None, [("", (f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, column "
                                            f"{column}; save the file as UTF-8"))]) from None


def parse(path: str | os.PathLike[str]) -> Source:
    """Read a YAML file: data, node tree for line numbers; duplicate keys are errors."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(p, None, [("", f"file not found (looked for {p.resolve()})")])
    text = read_text(p.resolve())
    try:
        root = yaml.compose(text, Loader=_Loader)
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(
            p, None, [("", f"not valid YAML: {where}{getattr(exc, 'problem', None) or exc}")]
        ) from None
    dupes = _duplicate_keys(root)
    if dupes:
        raise ConfigError(p, None, dupes)
    return Source(p.resolve(), data, root)



def loc_to_key(prefix: str, loc: Sequence[Any]) -> str:
    key = prefix
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        else:
            key += f".{part}" if key else str(part)
    return key



def describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"



def from_set(dotted: str, overrides: Sequence[str]) -> bool:
    """Whether the setting ``dotted`` (or a part of it) came from a ``--set`` key."""
    return any(dotted == k or dotted.startswith(k + ".") or k.startswith(dotted + ".") for k in overrides)

