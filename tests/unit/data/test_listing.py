"""The streamed listing of `kiln data prepare`: sorted walks, the windowed seeded order, the
units' spill, and memory that does not grow with the number of files."""

import os
import tracemalloc
from pathlib import Path

from kiln.data import listing
from kiln.data.listing import cut_units, list_inputs, place, spill
from kiln.storage import resolve


def _tree(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"text of {name}\n")


def test_the_walk_yields_every_file_once_in_the_sorted_order_of_their_paths(tmp_path):
    # '-' (0x2d) sorts before '/' (0x2f): a per-directory walk that sorted plain names would put
    # a/b.txt before a-b.txt; a directory must sort where its files' paths do.
    names = ["a/b.txt", "a-b.txt", "a.txt", "a/c/d.py", "ab/x.md", "b.rst", "a/c.jsonl", "z/y/x/w.txt"]
    _tree(tmp_path / "c", names)
    (tmp_path / "c" / "pic.png").write_bytes(b"\x89PNG")  # not a text suffix
    os.symlink(tmp_path / "c" / "ab", tmp_path / "c" / "linked")  # a symlinked directory: not followed
    inputs = [str(tmp_path / "c"), str(tmp_path / "c" / "a" / "b.txt"), str(tmp_path / "c" / "a*.txt")]
    got = [f.uri for f in list_inputs(inputs)]
    expected = sorted(str(tmp_path / "c" / n) for n in names)
    assert got == expected  # sorted as strings, each once though three inputs name a/b.txt


def test_units_cover_every_file_once_in_a_seeded_order_of_windows(tmp_path, monkeypatch):
    monkeypatch.setattr(listing, "WINDOW_FILES", 16)
    _tree(tmp_path, [f"d{i // 10:02d}/f{i % 10}.txt" for i in range(100)])
    files = list(list_inputs([str(tmp_path)]))

    def order(seed):
        return [p.file.uri for u in cut_units(iter(files), 64, seed) for p in u.pieces]

    first = order(1)
    assert sorted(first) == [f.uri for f in files]  # every file once
    assert first == order(1) and first != order(2)  # deterministic, and the seed decides
    for w in range(0, 100, 16):  # a file stays in its window: the shuffle holds 16 files at once
        assert set(first[w : w + 16]) == {f.uri for f in files[w : w + 16]}
    assert first[:16] != [f.uri for f in files[:16]]


def test_the_spill_is_placed_and_read_back_unit_by_unit(tmp_path):
    _tree(tmp_path / "c", [f"m{i}.py" for i in range(40)])
    units = spill([str(tmp_path / "c")], "", 40, 7, str(tmp_path))
    assert units.files == 40 and len(units) == len(units.sizes) > 5
    assert not [p for p in tmp_path.iterdir() if p.name != "c"]  # the scratch spill has no name
    placed = place(units, resolve(str(tmp_path / "staged" / "listing.pkl")))
    got = list(placed)
    assert [u.index for u in got] == list(range(len(units)))
    assert [u.bytes for u in got] == units.sizes.tolist()
    assert placed.ref(3).load() == got[3]
    assert sorted(p.file.uri for u in got for p in u.pieces) == sorted(str(p) for p in (tmp_path / "c").iterdir())


def test_listing_memory_does_not_grow_with_the_number_of_files(tmp_path, monkeypatch):
    """2,000 and 20,000 files (in directories of 100, units of 100 files): the listing's peak
    memory is a window's, a directory's and a unit's, where a list of the files grows 10x."""
    monkeypatch.setattr(listing, "WINDOW_FILES", 256)
    peaks = {}
    for n in (2_000, 20_000):
        root = tmp_path / f"c{n}"
        for d in range(n // 100):
            (root / f"pkg{d:04d}").mkdir(parents=True)
            for i in range(100):
                (root / f"pkg{d:04d}" / f"mod{i:03d}.py").write_text("x = 1\n")
        tracemalloc.start()
        units = spill([str(root)], "", 600, 3, str(tmp_path))
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert units.files == n and len(units) == n // 100
        units.close()
    # 20,000 InputFiles alone are ~10 MB: a listing held whole would fail this by far
    assert peaks[20_000] < 1.3 * peaks[2_000], peaks


def test_a_prepare_cut_by_another_rule_is_neither_resumed_nor_reused(monkeypatch):
    """The key names the cut: unit numbers of a stopped prepare cut otherwise name other files."""
    from kiln.data.prepare import PrepareConfig, _key

    cfg = PrepareConfig(inputs=["x"], output="y")
    before, window = _key(cfg, "listing"), listing.WINDOW_FILES
    monkeypatch.setattr(listing, "WINDOW_FILES", 16)
    assert _key(cfg, "listing") != before
    monkeypatch.setattr(listing, "WINDOW_FILES", window)
    assert _key(cfg, "listing") == before
    monkeypatch.setattr(listing, "CUT_RULE", 1)
    assert _key(cfg, "listing") != before
