"""YAML as Kiln reads it: safe, strict and bounded, for run configs, `--set` values, sweep files
and cluster files alike.

- Safe: PyYAML's safe loader (no Python tags), YAML 1.2's reading of `3e-4` as a number.
- Strict: a key given twice in one mapping is an error (YAML would keep the last one silently,
  and a run would train with a value nobody meant). Merge keys (`<<: *base`) work, and a key
  written beside a merge wins over the merged one, as YAML says.
- Bounded: a file over `MAX_BYTES` is refused before it is parsed; the event stream is walked
  once (PyYAML's parser keeps its own stack, so deep nesting cannot exhaust Python's) and a
  document nested deeper than `MAX_DEPTH`, or whose aliases expand it past `MAX_EXPANSION`
  times the nodes written (an alias bomb), is refused before anything is built.

Hand-written: PyYAML has no limits of its own, and no maintained loader adds them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from kiln.errors import ConfigError

MAX_BYTES = 1 << 20  # 1 MiB: a run config is a few KB, a cluster file tens of KB
MAX_DEPTH = 64  # mappings and lists inside each other; real configs nest 3-6 deep
MAX_EXPANSION = 10  # aliases may make a document at most 10x the nodes written in it ...
MIN_BUDGET = 10_000  # ... or this many nodes, whichever is larger (a small file may reuse anchors freely)

_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML was built with it


class StrictLoader(_Base):  # type: ignore[misc, valid-type]
    """The safe loader with duplicate keys refused, merge keys kept, and `3e-4` a float."""


def _mapping(loader: StrictLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *base`: flattened by construct_mapping, own keys winning
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key that is a list or mapping", key_node.start_mark
            ) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
# YAML 1.1 (PyYAML) needs a dot in a float, so `lr: 3e-4` would load as the string "3e-4";
# YAML 1.2 and every user read it as a number, and so does Kiln.
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def check_bounds(text: str, what: str) -> None:
    """Refuse `text` if it is too large, nested too deep, or an alias bomb: one pass over
    PyYAML's events, counting each node's size with its aliases expanded (an anchor's size is
    known when its node ends), without building anything."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{what} is {len(text):,} characters; expected at most {MAX_BYTES:,}")
    sizes: dict[str, int] = {}
    stack: list[list] = []  # per open collection: [anchor, nodes inside so far]
    written = expanded = 0
    for event in yaml.parse(text, Loader=_Base):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            stack.append([event.anchor, 0])
            if len(stack) > MAX_DEPTH:
                raise ConfigError(f"{what} nests lists and mappings over {MAX_DEPTH} deep; expected a config")
            written += 1
            continue
        if isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, inside = stack.pop()
            size = 1 + inside
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
            written += 1
        elif isinstance(event, yaml.AliasEvent):
            anchor, size = None, sizes.get(event.anchor, 1)
        else:
            continue
        if anchor is not None:
            sizes[anchor] = size
        if stack:
            stack[-1][1] += size
        else:
            expanded += size
        budget = max(MIN_BUDGET, MAX_EXPANSION * written)
        if expanded + sum(frame[1] for frame in stack) > budget:
            raise ConfigError(
                f"{what}: its aliases expand to over {budget:,} values from {written:,} written "
                "(an alias bomb?); write the values out"
            )


def load_text(text: str, what: str) -> Any:
    """YAML text, checked by `check_bounds`, then loaded strictly. YAML errors propagate (the
    caller says what the text was); bounds are a ConfigError naming `what`."""
    check_bounds(text, what)
    return yaml.load(text, Loader=StrictLoader)


def read_text(path: str | os.PathLike, what: str) -> str:
    """A file's UTF-8 text, refused unread when it is larger than `MAX_BYTES`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} does not exist" + (" (it is a directory)" if p.is_dir() else ""))
    with open(p, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{what} is larger than {MAX_BYTES:,} bytes; expected a config file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None


def problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong, and where."""
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}{where}"


def read_mapping(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping; `what` names it in errors ("config file 'x.yaml'").
    An empty file, a duplicated key or bytes that are not UTF-8 are errors, not defaults."""
    text = read_text(path, what)
    try:
        tree = load_text(text, what)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} is not valid YAML: {problem(e)}") from None
    if tree is None:
        raise ConfigError(f"{what} is empty: expected a mapping of settings")
    if not isinstance(tree, dict):
        raise ConfigError(f"{what} must hold a mapping")
    return tree
