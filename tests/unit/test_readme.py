"""The README says what the code does: every command it shows parses with Kiln's own parser,
every config key it names exists, its flavours and alerts are the code's, and its links land.
A renamed flag, field or file fails here instead of misleading a newcomer."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from kiln.cli_args import build_parser
from kiln.config import RunConfig
from kiln.knobs import flatten
from kiln.model import FLAVOURS

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
SECTIONS = ("data", "model", "parallel", "optim", "schedule", "train", "logging")


def _commands() -> list[str]:
    """Every `kiln ...` command line of the README's bash blocks, continuations joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            line = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", line)  # VAR=value kiln ...
            if line.startswith("kiln "):
                out.append(line)
    return out


def test_every_kiln_command_in_the_readme_parses():
    commands = _commands()
    assert len(commands) >= 15, commands  # the how-to sections show the commands
    parser = build_parser()
    shown = set()
    for line in commands:
        argv = shlex.split(line)[1:]
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # argparse's way of saying the README is wrong
            if argv[-1:] in (["--help"], ["--version"]) and e.code == 0:
                continue
            pytest.fail(f"README command does not parse: {line}")
        shown.add(args.command)
    assert shown >= {"data", "train", "sweep", "runs", "plan", "cluster", "services", "lr", "config"}, shown


def test_every_config_key_the_readme_names_exists():
    keys = set(flatten(RunConfig().to_dict()))
    section = "|".join(SECTIONS)
    named = set(re.findall(rf"(?<![\w./-])((?:{section})\.[a-z_][a-z0-9_.]*[a-z0-9_])", README))
    named -= {
        "model.py",
        "model.safetensors",
        "model.safetensors.index.json",
        "optim.lrr",
    }  # files, and the README's example of a typo Kiln catches
    assert "optim.lrr` → `did you mean 'lr'?" in README
    unknown = sorted(k for k in named if not any(x == k or x.startswith(k + ".") for x in keys))
    assert len(named) > 40 and not unknown, unknown


def test_flavours_and_alerts_are_the_codes():
    section = README[README.index("### Configs and flavours") : README.index("### What a run records")]
    assert all(f"`{name}`" in section for name in FLAVOURS), sorted(FLAVOURS)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    assert f"one of {words[len(FLAVOURS)]} model sizes" in section
    rules = yaml.safe_load((REPO / "dashboards/alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    table = set(re.findall(r"^\| `(Kiln\w+)` \|", README, re.M))
    assert table == alerts, table ^ alerts


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_contents_and_links_land():
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", README, re.M)}
    linked = set(re.findall(r"\]\(#([\w-]+)\)", README))
    assert linked and linked <= anchors, linked - anchors
    contents = README[README.index("**Contents**") : README.index("## Quickstart")]
    top = [_slug(h) for h in re.findall(r"^## (.+)$", README, re.M)]
    assert re.findall(r"^\d+\. \[[^]]+\]\(#([\w-]+)\)", contents, re.M) == top  # every section, in order
    files = {f.split("#")[0] for f in re.findall(r"\]\(([^)#:]+(?:#[^)]*)?)\)", README)}
    missing = sorted(f for f in files if not (REPO / f).exists())
    assert files and not missing, missing
    # The newcomer's first step after `make`: how `kiln` gets on the PATH.
    assert README.index("source .venv/bin/activate") < README.index("## Preparing data")


def test_the_planner_output_the_readme_shows_is_what_kiln_plan_prints(capsys):
    """Each `$ kiln plan ...` line of a text block runs as shown; every line under it (up to the
    next `$`, `...` marking a cut) is a line of what it prints."""
    import shlex

    from kiln.cli import main

    checked = 0
    for block in re.findall(r"```text\n(.*?)```", README, re.S):
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
