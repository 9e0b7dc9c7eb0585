"""ARCHITECTURE.md names only what exists: every path, module, attribute, config field, class and
command in backticks is checked against the repository."""

import dataclasses
import importlib
import re
import typing
from pathlib import Path

from kiln.cli_args import build_parser
from kiln.config import RunConfig

REPO = Path(__file__).resolve().parents[2]
KILN = REPO / "platform" / "kiln"
DOC = (REPO / "ARCHITECTURE.md").read_text()
NAMED = sorted(set(re.findall(r"`([^`\n]+)`", DOC)))


def _resolves(dotted: str) -> bool:
    """A module, or an attribute of the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _field(dotted: str) -> bool:
    cls = RunConfig
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls) or part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        cls = typing.get_type_hints(cls)[part]
    return True


def _command(words: list[str]) -> bool:
    parser = build_parser()
    for word in words:
        subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        if not subs or word not in subs[0].choices:
            return word.startswith("-") or word.isupper()  # a flag or a placeholder ends the command
        parser = subs[0].choices[word]
    return True


def _class_defined(name: str) -> bool:
    pattern = re.compile(rf"^class {name}\b", re.M)
    return any(pattern.search(p.read_text()) for p in KILN.rglob("*.py"))


def _problem(token: str) -> str | None:
    if token.startswith("kiln "):
        return None if _command(token.split()[1:]) else "no such command"
    if token.startswith("make "):
        return None if re.search(rf"^{token.split()[1]}:", (REPO / "Makefile").read_text(), re.M) else "no make target"
    if re.fullmatch(r"[\w./-]+(/|\.py|\.md|\.toml|\.yaml)", token) and not re.search(r"_[A-Z]\b", token):
        return None if (KILN / token).exists() or (REPO / token).exists() else "no such path"
    if re.fullmatch(r"kiln(\.\w+)+", token):
        return None if _resolves(token) else "does not import"
    if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", token) and token.split(".")[0] in {
        f.name for f in dataclasses.fields(RunConfig)
    }:
        return None if _field(token) else "no such config field"
    if re.fullmatch(r"[A-Z][A-Za-z]+", token) and token not in ("Ray", "MLflow", "DeepSpeed"):
        return None if _class_defined(token) else "no such class"
    return None


def test_everything_architecture_md_names_exists():
    problems = [f"`{t}`: {why}" for t in NAMED if (why := _problem(t))]
    assert problems == []
    # The doc names many things, and this test reads them: its patterns match most tokens.
    recognised = [t for t in NAMED if re.fullmatch(r"kiln(\.\w+)+|kiln .+|make .+|[\w./-]+(/|\.py)|[A-Z][A-Za-z]+", t)]
    assert len(recognised) > 80, recognised


def test_the_checker_catches_what_does_not_exist():
    for wrong in (
        "core/nothing.py",
        "kiln.core.optim.NOPE",
        "kiln nothing",
        "train.nothing",
        "NoSuchSeam",
        "make nothing",
        "kiln.nowhere",
    ):
        assert _problem(wrong) is not None, wrong


def test_the_benchmark_results_name_only_modules_and_paths_that_exist():
    """bench/results/*.md cite modules and files as evidence; a move must not leave them stale."""
    stale = []
    for f in sorted((REPO / "bench" / "results").glob("*.md")):
        text = f.read_text()
        stale += [f"{f.name}: {t}" for t in set(re.findall(r"`(kiln(?:\.\w+)+)`", text)) if not _resolves(t)]
        stale += [
            f"{f.name}: {t}"
            for t in set(re.findall(r"(?<![\w/.-])((?:platform|tests|bench|jobs)/[\w/.-]+\.(?:py|sh|yaml))", text))
            if not (REPO / t).exists()
        ]
    assert stale == []
