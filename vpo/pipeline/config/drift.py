"""How the declared settings (:mod:`vpo.pipeline.config.fields`) differ from the installed VPOConfig.

The schema of ``trainer:`` and ``arms:`` is written out by hand, one line per VPOConfig field, so a
reader and a type checker see every setting and loading ``pipelines.yaml`` never imports TRL. This
module holds it against the dataclass TRL and transformers actually ship: every init field declared
(or set by the pipeline itself, :data:`~vpo.pipeline.config.fields.RESERVED`), under the same type,
with TRL's default unless :func:`~vpo.trainer_fields.ours` says why not, and with the first sentence
of TRL's help (the estimator's own settings, :class:`~vpo.trainer_fields.VPOFields`, are VPOConfig's
source: their help is written there). A test runs :func:`differences`; after a TRL upgrade ``python -m
vpo.pipeline.config.drift`` prints what changed and the line to write for each new field.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel

from vpo.pipeline.config.fields import OWNED, RESERVED, VPOConfigFields
from vpo.trainer_fields import OURS, VPOFields

__all__ = ["differences", "first_sentence", "kind", "line", "main"]


def kind(hint: Any, choices: typing.Sequence[Any] | None = None) -> Any:
    """A comparable description of a type: builtins by name, ``Literal`` (and enums, and a string
    narrowed to declared ``choices``) as the set of its values, unions as sets, ``list``/``dict`` with
    their items; bounds (``Annotated``) are left out, and so is a Python object no YAML value can be."""
    if typing.get_origin(hint) is typing.Annotated:
        return kind(typing.get_args(hint)[0], choices)
    if hint is None or hint is type(None):
        return "null"
    if hint is Any:
        return "any"
    if hint is str and choices:
        return ("literal", frozenset(choices))
    if hint in (bool, int, float, str):
        return hint.__name__
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return ("literal", frozenset(m.value for m in hint))
    origin = typing.get_origin(hint)
    if origin is Literal:
        return ("literal", frozenset(typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        args = list(typing.get_args(hint))
        if str in args and any(isinstance(a, type) and issubclass(a, enum.Enum) for a in args):
            args.remove(str)  # `SchedulerType | str`: the string must be one of the enum's values
        members = frozenset(k for k in (kind(a, choices) for a in args) if k != "object")
        return next(iter(members)) if len(members) == 1 else ("union", members)
    if origin in (list, tuple) or hint in (list, tuple):
        inner = typing.get_args(hint)
        return ("list", kind(inner[0]) if inner else "any")
    if origin is dict or hint is dict:
        inner = typing.get_args(hint)
        return ("dict", kind(inner[1]) if len(inner) == 2 else "any")
    return "object"


def first_sentence(text: str | None, limit: int = 96) -> str:
    """The first sentence of a help text on one line, cut to ``limit`` characters."""
    flat = " ".join((text or "").split())
    end = next((i + 1 for i, ch in enumerate(flat) if ch == "." and (i + 1 == len(flat) or flat[i + 1] == " ")),
               len(flat))
    out = flat[:end]
    return out if len(out) <= limit else out[: limit - 3].rsplit(" ", 1)[0] + "..."


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return _plain(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _plain(f.default_factory())
    return None


def _source(hint: Any, choices: typing.Sequence[Any] | None = None) -> str:
    """A type hint written as it would be declared (for the line :func:`line` suggests)."""
    k = kind(hint, choices)

    def text(k: Any) -> str:
        if isinstance(k, str):
            return {"null": "None", "any": "Any", "float": "Float"}.get(k, k)
        tag, inner = k
        if tag == "literal":
            return f"Literal[{', '.join(map(repr, sorted(inner, key=repr)))}]"
        if tag == "list":
            return f"list[{text(inner)}]"
        if tag == "dict":
            return f"dict[str, {text(inner)}]"
        members = sorted(inner, key=lambda m: m == "null")
        return " | ".join(text(m) for m in members)

    return text(k)


def line(f: dataclasses.Field[Any], hint: Any) -> str:
    """The declaration to write for a dataclass field: its line and its help under it."""
    return (f"    {f.name}: {_source(hint, f.metadata.get('choices'))} = {_default(f)!r}\n"
            f'    """{first_sentence(f.metadata.get("help"))}"""')


def _declared_kind(model: type[BaseModel], name: str) -> Any:
    return kind(model.model_fields[name].annotation)


def _fits(declared: Any, live: Any) -> bool:
    """Whether a declared type is the live one, or narrows TRL's plain string to the values it accepts
    (TRL checks them only deep inside training; the schema checks them when a config loads)."""
    narrowed = isinstance(declared, tuple) and declared[0] == "literal" and all(isinstance(v, str) for v in declared[1])
    return declared == live or (live == "str" and narrowed)


def differences(live: type, declared: type[BaseModel] = VPOConfigFields) -> list[str]:
    """What differs between the dataclass ``live`` (the installed VPOConfig) and ``declared``: one line
    per field added, dropped or changed in type, default or help, with the line to write."""
    hints = typing.get_type_hints(live)
    fields = {f.name: f for f in dataclasses.fields(live) if f.init}
    out: list[str] = []
    skip = set(RESERVED) | set(OWNED)
    for name, f in fields.items():
        if name in skip:
            continue
        if name not in declared.model_fields:
            out.append(f"new field {name}: declare it (or list it in RESERVED with the reason)\n{line(f, hints[name])}")
            continue
        info = declared.model_fields[name]
        want = kind(hints[name], f.metadata.get("choices"))
        if not _fits(_declared_kind(declared, name), want):
            out.append(f"{name}: the type changed; now\n{line(f, hints[name])}")
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if OURS not in extra and info.get_default(call_default_factory=True) != _default(f):
            out.append(f"{name}: the default is now {_default(f)!r} (declared: "
                       f"{info.get_default(call_default_factory=True)!r}); take it, or keep ours with ours(value, why)")
        if (info.description or "") != first_sentence(f.metadata.get("help")) and name not in VPOFields.model_fields:
            out.append(f"{name}: the help changed; now\n    \"\"\"{first_sentence(f.metadata.get('help'))}\"\"\"")
    for name in declared.model_fields:
        if name not in fields:
            out.append(f"{name}: no longer a field of {live.__name__}; remove its declaration")
    return out


def _lines(items: list[str]) -> Iterator[str]:
    for i, item in enumerate(items, 1):
        yield f"{i}. {item}"


def main() -> int:
    """Print the differences with the installed VPOConfig; exit 1 when there are any."""
    from vpo.trainer import VPOConfig

    found = differences(VPOConfig)
    if not found:
        print("vpo/pipeline/config/fields.py declares every VPOConfig field as installed")
        return 0
    print("\n".join(_lines(found)))
    return 1


if __name__ == "__main__":
    sys.exit(main())
