"""The config language every section shares: fields with ranges, strict loading, overrides.

A section is a dataclass. Each field carries its type, default and allowed range on the field
itself (`knob`, `span`, `choice`) and a docstring under it (litgpt style), which `field_docs`
reads back for generated YAML and error messages. `build_section` turns a mapping into a
section, every key and value checked: an unknown key names itself and the closest valid one, a
bad value names its field and what was allowed. `set_dotted` applies `--set a.b=c`.

This module knows no section: `kiln.config` composes them into `RunConfig`, and each section
lives beside the code that uses it. It imports no torch and does no I/O.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import field
from functools import cache
from typing import Any, Literal

import yaml

from kiln import yamlfile
from kiln.errors import ConfigError
from kiln.limits import MAX_INT

RANGE = "kiln.range"  # dataclass field metadata: (predicate, what is allowed)
CHOICE = "kiln.choice"  # dataclass field metadata: the table a name must be in (`choice`)


def knob(default: Any, ok: Callable[[Any], bool], allowed: str) -> Any:
    """A field's default and its allowed range, declared on the field itself: `check_ranges`
    checks `ok(value)` and names the field and `allowed` when it fails."""
    return field(default=default, metadata={RANGE: (ok, allowed)})


def choice(default: str, table: Mapping[str, Any]) -> Any:
    """A field naming an entry of `table` (a registry such as `kiln.core.optim.OPTIMIZERS`),
    read when the value is checked: an entry registered later is allowed too."""
    return field(default=default, metadata={CHOICE: table})


def span(
    lo: float, hi: float, what: str = "an integer", note: str = "", *, lo_open: bool = False
) -> tuple[Callable[[Any], bool], str]:
    """`knob`'s (ok, allowed) for a number in [lo, hi] ((lo, hi] with lo_open): every numeric
    field states its sane maximum, and the check and its message come from the same numbers."""

    def ok(v: float) -> bool:
        return (lo < v if lo_open else lo <= v) and v <= hi

    allowed = f"{what} in {'(' if lo_open else '['}{readable(lo)}, {readable(hi)}]"
    return ok, allowed + (f" ({note})" if note else "")


def readable(x: float) -> str:
    """1e9 rather than 1000000000 where that is exact; every digit otherwise."""
    short = f"{x:.0e}".replace("e+0", "e").replace("e+", "e")
    if abs(x) >= 1e6 and float(short) == x:
        return short
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def field_range(root: type, dotted: str) -> tuple[Callable[[Any], bool], str]:
    """The (ok, allowed) a field declares with `knob` (or `choice`), for a flag elsewhere that
    sets the same quantity (`kiln plan --seq-len` and model.seq_len share one limit)."""
    cls: Any = root
    *sections, name = dotted.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    meta = {f.name: f for f in dataclasses.fields(cls)}[name].metadata
    if CHOICE in meta:
        table = meta[CHOICE]
        return (lambda v: v in table), f"one of {list(table)}"
    return meta[RANGE]


def choices(root: type, dotted: str) -> list[str]:
    """The names a `choice` field allows now, in its table's order (a CLI flag's choices)."""
    cls: Any = root
    *sections, name = dotted.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    return list({f.name: f for f in dataclasses.fields(cls)}[name].metadata[CHOICE])


def check_ranges(section: Any, where: str) -> None:
    """Every field of `section` declared with `knob` or `choice` against what it allows."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if CHOICE in f.metadata and value not in f.metadata[CHOICE]:
            raise ConfigError(
                f"{where}.{f.name} = {value!r} is not allowed: expected one of {list(f.metadata[CHOICE])}"
            )
        if RANGE in f.metadata:
            ok, allowed = f.metadata[RANGE]
            if not ok(value):
                raise ConfigError(f"{where}.{f.name} = {value!r} is out of range: expected {allowed}")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]  # getsource(cls) parses to its ClassDef
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce_number(value: Any, tp: type, where: str) -> Any:
    """An int or float field's value, or ConfigError naming `where`."""
    number: int | float | None = None
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r} is not an integer")
        if isinstance(value, int):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = int(value)
        if number is None:
            raise ConfigError(f"{where} = {value!r} is not an integer")
        if abs(number) > MAX_INT:
            raise ConfigError(f"{where} = {value!r} is too large: expected an integer of at most 2**53")
        return number
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is None:
        raise ConfigError(f"{where} = {value!r} is not a number")
    if not math.isfinite(number):
        raise ConfigError(f"{where} = {value!r} is not a finite number")
    return number


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML/CLI value to the annotated type, or raise ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on/no/yes as a boolean
            value = next((w for w in (("off", "no", "false"), ("on", "yes", "true"))[value] if w in allowed), value)
        if value not in allowed:
            raise ConfigError(f"{where} = {value!r} is not allowed: expected one of {list(allowed)}")
        return value
    if origin in (typing.Union, types.UnionType):  # Optional[X], or a scalar or a list (X | list[X])
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        lists = [a for a in args if typing.get_origin(a) is list]
        if isinstance(value, list) and lists:
            return _coerce(value, lists[0], where)
        return None if value is None else _coerce(value, args[0], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where} = {value!r} is not a boolean: expected true or false")
    if tp in (int, float):
        return _coerce_number(value, tp, where)
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where} = {value!r} is not a string")
        return "" if value is None else str(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} = {value!r} is not a list")
        (item,) = typing.get_args(tp)
        return [
            build_section(item, v, f"{where}[{i}]")
            if dataclasses.is_dataclass(item)
            else _coerce(v, item, f"{where}[{i}]")
            for i, v in enumerate(value)
        ]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} = {value!r} is not a mapping")
        return value
    raise TypeError(f"unsupported config type {tp} at {where}")


def _unknown_key(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
    path = f"{where}.{key}" if where else key
    return ConfigError(f"unknown config key {path!r}{hint}")


def build_section(cls: Any, raw: dict[str, Any], where: str = ""):
    """A config dataclass from a raw mapping, every key and value checked (`where`: its dotted name)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise _unknown_key(str(key), list(fields), where)
        dotted = f"{where}.{key}" if where else key
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_section(tp, {} if value is None else value, dotted)
        else:
            kwargs[key] = _coerce(value, tp, dotted)
    return cls(**kwargs)


def set_dotted(root: type, tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Apply `a.b.c=value` to a nested dict, checking each key against `root`'s fields."""
    keys = dotted.split(".")
    cls: Any = root
    node = tree
    for i, key in enumerate(keys):
        where = ".".join(keys[:i])
        if cls is dict:  # free-form (parallel.deepspeed): any key goes
            if i == len(keys) - 1:
                node[key] = value
            else:
                node = _child(node, key)
            continue
        names = [f.name for f in dataclasses.fields(cls)]
        if key not in names:
            raise _unknown_key(key, names, where)
        tp = typing.get_type_hints(cls)[key]
        if i == len(keys) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"--set {dotted}: {dotted!r} is a section; set one of its fields")
            node[key] = value
        else:
            if not (dataclasses.is_dataclass(tp) or tp is dict):
                raise ConfigError(f"--set {dotted}: {'.'.join(keys[: i + 1])!r} is not a section")
            node = _child(node, key)
            cls = tp


def _child(node: dict[str, Any], key: str) -> dict[str, Any]:
    if not isinstance(node.get(key), dict):
        node[key] = {}
    return node[key]


def parse_override(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of `--set`, the value read as YAML (bounded, `kiln.yamlfile`)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set optim.lr=3e-4")
    key, raw = text.split("=", 1)
    if not key.strip() or "" in key.strip().split("."):
        raise ConfigError(
            f"--set {text!r}: {key.strip()!r} is not a field name; expected KEY=VALUE, e.g. --set optim.lr=3e-4"
        )
    try:
        value = yamlfile.load_text(raw, f"--set {key.strip()}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 1e-3}} -> {'optim.lr': 1e-3}; used for MLflow params."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def annotated_yaml(cfg: Any) -> str:
    """A config of sections as YAML, each field's docstring and allowed range as a comment above it
    (a nested section's fields too, indented under it)."""
    lines: list[str] = []
    config_type: type = type(cfg)  # a class, which field_docs caches by
    for section in dataclasses.fields(cfg):
        lines.append(f"# {field_docs(config_type).get(section.name, '')}")
        lines.append(f"{section.name}:")
        lines += _annotated_fields(getattr(cfg, section.name), "  ")
        lines.append("")
    return "\n".join(lines)


def _annotated_fields(section: Any, indent: str) -> list[str]:
    lines: list[str] = []
    section_type: type = type(section)
    docs = field_docs(section_type)
    for f in dataclasses.fields(section):
        doc = docs.get(f.name, "")
        if RANGE in f.metadata or CHOICE in f.metadata:
            doc += f" Allowed: {field_range(type(section), f.name)[1]}."
        lines.extend(f"{indent}# {line}" for line in textwrap.wrap(doc.strip(), 96 - len(indent)))
        v = getattr(section, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            lines.append(f"{indent}{f.name}:")
            lines += _annotated_fields(v, indent + "  ")
            continue
        dumped = yaml.safe_dump({f.name: v}, default_flow_style=True)
        lines.append(indent + dumped.strip()[1:-1])
    return lines
