"""The bad-input table: one row per mistake a user can make, across every `kiln` command.

Each row is the command as typed (`{ws}` is the case's own empty directory, `{corpus}` a
directory of real text, `{ds}` a copy of a valid byte dataset where `dataset=True`), what the
one `kiln: error:` line must contain (the field or file it names), the exit code (2: the
command or config is wrong, 1: it failed while running) and any files the user had there
first. Secrets planted in a row's own arguments or files are listed in `secrets`; the
harness adds secrets to every case's environment too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# Planted in every case's environment, in the shapes `kiln.redact` knows.
ENV_SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAPLANTEDENVKEY000",
    "AWS_SECRET_ACCESS_KEY": "planted-env-aws-secret-Zq81",
    "HF_TOKEN": "hf_PlantedEnvTokenValue0123456789ab",
    "GITHUB_TOKEN": "ghp_PlantedEnvTokenValue0123456789abcd",
    "MLFLOW_TRACKING_PASSWORD": "planted-env-mlflow-pw-Qx7",
}
PW = "planted-pass-Vb92"  # a password in a URL's userinfo
TOKEN_USER = "ghp_PlantedUrlToken0123456789abcdefgh"  # a token as a URL's whole userinfo
DS_SECRET = "planted-ds-secret-Kq55"  # in the DeepSpeed passthrough
DS_SET = f"parallel.deepspeed.aws_secret_access_key={DS_SECRET}"


@dataclass
class Case:
    id: str
    argv: list[str]
    needle: str
    code: int = 2
    files: dict[str, str | bytes] = field(default_factory=dict)
    dataset: bool = False
    secrets: tuple[str, ...] = ()
    model: bool = False
    """A copy of a tiny Hugging Face GPT-2 at `{hf}` (`hf/` in the case's directory)."""
    env: dict[str, str] = field(default_factory=dict)


def _train(id, sets, needle, code=2, **kw):
    """A `kiln train` case; every one also carries a secret in the DeepSpeed passthrough."""
    args = [a for s in [*sets, DS_SET] for a in ("--set", s)]
    return Case(id, ["train", *args], needle, code, secrets=(DS_SECRET, *kw.pop("secrets", ())), **kw)


def _cfg(id, yaml_text, needle, code=2, command="train", **kw):
    """A config file the user wrote, given to a command that reads one."""
    return Case(id, [*command.split(), "--config", "c.yaml"], needle, code, files={"c.yaml": yaml_text}, **kw)


def _prep(id, args, needle, code=2, **kw):
    base = {"--input": "{corpus}", "--output": "out", "--tokenizer": "byte", "--seq-len": "32"}
    given = dict(zip(args[::2], args[1::2]))
    argv = ["data", "prepare"] + [x for k, v in {**base, **given}.items() if v is not None for x in (k, v)]
    return Case(id, argv, needle, code, **kw)


PREPARE = [
    _prep("prep-missing-input", ["--input", "nope.txt"], "input 'nope.txt' does not exist", 1),
    _prep("prep-glob-no-match", ["--input", "*.nothing"], "input pattern '*.nothing' matches no files", 1),
    _prep(
        "prep-dir-without-text",
        ["--input", "pics"],
        "input directory 'pics' holds no text files",
        1,
        files={"pics/a.png": b"\x89PNG\r\n"},
    ),
    _prep("prep-empty-corpus", ["--input", "e"], "the corpus is empty", 1, files={"e/a.txt": ""}),
    _prep("prep-binary-input", ["--input", "ls.txt"], "ls.txt", 1, files={"ls.txt": b"\x7fELF\x02\x01\x00\x00" * 64}),
    _prep(
        "prep-binary-only-skipped",
        ["--input", "ls.txt", "--on-binary", "skip"],
        "the corpus is empty",
        1,
        files={"ls.txt": b"\x7fELF\x02\x01\x00\x00" * 64},
    ),
    _prep("prep-jsonl-bad-json", ["--input", "d.jsonl"], "d.jsonl", 1, files={"d.jsonl": '{"text": "a"}\n{oops\n'}),
    _prep(
        "prep-jsonl-missing-field",
        ["--input", "d.jsonl", "--text-field", "body"],
        "body",
        1,
        files={"d.jsonl": '{"text": "hello there"}\n'},
    ),
    _prep("prep-parquet-not-parquet", ["--input", "d.parquet"], "d.parquet", 1, files={"d.parquet": "not parquet"}),
    _prep("prep-seq-len-zero", ["--seq-len", "0"], "--seq-len 0"),
    _prep("prep-seq-len-one", ["--seq-len", "1"], "--seq-len 1"),
    _prep("prep-seq-len-negative", ["--seq-len", "-3"], "--seq-len -3"),
    _prep("prep-seq-len-absurd", ["--seq-len", "100000000"], "--seq-len 100000000"),
    _prep("prep-seq-len-not-int", ["--seq-len", "3e2"], "--seq-len"),
    _prep("prep-vocab-negative-byte", ["--vocab-size", "-7"], "--vocab-size -7"),
    _prep("prep-vocab-small-bpe", ["--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size 100"),
    _prep("prep-vocab-absurd-bpe", ["--tokenizer", "bpe", "--vocab-size", "99999999"], "--vocab-size 99999999"),
    _prep("prep-shard-tokens-negative", ["--shard-tokens", "-1"], "--shard-tokens -1"),
    _prep("prep-shard-tokens-below-a-row", ["--shard-tokens", "5"], "--shard-tokens 5"),
    _prep("prep-shard-tokens-absurd", ["--shard-tokens", "100000000000000"], "--shard-tokens 100000000000000"),
    _prep("prep-val-fraction-zero", ["--val-fraction", "0"], "--val-fraction 0"),
    _prep("prep-val-fraction-one", ["--val-fraction", "1"], "--val-fraction 1"),
    _prep("prep-val-fraction-nan", ["--val-fraction", "nan"], "--val-fraction nan"),
    _prep("prep-seed-negative", ["--seed", "-1"], "--seed -1"),
    _prep("prep-unknown-tokenizer", ["--tokenizer", "sentencepiece"], "--tokenizer"),
    _prep("prep-prompt-field-alone", ["--prompt-field", "prompt"], "--prompt-field"),
    _prep(
        "prep-chat-without-template",
        ["--input", "chat.jsonl", "--chat-field", "messages"],
        "--chat-field messages: the byte tokenizer has no special tokens",
        2,
        files={
            "chat.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        },
    ),
    _prep(
        "prep-chat-bpe-without-template",
        ["--input", "chat.jsonl", "--chat-field", "messages", "--tokenizer", "bpe", "--vocab-size", "300"],
        "has no chat template",
        2,
        files={
            "chat.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        },
    ),
    _prep(
        "prep-chat-unknown-role",
        [
            "--input",
            "chat.jsonl",
            "--chat-field",
            "messages",
            "--chat-template",
            "t.jinja",
            "--tokenizer",
            "bpe",
            "--vocab-size",
            "300",
        ],
        "chat.jsonl:2: field 'messages': message 1 has role 'bot'; expected one of",
        1,
        files={
            "t.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "chat.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}\n',
        },
    ),
    _prep("prep-tokenizer-not-json", ["--tokenizer", "tok.json"], "tok.json", files={"tok.json": "{not json"}),
    _prep("prep-tokenizer-binary", ["--tokenizer", "tok.bin"], "tok.bin", files={"tok.bin": b"\x00\xff\xfe"}),
    _prep(
        "prep-tokenizer-without-eot",
        ["--tokenizer", "tok.json"],
        "has no end-of-text token",
        files={
            "tok.json": '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, '
            '"unk_token": "a"}}'
        },
    ),
    _prep("prep-unknown-if-exists", ["--if-exists", "clobber"], "--if-exists"),
    _prep("prep-unknown-on-binary", ["--on-binary", "ignore"], "--on-binary"),
    _prep("prep-unknown-on-bad-record", ["--on-bad-record", "ignore"], "--on-bad-record"),
    _prep("prep-workers-negative", ["--workers", "-2"], "--workers -2"),
    _prep("prep-unit-bytes-tiny", ["--unit-bytes", "10"], "--unit-bytes 10"),
    _prep("prep-bpe-sample-zero", ["--tokenizer", "bpe", "--bpe-sample-bytes", "0"], "--bpe-sample-bytes 0"),
    _prep(
        "prep-jsonl-bad-record-line",
        ["--input", "d.jsonl"],
        "d.jsonl:3",
        1,
        files={"d.jsonl": '{"text": "a b c"}\n{"text": "d e f"}\n{"body": "x"}\n'},
    ),
    _prep("prep-output-is-a-file", ["--output", "notes.txt"], "notes.txt", 1, files={"notes.txt": "mine"}),
    _prep("prep-output-under-a-file", ["--output", "notes.txt/ds"], "notes.txt", 1, files={"notes.txt": "mine"}),
    _prep("prep-output-foreign-dir", ["--output", "mine"], "not a Kiln dataset", 1, files={"mine/notes.md": "keep"}),
    _prep(
        "prep-overwrite-foreign-dir",
        ["--output", "mine", "--if-exists", "overwrite"],
        "not a Kiln dataset",
        1,
        files={"mine/notes.md": "keep", "mine/other/manifest.json": "{}"},
    ),
    _prep(
        "prep-overwrite-cwd", ["--output", ".", "--if-exists", "overwrite"], "--output", 1, files={"notes.md": "keep"}
    ),
    _prep(
        "prep-overwrite-home",
        ["--output", "~", "--if-exists", "overwrite"],
        "--output",
        1,
        files={"home/notes.md": "keep"},
    ),
    _prep("prep-overwrite-root", ["--output", "/", "--if-exists", "overwrite"], "--output", 1),
    _prep(
        "prep-overwrite-repo-root",
        ["--output", "repo", "--if-exists", "overwrite"],
        "repo",
        1,
        files={"repo/.git/HEAD": "ref: refs/heads/main\n", "repo/manifest.json": "{}"},
    ),
    _prep(
        "prep-different-dataset-there",
        ["--output", "ds", "--seq-len", "16"],
        "already holds a different dataset",
        1,
        dataset=True,
    ),
    _prep(
        "prep-fake-manifest-overwrite",
        ["--output", "fake", "--if-exists", "overwrite"],
        "not a Kiln dataset",
        1,
        files={
            "fake/manifest.json": '{"format_version": 1, "splits": {"train": {"shards": [{"path": "../x"}]}}}',
            "x": "keep",
        },
    ),
    _prep(
        "prep-s3-unreachable",
        ["--output", "s3://bucket/ds", "--s3-endpoint", f"http://kiln:{PW}@127.0.0.1:9"],
        "s3://bucket/ds",
        1,
        secrets=(PW,),
    ),
    _prep(
        "prep-s3-token-url",
        ["--output", "s3://bucket/ds", "--s3-endpoint", f"http://{TOKEN_USER}@127.0.0.1:9"],
        "s3://bucket/ds",
        1,
        secrets=(TOKEN_USER,),
    ),
    _prep(
        "prep-s3-whole-bucket",
        ["--output", "s3://bucket", "--if-exists", "overwrite", "--s3-endpoint", "http://127.0.0.1:9"],
        "s3://bucket",
        1,
    ),
    _prep("prep-no-output", ["--output", None], "--output"),
    Case("prep-no-input", ["data", "prepare", "--output", "out"], "--input"),
]

VERIFY = [
    Case("verify-missing", ["data", "verify", "nope"], "nope", 1),
    Case("verify-no-manifest", ["data", "verify", "d"], "d", 1, files={"d/a.txt": "x"}),
    Case("verify-manifest-not-json", ["data", "verify", "d"], "manifest.json", 1, files={"d/manifest.json": "{nope"}),
    Case("verify-manifest-number", ["data", "verify", "d"], "manifest.json", 1, files={"d/manifest.json": "42"}),
    Case(
        "verify-manifest-latin1",
        ["data", "verify", "d"],
        "manifest.json",
        1,
        files={"d/manifest.json": b'{"a": "\xe9"}'},
    ),
    Case("verify-tokenizer-a-string", ["data", "verify", "ds"], "tokenizer", 1, dataset=True),
    Case("verify-shard-without-bytes", ["data", "verify", "ds"], "bytes", 1, dataset=True),
    Case("verify-seq-len-changed", ["data", "verify", "ds"], "seq_len", 1, dataset=True),
    Case("verify-shard-missing", ["data", "verify", "ds"], "is missing", 1, dataset=True),
    Case("verify-shard-truncated", ["data", "verify", "ds"], "shard", 1, dataset=True),
    Case("verify-shard-corrupted", ["data", "verify", "ds"], "does not match the SHA-256", 1, dataset=True),
    Case("verify-format-version", ["data", "verify", "ds"], "format_version", 1, dataset=True),
    Case("verify-vocab-below-tokens", ["data", "verify", "ds"], "vocab", 1, dataset=True),
    Case(
        "verify-s3-unreachable",
        ["data", "verify", "s3://bucket/ds", "--s3-endpoint", f"http://u:{PW}@127.0.0.1:9"],
        "s3://bucket/ds",
        1,
        secrets=(PW,),
    ),
]

CONFIG_FILES = [
    _cfg("config-empty", "", "c.yaml"),
    _cfg("config-only-comments", "# nothing\n", "c.yaml"),
    _cfg("config-duplicate-key", "train:\n  max_steps: 5\n  max_steps: 6\n", "max_steps"),
    _cfg("config-latin1", b"train:\n  max_steps: 5 # caf\xe9\n", "c.yaml"),
    _cfg("config-yaml-syntax", "train: [max_steps: 5\n", "c.yaml"),
    _cfg("config-top-level-list", "- train\n", "c.yaml"),
    _cfg("config-top-level-scalar", "42\n", "c.yaml"),
    _cfg("config-section-a-list", "optim: []\n", "optim"),
    _cfg("config-section-a-scalar", "optim: 3\n", "optim"),
    _cfg("config-unknown-section", "optimiser:\n  lr: 0.1\n", "optimiser"),
    _cfg("config-unknown-key", "optim:\n  lrr: 0.1\n", "optim.lrr"),
    _cfg("config-overflow-float", "optim:\n  lr: 1e400\n", "optim.lr"),
    _cfg("config-inf", "parallel:\n  cpus_per_worker: .inf\n", "parallel.cpus_per_worker"),
    _cfg("config-nan", "optim:\n  lr: .nan\n", "optim.lr"),
    _cfg("config-absurd-steps", "train:\n  max_steps: 1.0e+26\n", "train.max_steps"),
    _cfg("config-steps-over-cap", "train:\n  max_steps: 2000000000\n", "train.max_steps"),
    _cfg("config-steps-string", "train:\n  max_steps: many\n", "train.max_steps"),
    _cfg("config-steps-bool", "train:\n  max_steps: true\n", "train.max_steps"),
    _cfg("config-flavour-list", "model:\n  flavour: [debug]\n", "model.flavour"),
    _cfg("config-deepspeed-not-mapping", "parallel:\n  deepspeed: 5\n", "parallel.deepspeed"),
    _cfg("config-anchor-bomb", "a: &a [x, x, x]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n", "unknown config key 'a'"),
    _cfg("config-python-tag", "train: !!python/object/apply:os.system ['true']\n", "c.yaml"),
    _cfg(
        "config-secret-in-uri-and-bad",
        f"logging:\n  tracking_uri: http://me:{PW}@127.0.0.1:9\n  log_every: 0\n",
        "logging.log_every",
        secrets=(PW,),
    ),
    Case("config-missing-file", ["train", "--config", "nope.yaml"], "nope.yaml"),
    Case("config-a-directory", ["train", "--config", "cfgdir"], "cfgdir", files={"cfgdir/x": ""}),
    Case("config-binary", ["train", "--config", "c.yaml"], "c.yaml", files={"c.yaml": b"\x00\x01\x02\xff" * 30}),
]

OVERRIDES = [
    _train("set-no-equals", ["optim.lr"], "optim.lr"),
    _train("lora-without-init-from", ["model.lora.rank=8"], "model.lora.rank > 0 without model.init_from"),
    _train(
        "lora-unknown-target",
        ["model.lora.rank=8", "model.init_from=base", "model.lora.targets=q_proj,wq"],
        "model.lora.targets = 'q_proj,wq'",
    ),
    _train(
        "lora-with-pipeline",
        ["model.lora.rank=8", "model.init_from=base", "parallel.pipeline_stages=2", "parallel.zero_stage=0"],
        "parallel.pipeline_stages = 2 with model.lora",
    ),
    _train(
        "lora-at-zero3",
        ["model.lora.rank=8", "model.init_from=base", "parallel.zero_stage=3"],
        "parallel.zero_stage = 3 with model.lora",
    ),
    _train("document-mask-word", ["data.document_mask=sometimes"], "data.document_mask = 'sometimes' is not allowed"),
    _train(
        "document-mask-with-pipeline",
        ["data.document_mask=true", "parallel.pipeline_stages=2", "parallel.zero_stage=0"],
        "data.document_mask = true with parallel.pipeline_stages = 2",
    ),
    _train("set-empty-key", ["=3"], "--set"),
    _train("set-unknown-field", ["optim.lrr=0.1"], "optim.lrr"),
    _train("set-unknown-section", ["optimiser.lr=0.1"], "optimiser"),
    _train("set-too-deep", ["optim.lr.value=0.1"], "optim.lr"),
    _train("set-lr-zero", ["optim.lr=0"], "optim.lr"),
    _train("set-lr-negative", ["optim.lr=-1"], "optim.lr"),
    _train("set-lr-inf", ["optim.lr=inf"], "optim.lr"),
    _train("set-lr-nan", ["optim.lr=nan"], "optim.lr"),
    _train("set-lr-word", ["optim.lr=fast"], "optim.lr"),
    _train("set-zero-stage-4", ["parallel.zero_stage=4"], "parallel.zero_stage"),
    # parallel.sync (local SGD, DiLoCo): H, the outer step, and the layouts that cannot sync
    _train("sync-every-zero", ["parallel.sync=local_sgd", "parallel.sync_every=0"], "parallel.sync_every"),
    _train("outer-lr-zero", ["parallel.sync=diloco", "parallel.outer_lr=0"], "parallel.outer_lr"),
    _train(
        "powersgd-rank-zero",
        ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=0"],
        "parallel.powersgd_rank",
    ),
    _train(
        "powersgd-zero-2",
        ["parallel.grad_compression=powersgd", "parallel.zero_stage=2"],
        "parallel.grad_compression = 'powersgd' with ZeRO-2",
    ),
    _train("diloco-zero-2", ["parallel.sync=diloco", "parallel.zero_stage=2"], "parallel.sync = 'diloco' with ZeRO-2"),
    _train(
        "diloco-pipeline",
        ["parallel.sync=diloco", "parallel.zero_stage=0", "parallel.pipeline_stages=2"],
        "parallel.sync = 'diloco' with parallel.pipeline_stages = 2",
    ),
    _train(
        "local-sgd-compressed",
        ["parallel.sync=local_sgd", "parallel.zero_stage=0", "parallel.grad_compression=fp16"],
        "parallel.grad_compression = 'fp16'",
    ),
    _train("set-workers-zero", ["parallel.num_workers=0"], "parallel.num_workers"),
    _train("set-workers-absurd", ["parallel.num_workers=10000000"], "parallel.num_workers"),
    _train("set-steps-absurd", ["train.max_steps=100000000000000000000000000"], "train.max_steps"),
    _train("set-micro-batch-zero", ["train.micro_batch_size=0"], "train.micro_batch_size"),
    _train("set-accum-absurd", ["train.grad_accum_steps=1000000000"], "train.grad_accum_steps"),
    _train("set-seq-len-absurd", ["model.seq_len=1000000000"], "model.seq_len"),
    _train("set-vocab-negative", ["model.vocab_size=-5"], "model.vocab_size"),
    _train("set-n-layer-absurd", ["model.n_layer=100000"], "model.n_layer"),
    _train("set-dropout-one", ["model.dropout=1"], "model.dropout"),
    _train("set-flavour-unknown", ["model.flavour=gpt5"], "model.flavour"),
    _train("set-optimizer-unknown", ["optim.name=adafactor"], "optim.name"),
    _train("set-schedule-unknown", ["schedule.name=step"], "schedule.name"),
    _train("set-beta-one", ["optim.beta2=1"], "optim.beta2"),
    _train("set-eps-zero", ["optim.eps=0"], "optim.eps"),
    _train("set-warmup-negative", ["schedule.warmup_steps=-1"], "schedule.warmup_steps"),
    _train("set-min-lr-ratio-two", ["schedule.min_lr_ratio=2"], "schedule.min_lr_ratio"),
    _train("set-grad-clip-negative", ["train.grad_clip=-1"], "train.grad_clip"),
    _train("set-precision-fp8", ["train.precision=fp8"], "train.precision"),
    _train(
        "set-fp16-on-cpu",
        ["data.path={ds}", "train.precision=fp16"],
        "train.precision = 'fp16' is not supported on CPU",
        dataset=True,
    ),
    _train(
        "set-pipeline-zero2",
        ["parallel.pipeline_stages=2", "parallel.zero_stage=2"],
        "parallel.zero_stage = 2 with parallel.pipeline_stages = 2",
    ),
    _train("set-pipeline-not-multiple", ["parallel.pipeline_stages=3"], "parallel.num_workers = 2 is not a multiple"),
    _train("set-tp-not-multiple", ["parallel.num_workers=3", "parallel.tensor_parallel=2"], "parallel.tensor_parallel"),
    _train("set-tp-zero3", ["parallel.tensor_parallel=2", "parallel.zero_stage=3"], "parallel.zero_stage = 3"),
    _train(
        "set-tp-pipeline",
        ["parallel.num_workers=4", "parallel.tensor_parallel=2", "parallel.pipeline_stages=2", "parallel.zero_stage=1"],
        "parallel.pipeline_stages = 2",
    ),
    _train("set-tp-offload", ["parallel.tensor_parallel=2", "parallel.offload_optimizer=cpu"], "parallel.offload_*"),
    _train("set-tp-zero", ["parallel.tensor_parallel=0"], "parallel.tensor_parallel"),
    _train("set-engine-unknown", ["parallel.engine=megatron"], "parallel.engine"),
    _train(
        "set-fsdp2-zero1",
        ["parallel.engine=fsdp2", "parallel.zero_stage=1"],
        "parallel.engine = 'fsdp2' with parallel.zero_stage = 1",
    ),
    _train(
        "set-fsdp2-pipeline",
        ["parallel.engine=fsdp2", "parallel.pipeline_stages=2"],
        "Kiln's FSDP2 engine is data-parallel only",
    ),
    _train("set-fsdp2-offload", ["parallel.engine=fsdp2", "parallel.offload_optimizer=cpu"], "does not offload"),
    _train(
        "set-fsdp2-fp16",
        ["parallel.engine=fsdp2", "train.precision=fp16"],
        "train.precision = 'fp16' with parallel.engine = 'fsdp2'",
    ),
    _train(
        "set-fsdp2-bf16-weights",
        ["parallel.engine=fsdp2", "train.precision=bf16", "train.mixed_precision=weights"],
        "train.mixed_precision = 'weights' with parallel.engine = 'fsdp2'",
    ),
    _train("set-fsdp2-passthrough", ["parallel.engine=fsdp2"], "parallel.deepspeed with parallel.engine = 'fsdp2'"),
    _train(
        "set-tp-heads",
        ["data.path={ds}", "parallel.num_workers=3", "parallel.tensor_parallel=3"],
        "does not divide model n_head = 4",
        dataset=True,
    ),
    _train(
        "set-tp-kv-heads",
        ["data.path={ds}", "model.flavour=llama-debug", "parallel.num_workers=4", "parallel.tensor_parallel=4"],
        "n_kv_head (key/value heads) = 2",
        dataset=True,
    ),
    _train(
        "set-param-offload-zero2",
        ["parallel.offload_params=cpu"],
        "parallel.offload_params = 'cpu' needs parallel.zero_stage = 3",
    ),
    _train("set-offload-gpu", ["parallel.offload_optimizer=gpu"], "parallel.offload_optimizer = 'gpu' is not allowed"),
    _train("set-placement-unknown", ["parallel.placement_strategy=RANDOM"], "parallel.placement_strategy"),
    _train("set-health-inject", ["train.health.inject=boom@3"], "train.health.inject"),
    _train("set-health-spike", ["train.health.spike_factor=0.5"], "train.health.spike_factor"),
    _train("set-health-window-absurd", ["train.health.spike_window=1e30"], "train.health.spike_window"),
    _train("set-profile-ranks", ["train.profile.start_step=2", "train.profile.ranks=x"], "train.profile.ranks"),
    _train("set-profile-past-end", ["train.max_steps=5", "train.profile.start_step=4"], "train.profile"),
    _train("set-checkpoint-minutes-absurd", ["train.checkpoint_every_minutes=1e12"], "train.checkpoint_every_minutes"),
    _train("set-keep-by-unknown", ["train.keep_checkpoints_by=oldest"], "train.keep_checkpoints_by"),
    _train("set-max-failures", ["train.max_failures=-2"], "train.max_failures"),
    _train("set-log-every-zero", ["logging.log_every=0"], "logging.log_every"),
    _train(
        "set-elastic-min-over-max",
        ["parallel.num_workers=[3, 2]"],
        "parallel.num_workers = [3, 2]: expected [min, max] with min <= max",
    ),
    _train("set-experiment-blank", ["logging.experiment= "], "logging.experiment"),
    _train("set-peak-flops-absurd", ["train.peak_flops=1e30"], "train.peak_flops"),
    _train("set-outage-wait-negative", ["logging.outage_wait_s=-1"], "logging.outage_wait_s"),
    Case("set-deepspeed-scalar", ["train", "--set", "parallel.deepspeed=5"], "parallel.deepspeed"),
    _train("set-data-section", ["data=3"], "data"),
    _train("set-mix-not-a-list", ["data.mix=data/a"], "data.mix"),
    _train("set-mix-weight-zero", ["data.mix=[{{path: a, weight: 0}}]"], "data.mix[0].weight"),
    _train("set-mix-weight-word", ["data.mix=[{{path: a, weight: half}}]"], "data.mix[0].weight"),
    _train("set-mix-no-path", ["data.mix=[{{weight: 2}}]"], "data.mix[0].path"),
    _train("set-mix-unknown-key", ["data.mix=[{{path: a, wieght: 2}}]"], "data.mix[0].wieght"),
    _train("set-mix-same-name", ["data.mix=[{{path: x/code}}, {{path: y/code}}]"], "data.mix[1]"),
    _train("set-mix-bad-name", ["data.mix=[{{path: a, name: 'my data'}}]"], "data.mix[0].name"),
    _cfg("config-mix-a-mapping", "data:\n  mix: {path: a, weight: 1}\n", "data.mix"),
]

# A complete checkpoint of 2 ranks at 12 sequences a step (2 x 3 micro-batches x 2), as far as
# preflight reads one: the markers, the card, the state directory.
_CHECKPOINT_2x3x2 = {
    **{
        f"ckpt/kiln_complete.rank{r}.json": json.dumps({"step": 10, "world_size": 2, "rank": r, "tag": "state"})
        for r in (0, 1)
    },
    "ckpt/state/mp_rank_00_model_states.pt": "x",
    "ckpt/kiln_model.json": json.dumps(
        {
            "parallel": {"zero_stage": 2, "pipeline_stages": 1, "tensor_parallel": 1},
            "batch": {"micro_batch_size": 2, "micro_batches_per_step": 3},
        }
    ),
}

LAUNCH = [
    _train("train-no-dataset", ["data.path=nowhere"], "nowhere", 1),
    _train(
        "train-mix-missing-dataset",
        ["data.mix=[{{path: {ds}}}, {{path: nowhere, name: n}}]"],
        "nowhere",
        1,
        dataset=True,
    ),
    _train("train-mix-other-seq-len", ["data.mix=[{{path: {ds}}}, {{path: {ds}32}}]"], "data.mix[1]", 2, dataset=True),
    _train("train-path-not-a-dataset", ["data.path=d"], "d", 1, files={"d/a.txt": "x"}),
    _train("train-seq-len-mismatch", ["data.path={ds}", "model.seq_len=32"], "model.seq_len", dataset=True),
    _train("train-vocab-too-small", ["data.path={ds}", "model.vocab_size=128"], "model.vocab_size", dataset=True),
    _train("train-manifest-wrong-shape", ["data.path={ds}"], "tokenizer", 1, dataset=True),
    _train(
        "train-resume-missing", ["data.path={ds}", "train.resume_from=runs/nope"], "train.resume_from", 2, dataset=True
    ),
    _train(
        "train-resume-no-such-run",
        ["data.path={ds}", "train.resume_from=nosuchrun"],
        "train.resume_from = 'nosuchrun': no such directory, and no run of that name under train.storage_path",
        2,
        dataset=True,
    ),
    _train(
        "train-resume-not-checkpoint",
        ["data.path={ds}", "train.resume_from=ckpt"],
        "train.resume_from",
        2,
        dataset=True,
        files={"ckpt/notes.txt": "x"},
    ),
    _train(
        "train-resume-batch-not-kept",
        ["data.path={ds}", "train.resume_from=ckpt", "train.micro_batch_size=2", "parallel.num_workers=4"],
        "which 4 replicas x train.micro_batch_size = 2 cannot divide",
        2,
        dataset=True,
        files=_CHECKPOINT_2x3x2,
    ),
    Case(
        "train-fork-no-checkpoint",
        ["train", "--fork", "parent", "--set", "data.path={ds}"],
        "runs/parent': holds no complete Kiln checkpoint",
        2,
        dataset=True,
        files={"runs/parent/workers.log": "x"},
    ),
    Case(
        "train-fork-and-resume-from",
        ["train", "--fork", "parent", "--set", "train.resume_from=ckpt"],
        "--fork parent and --set train.resume_from both say where the run starts",
        2,
    ),
    _train(
        "train-fork-other-optimizer",
        ["data.path={ds}", "train.resume_from=ckpt", "optim.name=sgd", "parallel.num_workers=2"],
        "was written with optim.name = 'adamw'",
        2,
        dataset=True,
        files={
            **_CHECKPOINT_2x3x2,
            "ckpt/kiln_model.json": json.dumps(
                {
                    "parallel": {"zero_stage": 2, "pipeline_stages": 1, "tensor_parallel": 1},
                    "optimizer": "adamw",
                    "batch": {"micro_batch_size": 2, "micro_batches_per_step": 3},
                }
            ),
        },
    ),
    _train(
        "train-elastic-min-does-not-fit",
        ["data.path={ds}", "parallel.num_workers=[1, 2]", "parallel.device_memory_gib=0.001"],
        "parallel.num_workers = [1, 2]: an elastic run must fit on its minimum, 1 worker(s)",
        2,
        dataset=True,
    ),
    _train(
        "train-tracking-unreachable",
        ["data.path={ds}", f"logging.tracking_uri=http://me:{PW}@127.0.0.1:9"],
        "127.0.0.1:9",
        1,
        dataset=True,
        secrets=(PW,),
    ),
    _train(
        "train-tracking-bad-scheme",
        ["data.path={ds}", f"logging.tracking_uri=htpp://me:{PW}@127.0.0.1:9"],
        "htpp://me:***@127.0.0.1:9",
        2,
        dataset=True,
        secrets=(PW,),
    ),
    _train(
        "train-storage-s3-unreachable",
        ["data.path={ds}", "train.storage_path=s3://bucket/runs", f"data.s3_endpoint=http://{TOKEN_USER}@127.0.0.1:9"],
        "s3://bucket/runs",
        1,
        dataset=True,
        secrets=(TOKEN_USER,),
    ),
    _train(
        "train-data-s3-unreachable",
        ["data.path=s3://bucket/ds", "data.s3_endpoint=http://127.0.0.1:9"],
        "s3://bucket/ds",
        1,
    ),
    _train(
        "train-too-big",
        ["data.path={ds}", "parallel.zero_stage=0", "parallel.device_memory_gib=0.025"],
        "parallel.device_memory_gib",
        dataset=True,
    ),
    _train(
        "train-stage-without-block",
        ["data.path={ds}", "parallel.zero_stage=1", "parallel.pipeline_stages=2", "parallel.partition_method=uniform"],
        "leaves stage 1 without a transformer block (layer boundaries [0, 3, 5]",
        dataset=True,
    ),
    Case(
        "train-address-garbage",
        ["train", "--address", "head-node", "--set", "data.path={ds}"],
        "Ray address 'head-node': expected host:port",
        dataset=True,
    ),
    Case(
        "train-address-unreachable",
        ["train", "--address", "127.0.0.1:9", "--set", "data.path={ds}"],
        "no Ray cluster answers at 127.0.0.1:9",
        1,
        dataset=True,
    ),
    Case(
        "train-summary-json-nowhere",
        ["train", "--set", "data.path={ds}", "--summary-json", "no/such/dir/s.json"],
        "--summary-json",
        dataset=True,
    ),
    Case("train-dry-run-bad", ["train", "--dry-run", "--set", "data.path=nowhere"], "nowhere", 1),
    Case("train-unknown-flag", ["train", "--stepz", "5"], "--stepz"),
]

SWEEP_OK = "name: s\nbase: base.yaml\nspace:\n  optim.lr: {loguniform: [1e-4, 1e-2]}\n"
BASE = "train:\n  max_steps: 20\n  eval_every: 10\n"


def _sweep(id, text, needle, code=2, args=(), **kw):
    return Case(
        id,
        ["sweep", "--config", "s.yaml", *args],
        needle,
        code,
        files={"s.yaml": text, "base.yaml": BASE, **kw.pop("files", {})},
        **kw,
    )


SWEEP = [
    Case("sweep-missing-file", ["sweep", "--config", "nope.yaml"], "nope.yaml"),
    _sweep("sweep-empty", "", "s.yaml"),
    _sweep("sweep-a-list", "- 1\n", "s.yaml"),
    _sweep("sweep-unknown-key", SWEEP_OK + "samples: 3\n", "samples"),
    _sweep("sweep-no-name", SWEEP_OK.replace("name: s", "name: ''"), "name"),
    _sweep("sweep-no-base", SWEEP_OK.replace("base: base.yaml", "base: ''"), "base"),
    _sweep("sweep-base-missing", SWEEP_OK.replace("base.yaml", "gone.yaml"), "gone.yaml"),
    _sweep("sweep-base-bad", SWEEP_OK, "optim.lrr", files={"base.yaml": "optim:\n  lrr: 1\n"}),
    _sweep("sweep-space-empty", "name: s\nbase: base.yaml\nspace: {}\n", "sweep.space"),
    _sweep("sweep-space-unknown-field", SWEEP_OK.replace("optim.lr", "optim.lrr"), "optim.lrr"),
    _sweep("sweep-space-bad-kind", SWEEP_OK.replace("loguniform", "gaussian"), "sweep.space.optim.lr"),
    _sweep(
        "sweep-uniform-reversed",
        SWEEP_OK.replace("loguniform: [1e-4, 1e-2]", "uniform: [0.1, 0.01]"),
        "low must be below high",
    ),
    _sweep("sweep-loguniform-zero", SWEEP_OK.replace("1e-4", "0"), "loguniform"),
    _sweep(
        "sweep-out-of-range-value", SWEEP_OK.replace("loguniform: [1e-4, 1e-2]", "uniform: [1e-3, 20.0]"), "optim.lr"
    ),
    _sweep("sweep-num-samples-zero", SWEEP_OK + "num_samples: 0\n", "sweep.num_samples"),
    _sweep("sweep-num-samples-absurd", SWEEP_OK + "num_samples: 1000000000\n", "sweep.num_samples"),
    _sweep("sweep-concurrency-zero", SWEEP_OK + "max_concurrent_trials: 0\n", "sweep.max_concurrent_trials"),
    _sweep("sweep-pbt-no-checkpoints", SWEEP_OK + "num_samples: 4\nscheduler: {name: pbt}\n", "train.checkpoint_every"),
    _sweep(
        "sweep-pbt-mutation-out-of-range",
        SWEEP_OK.replace("optim.lr: {loguniform: [1e-4, 1e-2]}", "optim.beta2: {uniform: [0.9, 1.2]}")
        + "num_samples: 4\nscheduler: {name: pbt}\n",
        "sweep.space.optim.beta2.uniform bound 1.2",
        files={"base.yaml": BASE + "  checkpoint_every: 10\n"},
    ),
    _sweep(
        "sweep-pbt-model-field",
        SWEEP_OK.replace("optim.lr: {loguniform: [1e-4, 1e-2]}", "model.n_layer: {grid: [1, 2]}")
        + "scheduler: {name: pbt}\n",
        "sweep.space.model.n_layer",
        files={"base.yaml": BASE + "  checkpoint_every: 10\n"},
    ),
    _sweep("sweep-grace-past-end", SWEEP_OK + "scheduler: {name: asha, grace_period: 50}\n", "grace_period"),
    _sweep("sweep-grid-with-uniform", SWEEP_OK + "search: grid\n", "grid"),
    _sweep("sweep-metric-without-eval", SWEEP_OK, "eval_every", files={"base.yaml": "train:\n  eval_every: 0\n"}),
    _sweep("sweep-set-tag", SWEEP_OK, "name", args=("--set", "name.tag=x")),
    _sweep("sweep-set-bad-override", SWEEP_OK, "optim.lrr", args=("--set", "overrides.optim.lrr=1")),
    _sweep(
        "sweep-secret-data-unreachable",
        SWEEP_OK + f"overrides:\n  data.path: s3://b/ds\n  data.s3_endpoint: http://me:{PW}@127.0.0.1:9\n",
        "s3://b/ds",
        1,
        secrets=(PW,),
    ),
    _sweep(
        "sweep-no-ray-at-address",
        SWEEP_OK,
        "127.0.0.1:9",
        1,
        args=("--address", "127.0.0.1:9"),
        dataset=True,
        files={"base.yaml": BASE + "data:\n  path: ds\nlogging:\n  tracking_uri: sqlite:///m.db\n"},
    ),
    Case("sweep-resume-unknown", ["sweep", "--resume", "nope"], "nope"),
    Case("sweep-no-config", ["sweep"], "--config"),
]

LR = [
    Case("lr-out-a-dir", ["lr", "plot", "--out", "pics"], "--out pics", files={"pics/a": ""}),
    Case("lr-out-missing-dir", ["lr", "plot", "--out", "no/such/lr.png"], "--out no/such/lr.png"),
    Case("lr-out-under-a-file", ["lr", "plot", "--out", "f.txt/lr.png"], "--out f.txt/lr.png", files={"f.txt": "x"}),
    Case("lr-bad-config", ["lr", "plot", "--set", "schedule.name=wavy"], "schedule.name"),
    Case("lr-bad-warmup", ["lr", "plot", "--set", "schedule.warmup_steps=-4"], "schedule.warmup_steps"),
    Case("lr-steps-absurd", ["lr", "plot", "--set", "train.max_steps=1e15"], "train.max_steps"),
]

RUNS = [
    Case("runs-empty-dir", ["runs", "list"], "no MLflow store", 1),
    Case(
        "runs-empty-file",
        ["runs", "list", "--tracking-uri", "sqlite:///m.db"],
        "no MLflow store",
        1,
        files={"m.db": b""},
    ),
    Case(
        "runs-unknown-experiment",
        ["runs", "list", "--tracking-uri", "sqlite:///m.db", "--experiment", "nope"],
        "nope",
        1,
        files={"m.db": "STORE"},
    ),
    Case("runs-limit-negative", ["runs", "list", "--limit", "-1", "--tracking-uri", "sqlite:///m.db"], "--limit -1"),
    Case("runs-limit-zero", ["runs", "compare", "--limit", "0", "--tracking-uri", "sqlite:///m.db"], "--limit 0"),
    Case("runs-limit-word", ["runs", "list", "--limit", "many"], "--limit"),
    Case(
        "runs-postgres-no-driver",
        ["runs", "list", "--tracking-uri", f"postgresql://me:{PW}@127.0.0.1:9/db"],
        "postgresql://me:***@127.0.0.1:9/db",
        1,
        secrets=(PW,),
    ),
    Case(
        "runs-bad-scheme",
        ["runs", "list", "--tracking-uri", f"htpp://user:{PW}@127.0.0.1:9"],
        "htpp://user:***@",
        2,
        secrets=(PW,),
    ),
    Case(
        "runs-token-url",
        ["runs", "list", "--tracking-uri", f"http://{TOKEN_USER}@127.0.0.1:9"],
        "127.0.0.1:9",
        1,
        secrets=(TOKEN_USER,),
    ),
    Case("runs-unreachable", ["runs", "compare", "--tracking-uri", "http://127.0.0.1:9"], "127.0.0.1:9", 1),
    Case("runs-sqlite-missing-dir", ["runs", "list", "--tracking-uri", "sqlite:///no/such/m.db"], "no/such/m.db", 1),
    Case(
        "runs-quote-in-sweep",
        ["runs", "list", "--tracking-uri", "sqlite:///m.db", "--sweep", "a'b"],
        "--sweep",
        2,
        files={"m.db": "STORE"},
    ),
    Case(
        "runs-quote-in-sort",
        ["runs", "compare", "--tracking-uri", "sqlite:///m.db", "--sort", "lo'ss"],
        "--sort",
        2,
        files={"m.db": "STORE"},
    ),
    Case(
        "runs-db-not-sqlite",
        ["runs", "list", "--tracking-uri", "sqlite:///m.db"],
        "m.db",
        1,
        files={"m.db": "this is not a database" * 100},
    ),
]

PLAN = [
    Case("plan-unknown-model", ["plan", "--model", "huge"], "--model 'huge'"),
    Case("plan-memory-nan", ["plan", "--model", "debug", "--device-memory-gib", "nan"], "--device-memory-gib"),
    Case("plan-memory-inf", ["plan", "--model", "debug", "--device-memory-gib", "inf"], "--device-memory-gib"),
    Case("plan-memory-negative", ["plan", "--model", "debug", "--device-memory-gib", "-8"], "--device-memory-gib"),
    Case("plan-seq-negative", ["plan", "--model", "debug", "--seq-len", "-5"], "--seq-len"),
    Case("plan-world-zero", ["plan", "--model", "debug", "--world-size", "0"], "--world-size"),
    Case("plan-micro-zero", ["plan", "--model", "debug", "--micro-batch", "0"], "--micro-batch"),
    Case(
        "plan-tp-heads",
        ["plan", "--model", "debug", "--world-size", "3", "--tensor-parallel", "3"],
        "--tensor-parallel = 3 does not divide model n_head",
    ),
    Case(
        "plan-tp-zero3",
        ["plan", "--model", "debug", "--world-size", "2", "--tensor-parallel", "2", "--zero-stage", "3"],
        "--zero-stage = 3",
    ),
    Case(
        "plan-pipeline-zero2",
        ["plan", "--model", "debug", "--world-size", "2", "--pipeline-stages", "2", "--zero-stage", "2"],
        "zero",
    ),
    Case(
        "plan-world-not-multiple",
        ["plan", "--model", "debug", "--world-size", "3", "--pipeline-stages", "2", "--zero-stage", "1"],
        "--pipeline-stages",
    ),
    Case("plan-mfu-two", ["plan", "--model", "debug", "--mfu", "2"], "--mfu"),
    Case("plan-mfu-nan", ["plan", "--model", "debug", "--mfu", "nan"], "--mfu"),
    Case(
        "plan-target-negative",
        ["plan", "--model", "debug", "--cluster", "{repo}/cluster/aws-gpu.yaml", "--target-tokens", "-1"],
        "--target-tokens",
    ),
    Case(
        "plan-usd-nan",
        ["plan", "--model", "debug", "--cluster", "{repo}/cluster/aws-gpu.yaml", "--usd-per-hour", "nan"],
        "--usd-per-hour",
    ),
    Case("plan-cluster-missing", ["plan", "--model", "debug", "--cluster", "nope.yaml"], "nope.yaml"),
    Case(
        "plan-cluster-binary",
        ["plan", "--model", "debug", "--cluster", "c.yaml"],
        "c.yaml",
        files={"c.yaml": b"\x00\xff\xfe" * 50},
    ),
    Case(
        "plan-nodes-zero",
        ["plan", "--model", "debug", "--cluster", "{repo}/cluster/aws-gpu.yaml", "--nodes", "0"],
        "--nodes",
    ),
    Case(
        "plan-bad-config", ["plan", "--config", "c.yaml"], "model.flavour", files={"c.yaml": "model: {flavour: 3b}\n"}
    ),
    Case("plan-memory-absurd", ["plan", "--model", "debug", "--device-memory-gib", "1e300"], "--device-memory-gib"),
    Case("plan-vocab-zero", ["plan", "--model", "debug", "--vocab-size", "0"], "--vocab-size"),
]

CLUSTER = [
    Case("cluster-missing", ["cluster", "check", "nope.yaml"], "nope.yaml"),
    Case("cluster-a-dir", ["cluster", "check", "cdir"], "cdir", files={"cdir/a.yaml": "x: 1\n"}),
    Case("cluster-binary", ["cluster", "check", "c.yaml"], "c.yaml", files={"c.yaml": b"\x7fELF\x00\xff" * 40}),
    Case("cluster-not-yaml", ["cluster", "check", "c.yaml"], "c.yaml", files={"c.yaml": "a: [b\n"}),
    Case("cluster-a-list", ["cluster", "check", "c.yaml"], "c.yaml", files={"c.yaml": "- a\n"}),
    Case("cluster-empty", ["cluster", "check", "c.yaml"], "c.yaml", files={"c.yaml": ""}),
    Case(
        "cluster-no-provider",
        ["cluster", "check", "c.yaml"],
        "provider",
        files={"c.yaml": "cluster_name: x\nmax_workers: 2\n"},
    ),
    Case(
        "cluster-aws-secret",
        ["cluster", "check", "c.yaml"],
        "a credential in clear",
        files={
            "c.yaml": "cluster_name: x\nprovider: {type: aws, region: us-east-1}\nsetup_commands:\n"
            f"  - export AWS_SECRET_ACCESS_KEY={PW}\n"
        },
        secrets=(PW,),
    ),
    Case(
        "cluster-kuberay-bad",
        ["cluster", "check", "k.yaml"],
        "k.yaml",
        files={"k.yaml": "apiVersion: ray.io/v1\nkind: RayCluster\nspec: 3\n"},
    ),
]

SERVICES = [
    Case(
        "services-status-corrupt",
        ["services", "status", "--dir", "svc"],
        "services.json",
        1,
        files={"svc/services.json": "{not json"},
    ),
    Case(
        "services-down-corrupt",
        ["services", "down", "--dir", "svc"],
        "services.json",
        1,
        files={"svc/services.json": "[1, 2]"},
    ),
    Case(
        "services-down-pid-a-word",
        ["services", "down", "--dir", "svc"],
        "services.json",
        1,
        files={"svc/services.json": '[{"name": "mlflow", "pid": "1; rm -rf /", "url": "u", "log": "l"}]'},
    ),
    Case("services-up-port-word", ["services", "up", "--dir", "svc", "--port", "http"], "--port"),
    Case("services-up-port-out-of-range", ["services", "up", "--dir", "svc", "--port", "99999"], "--port"),
    Case("services-up-dir-a-file", ["services", "up", "--dir", "f.txt"], "f.txt", 1, files={"f.txt": "x"}),
    Case(
        "services-up-running",
        ["services", "up", "--dir", "svc"],
        "already running",
        1,
        files={"svc/services.json": "RUNNING", "svc/.kiln-output": "kiln-output:services\n"},
    ),
]

KILN_CONFIG = [
    Case("kiln-config-bad-set", ["config", "--set", "optim.lr=-3"], "optim.lr"),
    Case("kiln-config-missing", ["config", "--config", "nope.yaml"], "nope.yaml"),
    Case("kiln-config-dup", ["config", "--config", "c.yaml"], "lr", files={"c.yaml": "optim:\n  lr: 1\n  lr: 2\n"}),
    Case("kiln-unknown-command", ["fly"], "fly"),
    Case("kiln-no-command", [], "command"),
]

BERT = '{"model_type": "bert"}'
MODELS = [
    Case("export-no-such-model", ["export", "nope", "--output", "out"], "nope"),
    Case(
        "export-not-a-checkpoint",
        ["export", "notckpt", "--output", "out"],
        "notckpt",
        files={"notckpt/readme.txt": "hi"},
    ),
    Case(
        "export-output-holds-files",
        ["export", "hf", "--output", "mine"],
        "mine",
        files={"hf/config.json": BERT, "mine/todo.txt": "keep"},
    ),
    Case(
        "export-output-holds-files-overwrite",
        ["export", "hf", "--output", "mine", "--overwrite"],
        "mine",
        files={"hf/config.json": BERT, "mine/todo.txt": "keep"},
    ),
    Case(
        "export-unsupported-arch",
        ["export", "hf", "--output", "out"],
        "model_type 'bert'",
        files={"hf/config.json": BERT},
    ),
    Case(
        "export-truncated-config",
        ["export", "hf", "--output", "out"],
        "config.json",
        files={"hf/config.json": '{"model_type": "gpt2"'},
    ),
    Case(
        "export-config-missing-field",
        ["export", "hf", "--output", "out"],
        "n_embd",
        files={"hf/config.json": '{"model_type": "gpt2", "n_layer": 2}'},
    ),
    Case("generate-no-prompt", ["generate", "--model", "x"], "--prompt"),
    Case("generate-prompts-file-missing", ["generate", "--model", "x", "--prompts", "p.txt"], "p.txt"),
    Case("generate-top-p-zero", ["generate", "--model", "x", "--prompt", "a", "--top-p", "0"], "--top-p"),
    Case(
        "generate-temperature-nan",
        ["generate", "--model", "x", "--prompt", "a", "--temperature", "nan"],
        "--temperature",
    ),
    Case("generate-no-such-model", ["generate", "--model", "nope", "--prompt", "a"], "nope"),
    Case(
        "generate-model-is-bert",
        ["generate", "--model", "hf", "--prompt", "a"],
        "model_type 'bert'",
        files={"hf/config.json": BERT},
    ),
    Case("eval-batch-size-zero", ["eval", "--model", "x", "--data", "d", "--batch-size", "0"], "--batch-size"),
    Case("eval-no-such-data", ["eval", "--model", "x", "--data", "nope"], "nope", 1),
]


PW_ODD = "planted#pa/ss?Qz7@x"  # a password with the characters URL parsers stop at
KEY_SECRET = "planted-key-secret-Wd38"
GPT2_BAD = '{"model_type": "gpt2", "n_embd": 30, "n_head": 4, "n_layer": 1, "n_positions": 8, "vocab_size": 300}'
CARD_OK = (
    '{"format": 1, "gpt": {"vocab_size": 320, "seq_len": 64, "n_layer": 1, "n_head": 4, "d_model": 32}, '
    '"parallel": {"zero_stage": 0, "pipeline_stages": 1}, "data": {"path": "ds"}}'
)
CKPT_MARKER = '{"step": 1, "world_size": 1, "rank": 0, "tag": "state"}'


def _ckpt(card: str, **more) -> dict[str, str | bytes]:
    """A checkpoint directory as Kiln lays one out, with `card` as its kiln_model.json."""
    return {
        "ckpt/kiln_model.json": card,
        "ckpt/kiln_complete.rank0.json": CKPT_MARKER,
        "ckpt/state/notes.txt": "x",
        **more,
    }


def _bomb(levels: int = 9, leaf: str = "lol") -> str:
    """YAML's billion laughs: each level nine aliases of the one below (9**9 values)."""
    lines = [f"l0: &l0 [{leaf}]"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _flow_bomb(levels: int = 9) -> str:
    """The same as one flow mapping, as `--set` takes a value."""
    parts = ["a0: &a0 [x]"] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "{{" + ", ".join(parts) + "}}"  # doubled: the harness formats each argument


HOME_SECRETS = {
    "home/.ssh/id_ed25519": "PRIVATE KEY",
    "home/todo.txt": "mine",
    "home/config.json": "{}",
    "home/model.safetensors": "x",
}
HF_LOOKALIKE = {
    "theirs/config.json": '{"model_type": "gpt2"}',
    "theirs/model.safetensors": "w",
    "theirs/README.md": "# model card",
    "theirs/eval/scores.txt": "0.93",
}
LAUNCHER = "cluster_name: x\nprovider: {type: aws, region: us-east-1}\n"
KUBE = "apiVersion: ray.io/v1\nkind: RayCluster\nmetadata: {name: k}\n"
KUBE_SPEC = (
    "spec:\n  authOptions: {mode: token}\n  headGroupSpec:\n    template:\n      spec:\n"
    "        containers: [{name: h, image: i}]\n"
)

WRITE_GUARD = [
    Case(
        "export-onto-home",
        ["export", "{hf}", "--output", "~", "--overwrite"],
        "--output ~",
        model=True,
        files=HOME_SECRETS,
    ),
    Case(
        "export-onto-cwd",
        ["export", "{hf}", "--output", ".", "--overwrite"],
        "--output .",
        model=True,
        files={"train.py": "print(1)", "data/x.txt": "x", "config.json": "{}", "model.safetensors": "x"},
    ),
    Case("export-onto-parent", ["export", "{hf}", "--output", "..", "--overwrite"], "--output ..", model=True),
    Case(
        "export-onto-hf-folder",
        ["export", "{hf}", "--output", "theirs", "--overwrite"],
        "no .kiln-output marker",
        model=True,
        files=HF_LOOKALIKE,
    ),
    Case(
        "export-onto-symlink",
        ["export", "{hf}", "--output", "link", "--overwrite"],
        "symbolic link",
        model=True,
        files={**HF_LOOKALIKE, "link": "SYMLINK:theirs"},
    ),
    Case("export-onto-its-input", ["export", "{hf}", "--output", "{hf}", "--overwrite"], "own input", model=True),
    Case("export-into-its-input", ["export", "{hf}", "--output", "{hf}/out"], "own input", model=True),
    Case(
        "export-onto-repo-root",
        ["export", "{hf}", "--output", "repo", "--overwrite"],
        "repository",
        model=True,
        files={"repo/.git/HEAD": "ref: refs/heads/main\n", "repo/config.json": "{}", "repo/model.safetensors": "x"},
    ),
    Case(
        "export-output-a-file",
        ["export", "{hf}", "--output", "notes.txt"],
        "is a file",
        model=True,
        files={"notes.txt": "mine"},
    ),
    Case(
        "export-s3-userinfo",
        ["export", "{hf}", "--output", f"s3://me:{PW}@bucket/m"],
        "credentials never go",
        model=True,
        secrets=(PW,),
    ),
    Case(
        "lr-out-onto-its-config",
        ["lr", "plot", "--config", "c.yaml", "--out", "c.yaml"],
        "--out c.yaml",
        files={"c.yaml": "train:\n  max_steps: 10\n"},
    ),
    Case(
        "lr-out-onto-foreign-png",
        ["lr", "plot", "--out", "mine.png"],
        "--out mine.png",
        files={"mine.png": b"\x89PNG\r\n\x1a\nnot Kiln's"},
    ),
    Case(
        "lr-out-symlink",
        ["lr", "plot", "--out", "lr.png"],
        "symbolic link",
        files={"mine.png": "x", "lr.png": "SYMLINK:mine.png"},
    ),
    Case(
        "train-summary-onto-foreign",
        ["train", "--set", "data.path={ds}", "--summary-json", "notes.json"],
        "--summary-json notes.json",
        dataset=True,
        files={"notes.json": '{"mine": 1}'},
    ),
    Case(
        "train-summary-onto-config",
        ["train", "--config", "c.yaml", "--summary-json", "c.yaml"],
        "--summary-json c.yaml",
        files={"c.yaml": "train:\n  max_steps: 10\n"},
    ),
    _sweep("sweep-summary-onto-sweep-file", SWEEP_OK, "--summary-json s.yaml", args=("--summary-json", "s.yaml")),
    Case("services-up-home", ["services", "up", "--dir", "~"], "home directory", 1, files={"home/notes": "x"}),
    Case(
        "services-up-foreign-dir",
        ["services", "up", "--dir", "mine"],
        "mine",
        1,
        files={"mine/notes.md": "keep", "mine/mlflow.db": "APPDB"},
    ),
]

STORES = [
    Case(
        "runs-foreign-sqlite",
        ["runs", "list", "--tracking-uri", "sqlite:///app.db"],
        "another application's",
        1,
        files={"app.db": "APPDB"},
    ),
    Case("runs-default-store-foreign", ["runs", "compare"], "another application's", 1, files={"mlflow.db": "APPDB"}),
    Case(
        "generate-models-uri-foreign-db",
        ["generate", "--model", "models:/x/1", "--prompt", "a", "--tracking-uri", "sqlite:///app.db"],
        "another application's",
        1,
        files={"app.db": "APPDB"},
    ),
    Case(
        "eval-run-id-foreign-db",
        ["eval", "--model", "{hf}", "--data", "{ds}", "--run-id", "abc", "--tracking-uri", "sqlite:///app.db"],
        "another application's",
        1,
        files={"app.db": "APPDB"},
        model=True,
        dataset=True,
    ),
    Case(
        "generate-chat-no-template",
        ["generate", "--model", "{hf}", "--prompt", "a", "--chat"],
        "--chat: the model's tokenizer has no chat template",
        model=True,
    ),
    Case("export-dtype-int8", ["export", "{hf}", "--output", "out", "--dtype", "int8"], "--dtype", model=True),
    Case(
        "export-shard-size-unitless-words",
        ["export", "{hf}", "--output", "out", "--max-shard-size", "5 parsecs"],
        "--max-shard-size 5 parsecs: expected a size",
        model=True,
    ),
    Case("export-models-uri-no-store", ["export", "models:/x/1", "--output", "out"], "no MLflow store", 1),
    Case("generate-models-uri-no-store", ["generate", "--model", "models:/x/1", "--prompt", "a"], "no MLflow store", 1),
    Case(
        "eval-run-id-no-store",
        ["eval", "--model", "{hf}", "--data", "{ds}", "--run-id", "abc"],
        "no MLflow store",
        1,
        model=True,
        dataset=True,
    ),
    Case(
        "generate-file-store-missing",
        ["generate", "--model", "models:/x/1", "--prompt", "a", "--tracking-uri", "./nowhere"],
        "no MLflow store",
        1,
    ),
    Case(
        "services-up-foreign-backend",
        ["services", "up", "--dir", "svc", "--backend-store-uri", "sqlite:///app.db"],
        "another application's",
        1,
        files={"app.db": "APPDB"},
    ),
    _train(
        "train-tracking-foreign-db",
        ["data.path={ds}", "logging.tracking_uri=sqlite:///app.db"],
        "another application's",
        1,
        dataset=True,
        files={"app.db": "APPDB"},
    ),
]

BOUNDS = [
    _cfg("config-billion-laughs", _bomb(), "alias bomb"),
    _cfg(
        "config-bomb-in-deepspeed",
        "parallel:\n  deepspeed:\n" + "".join("    " + line + "\n" for line in _bomb().splitlines()),
        "alias bomb",
    ),
    _train("set-billion-laughs", [f"parallel.deepspeed={_flow_bomb()}"], "--set parallel.deepspeed"),
    _cfg("config-50mb", "BIG", "larger than"),
    _cfg("config-nested-deep", "a: " + "[" * 500 + "]" * 500 + "\n", "nests"),
    _cfg("config-nested-past-libyaml", "a: " + "[" * 5000 + "]" * 5000 + "\n", "maximum nesting depth"),
    _sweep("sweep-billion-laughs", SWEEP_OK + _bomb(), "alias bomb"),
    Case("cluster-billion-laughs", ["cluster", "check", "c.yaml"], "alias bomb", files={"c.yaml": LAUNCHER + _bomb()}),
    Case(
        "plan-cluster-billion-laughs",
        ["plan", "--model", "debug", "--cluster", "c.yaml"],
        "alias bomb",
        files={"c.yaml": LAUNCHER + _bomb()},
    ),
    Case(
        "cluster-duplicate-key",
        ["cluster", "check", "c.yaml"],
        "duplicate key 'max_workers'",
        files={"c.yaml": LAUNCHER + "max_workers: 2\nmax_workers: 3\n"},
    ),
]

SECRETS = [
    _cfg(
        "config-deepspeed-list-secret",
        f"parallel:\n  deepspeed: [{{aws_secret_access_key: {KEY_SECRET}}}]\n",
        "parallel.deepspeed",
        secrets=(KEY_SECRET,),
    ),
    _cfg(
        "config-mix-mapping-secret",
        f"data:\n  mix: {{path: a, token: {KEY_SECRET}}}\n",
        "data.mix",
        secrets=(KEY_SECRET,),
    ),
    Case(
        "set-deepspeed-secret-scalar",
        ["train", "--set", f"parallel.deepspeed=api_key={KEY_SECRET}"],
        "parallel.deepspeed",
        secrets=(KEY_SECRET,),
    ),
    _prep(
        "prep-s3-endpoint-no-scheme",
        ["--output", "s3://bucket/ds", "--s3-endpoint", f"kiln:{PW}@127.0.0.1:9"],
        "s3://bucket/ds",
        1,
        secrets=(PW,),
    ),
    _prep(
        "prep-s3-password-odd-chars",
        ["--output", "s3://bucket/ds", "--s3-endpoint", f"http://kiln:{PW_ODD}@127.0.0.1:9"],
        "s3://bucket/ds",
        1,
        secrets=(PW_ODD,),
    ),
    _prep(
        "prep-s3-userinfo-in-path", ["--output", f"s3://me:{PW}@bucket/ds"], "credentials never go", 2, secrets=(PW,)
    ),
    _train("train-data-s3-userinfo", [f"data.path=s3://me:{PW}@bucket/ds"], "credentials never go", 2, secrets=(PW,)),
    Case(
        "cluster-schema-secret",
        ["cluster", "check", "c.yaml"],
        "setup_commands",
        files={"c.yaml": LAUNCHER + f"setup_commands: 'export WANDB_API_KEY={KEY_SECRET}'\n"},
        secrets=(KEY_SECRET,),
    ),
    Case(
        "runs-odd-password-url",
        ["runs", "list", "--tracking-uri", f"http://me:{PW_ODD}@127.0.0.1:9"],
        "127.0.0.1:9",
        1,
        secrets=(PW_ODD,),
    ),
]

TYPES = [
    Case(
        "plan-cluster-max-workers-word",
        ["plan", "--model", "debug", "--cluster", "c.yaml"],
        "max_workers",
        files={"c.yaml": LAUNCHER + "max_workers: two\n"},
    ),
    Case(
        "plan-cluster-node-config-string",
        ["plan", "--model", "debug", "--cluster", "c.yaml"],
        "node_config",
        files={"c.yaml": LAUNCHER + "available_node_types:\n  gpu: {node_config: p4d, resources: {GPU: 8}}\n"},
    ),
    Case(
        "plan-cluster-resources-string",
        ["plan", "--model", "debug", "--cluster", "c.yaml"],
        "resources",
        files={"c.yaml": LAUNCHER + "available_node_types:\n  gpu: {node_config: {}, resources: GPU}\n"},
    ),
    Case(
        "cluster-max-workers-word",
        ["cluster", "check", "c.yaml"],
        "max_workers: expected an integer",
        files={"c.yaml": LAUNCHER + "max_workers: two\n"},
    ),
    Case(
        "cluster-node-config-string",
        ["cluster", "check", "c.yaml"],
        "node_config: expected a mapping",
        files={"c.yaml": LAUNCHER + "available_node_types:\n  gpu: {node_config: p4d, resources: {}}\n"},
    ),
    Case(
        "kuberay-replicas-string",
        ["cluster", "check", "k.yaml"],
        "replicas: expected an integer",
        files={"k.yaml": KUBE + KUBE_SPEC + "  workerGroupSpecs:\n    - {groupName: g, replicas: '2'}\n"},
    ),
    Case(
        "kuberay-metadata-scalar",
        ["cluster", "check", "k.yaml"],
        "metadata: expected a mapping",
        files={"k.yaml": KUBE.replace("{name: k}", "k") + KUBE_SPEC},
    ),
    Case(
        "kuberay-template-scalar",
        ["cluster", "check", "k.yaml"],
        "template: expected a mapping",
        files={"k.yaml": KUBE + "spec:\n  headGroupSpec: {template: pod}\n"},
    ),
    Case(
        "kuberay-env-scalar",
        ["cluster", "check", "k.yaml"],
        "env: expected a list",
        files={"k.yaml": KUBE + KUBE_SPEC.replace("image: i}", "image: i, env: RAY_AUTH_MODE}")},
    ),
    Case(
        "export-card-wrong-types",
        ["export", "ckpt", "--output", "out"],
        "kiln_model.json",
        files=_ckpt(CARD_OK.replace('"n_head": 4', '"n_head": "four"')),
    ),
    Case("export-card-not-a-mapping", ["export", "ckpt", "--output", "out"], "kiln_model.json", files=_ckpt('["gpt"]')),
    Case(
        "export-card-heads",
        ["export", "ckpt", "--output", "out"],
        "not divisible by n_head",
        files=_ckpt(CARD_OK.replace('"n_head": 4', '"n_head": 5')),
    ),
    Case(
        "export-shards-truncated",
        ["export", "ckpt", "--output", "out"],
        "cannot be read",
        1,
        files=_ckpt(CARD_OK, **{"ckpt/state/mp_rank_00_model_states.pt": b"PK\x03\x04trunc"}),
    ),
    Case(
        "export-zero-optimizer-truncated",
        ["export", "ckpt", "--output", "out"],
        "cannot be read",
        1,
        files=_ckpt(
            CARD_OK,
            **{
                "ckpt/state/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"PK\x03\x04",
                "ckpt/state/mp_rank_00_model_states.pt": b"PK\x03\x04",
            },
        ),
    ),
    Case(
        "export-index-non-strings",
        ["export", "{hf}", "--output", "out"],
        "model.safetensors.index.json",
        model=True,
        files={"hf/model.safetensors.index.json": '{"weight_map": {"transformer.wte.weight": 5}}'},
    ),
    Case(
        "export-index-escapes",
        ["export", "{hf}", "--output", "out"],
        "model.safetensors.index.json",
        model=True,
        files={"hf/model.safetensors.index.json": '{"weight_map": {"transformer.wte.weight": "../../x"}}'},
    ),
    Case(
        "export-index-not-json",
        ["export", "{hf}", "--output", "out"],
        "model.safetensors.index.json",
        model=True,
        files={"hf/model.safetensors.index.json": '{"weight_map": '},
    ),
    Case("export-heads-not-dividing", ["export", "{hf}", "--output", "out"], "not divisible by n_head", model=True),
    Case(
        "generate-hf-heads",
        ["generate", "--model", "hf", "--prompt", "a"],
        "not divisible by n_head",
        files={"hf/config.json": GPT2_BAD},
    ),
    Case("generate-nan-weights", ["generate", "--model", "{hf}", "--prompt", "a"], "NaN", 1, model=True),
    Case(
        "generate-device-cuda",
        ["generate", "--model", "{hf}", "--prompt", "a", "--device", "cuda"],
        "--device cuda",
        model=True,
    ),
    Case(
        "generate-device-gpu0",
        ["generate", "--model", "{hf}", "--prompt", "a", "--device", "gpu0"],
        "--device gpu0",
        model=True,
    ),
    _prep(
        "prep-parquet-int-text",
        ["--input", "d.parquet"],
        "column 'text' holds int64",
        1,
        files={"d.parquet": "PARQUET_INT"},
    ),
]

DRY_RUN = [
    Case(
        "dry-run-lora-target-gpt2-lacks",
        [
            "train",
            "--dry-run",
            "--set",
            "data.path={ds}",
            "--set",
            "model.init_from={hf}",
            "--set",
            "model.lora.rank=4",
            "--set",
            "model.lora.targets=q_proj,gate_proj",
        ],
        "['gate_proj'] match no module of the gpt architecture",
        dataset=True,
        model=True,
    ),
    Case(
        "export-adapters-of-a-full-model",
        ["export", "{hf}", "--output", "out", "--adapters"],
        "--adapters: ",
        model=True,
    ),
    Case(
        "dry-run-init-truncated",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "model.init_from={hf}"],
        "model.init_from",
        dataset=True,
        model=True,
    ),
    Case(
        "dry-run-init-wrong-shape",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "model.init_from={hf}"],
        "model.init_from",
        dataset=True,
        model=True,
    ),
    Case(
        "dry-run-init-bin-only",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "model.init_from={hf}"],
        "no model.safetensors",
        dataset=True,
        model=True,
    ),
    Case(
        "dry-run-init-heads",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "model.init_from={hf}"],
        "not divisible by n_head",
        dataset=True,
        model=True,
    ),
    Case(
        "dry-run-run-name-escapes",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "logging.run_name=../../outside"],
        "logging.run_name",
        dataset=True,
    ),
    Case(
        "dry-run-storage-a-file",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "train.storage_path=f.txt/runs"],
        "train.storage_path",
        1,
        dataset=True,
        files={"f.txt": "x"},
    ),
    Case(
        "dry-run-ds-contradicts-zero",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "parallel.deepspeed.zero_optimization.stage=3"],
        "parallel.deepspeed.zero_optimization.stage",
        dataset=True,
    ),
    Case(
        "dry-run-ds-autotp",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "parallel.deepspeed.tensor_parallel.autotp_size=2"],
        "parallel.tensor_parallel",
        dataset=True,
    ),
    Case(
        "dry-run-ds-micro-batch",
        [
            "train",
            "--dry-run",
            "--set",
            "data.path={ds}",
            "--set",
            "parallel.deepspeed.train_micro_batch_size_per_gpu=99",
        ],
        "train.micro_batch_size",
        dataset=True,
    ),
    Case(
        "dry-run-ds-optimizer",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "parallel.deepspeed.optimizer={{type: Adam}}"],
        "parallel.deepspeed.optimizer",
        dataset=True,
    ),
    Case(
        "dry-run-ds-misspelt",
        [
            "train",
            "--dry-run",
            "--set",
            "data.path={ds}",
            "--set",
            "parallel.deepspeed.zero_optimization.reduce_bucket_sise=5",
        ],
        "parallel.deepspeed: DeepSpeed's config parser refuses it",
        dataset=True,
    ),
    Case(
        "dry-run-ds-out-of-range",
        [
            "train",
            "--dry-run",
            "--set",
            "data.path={ds}",
            "--set",
            "parallel.deepspeed.zero_optimization.reduce_bucket_size=-3",
        ],
        "Input should be greater than 0",
        dataset=True,
    ),
    Case("ds-json-missing", ["train", "--set", "parallel.deepspeed=ds.json"], "parallel.deepspeed file 'ds.json'"),
    Case(
        "ds-json-a-list",
        ["train", "--set", "parallel.deepspeed=ds.json"],
        "parallel.deepspeed file 'ds.json' must hold a mapping",
        files={"ds.json": "[1, 2]"},
    ),
    Case(
        "ds-json-malformed",
        ["train", "--set", "parallel.deepspeed=ds.json"],
        "parallel.deepspeed file 'ds.json' is not valid",
        files={"ds.json": '{"zero_optimization": {"stage": 2,}'},
    ),
    Case(
        "dry-run-resume-with-address",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "train.resume_from=ckpt"],
        "train.resume_from",
        dataset=True,
        files={"ckpt/notes.txt": "x"},
        env={"RAY_ADDRESS": "127.0.0.1:9"},
    ),
    Case(
        "dry-run-export-to-home",
        ["train", "--dry-run", "--set", "data.path={ds}", "--set", "logging.export_to=~/"],
        "logging.export_to",
        dataset=True,
        files={"home/todo.txt": "mine"},
    ),
]

SWEEP_EDGE = [
    _sweep(
        "sweep-grid-huge",
        "name: s\nbase: base.yaml\nsearch: grid\nspace:\n"
        + "".join(
            f"  {f}: {{grid: [{', '.join(str(v) for v in vals)}]}}\n"
            for f, vals in (
                ("optim.lr", [1e-4 * (i + 1) for i in range(10)]),
                ("optim.weight_decay", [0.01 * i for i in range(10)]),
                ("optim.beta1", [0.8 + 0.01 * i for i in range(10)]),
                ("optim.beta2", [0.9 + 0.005 * i for i in range(10)]),
                ("train.seed", list(range(10))),
                ("schedule.warmup_steps", list(range(10))),
                ("train.grad_clip", [0.5 + 0.1 * i for i in range(10)]),
                ("model.dropout", [0.01 * i for i in range(10)]),
            )
        ),
        "100,000,000 trials",
    ),
    _sweep("sweep-metric-typo", SWEEP_OK + "metric: loss/vall\n", "sweep.metric"),
    _sweep(
        "sweep-uniform-int-field",
        "name: s\nbase: base.yaml\nspace:\n  train.micro_batch_size: {uniform: [1, 8]}\n",
        "integer field",
    ),
    Case(
        "sweep-resume-broken-state",
        ["sweep", "--resume", "s"],
        "kiln-sweep.json",
        files={"runs/sweeps/s/kiln-sweep.json": "{not json"},
    ),
    Case(
        "sweep-resume-bad-config-state",
        ["sweep", "--resume", "s"],
        "kiln-sweep.json",
        files={
            "runs/sweeps/s/kiln-sweep.json": '{"parent_run_id": "r", "sweep": {"config": {"name": "s", '
            '"base": "b.yaml", "num_samples": 0}, "base_tree": {}, "source": "s.yaml"}}'
        },
    ),
    _prep("prep-seq-len-with-address", ["--seq-len", "-3", "--address", "127.0.0.1:9"], "--seq-len -3"),
]

CASES = (
    MODELS
    + PREPARE
    + VERIFY
    + CONFIG_FILES
    + OVERRIDES
    + LAUNCH
    + SWEEP
    + LR
    + RUNS
    + PLAN
    + CLUSTER
    + SERVICES
    + KILN_CONFIG
    + WRITE_GUARD
    + STORES
    + BOUNDS
    + SECRETS
    + TYPES
    + DRY_RUN
    + SWEEP_EDGE
)
