"""The `kiln` command's arguments: the top-level parser and one sub-parser per command.

`kiln.cli` carries the parsed commands out. Choices that come from a registry (optimizers)
are read from it when a value is checked or help is shown, not when the parser is built, so
that `kiln --help` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import typing
from collections.abc import Iterator

_MODEL_HELP = (
    "a run's directory (its newest checkpoint), a checkpoint directory, an exported (Hugging Face) "
    "directory, or an MLflow model: models:/NAME/VERSION or models:/MODEL_ID"
)
_TRACKING_HELP = "MLflow store for models:/ URIs (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"


class Registered:
    """argparse choices that are the names of a registry (`module.attr`), read on use: a name
    registered there appears here too."""

    def __init__(self, module: str, attr: str):
        self.module, self.attr = module, attr

    def _names(self) -> list[str]:
        return list(getattr(importlib.import_module(self.module), self.attr))

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors in Kiln's one-line form (`kiln: error: ...`), still exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.print_usage(sys.stderr)
        from kiln.redact import scrub

        self.exit(2, scrub(f"kiln: error: {self.prog}: {message}") + "\n")


def _port(text: str) -> int:
    """An argparse type: a TCP port a server can listen on."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number in 1..65535")
    return int(text)


def _add_overrides(p: argparse.ArgumentParser, text: str) -> None:
    """`--set KEY=VALUE`, repeatable, into `args.overrides`: every command that reads a config."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=text)


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="run config YAML (jobs/configs/*.yaml); defaults if omitted")
    _add_overrides(p, "override a config field, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument(
        "--fork",
        metavar="RUN",
        default=None,
        help="start a new run from RUN's newest checkpoint (a run name under train.storage_path, or a "
        "run or checkpoint directory) with this config's settings, e.g. a new optim.lr; the "
        "MLflow run is tagged with its parent (kiln.parent.*)",
    )
    p.add_argument(
        "--address", default=None, help="Ray cluster address; default $RAY_ADDRESS, else an embedded local Ray"
    )
    p.add_argument(
        "--summary-json",
        default=None,
        metavar="PATH",
        help="also write the run summary (final metrics, run id) as JSON here",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run every pre-launch check and print the resolved plan; start nothing (no Ray, no MLflow run)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also show Ray's and DeepSpeed's output on the console (always in the run's workers.log)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile 3 steps on rank 0 after warm-up (train.profile.start_step=min(10, max_steps-2)); "
        "trace and top operators go to the run's MLflow artifacts under profile/",
    )


def build_parser() -> argparse.ArgumentParser:
    import kiln

    parser = _Parser(prog="kiln", description="Efficient LLM training on Ray.")
    parser.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _data_parser,
        _train_parser,
        _sweep_parser,
        _export_parser,
        _generate_parser,
        _eval_parser,
        _lr_parser,
        _runs_parser,
        _plan_parser,
        _cluster_parser,
        _services_parser,
        _config_parser,
    ):
        add(sub)
    return parser


def _data_parser(sub) -> None:

    data = sub.add_parser("data", help="prepare tokenized Parquet datasets").add_subparsers(
        dest="data_cmd", required=True
    )
    prep = data.add_parser("prepare", help="tokenize text into Parquet shards + manifest")
    prep.add_argument(
        "--input", action="append", required=True, help="text file, directory, .jsonl or .parquet (repeatable)"
    )
    prep.add_argument("--output", required=True, help="directory or s3://bucket/prefix")
    prep.add_argument(
        "--tokenizer",
        default="bpe",
        help="bpe: a byte-level BPE trained on the train split (default); byte: 256 byte ids + EOT; "
        "or a pretrained tokenizer.json, or the Hugging Face directory of a model to fine-tune",
    )
    prep.add_argument("--vocab-size", type=int, default=4096, help="BPE vocab size (default 4096)")
    prep.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    prep.add_argument("--val-fraction", type=float, default=0.1, help="share of documents for validation")
    prep.add_argument("--shard-tokens", type=int, default=1 << 20, help="target tokens per shard")
    prep.add_argument("--text-field", default="text", help="JSONL field / Parquet column with the text")
    prep.add_argument(
        "--prompt-field",
        default="",
        help="instruction data: the field holding each prompt (with --response-field; only responses are scored)",
    )
    prep.add_argument("--response-field", default="", help="instruction data: the field holding each response")
    prep.add_argument(
        "--chat-field",
        default="",
        help="chat data: the field holding each conversation, a list of "
        "{role, content} messages, rendered with the tokenizer's chat template (only assistant turns "
        "are scored)",
    )
    prep.add_argument(
        "--chat-template",
        default="",
        help="with --chat-field: a Jinja chat template file to use instead of the tokenizer's",
    )
    prep.add_argument("--seed", type=int, default=1234, help="seeds the train/val split and the row shuffle")
    prep.add_argument(
        "--if-exists",
        choices=["error", "reuse", "overwrite"],
        default="error",
        help="if the output already holds a dataset (default: error)",
    )
    prep.add_argument("--s3-endpoint", default="", help="S3-compatible endpoint URL (default $AWS_ENDPOINT_URL)")
    prep.add_argument(
        "--on-binary",
        choices=["error", "skip"],
        default="error",
        help="an input holding binary data (NUL bytes): stop with an error (default), or skip it",
    )
    prep.add_argument(
        "--on-bad-record",
        choices=["error", "skip"],
        default="error",
        help="a JSONL record that is not JSON or lacks the field: stop naming its file and line "
        "(default), or skip it and count it in the manifest",
    )
    prep.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizer actors on Ray (default: one per CPU of the cluster; 0: no Ray, in this process)",
    )
    prep.add_argument("--address", default=None, help="Ray cluster address; default $RAY_ADDRESS, else embedded")
    prep.add_argument(
        "--unit-bytes",
        type=int,
        default=32 << 20,
        help="input bytes a tokenizer task takes at once (default 32 MiB): bounds each worker's memory",
    )
    prep.add_argument(
        "--bpe-sample-bytes", type=int, default=64 << 20, help="text the BPE is trained on, at most (default 64 MiB)"
    )

    verify = data.add_parser("verify", help="check every shard of a dataset against its manifest's SHA-256")
    verify.add_argument("path", help="dataset directory or s3://bucket/prefix")
    verify.add_argument("--s3-endpoint", default="", help="S3-compatible endpoint URL (default $AWS_ENDPOINT_URL)")


def _train_parser(sub) -> None:
    train = sub.add_parser("train", help="train on Ray Train + DeepSpeed, logging to MLflow")
    _add_train_args(train)


def _sweep_parser(sub) -> None:
    sweep = sub.add_parser(
        "sweep",
        help="Ray Tune sweep: every trial a Ray Train run, all in MLflow",
        description="Run (or resume) a sweep file from jobs/configs/sweeps/.",
    )
    what = sweep.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="sweep YAML (jobs/configs/sweeps/*.yaml)")
    what.add_argument("--resume", metavar="NAME", help="resume the interrupted sweep NAME")
    _add_overrides(sweep, "override a sweep-file field, e.g. --set num_samples=4 or --set overrides.train.max_steps=40")
    sweep.add_argument("--storage-path", default="runs/sweeps", help="with --resume: where the sweep's state is")
    sweep.add_argument("--address", default=None, help="Ray cluster address; default $RAY_ADDRESS, else embedded")
    sweep.add_argument("--summary-json", default=None, metavar="PATH", help="also write the ranked trials as JSON")


def _export_parser(sub) -> None:
    exp = sub.add_parser(
        "export",
        help="write a trained model as a Hugging Face directory (safetensors)",
        description="Consolidate a checkpoint's ZeRO or pipeline shards into one Hugging Face "
        "directory (GPT-2 or Llama architecture): config, model.safetensors (or its shards), "
        "tokenizer, generation config.",
    )
    exp.add_argument("model", help=_MODEL_HELP)
    exp.add_argument("--output", required=True, help="directory to create, or s3://bucket/prefix")
    exp.add_argument("--s3-endpoint", default="", help="S3-compatible endpoint URL (default $AWS_ENDPOINT_URL)")
    exp.add_argument("--overwrite", action="store_true", help="replace an earlier export at --output")
    exp.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="the weights' precision (default fp32: the checkpoint's master weights as they are; "
        "bf16 or fp16 halve the size)",
    )
    exp.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest weight file, as transformers takes it (default 5GB; more weights go in "
        "shards listed by model.safetensors.index.json)",
    )
    exp.add_argument(
        "--adapters",
        action="store_true",
        help="a LoRA checkpoint's adapters alone, in PEFT's layout (adapter_model.safetensors and "
        "adapter_config.json, for PeftModel.from_pretrained on the base); without it, the model with "
        "the adapters merged in",
    )
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
    gen.add_argument(
        "--repetition-penalty",
        type=float,
        default=d.repetition_penalty,
        help="> 1 discourages recent tokens (default 1: off)",
    )
    gen.add_argument(
        "--repetition-window",
        type=int,
        default=d.repetition_window,
        help=f"how many recent tokens the penalty looks at (default {d.repetition_window})",
    )
    gen.add_argument("--seed", type=int, default=d.seed, help=f"sampling seed (default {d.seed})")
    gen.add_argument("--no-stop", action="store_true", help="do not stop at end-of-text")
    gen.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1: streamed)")
    gen.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (torch.compile): seconds to compile first, then each token costs less; "
        "pays on long generations and large batches",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user turn in the model's chat template (its tokenizer's), and the "
        "template's end of turn stops the reply",
    )
    gen.add_argument(
        "--device",
        default="auto",
        help="torch device: auto (a GPU where there is one, else the CPU; the default), cpu, cuda or cuda:N",
    )
    gen.add_argument("--tracking-uri", default="", help=_TRACKING_HELP)


def _eval_parser(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="a model's loss and bits per byte on a prepared dataset",
        description="Score a split of a dataset prepared with the model's tokenizer. Bits per byte "
        "compare models with different tokenizers. With an MLflow model (models:/...) "
        "or --run-id, the figures are logged to that run.",
    )
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
    _add_overrides(plot, "override a config field, e.g. --set schedule.name=linear (repeatable)")
    plot.add_argument("--out", default="lr_schedule.png", help="PNG path (default lr_schedule.png)")


def _runs_parser(sub) -> None:
    runs = sub.add_parser("runs", help="list or compare MLflow runs").add_subparsers(dest="runs_cmd", required=True)
    for name, helptext in (("list", "newest runs first"), ("compare", "runs ranked by a metric")):
        r = runs.add_parser(name, help=helptext)
        r.add_argument(
            "--experiment", default="", help="MLflow experiment (default $MLFLOW_EXPERIMENT_NAME, else kiln)"
        )
        r.add_argument("--json", action="store_true", help="print the runs as JSON: id, name, status, params, metrics")
        r.add_argument("--tracking-uri", default="", help="default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
        r.add_argument("--limit", type=int, default=50, help="at most this many runs (default 50)")
        r.add_argument("--sweep", default=None, help="only the trials of this sweep")
        if name == "compare":
            r.add_argument("--sort", default="loss/val", help="metric to rank by")
            r.add_argument("--desc", action="store_true", help="rank highest first (for metrics to maximise)")


def _plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="per-device memory of a training setup, and the cheapest option that fits",
        description="Estimate per-device bytes of parameters, gradients, optimizer state and activations "
        "(ZeRO paper formulas, the model's shapes) for every ZeRO stage x offload x activation "
        "checkpointing choice, and recommend the cheapest that fits. Needs no hardware.",
    )
    plan.add_argument("--config", help="take model, workers, batch, precision and parallelism from this run config")
    _add_overrides(plan, "override a run-config field (with --config or alone)")
    # Not listed here: the list lives in kiln.model, and importing it (torch) for the parser
    # would slow every kiln command; a wrong name is refused with the list.
    plan.add_argument("--model", help="model flavour, as model.flavour takes (debug, gpt2-124m, ...)")
    plan.add_argument("--world-size", type=int, help="devices in the run (default: parallel.num_workers)")
    plan.add_argument("--device-memory-gib", type=float, help="memory per device (default: 80, or the config's)")
    plan.add_argument("--micro-batch", type=int, help="sequences per device per micro-step")
    plan.add_argument("--seq-len", type=int, help="tokens per sequence (default: the flavour's)")
    plan.add_argument("--vocab-size", type=int, help="vocabulary (default 50304, GPT-2's padded)")
    plan.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="compute precision (default: the config's)")
    plan.add_argument(
        "--zero-stage", type=int, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage (default: the config's)"
    )
    plan.add_argument(
        "--offload",
        choices=["none", "optimizer", "optimizer+params"],
        help="ZeRO-Offload to CPU: the optimizer, or (stage 3) parameters too",
    )
    plan.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute activations in backward (default: the config's)",
    )
    plan.add_argument("--pipeline-stages", type=int, help="pipeline-parallel stages (ZeRO 0-1 only)")
    plan.add_argument("--tensor-parallel", type=int, help="ranks splitting each layer's matmuls (inside a node)")
    plan.add_argument("--micro-batches", type=int, help="micro-batches per step in a pipeline")
    # A metavar, so that building the parser never lists (and imports) the registry; help lists it.
    plan.add_argument(
        "--optimizer",
        choices=Registered("kiln.core.optim", "OPTIMIZERS"),
        metavar="NAME",
        help="one of %(choices)s; its state is what ZeRO shards (default: the config's)",
    )
    plan.add_argument(
        "--cluster",
        help="a Ray launcher YAML (cluster/aws-gpu.yaml): also estimate tokens/s, "
        "time to --target-tokens and cost on its GPU nodes",
    )
    plan.add_argument("--nodes", type=int, help="GPU nodes to plan for (default: the node type's max_workers)")
    plan.add_argument("--mfu", type=float, default=0.40, help="assumed model FLOPs utilisation (default 0.40)")
    plan.add_argument("--target-tokens", type=float, help="token budget (default: 20 per parameter, Chinchilla)")
    plan.add_argument("--usd-per-hour", type=float, help="the cluster's price per hour (default: on-demand list)")
    plan.add_argument(
        "--preemptions-per-hour",
        type=float,
        default=0.01,
        help="with --cluster: how often a node is lost (spot), per node-hour (default 0.01); the time "
        "and cost they add at the run config's checkpoint interval",
    )


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
    _add_overrides(cfg, "override a config field, e.g. --set optim.lr=3e-4 (repeatable)")
