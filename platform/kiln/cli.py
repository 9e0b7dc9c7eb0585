"""The `kiln` command: data, train, sweep, export, generate, runs, lr, plan, cluster, services, config.

Every failure ends as one line (`kiln.launch.console`): a user's mistake or environment
`kiln: error: ...`, a bug `kiln: internal error: ...`; a traceback, where there is one, goes to a
private file named on that line. Exit codes (`kiln.errors`): 2 for a wrong command or config, 1
for a failure while running, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path

from kiln.clock import process_start
from kiln.errors import ConfigError, KilnError
from kiln.launch.console import run_reporting_errors
from kiln.redact import configure_logging
from kiln.storage import write_whole

_STARTED = process_start()


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors in Kiln's one-line form (`kiln: error: ...`), still exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.print_usage(sys.stderr)
        from kiln.redact import scrub

        self.exit(2, scrub(f"kiln: error: {self.prog}: {message}") + "\n")


def _output_file(path: str | None, flag: str, kind: str, inputs: list[str] | tuple = ()) -> Path | None:
    """A file the command writes when it is done, checked before it starts (`kiln.guard`): its
    directory must exist and take new files, and anything there must be an earlier such output,
    so a typo does not cost a finished run its result, nor a user their file."""
    if path is None:
        return None
    from kiln.guard import check_file_target

    check_file_target(path, kind, f"{flag} {path}", inputs=[i for i in inputs if i])
    return Path(path)


def _port(text: str) -> int:
    """An argparse type: a TCP port a server can listen on."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number in 1..65535")
    return int(text)


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="run config YAML (jobs/configs/*.yaml); defaults if omitted")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address; default $RAY_ADDRESS, else an embedded local Ray")
    p.add_argument("--summary-json", default=None, metavar="PATH",
                   help="also write the run summary (final metrics, run id) as JSON here")
    p.add_argument("--dry-run", action="store_true",
                   help="run every pre-launch check and print the resolved plan; start nothing (no Ray, no MLflow run)")
    p.add_argument("--verbose", action="store_true",
                   help="also show Ray's and DeepSpeed's output on the console (always in the run's workers.log)")
    p.add_argument("--profile", action="store_true",
                   help="profile 3 steps on rank 0 after warm-up (train.profile.start_step=min(10, max_steps-2)); "
                        "trace and top operators go to the run's MLflow artifacts under profile/")


def build_parser() -> argparse.ArgumentParser:
    import kiln

    parser = _Parser(prog="kiln", description="Efficient LLM training on Ray.")
    parser.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_data_parser, _train_parser, _sweep_parser, _export_parser, _generate_parser, _eval_parser, _lr_parser,
                _runs_parser, _plan_parser, _cluster_parser, _services_parser, _config_parser):
        add(sub)
    return parser


def _data_parser(sub) -> None:

    data = sub.add_parser("data", help="prepare tokenized Parquet datasets").add_subparsers(dest="data_cmd", required=True)
    prep = data.add_parser("prepare", help="tokenize text into Parquet shards + manifest")
    prep.add_argument("--input", action="append", required=True,
                      help="text file, directory, .jsonl or .parquet (repeatable)")
    prep.add_argument("--output", required=True, help="directory or s3://bucket/prefix")
    prep.add_argument("--tokenizer", default="bpe",
                      help="bpe: a byte-level BPE trained on the train split (default); byte: 256 byte ids + EOT; "
                           "or a pretrained tokenizer.json, or the Hugging Face directory of a model to fine-tune")
    prep.add_argument("--vocab-size", type=int, default=4096, help="BPE vocab size (default 4096)")
    prep.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    prep.add_argument("--val-fraction", type=float, default=0.1, help="share of documents for validation")
    prep.add_argument("--shard-tokens", type=int, default=1 << 20, help="target tokens per shard")
    prep.add_argument("--text-field", default="text", help="JSONL field / Parquet column with the text")
    prep.add_argument("--prompt-field", default="", help="instruction data: the field holding each prompt "
                      "(with --response-field; only responses are scored)")
    prep.add_argument("--response-field", default="", help="instruction data: the field holding each response")
    prep.add_argument("--seed", type=int, default=1234, help="seeds the train/val split and the row shuffle")
    prep.add_argument("--if-exists", choices=["error", "reuse", "overwrite"], default="error",
                      help="if the output already holds a dataset (default: error)")
    prep.add_argument("--s3-endpoint", default="", help="S3-compatible endpoint URL (default $AWS_ENDPOINT_URL)")
    prep.add_argument("--on-binary", choices=["error", "skip"], default="error",
                      help="an input holding binary data (NUL bytes): stop with an error (default), or skip it")
    prep.add_argument("--on-bad-record", choices=["error", "skip"], default="error",
                      help="a JSONL record that is not JSON or lacks the field: stop naming its file and line "
                           "(default), or skip it and count it in the manifest")
    prep.add_argument("--workers", type=int, default=None,
                      help="tokenizer actors on Ray (default: one per CPU of the cluster; 0: no Ray, in this process)")
    prep.add_argument("--address", default=None, help="Ray cluster address; default $RAY_ADDRESS, else embedded")
    prep.add_argument("--unit-bytes", type=int, default=32 << 20,
                      help="input bytes a tokenizer task takes at once (default 32 MiB): bounds each worker's memory")
    prep.add_argument("--bpe-sample-bytes", type=int, default=64 << 20,
                      help="text the BPE is trained on, at most (default 64 MiB)")

    verify = data.add_parser("verify", help="check every shard of a dataset against its manifest's SHA-256")
    verify.add_argument("path", help="dataset directory or s3://bucket/prefix")
    verify.add_argument("--s3-endpoint", default="", help="S3-compatible endpoint URL (default $AWS_ENDPOINT_URL)")


def _train_parser(sub) -> None:
    train = sub.add_parser("train", help="train on Ray Train + DeepSpeed, logging to MLflow")
    _add_train_args(train)


def _sweep_parser(sub) -> None:
    sweep = sub.add_parser("sweep", help="Ray Tune sweep: every trial a Ray Train run, all in MLflow",
                           description="Run (or resume) a sweep file from jobs/configs/sweeps/.")
    what = sweep.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="sweep YAML (jobs/configs/sweeps/*.yaml)")
    what.add_argument("--resume", metavar="NAME", help="resume the interrupted sweep NAME")
    sweep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a sweep-file field, e.g. --set num_samples=4 or --set overrides.train.max_steps=40")
    sweep.add_argument("--storage-path", default="runs/sweeps", help="with --resume: where the sweep's state is")
    sweep.add_argument("--address", default=None, help="Ray cluster address; default $RAY_ADDRESS, else embedded")
    sweep.add_argument("--summary-json", default=None, metavar="PATH", help="also write the ranked trials as JSON")


_MODEL_HELP = ("a run's directory (its newest checkpoint), a checkpoint directory, an exported (Hugging Face) "
               "directory, or an MLflow model: models:/NAME/VERSION or models:/MODEL_ID")
_TRACKING_HELP = "MLflow store for models:/ URIs (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"


def _tracking_uri(given: str) -> str:
    from kiln.tracking.server import check_store, resolve_tracking_uri

    uri = resolve_tracking_uri(given)
    check_store(uri, "--tracking-uri", read_only=True)  # these commands only read the store
    return uri


def _local_model(spec: str, tracking_uri: str) -> str:
    """A models:/ or runs:/ URI downloaded from MLflow; any other spec as it is."""
    from kiln.storage import is_mlflow_model

    if not is_mlflow_model(spec):
        return spec
    from kiln.infer.mlflow_model import download

    return download(spec, _tracking_uri(tracking_uri))


def _export_parser(sub) -> None:
    exp = sub.add_parser("export", help="write a trained model as a Hugging Face directory (safetensors)",
                         description="Consolidate a checkpoint's ZeRO or pipeline shards into one Hugging Face "
                                     "directory (GPT-2 or Llama architecture): config, model.safetensors, "
                                     "tokenizer, generation config.")
    exp.add_argument("model", help=_MODEL_HELP)
    exp.add_argument("--output", required=True, help="directory to create, or s3://bucket/prefix")
    exp.add_argument("--s3-endpoint", default="", help="S3-compatible endpoint URL (default $AWS_ENDPOINT_URL)")
    exp.add_argument("--overwrite", action="store_true", help="replace an earlier export at --output")
    exp.add_argument("--tracking-uri", default="", help=_TRACKING_HELP)


def _generate_parser(sub) -> None:
    from kiln.infer.sampling import Sampling

    d = Sampling()
    gen = sub.add_parser("generate", help="sample text from a trained model, streamed as it decodes")
    gen.add_argument("--model", required=True, help=_MODEL_HELP)
    gen.add_argument("--prompt", action="append", default=[], help="text to continue (repeatable)")
    gen.add_argument("--prompts", metavar="FILE", help="a file of prompts, one per line")
    gen.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help=f"default {d.max_new_tokens}")
    gen.add_argument("--temperature", type=float, default=d.temperature, help=f"0: greedy (default {d.temperature})")
    gen.add_argument("--top-k", type=int, default=d.top_k, help="sample among the k likeliest (default 0: all)")
    gen.add_argument("--top-p", type=float, default=d.top_p, help="nucleus: the likeliest summing to p (default 1)")
    gen.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                     help="> 1 discourages recent tokens (default 1: off)")
    gen.add_argument("--repetition-window", type=int, default=d.repetition_window,
                     help=f"how many recent tokens the penalty looks at (default {d.repetition_window})")
    gen.add_argument("--seed", type=int, default=d.seed, help=f"sampling seed (default {d.seed})")
    gen.add_argument("--no-stop", action="store_true", help="do not stop at end-of-text")
    gen.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1: streamed)")
    gen.add_argument("--device", default="cpu", help="torch device (default cpu)")
    gen.add_argument("--tracking-uri", default="", help=_TRACKING_HELP)


def _eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="a model's loss and bits per byte on a prepared dataset",
                        description="Score a split of a dataset prepared with the model's tokenizer. Bits per byte "
                                    "compare models with different tokenizers. With an MLflow model (models:/...) "
                                    "or --run-id, the figures are logged to that run.")
    ev.add_argument("--model", required=True, help=_MODEL_HELP)
    ev.add_argument("--data", required=True, help="dataset directory or s3://bucket/prefix")
    ev.add_argument("--split", choices=["val", "train"], default="val", help="default val")
    ev.add_argument("--batch-size", type=int, default=8, help="rows per forward (default 8)")
    ev.add_argument("--max-batches", type=int, default=0, help="stop after this many batches (default 0: all)")
    ev.add_argument("--run-id", default="", help="MLflow run to log the figures to")
    ev.add_argument("--tracking-uri", default="", help=_TRACKING_HELP)
    ev.add_argument("--s3-endpoint", default="", help="S3-compatible endpoint URL (default $AWS_ENDPOINT_URL)")


def _lr_parser(sub) -> None:
    lr = sub.add_parser("lr", help="learning-rate schedules").add_subparsers(dest="lr_cmd", required=True)
    plot = lr.add_parser("plot", help="write a PNG of a run config's LR schedule")
    plot.add_argument("--config", help="run config YAML (defaults if omitted)")
    plot.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config field, e.g. --set schedule.name=linear (repeatable)")
    plot.add_argument("--out", default="lr_schedule.png", help="PNG path (default lr_schedule.png)")


def _runs_parser(sub) -> None:
    runs = sub.add_parser("runs", help="list or compare MLflow runs").add_subparsers(dest="runs_cmd", required=True)
    for name, helptext in (("list", "newest runs first"), ("compare", "runs ranked by a metric")):
        r = runs.add_parser(name, help=helptext)
        r.add_argument("--experiment", default="kiln", help="MLflow experiment (default kiln)")
        r.add_argument("--tracking-uri", default="", help="default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
        r.add_argument("--limit", type=int, default=50, help="at most this many runs (default 50)")
        r.add_argument("--sweep", default=None, help="only the trials of this sweep")
        if name == "compare":
            r.add_argument("--sort", default="loss/val", help="metric to rank by")
            r.add_argument("--desc", action="store_true", help="rank highest first (for metrics to maximise)")


def _plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan", help="per-device memory of a training setup, and the cheapest option that fits",
        description="Estimate per-device bytes of parameters, gradients, optimizer state and activations "
                    "(ZeRO paper formulas, the model's shapes) for every ZeRO stage x offload x activation "
                    "checkpointing choice, and recommend the cheapest that fits. Needs no hardware.")
    plan.add_argument("--config", help="take model, workers, batch, precision and parallelism from this run config")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a run-config field (with --config or alone)")
    # Not listed here: the list lives in kiln.model, and importing it (torch) for the parser
    # would slow every kiln command; a wrong name is refused with the list.
    plan.add_argument("--model", help="model flavour, as model.flavour takes (debug, gpt2-124m, ...)")
    plan.add_argument("--world-size", type=int, help="devices in the run (default: parallel.num_workers)")
    plan.add_argument("--device-memory-gib", type=float, help="memory per device (default: 80, or the config's)")
    plan.add_argument("--micro-batch", type=int, help="sequences per device per micro-step")
    plan.add_argument("--seq-len", type=int, help="tokens per sequence (default: the flavour's)")
    plan.add_argument("--vocab-size", type=int, help="vocabulary (default 50304, GPT-2's padded)")
    plan.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="compute precision (default: the config's)")
    plan.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage (default: the config's)")
    plan.add_argument("--offload", choices=["none", "optimizer", "optimizer+params"],
                      help="ZeRO-Offload to CPU: the optimizer, or (stage 3) parameters too")
    plan.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                      help="recompute activations in backward (default: the config's)")
    plan.add_argument("--pipeline-stages", type=int, help="pipeline-parallel stages (ZeRO 0-1 only)")
    plan.add_argument("--micro-batches", type=int, help="micro-batches per step in a pipeline")
    plan.add_argument("--optimizer", choices=["adamw", "adam", "lamb", "rmsprop", "sgd"],
                      help="its state is what ZeRO shards (default: the config's)")
    plan.add_argument("--cluster", help="a Ray launcher YAML (cluster/aws-gpu.yaml): also estimate tokens/s, "
                      "time to --target-tokens and cost on its GPU nodes")
    plan.add_argument("--nodes", type=int, help="GPU nodes to plan for (default: the node type's max_workers)")
    plan.add_argument("--mfu", type=float, default=0.40, help="assumed model FLOPs utilisation (default 0.40)")
    plan.add_argument("--target-tokens", type=float, help="token budget (default: 20 per parameter, Chinchilla)")
    plan.add_argument("--usd-per-hour", type=float, help="the cluster's price per hour (default: on-demand list)")


def _cluster_parser(sub) -> None:
    cluster = sub.add_parser("cluster", help="Ray cluster files").add_subparsers(dest="cluster_cmd", required=True)
    check = cluster.add_parser("check", help="validate cluster launcher YAMLs and KubeRay manifests before `ray up`")
    check.add_argument("files", nargs="+", metavar="FILE", help="e.g. cluster/aws-gpu.yaml cluster/kuberay/*.yaml")


def _services_parser(sub) -> None:
    services = sub.add_parser("services", help="a shared MLflow server (and Prometheus) on this machine")
    svc = services.add_subparsers(dest="services_cmd", required=True)
    for name, helptext in (("up", "start them"), ("down", "stop them"), ("status", "show what runs")):
        s = svc.add_parser(name, help=helptext)
        s.add_argument("--dir", default="runs/services", help="state, logs, SQLite store and artifacts")
        if name == "up":
            s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
            s.add_argument("--port", type=_port, default=5000, help="MLflow server port (default 5000)")
            s.add_argument("--backend-store-uri", help="default sqlite:///<dir>/mlflow.db; e.g. postgresql://...")
            s.add_argument("--artifacts-destination", help="default <dir>/artifacts; e.g. s3://bucket/mlflow")
            s.add_argument("--prometheus", action="store_true", help="also run Prometheus on Ray's metrics")
            s.add_argument("--prometheus-port", type=_port, default=9090, help="Prometheus port (default 9090)")


def _config_parser(sub) -> None:
    cfg = sub.add_parser("config", help="print a run config as annotated YAML")
    cfg.add_argument("--config", help="YAML to resolve (defaults if omitted)")
    cfg.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field, e.g. --set optim.lr=3e-4 (repeatable)")


def run(args: argparse.Namespace) -> int:
    """Carry out a parsed command; its handler prints the result and returns the exit code."""
    handlers = {"data": _data, "train": _train, "runs": _runs, "sweep": _sweep, "lr": _lr, "plan": _plan,
                "cluster": _cluster, "services": _services, "config": _config, "export": _export,
                "generate": _generate, "eval": _eval}
    return handlers[args.command](args)


def _data(args: argparse.Namespace) -> int:
    if args.data_cmd == "verify":
        return verify_dataset(args.path, args.s3_endpoint)
    from kiln.data.prepare import prepare
    from kiln.data.prepare_config import PrepareConfig, validate_config

    if args.workers is not None and args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: expected 0 (no Ray) or a number of tokenizer actors")
    cfg = PrepareConfig(
        inputs=args.input, output=args.output, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        seq_len=args.seq_len, val_fraction=args.val_fraction, shard_tokens=args.shard_tokens,
        text_field=args.text_field, prompt_field=args.prompt_field, response_field=args.response_field,
        seed=args.seed, if_exists=args.if_exists, s3_endpoint=args.s3_endpoint, on_binary=args.on_binary,
        on_bad_record=args.on_bad_record, unit_bytes=args.unit_bytes, bpe_sample_bytes=args.bpe_sample_bytes)
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
    print(f"dataset {args.output}: {tr['tokens']:,} train / {va['tokens']:,} val tokens, "
          f"{len(tr['shards'])} + {len(va['shards'])} shards, vocab {m['tokenizer']['vocab_size']}, "
          f"seq_len {m['seq_len']}, unigram entropy {m['unigram_entropy_bits']:.3f} bits/token")
    found, rate = m.get("input", {}), m.get("throughput")
    if any(found.values()):
        print(f"  input: {found.get('binary_files_skipped', 0)} binary file(s) skipped, "
              f"{found.get('invalid_utf8_chars', 0)} invalid UTF-8 sequence(s) replaced, "
              f"{found.get('bad_records_skipped', 0)} bad record(s) skipped")
    if rate and rate.get("units"):
        print(f"  {rate['mb']:,.1f} MB in {rate['seconds']:.1f} s: {rate['mb_per_s']:.2f} MB/s, "
              f"{rate['tokens_per_s']:,.0f} tokens/s, {rate['units']} unit(s) on {rate['workers']} worker(s)")
    return 0


def _train(args: argparse.Namespace) -> int:
    from kiln.config import load_config
    from kiln.launch.on_ray import train

    overrides = list(args.overrides)
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
        print("kiln train --dry-run: every pre-launch check passed; nothing was started.\n"
              + preflight(cfg, remote_cluster=bool(address)).describe())
        return 0
    summary = train(cfg, address=args.address, started=_STARTED, verbose=args.verbose)
    print(summary.render())
    if summary_json:
        write_whole(summary_json, summary.to_json(), kind=RUN_SUMMARY)
    return 0


def _runs(args: argparse.Namespace) -> int:
    from kiln.tracking.runs import fetch_runs, runs_table

    runs = fetch_runs(args.experiment, args.tracking_uri, getattr(args, "sort", None), args.limit,
                      sweep=args.sweep, descending=getattr(args, "desc", False))
    print(runs_table(runs))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from kiln.sweep.run import SWEEP_SUMMARY, run_sweep

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
    from kiln.infer.commands import export
    from kiln.model import num_params

    loaded, files = export(_local_model(args.model, args.tracking_uri), args.output, args.overwrite, args.s3_endpoint)
    arch = {"gpt": "GPT-2", "llama": "Llama"}[loaded.cfg.arch]
    print(f"exported {loaded.source} -> {args.output}: {arch} architecture, {num_params(loaded.cfg):,} "
          f"non-embedding params, vocab {loaded.vocab_size}, {len(files)} files")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kiln.infer.commands import check_device, read_prompts, run_generate
    from kiln.infer.sampling import Sampling

    s = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.repetition_penalty,
                 args.repetition_window, args.seed, not args.no_stop)
    check_sampling(s, args.batch_size)
    check_device(args.device)
    prompts = read_prompts(args.prompt, args.prompts)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = run_generate(_local_model(args.model, args.tracking_uri), prompts, s, args.batch_size, args.device, write)
    print(f"{result.new_tokens} tokens in {result.seconds:.2f} s: "
          f"{result.new_tokens / max(result.seconds, 1e-9):,.1f} tokens/s", file=sys.stderr)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from kiln.infer.evaluate import evaluate_model

    for flag, value, lowest in (("--batch-size", args.batch_size, 1), ("--max-batches", args.max_batches, 0)):
        if not lowest <= value <= 1_000_000:
            raise ConfigError(f"{flag} {value}: expected an integer in {lowest}..1000000")
    from kiln.storage import is_mlflow_model

    uri = _tracking_uri(args.tracking_uri) if is_mlflow_model(args.model) or args.run_id else ""
    result, logged_to = evaluate_model(args.model, args.data, args.split, args.batch_size, args.max_batches,
                                       args.s3_endpoint, uri, args.run_id)
    print(f"eval {args.data} ({result.split}): loss {result.loss:.4f} nats/token, {result.bits_per_byte:.4f} "
          f"bits/byte over {result.tokens:,} tokens ({result.bytes:,} bytes)"
          + (f"; logged to MLflow run {logged_to}" if logged_to else ""))
    return 0


def check_sampling(s, batch_size: int) -> None:
    """Each sampling control's range, named by its flag."""
    checks = [("--max-new-tokens", s.max_new_tokens, 1 <= s.max_new_tokens <= 1_000_000, "an integer >= 1"),
              ("--temperature", s.temperature, 0 <= s.temperature <= 100, "a number in [0, 100]"),
              ("--top-k", s.top_k, s.top_k >= 0, "an integer >= 0"),
              ("--top-p", s.top_p, 0 < s.top_p <= 1, "a number in (0, 1]"),
              ("--repetition-penalty", s.repetition_penalty, 0 < s.repetition_penalty <= 100, "a number in (0, 100]"),
              ("--repetition-window", s.repetition_window, s.repetition_window >= 0, "an integer >= 0"),
              ("--seed", s.seed, 0 <= s.seed < 2**63, "an integer >= 0"),
              ("--batch-size", batch_size, 1 <= batch_size <= 4096, "an integer in 1..4096")]
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
        started = services.up(args.dir, args.host, args.port, args.backend_store_uri,
                              args.artifacts_destination, args.prometheus, args.prometheus_port)
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
