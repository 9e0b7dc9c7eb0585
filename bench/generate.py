"""Generation throughput on this machine's CPU, in one run: Kiln's `generate` with its KV cache,
the same without it (every step recomputes the whole sequence), and transformers' `generate`
on Kiln's export of the same model, greedy, the same prompts and the same number of new tokens.

Random weights (the speed of a forward does not depend on them), GPT-2 and Llama shapes at two
sizes, one prompt and a batch of eight. Rounds alternate which runs first; medians are reported.
Appends a table to bench/results/generation.md.

    python -m bench.generate                 # about 3 minutes on 2 cores
    python -m bench.generate --rounds 5 --new-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine, publish, results_file
from kiln import hf_export
from kiln.data.tokenizer import ByteTokenizer
from kiln.infer.generate import Sampling, generate
from kiln.model import GPT, GPTConfig
from kiln.model_size import num_params

SHAPES = {
    "gpt small (debug)": GPTConfig(vocab_size=320, seq_len=256, n_layer=2, n_head=4, d_model=128),
    "gpt 8x512": GPTConfig(vocab_size=320, seq_len=256, n_layer=8, n_head=8, d_model=512),
    "llama 8x512, GQA 8/2": GPTConfig(
        arch="llama", vocab_size=320, seq_len=256, n_layer=8, n_head=8, n_kv_head=2, d_model=512, tie_embeddings=False
    ),
}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _transformers(model: GPT, tmp: Path):
    import transformers

    hf_export.write(model.cfg, model.state_dict(), ByteTokenizer(), 257, tmp)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp).eval()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(
    cfg: GPTConfig,
    batch: int,
    prompt_len: int,
    new: int,
    rounds: int,
    device: str = "cpu",
    dtype: str = "fp32",
    compiled: bool = False,
) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    prompts = torch.randint(0, 256, (batch, prompt_len))
    s = Sampling(max_new_tokens=new, temperature=0, stop_at_eot=False)
    with tempfile.TemporaryDirectory() as tmp:
        theirs = _transformers(model, Path(tmp)).to(device=device, dtype=DTYPES[dtype])
    model = model.to(device=device, dtype=DTYPES[dtype])
    ids = prompts.tolist()
    prompts = prompts.to(device)
    runs = {
        "kiln, KV cache": lambda: generate(model, ids, s, 256, 257),
        "kiln, no cache": lambda: generate(model, ids, s, 256, 257, use_cache=False),
        "transformers": lambda: theirs.generate(
            prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=256
        ),
    }
    with torch.no_grad():
        mine = generate(model, ids, s, 256, 257).tokens
        if compiled:  # generate(compile=True): a StaticKVCache, the decode step compiled once
            start = time.perf_counter()
            fast = generate(model, ids, s, 256, 257, compile=True).tokens
            compile_s = time.perf_counter() - start
            assert fast == mine, "the compiled decode gives other tokens"
            runs["kiln, compiled decode"] = lambda: generate(model, ids, s, 256, 257, compile=True)
        ref = theirs.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=256)
        theirs_tokens = ref[:, prompt_len:].tolist()
        if dtype == "fp32":
            assert mine == theirs_tokens, "Kiln and transformers disagree: the timing would compare unlike work"
        # In bf16 two correct implementations may round a near-tie apart and then diverge; the
        # work per token is the same, so the timing still compares like with like.
        for fn in runs.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                times[name].append(_timed(runs[name]))
    out = {k: batch * new / statistics.median(v) for k, v in times.items()}
    if compiled:
        out["first compiled call, s"] = compile_s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument(
        "--compile", action="store_true", help="also time Kiln's compiled decode (generate(compile=True)), 8x512 shapes"
    )
    ap.add_argument("--results", default=results_file("generation"))
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to bench/results/generation.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.compile:
        return _compiled(args)
    rows = []
    for name, cfg in SHAPES.items():
        for batch in (1, 8):
            tps = measure(cfg, batch, args.prompt_len, args.new_tokens, args.rounds, args.device, args.dtype)
            rows.append(
                f"| {name} | {num_params(cfg) / 1e6:.1f}M | {batch} | {tps['kiln, KV cache']:,.0f} | "
                f"{tps['kiln, no cache']:,.0f} | {tps['transformers']:,.0f} | "
                f"{tps['kiln, KV cache'] / tps['kiln, no cache']:.2f} | "
                f"{tps['kiln, KV cache'] / tps['transformers']:.2f} |"
            )
            print(rows[-1], flush=True)
    return _publish(
        args,
        "Generation",
        f"Greedy, {args.prompt_len}-token prompts, {args.new_tokens} new tokens each; tokens/s of new tokens (prompt "
        "processing included), medians of the rounds. Each row first checks that Kiln's and transformers' tokens are "
        "identical (in fp32).",
        [
            "model",
            "params",
            "prompts",
            "Kiln, KV cache",
            "Kiln, no cache",
            "transformers",
            "cache speed-up",
            "Kiln / transformers",
        ],
        rows,
    )


def _publish(args, title: str, note: str, columns: list[str], rows: list[str]) -> int:
    """One results section: the title with the device, dtype, time and machine, the command and
    `note`, then the table (its first column left-aligned, the others right-aligned)."""
    table = "\n".join(
        [
            f"## {title} on {args.device}, {args.dtype}, {time.strftime('%Y-%m-%d %H:%M')} ({machine()}, "
            f"{args.threads} threads)",
            "",
            f"Command: `python -m bench.generate {' '.join(sys.argv[1:])}`. {note}",
            "",
            "| " + " | ".join(columns) + " |",
            "|---|" + "---:|" * (len(columns) - 1),
            *rows,
            "",
        ]
    )
    if not args.no_write:
        publish(table, args.results)
    return 0


def _compiled(args) -> int:
    """Kiln's decode eager and compiled, against transformers, in one run: both families."""
    rows = []
    for name, batch in [(n, b) for n in ("gpt 8x512", "llama 8x512, GQA 8/2") for b in (1, 8)]:
        tps = measure(
            SHAPES[name], batch, args.prompt_len, args.new_tokens, args.rounds, args.device, args.dtype, compiled=True
        )
        rows.append(
            f"| {name} | {batch} | {tps['kiln, KV cache']:,.0f} | {tps['kiln, compiled decode']:,.0f} | "
            f"{tps['transformers']:,.0f} | {tps['kiln, compiled decode'] / tps['kiln, KV cache']:.2f} | "
            f"{tps['kiln, compiled decode'] / tps['transformers']:.2f} | {tps['first compiled call, s']:.1f} s |"
        )
        print(rows[-1], flush=True)
    return _publish(
        args,
        "Compiled decode",
        f"Greedy, {args.prompt_len}-token prompts, {args.new_tokens} new tokens; tokens/s of new tokens, medians of "
        "the rounds, after a warm-up. The compiled decode's tokens are checked equal to the eager decode's first; its "
        "first call (the compile) is timed apart.",
        [
            "model",
            "prompts",
            "Kiln, eager",
            "Kiln, compiled decode",
            "transformers",
            "compiled / eager",
            "compiled / transformers",
            "first compiled call",
        ],
        rows,
    )


if __name__ == "__main__":
    raise SystemExit(main())
