"""The README and docs/ say what the code does: every command they show parses with Kiln's own
parser, every config key they name exists and every default they state is the code's, the
config reference is the code's own docstrings, flavours and alerts are the code's, every path
they cite is in the repository, and their links land. A renamed flag, field or file fails here
instead of misleading a newcomer. (`make docs` builds docs/ with `mkdocs --strict`, which fails
on a broken link between pages.)"""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from kiln.cli_args import build_parser
from kiln.config import RunConfig, annotated_yaml
from kiln.knobs import flatten
from kiln.model import FLAVOURS

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
PAGES = {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}
ALL = {"README.md": README, **{f"docs/{n}": t for n, t in PAGES.items()}}
SECTIONS = ("data", "model", "parallel", "optim", "schedule", "train", "logging")


def _commands(text: str) -> list[str]:
    """Every `kiln ...` command line of a page's bash blocks, continuations joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            line = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", line)  # VAR=value kiln ...
            line = re.sub(r"^make install && source \S+ && ", "", line)
            if line.startswith("kiln "):
                out.append(line)
    return out


def test_every_kiln_command_parses():
    parser = build_parser()
    shown = set()
    for page, text in ALL.items():
        for line in _commands(text):
            argv = shlex.split(line)[1:]
            try:
                args = parser.parse_args(argv)
            except SystemExit as e:  # argparse's way of saying the page is wrong
                if argv[-1:] in (["--help"], ["--version"]) and e.code == 0:
                    continue
                pytest.fail(f"{page}: command does not parse: {line}")
            shown.add(args.command)
    assert shown >= {"data", "train", "sweep", "runs", "plan", "cluster", "services", "lr", "config", "generate"}, shown
    assert len(_commands(README)) >= 10  # the README's quickstarts are commands


def _defaults() -> dict:
    return flatten(RunConfig().to_dict())


def test_every_config_key_named_exists_and_every_default_stated_is_the_codes():
    keys = _defaults()
    section = "|".join(SECTIONS)
    text = "\n".join(ALL.values())
    named = set(re.findall(rf"(?<![\w./-])((?:{section})\.[a-z_][a-z0-9_.]*[a-z0-9_])", text))
    named = {k for k in named if not k.endswith(".md")}  # the docs pages
    named -= {"model.py", "model.safetensors", "model.safetensors.index.json", "optim.lrr"}  # files; the typo example
    assert "optim.lrr` → `did you mean 'lr'?" in README
    unknown = sorted(k for k in named if not any(x == k or x.startswith(k + ".") for x in keys))
    assert len(named) > 40 and not unknown, unknown
    # "`key` (default `value`)" and "`key` ..., N by default" / "on by default" state the code's default
    stated = re.findall(rf"`((?:{section})\.[a-z_.]+)`[^.`]{{0,60}}?(?:\(default `([^`]+)`|, (\w+) by default)", text)
    assert len(stated) >= 3, stated
    for key, quoted, word in stated:
        default, said = keys[key], quoted or word
        if isinstance(default, bool):
            assert said == ("on" if default else "off"), (key, said, default)
        elif default == "":  # computed at launch (a run's directory): the text names the rule
            continue
        else:
            assert str(default).startswith(said.rstrip("…")) or said == str(default), (key, said, default)


def test_the_config_reference_is_the_codes_own_docstrings():
    page = PAGES["config.md"]
    shown = page[page.index("```yaml\n") + len("```yaml\n") : page.rindex("```")]
    assert shown.rstrip() == annotated_yaml().rstrip(), "docs/config.md is stale: regenerate it from annotated_yaml()"


def test_flavours_and_alerts_are_the_codes():
    training = PAGES["training.md"]
    section = training[training.index("## Configs and flavours") : training.index("## What a run records")]
    assert all(f"`{name}`" in section for name in FLAVOURS), sorted(FLAVOURS)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    assert f"one of {words[len(FLAVOURS)]} model sizes" in section
    rules = yaml.safe_load((REPO / "dashboards/alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    table = set(re.findall(r"^\| `(Kiln\w+)` \|", PAGES["monitoring.md"], re.M))
    assert table == alerts, table ^ alerts


def test_the_compiled_cache_step_stated_is_the_codes():
    from kiln.infer.generate import STATIC_CACHE_STEP

    stated = re.search(r"rounded up to a multiple of (\d+)\)", PAGES["models.md"])
    assert stated and int(stated.group(1)) == STATIC_CACHE_STEP


CITED = re.compile(
    r"`((?:platform|tests|bench|jobs|cluster|dashboards|docs)/[\w./-]*[\w/]|[A-Z]+\.md|constraints\.txt|Makefile)`"
)


def test_every_cited_path_is_in_the_repository():
    cited = {(page, m) for page, text in ALL.items() for m in CITED.findall(text)}
    assert len(cited) > 30, cited
    missing = sorted((page, path) for page, path in cited if "<" not in path and not (REPO / path).exists())
    assert not missing, missing


def _slug(heading: str) -> str:
    """GitHub's and mkdocs' anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_land():
    # The README's links are to files of the repository (it is read on a forge, not in the site).
    files = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    assert files and not [f for f in files if not (REPO / f).exists()]
    assert not re.findall(r"\]\(#", README)  # no in-page anchors: the README is short
    assert len(README.splitlines()) <= 250
    # Between pages: the page exists and so does the anchor.
    anchors = {name: {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)} for name, text in PAGES.items()}
    for name, text in PAGES.items():
        for target, anchor in re.findall(r"\]\(([\w-]*\.md)?(?:#([\w-]+))?\)", text):
            page = target or name
            assert page in anchors, (name, target)
            assert not anchor or anchor in anchors[page], (name, target, anchor)
    # Every page is in the site's navigation, and every README table row names a page.
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    assert {next(iter(item.values())) for item in nav} == set(PAGES)
    assert set(re.findall(r"^\| \[[^]]+\]\(docs/([\w-]+\.md)\)", README, re.M)) == set(PAGES) - {"index.md"}
    # The newcomer's first step after `make`: how `kiln` gets on the PATH.
    assert README.index("source .venv/bin/activate") < README.index("## CPU quickstart")


def test_the_planner_output_shown_is_what_kiln_plan_prints(capsys):
    """Each `$ kiln plan ...` line of a text block runs as shown; every line under it (up to the
    next `$`, `...` marking a cut) is a line of what it prints."""
    from kiln.cli import main

    checked = 0
    for block in re.findall(r"```text\n(.*?)```", "\n".join(ALL.values()), re.S):
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, *shown = chunk.rstrip("\n").split("\n")
            if not command.startswith("kiln plan"):
                continue
            assert main(shlex.split(command)[1:]) in (0, None), command
            printed = set(capsys.readouterr().out.splitlines())
            missing = [line for line in shown if line and line != "..." and line not in printed]
            assert not missing, (command, missing)
            checked += 1
    assert checked >= 5
