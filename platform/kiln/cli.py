"""The `kiln` command: data, train, sweep, export, generate, runs, lr, plan, cluster, services, config.

Every failure ends as one line (`kiln.launch.console`): a user's mistake or environment
`kiln: error: ...`, a bug `kiln: internal error: ...`; a traceback, where there is one, goes to a
private file named on that line. Exit codes (`kiln.errors`): 2 for a wrong command or config, 1
for a failure while running, 130 after Ctrl-C and 143 after SIGTERM (128 + the signal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from kiln.cli_args import build_parser
from kiln.clock import process_start
from kiln.errors import ConfigError, KilnError
from kiln.launch.console import run_reporting_errors
from kiln.redact import configure_logging
from kiln.storage import write_whole

_STARTED = process_start()


def _output_file(path: str | None, flag: str, kind: str, inputs: list[str] | tuple = ()) -> Path | None:
    """A file the command writes when it is done, checked before it starts (`kiln.guard`): its
    directory must exist and take new files, and anything there must be an earlier such output,
    so a typo does not cost a finished run its result, nor a user their file."""
    if path is None:
        return None
    from kiln.guard import check_file_target

    check_file_target(path, kind, f"{flag} {path}", inputs=[i for i in inputs if i])
    return Path(path)


def _tracking_uri(given: str) -> str:
    from kiln.tracking.server import check_store, resolve_tracking_uri

    uri = resolve_tracking_uri(given)
    check_store(uri, "--tracking-uri", read_only=True)  # these commands only read the store
    return uri


@contextlib.contextmanager
def _local_model(spec: str, tracking_uri: str) -> Iterator[str]:
    """A models:/ or runs:/ URI downloaded from MLflow for the block (then removed); any other
    spec as it is."""
    from kiln.storage import is_mlflow_model

    if not is_mlflow_model(spec):
        yield spec
        return
    from kiln.tracking.model import downloaded

    with downloaded(spec, _tracking_uri(tracking_uri)) as local:
        yield local


def run(args: argparse.Namespace) -> int:
    """Carry out a parsed command; its handler prints the result and returns the exit code."""
    handlers = {
        "data": _data,
        "train": _train,
        "runs": _runs,
        "sweep": _sweep,
        "lr": _lr,
        "plan": _plan,
        "cluster": _cluster,
        "services": _services,
        "config": _config,
        "export": _export,
        "generate": _generate,
        "eval": _eval,
    }
    return handlers[args.command](args)


def _data(args: argparse.Namespace) -> int:
    if args.data_cmd == "verify":
        return verify_dataset(args.path, args.s3_endpoint)
    from kiln.data.prepare import prepare
    from kiln.data.prepare_config import PrepareConfig, validate_config

    if args.workers is not None and args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: expected 0 (no Ray) or a number of tokenizer actors")
    cfg = PrepareConfig(
        inputs=args.input,
        output=args.output,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        text_field=args.text_field,
        prompt_field=args.prompt_field,
        response_field=args.response_field,
        chat_field=args.chat_field,
        chat_template=args.chat_template,
        seed=args.seed,
        if_exists=args.if_exists,
        s3_endpoint=args.s3_endpoint,
        on_binary=args.on_binary,
        on_bad_record=args.on_bad_record,
        unit_bytes=args.unit_bytes,
        bpe_sample_bytes=args.bpe_sample_bytes,
    )
    validate_config(cfg)  # the flags first, whatever the Ray address says
    executor = None
    if args.workers != 0:
        from kiln.ray.address import check_ray_address
        from kiln.ray.prepare import on_ray

        address = args.address or os.environ.get("RAY_ADDRESS")
        if address:
            check_ray_address(address)
        executor = on_ray(address, args.workers or 0)
    m = prepare(cfg, executor=executor)
    tr, va = m["splits"]["train"], m["splits"]["val"]
    print(
        f"dataset {args.output}: {tr['tokens']:,} train / {va['tokens']:,} val tokens, "
        f"{len(tr['shards'])} + {len(va['shards'])} shards, vocab {m['tokenizer']['vocab_size']}, "
        f"seq_len {m['seq_len']}, unigram entropy {m['unigram_entropy_bits']:.3f} bits/token"
    )
    found, rate = m.get("input", {}), m.get("throughput")
    if any(found.values()):
        print(
            f"  input: {found.get('binary_files_skipped', 0)} binary file(s) skipped, "
            f"{found.get('invalid_utf8_chars', 0)} invalid UTF-8 sequence(s) replaced, "
            f"{found.get('bad_records_skipped', 0)} bad record(s) skipped"
        )
    if rate and rate.get("units"):
        print(
            f"  {rate['mb']:,.1f} MB in {rate['seconds']:.1f} s: {rate['mb_per_s']:.2f} MB/s, "
            f"{rate['tokens_per_s']:,.0f} tokens/s, {rate['units']} unit(s) on {rate['workers']} worker(s)"
        )
    return 0


def _train(args: argparse.Namespace) -> int:
    from kiln.config import fork_overrides, load_config

    overrides = fork_overrides(args.overrides, args.fork)
    if getattr(args, "profile", False):
        steps = load_config(args.config, overrides).train.max_steps
        overrides.append(f"train.profile.start_step={max(1, min(10, steps - 2))}")
    from kiln.launch.summary import RUN_SUMMARY

    cfg = load_config(args.config, overrides)  # validated before anything starts
    summary_json = _output_file(args.summary_json, "--summary-json", RUN_SUMMARY, [args.config])
    if args.dry_run:
        import os

        from kiln.launch.preflight import preflight

        address = args.address or os.environ.get("RAY_ADDRESS")
        print(
            "kiln train --dry-run: every pre-launch check passed; nothing was started.\n"
            + preflight(cfg, remote_cluster=bool(address)).describe()
        )
        return 0
    from kiln.launch.on_ray import train  # Ray's import (about 1.7 s) once the config is known good

    summary = train(cfg, address=args.address, started=_STARTED, verbose=args.verbose)
    print(summary.render())
    if summary_json:
        write_whole(summary_json, summary.to_json(), kind=RUN_SUMMARY)
    return 0


def _runs(args: argparse.Namespace) -> int:
    from kiln.tracking.runs import fetch_runs, run_record, runs_table

    runs = fetch_runs(
        args.experiment,
        args.tracking_uri,
        getattr(args, "sort", None),
        args.limit,
        sweep=args.sweep,
        descending=getattr(args, "desc", False),
    )
    print(json.dumps([run_record(r) for r in runs], indent=1) if args.json else runs_table(runs))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from kiln.sweep.run import run_sweep
    from kiln.sweep.summary import SWEEP_SUMMARY

    summary_json = _output_file(args.summary_json, "--summary-json", SWEEP_SUMMARY, [args.config])
    if args.resume:
        from kiln.sweep.config import stored_sweep

        summary = run_sweep(stored_sweep(args.storage_path, args.resume), address=args.address, resume=True)
    else:
        from kiln.sweep.config import load_sweep

        summary = run_sweep(load_sweep(args.config, args.overrides), address=args.address)
    print(summary.render())
    if summary_json:
        write_whole(summary_json, summary.to_json(), kind=SWEEP_SUMMARY)
    return 0


def _export(args: argparse.Namespace) -> int:
    from kiln.hf_export import shard_size
    from kiln.infer.commands import export
    from kiln.model_size import num_params

    max_shard = shard_size(args.max_shard_size)
    with _local_model(args.model, args.tracking_uri) as local:
        loaded, files = export(
            local, args.output, args.overwrite, args.s3_endpoint, args.dtype, max_shard, args.adapters
        )
    if args.adapters:
        print(f"exported {loaded.source}'s LoRA adapters -> {args.output} (PEFT's layout, base {loaded.base})")
        return 0
    arch = "GPT-2" if loaded.cfg.arch == "gpt" else "Qwen2" if loaded.cfg.qkv_bias else "Llama"
    print(
        f"exported {loaded.source} -> {args.output}: {arch} architecture, {num_params(loaded.cfg):,} "
        f"non-embedding params, vocab {loaded.vocab_size}, {len(files)} files"
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kiln.infer.commands import check_device, read_prompts, run_generate
    from kiln.infer.sampling import Sampling

    s = Sampling(
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.repetition_penalty,
        args.repetition_window,
        args.seed,
        not args.no_stop,
    )
    check_sampling(s, args.batch_size)
    device = check_device(args.device)
    prompts = read_prompts(args.prompt, args.prompts)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    with _local_model(args.model, args.tracking_uri) as local:
        result = run_generate(local, prompts, s, args.batch_size, device, write, chat=args.chat, compile=args.compile)
    print(
        f"{result.new_tokens} tokens in {result.seconds:.2f} s: "
        f"{result.new_tokens / max(result.seconds, 1e-9):,.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def _eval(args: argparse.Namespace) -> int:
    from kiln.tracking.model import evaluate_model

    for flag, value, lowest in (("--batch-size", args.batch_size, 1), ("--max-batches", args.max_batches, 0)):
        if not lowest <= value <= 1_000_000:
            raise ConfigError(f"{flag} {value}: expected an integer in {lowest}..1000000")
    from kiln.storage import is_mlflow_model

    uri = _tracking_uri(args.tracking_uri) if is_mlflow_model(args.model) or args.run_id else ""
    result, logged_to = evaluate_model(
        args.model, args.data, args.split, args.batch_size, args.max_batches, args.s3_endpoint, uri, args.run_id
    )
    print(
        f"eval {args.data} ({result.split}): loss {result.loss:.4f} nats/token, {result.bits_per_byte:.4f} "
        f"bits/byte over {result.tokens:,} tokens ({result.bytes:,} bytes)"
        + (f"; logged to MLflow run {logged_to}" if logged_to else "")
    )
    return 0


def check_sampling(s, batch_size: int) -> None:
    """Each sampling control's range, named by its flag."""
    checks = [
        ("--max-new-tokens", s.max_new_tokens, 1 <= s.max_new_tokens <= 1_000_000, "an integer >= 1"),
        ("--temperature", s.temperature, 0 <= s.temperature <= 100, "a number in [0, 100]"),
        ("--top-k", s.top_k, s.top_k >= 0, "an integer >= 0"),
        ("--top-p", s.top_p, 0 < s.top_p <= 1, "a number in (0, 1]"),
        ("--repetition-penalty", s.repetition_penalty, 0 < s.repetition_penalty <= 100, "a number in (0, 100]"),
        ("--repetition-window", s.repetition_window, s.repetition_window >= 0, "an integer >= 0"),
        ("--seed", s.seed, 0 <= s.seed < 2**63, "an integer >= 0"),
        ("--batch-size", batch_size, 1 <= batch_size <= 4096, "an integer in 1..4096"),
    ]
    for flag, value, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{flag} {value}: expected {expected}")


def _lr(args: argparse.Namespace) -> int:
    from kiln.config import load_config
    from kiln.core.schedule import LR_PLOT, plot_schedule

    cfg = load_config(args.config, args.overrides)
    _output_file(args.out, "--out", LR_PLOT, [args.config])
    plot_schedule(cfg.schedule, cfg.optim.lr, cfg.train.max_steps, args.out)
    print(f"wrote {args.out}: {cfg.schedule.name} over {cfg.train.max_steps} steps, peak lr {cfg.optim.lr:g}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from kiln.plan.cli import plan_from_args

    print(plan_from_args(args))
    return 0


def _cluster(args: argparse.Namespace) -> int:
    from kiln.cluster.check import check_cluster_file

    failed = []
    for f in args.files:
        try:
            print(f"{f}: ok, {check_cluster_file(f)}")
        except KilnError as e:
            failed.append(str(e))
    if failed:
        raise ConfigError("\n  ".join(failed))
    return 0


def _services(args: argparse.Namespace) -> int:
    from kiln.tracking import services

    if args.services_cmd == "up":
        started = services.up(
            args.dir,
            args.host,
            args.port,
            args.backend_store_uri,
            args.artifacts_destination,
            args.prometheus,
            args.prometheus_port,
        )
        for s in started:
            print(f"{s.name}: {s.url} (pid {s.pid}, log {s.log})")
        print(f"point runs at it: export MLFLOW_TRACKING_URI={started[0].url}")
    elif args.services_cmd == "down":
        stopped = services.down(args.dir)
        print("stopped " + (", ".join(f"{s.name} (pid {s.pid})" for s in stopped) or "nothing"))
    else:
        rows = services.status(args.dir)
        for s, alive in rows:
            print(f"{s.name}: {s.url} pid {s.pid} {'running' if alive else 'NOT running'}")
        if not rows:
            print(f"no services recorded in {args.dir}")
    return 0


def _config(args: argparse.Namespace) -> int:
    from kiln.config import annotated_yaml, config_from_dict, load_config
    from kiln.redact import redact_tree, scrub

    cfg = load_config(args.config, args.overrides)
    print(scrub(annotated_yaml(config_from_dict(redact_tree(cfg.to_dict())))))  # never a secret in clear
    return 0


def verify_dataset(path: str, s3_endpoint: str = "") -> int:
    """`kiln data verify`: the manifest's shape, every shard's footer (rows, and the seq len the
    manifest claims) and every shard's bytes against the SHA-256 the manifest recorded."""
    from kiln.data.manifest import check_shards, find_corrupt_shards, load_manifest
    from kiln.errors import DataError
    from kiln.storage import resolve

    manifest = load_manifest(resolve(path, s3_endpoint))
    check_shards(manifest)
    problems, _ = find_corrupt_shards(manifest)
    if problems:
        raise DataError(f"{len(problems)} bad shard(s) in {manifest.location.uri}: " + "; ".join(problems))
    shards = sum(len(manifest.split(s)["shards"]) for s in ("train", "val"))
    print(f"dataset {manifest.location.uri}: all {shards} shards match their manifest")
    return 0


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    args = build_parser().parse_args(argv)
    return run_reporting_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
