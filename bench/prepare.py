"""Data preparation at scale: throughput against a plain loop, and peak memory as the corpus grows.

The corpus is real text nobody here wrote: the Python sources of the installed packages
(site-packages). Two parts, appended to bench/results/data.md:

1. Throughput with the BPE tokenizer, on a ~`--small-mb` corpus: `kiln data prepare` on Ray
   with 1 and 2 tokenizer actors, and in one process without Ray (`--workers 0`: the
   pipeline's own cost, apart from Ray's), against a plain single-process loop a user would write with
   the same tokenizer (read each file, HF tokenizers `encode_batch`, pack rows, write Parquet),
   on one thread (TOKENIZERS_PARALLELISM=false, as Kiln's actors run). Per-core ratio: Kiln's
   MB/s divided by its actors, over the plain loop's. The plain loop also runs as two processes
   at once: the machine's own two-core scaling, the ceiling for two actors.
   Then at scale (`--scale-mb`, 200 MB): 2 actors against the plain loop where the actors'
   start and the last unit's tail are a small part of the span, `--scale-rounds` times, each
   Kiln run between two plain runs, with the CPU seconds of the actors, the driver and Ray's
   other processes.
2. Peak RSS (and USS) of the driver and of each tokenizer actor (psutil, sampled every 0.2 s) at two
   corpus sizes 10x apart, the larger over 2 GB (site-packages seen through several symlinked
   copies: the same bytes again, read again), with the byte tokenizer and 2 actors; then from
   one large Parquet file and from one twice its size.

    python -m bench.prepare                       # ~20 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.common import BIN, REPO, machine, publish, results_file


def corpus_files(limit_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["purelib"])
    out, held = [], 0
    for p in sorted(root.rglob("*.py")):
        if held >= limit_bytes:
            break
        if p.is_file() and p.stat().st_size:
            out.append(p)
            held += p.stat().st_size
    return out


def link_corpus(files: list[Path], where: Path, copies: int = 1) -> int:
    """A directory of symlinks to the files (each copy under its own folder); its bytes."""
    total = 0
    for c in range(copies):
        for i, f in enumerate(files):
            dst = where / f"copy{c}" / f"{i:06d}_{f.name}"
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(f)
            total += f.stat().st_size
    return total


def run_measured(cmd: list[str], env: dict | None = None, memory: bool = True) -> tuple[float, dict[str, float]]:
    """Wall seconds, and by kind of process (driver, actor, other Ray): peak RSS, peak USS
    (`-uss`: the driver's and actors' private memory) and CPU seconds summed (`-cpu-s`).
    `memory=False`: CPU seconds only, looked at every second, not 5 times a second with each
    process's smaps read for its USS, CPU this sampler would take from the run it measures."""
    proc = subprocess.Popen(
        cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    peaks: dict[tuple[int, str], tuple[str, int]] = {}
    cpu: dict[int, tuple[str, float]] = {}
    stop = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    name = " ".join(p.cmdline())[:200]
                    what = (
                        "driver"
                        if p.pid == proc.pid
                        else ("actor" if "_UnitActor" in name or "MapBatches" in name else "ray")
                    )
                    # USS too for Kiln's own processes: RSS counts the pages of Ray's shared object
                    # store a process has touched, which are not its own.
                    mem = (p.memory_full_info() if what != "ray" else p.memory_info()) if memory else None
                except psutil.Error:
                    continue
                for kind, val in ((what, mem.rss), (f"{what}-uss", getattr(mem, "uss", 0))) if memory else ():
                    peaks[(p.pid, kind)] = (kind, max(val, peaks.get((p.pid, kind), ("", 0))[1]))
                try:
                    c = p.cpu_times()
                    cpu[p.pid] = (what, c.user + c.system)  # the last seen: CPU seconds up to then
                except psutil.Error:
                    pass
            stop.wait(0.2 if memory else 1.0)

    t = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    t.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    by_kind: dict[str, float] = {}
    for what, rss in peaks.values():
        by_kind[what] = max(by_kind.get(what, 0), rss)
    for what, secs in cpu.values():
        by_kind[f"{what}-cpu-s"] = by_kind.get(f"{what}-cpu-s", 0) + secs
    return wall, by_kind


def plain_loop(files: list[Path], tokenizer_json: str, out: Path, seq_len: int) -> tuple[float, int]:
    """What a user writes without Kiln: one process, read, encode_batch, pack, write shards."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    eot = tok.token_to_id("<|endoftext|>")
    t0, tokens, buf, n = time.perf_counter(), 0, [], 0
    for i in range(0, len(files), 256):
        texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files[i : i + 256]]
        for e in tok.encode_batch(texts):
            buf.append(np.asarray(e.ids + [eot], dtype=np.int32))
        stream = np.concatenate(buf)
        rows = len(stream) // (seq_len + 1)
        table = pa.table(
            {
                "id": np.arange(rows),
                "tokens": pa.FixedSizeListArray.from_arrays(pa.array(stream[: rows * (seq_len + 1)]), seq_len + 1),
            }
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        (out / f"part-{n:05d}.parquet").write_bytes(sink.getvalue())
        tokens, buf, n = tokens + rows * seq_len, [stream[rows * (seq_len + 1) :]], n + 1
    return time.perf_counter() - t0, tokens


def _plain_half(args) -> tuple[float, int]:
    files, tokenizer_json, out, seq_len, barrier = args
    barrier.wait()  # both start together, after their imports
    return plain_loop(files, tokenizer_json, out, seq_len)


def plain_pair(files: list[Path], tokenizer_json: str, out: Path, seq_len: int) -> tuple[float, int]:
    """Two plain loops at once, one process per core, each on every other file: what this
    machine gives two single-threaded tokenizers side by side, with no Ray in between."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        barrier = manager.Barrier(2)
        (out / "a").mkdir(), (out / "b").mkdir()
        done = pool.map(
            _plain_half,
            [
                (files[0::2], tokenizer_json, out / "a", seq_len, barrier),
                (files[1::2], tokenizer_json, out / "b", seq_len, barrier),
            ],
        )
    return max(t for t, _ in done), sum(n for _, n in done)


def prepare_cmd(inp: Path, out: Path, workers: int, tokenizer: str, extra: list[str]) -> list[str]:
    return [
        str(BIN / "kiln"),
        "data",
        "prepare",
        "--input",
        str(inp),
        "--output",
        str(out),
        "--tokenizer",
        tokenizer,
        "--seq-len",
        "512",
        "--workers",
        str(workers),
        *extra,
    ]


def main() -> None:
    # One tokenizer thread in this process too (the plain loop runs here): unset, HF tokenizers
    # spreads encode_batch over every core, and the "1 thread" row measured two.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small-mb", type=int, default=40, help="corpus for the throughput part (MB; 0: skip it)")
    ap.add_argument(
        "--rss-mb", type=int, default=220, help="the smaller corpus of the memory part (MB); x10 the larger"
    )
    ap.add_argument("--unit-mb", type=int, default=4, help="--unit-bytes, in MiB")
    ap.add_argument("--scale-rounds", type=int, default=3, help="Kiln runs at scale, each between two plain runs")
    ap.add_argument(
        "--scale-mb",
        type=int,
        default=200,
        help="a larger corpus for 2 actors against the plain loop, --scale-rounds times (MB; 0: skip)",
    )
    ap.add_argument("--no-memory", action="store_true", help="the throughput part only")
    ap.add_argument("--parquet-only", action="store_true", help="the large Parquet file's memory only")
    args = ap.parse_args()
    lines = [
        f"\n## Data preparation, {time.strftime('%Y-%m-%d %H:%M')}\n",
        f"Machine: {machine()}. Command: `python -m bench.prepare --small-mb {args.small_mb} "
        f"--rss-mb {args.rss_mb} --scale-mb {args.scale_mb} --scale-rounds {args.scale_rounds} --unit-mb {args.unit_mb}"
        f"{' --no-memory' if args.no_memory else ''}{' --parquet-only' if args.parquet_only else ''}`. Corpus: the `.py` files of the installed "
        "packages (site-packages), in sorted order.\n",
    ]
    unit = ["--unit-bytes", str(args.unit_mb << 20)]
    with tempfile.TemporaryDirectory(dir=REPO / "runs" if (REPO / "runs").is_dir() else None) as tmp:
        tmp = Path(tmp)
        if args.small_mb and not args.parquet_only:
            rows, tok_file = throughput_part(tmp, args, unit)
            lines += rows
            if args.scale_mb:
                lines += scale_part(tmp, args, unit, tok_file)
        if not args.no_memory and not args.parquet_only:
            lines += memory_part(tmp, args, unit)
        if not args.no_memory:
            lines += parquet_part(tmp, args, unit)
    text = "\n".join(lines) + "\n"
    publish(text, results_file("data"))


def throughput_part(tmp: Path, args, unit: list[str]) -> tuple[list[str], Path]:
    """Plain loop, two plain loops at once, and Kiln without Ray and with 1 and 2 actors on
    `--small-mb` of text, best of 2 alternating rounds; the rows, and the BPE tokenizer file."""
    files = corpus_files(args.small_mb * 1_000_000)
    mb = link_corpus(files, tmp / "small") / 1e6
    # The tokenizer once (trained by a prepare), then every measured run with that same file.
    subprocess.run(
        prepare_cmd(tmp / "small", tmp / "bpe", 0, "bpe", [*unit, "--vocab-size", "4096"]),
        check=True,
        capture_output=True,
    )
    tok_file = tmp / "bpe" / "tokenizer.json"
    (tmp / "plain").mkdir()
    env1 = {"TOKENIZERS_PARALLELISM": "false"}  # for --workers 0, tokenizing in the driver; actors set it
    results = {}
    for rnd in range(2):  # alternate, and keep each one's best: the machine is noisy
        t_plain, tokens = plain_loop(files, tok_file.read_text(), tmp / "plain", 512)
        results.setdefault("plain", []).append((t_plain, tokens))
        shutil.rmtree(tmp / "pair", ignore_errors=True)
        (tmp / "pair").mkdir()
        results.setdefault("pair", []).append(plain_pair(files, tok_file.read_text(), tmp / "pair", 512))
        for w in (0, 1, 2):  # 0: in this process, no Ray: the pipeline's own cost
            out = tmp / f"kiln{w}-{rnd}"
            wall, _ = run_measured(prepare_cmd(tmp / "small", out, w, str(tok_file), unit), env1, memory=False)
            rate = json.loads((out / "manifest.json").read_text())["throughput"]
            busy = rate["busy_s"] / (max(w, 1) * rate["seconds"])  # of the actors' wall time
            results.setdefault(w, []).append(
                (
                    rate["seconds"],
                    rate["mb_per_s"],
                    rate["tokens_per_s"],
                    wall,
                    busy,
                    rate["mb_per_busy_s"],
                    rate["first_unit_after_s"],
                )
            )
    t_plain, tokens = min(results["plain"])
    plain_mb_s = mb / t_plain
    lines = [
        "### Throughput, BPE (4,096 tokens), seq_len 512\n",
        "| run | MB/s of text | tokens/s | MB/s per core | per core / plain | workers busy | "
        "MB/s per busy worker | first unit after (s) | span (s) | wall incl. start (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| plain loop, 1 process, 1 thread | {plain_mb_s:.2f} | {tokens / t_plain:,.0f} | {plain_mb_s:.2f} "
        f"| 1.00 | | | | {t_plain:.1f} | {t_plain:.1f} |",
    ]
    t_pair, _ = min(results["pair"])
    lines.append(
        f"| plain loop, 2 processes at once (every other file each) | {mb / t_pair:.2f} | | "
        f"{mb / t_pair / 2:.2f} | {mb / t_pair / 2 / plain_mb_s:.2f} | | | | {t_pair:.1f} | {t_pair:.1f} |"
    )
    for w in (0, 1, 2):
        secs, mb_s, tok_s, wall, busy, busy_rate, first = min(results[w])
        cores = max(w, 1)
        name = f"Kiln on Ray, {w} actor(s)" if w else "Kiln without Ray (`--workers 0`), 1 process"
        lines.append(
            f"| {name} | {mb_s:.2f} | {tok_s:,.0f} | {mb_s / cores:.2f} | "
            f"{mb_s / cores / plain_mb_s:.2f} | {busy:.0%} | {busy_rate:.2f} | {first:.1f} | {secs:.1f} | "
            f"{wall:.1f} |"
        )
    lines.append(
        f"\nCorpus {mb:.0f} MB ({len(files):,} files), `--unit-bytes {args.unit_mb} MiB`; best of 2 "
        "alternating rounds. Kiln's MB/s is the manifest's: from the pipeline's start (the actors' start "
        "is in it) to the last record back (Ray's start and shutdown and the BPE training are outside it; "
        "the wall column has them). "
        "*Workers busy*: the time the workers spent on units, over their number times that span; "
        "*MB/s per busy worker*: the text over that busy time (the worker's own pace); *first unit after*: "
        "from the span's start to the first unit's (an actor's start); *span*: the manifest's seconds. "
        "*2 processes at once*: the plain loop twice side by side, from a common start to the slower "
        "one's end: the most two workers get from this machine's two cores, with no Ray.\n"
    )
    return lines, tok_file


def scale_part(tmp: Path, args, unit: list[str], tok_file: Path) -> list[str]:
    """2 actors against the plain loop on a corpus large enough that the actors' start and the
    last unit's tail are a small part of the span, with where the CPU went. Each Kiln run is
    bracketed by a plain run before and after it (plain, Kiln, plain, Kiln, plain) and compared
    with their mean: this machine's pace drifts by up to a fifth over minutes, more than the
    differences measured."""
    files = corpus_files(args.scale_mb * 1_000_000)
    mb = link_corpus(files, tmp / "scale") / 1e6

    def plain() -> float:
        shutil.rmtree(tmp / "scale-plain", ignore_errors=True)
        (tmp / "scale-plain").mkdir()
        return mb / plain_loop(files, tok_file.read_text(), tmp / "scale-plain", 512)[0]

    rows, ratios, before = [], [], plain()
    for rnd in range(args.scale_rounds):
        out = tmp / f"scale-out-{rnd}"
        wall, used = run_measured(prepare_cmd(tmp / "scale", out, 2, str(tok_file), unit), memory=False)
        rate = json.loads((out / "manifest.json").read_text())["throughput"]
        after = plain()
        ref = (before + after) / 2
        ratios.append(rate["mb_per_s"] / 2 / ref)
        rows.append(
            f"| {rnd + 1} | {before:.2f} / {after:.2f} | {rate['mb_per_s']:.2f} | {rate['mb_per_s'] / 2:.2f} | "
            f"**{ratios[-1]:.2f}** | {rate['busy_s'] / (2 * rate['seconds']):.0%} | "
            f"{rate['mb_per_busy_s']:.2f} | {rate['mb_per_busy_s'] / ref:.2f} | {rate['first_unit_after_s']:.1f} | "
            f"{rate['seconds']:.1f} | {wall:.1f} | {mb / wall / 2 / ref:.2f} | "
            f"{used.get('actor-cpu-s', 0):.1f} / {used.get('driver-cpu-s', 0):.1f} / "
            f"{used.get('ray-cpu-s', 0):.1f} of {2 * wall:.0f} |"
        )
        before = after
    return [
        f"### At scale: {mb:,.0f} MB ({len(files):,} files), 2 actors, each run between two plain runs\n",
        "| round | plain loop MB/s, before / after | Kiln MB/s | Kiln MB/s per core | per core / plain | "
        "workers busy | MB/s per busy worker | per busy worker / plain | first unit after (s) | span (s) | "
        "wall (s) | per core / plain, on the wall | "
        "CPU s: actors / driver / Ray's other processes of the wall's core-seconds |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        f"\nMedian *per core / plain* over the {len(ratios)} rounds: **{float(np.median(ratios)):.2f}**.\n",
        "*per core / plain*: Kiln's MB/s per actor (the manifest's: over the pipeline's span, from "
        "its start, the actors' start included, to the last record back) over the mean of the plain "
        "runs just before and after it. *On the wall*: the same over the whole command's wall time, "
        "with the CLI's start, the listing, Ray's start and shutdown: a fixed cost of a few seconds, "
        "whatever the corpus. The CPU seconds are each process's whole life (sampled every 1 s); the "
        "wall's core-seconds are two cores times the Kiln run's wall.\n",
    ]


def memory_part(tmp: Path, args, unit: list[str]) -> list[str]:
    small_mb = link_corpus(corpus_files(args.rss_mb * 1_000_000), tmp / "rss-small") / 1e6
    every = corpus_files(10 * args.rss_mb * 1_000_000)  # all of site-packages, or 10x the small corpus
    copies = -(-10 * int(small_mb * 1e6) // sum(f.stat().st_size for f in every))  # enough for 10x
    large_mb = link_corpus(every, tmp / "rss-large", copies=copies) / 1e6
    rows = [
        "### Peak memory as the corpus grows (byte tokenizer, 2 actors, seq_len 512)\n",
        "| corpus | MB | files | wall (s) | MB/s | driver peak RSS (MiB) | driver peak USS (MiB) | "
        "largest actor peak RSS (MiB) | largest actor peak USS (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, mb in (("rss-small", small_mb), ("rss-large", large_mb)):
        wall, peaks = run_measured(prepare_cmd(tmp / name, tmp / f"out-{name}", 2, "byte", unit))
        n_files = sum(1 for p in (tmp / name).rglob("*") if p.is_symlink())
        mib = {k: v / 2**20 for k, v in peaks.items()}
        rows.append(
            f"| {name} | {mb:,.0f} | {n_files:,} | {wall:.0f} | {mb / wall:.1f} | {mib.get('driver', 0):,.0f} | "
            f"{mib.get('driver-uss', 0):,.0f} | {mib.get('actor', 0):,.0f} | {mib.get('actor-uss', 0):,.0f} |"
        )
        shutil.rmtree(tmp / f"out-{name}", ignore_errors=True)
    rows.append(
        f"\nThe larger corpus is {large_mb / small_mb:.1f}x the smaller (site-packages' sources seen "
        f"through {copies} symlinked copies where one is not enough).\n"
    )
    return rows


def parquet_part(tmp: Path, args, unit: list[str]) -> list[str]:
    """Peak RSS of a prepare from one Parquet file (the small memory corpus's text, a row per
    source file, row groups of 256 rows as datasets are published), and from that file twice
    over: a file over --unit-bytes is read by row-group ranges, so neither grows with the file."""
    table = pa.table(
        {"text": [f.read_bytes().decode("utf-8", errors="replace") for f in corpus_files(args.rss_mb * 1_000_000)]}
    )
    text_mb = pc.sum(pc.binary_length(table.column("text"))).as_py() / 1e6  # UTF-8 bytes
    rows = [
        "### Peak memory from one large Parquet file (byte tokenizer, 2 actors, seq_len 512)\n",
        "| input | text MB | file MB | units | wall (s) | driver peak RSS (MiB) | largest actor peak RSS (MiB) | "
        "largest actor peak USS (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for copies in (1, 2):
        src = tmp / f"parquet-{copies}x.parquet"
        pq.write_table(pa.concat_tables([table] * copies), src, row_group_size=256)
        out = tmp / f"out-parquet-{copies}"
        wall, peaks = run_measured(prepare_cmd(src, out, 2, "byte", unit))
        mib = {k: v / 2**20 for k, v in peaks.items()}
        units = json.loads((out / "manifest.json").read_text())["units"]
        rows.append(
            f"| the corpus x{copies}, one file | {copies * text_mb:,.0f} | {src.stat().st_size / 1e6:,.0f} | {units} | "
            f"{wall:.0f} | {mib.get('driver', 0):,.0f} | {mib.get('actor', 0):,.0f} | "
            f"{mib.get('actor-uss', 0):,.0f} |"
        )
        shutil.rmtree(out, ignore_errors=True)
    rows.append("\n`--unit-bytes` counts the file's (compressed) bytes: a unit holds its range's row groups.\n")
    return rows


if __name__ == "__main__":
    main()
