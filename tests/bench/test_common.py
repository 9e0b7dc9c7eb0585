"""bench.common: a benchmark's section goes first in its topic's results file, whole."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ is a package at the repository root, run as `python -m bench.<name>`

from bench.common import TOPICS, publish, results_file  # noqa: E402


def test_sections_go_newest_first_after_the_header(tmp_path, capsys):
    path = tmp_path / "throughput.md"
    path.write_text("# Training throughput\n\nNewest first.\n\n## 2026-11-01 — old\n\nold rows\n")
    publish("## 2026-11-26 — new\n\nnew rows\n", str(path))
    text = path.read_text()
    assert text.index("# Training throughput") < text.index("## 2026-11-26") < text.index("## 2026-11-01")
    assert "new rows" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["throughput.md"]  # no temporary file left


def test_every_topic_has_its_results_file_and_every_file_a_topic():
    files = {p.stem for p in (REPO / "bench" / "results").glob("*.md")}
    assert files == set(TOPICS)
    for topic in TOPICS:
        assert Path(results_file(topic)).read_text().startswith("# ")
