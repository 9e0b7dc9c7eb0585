"""Hugging Face checkpoint -> Kiln -> fine-tune on Ray (2 workers, ZeRO-2 and ZeRO-3) -> export
-> transformers, on a tiny random Llama with grouped-query attention and an untied head, and on
each other family Kiln loads (built with transformers' `save_pretrained`; nothing is downloaded)."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import VOCAB, build, saved  # noqa: E402
from mlflow_store import sqlite_store  # noqa: E402

from kiln.config import load_config  # noqa: E402
from kiln.data.manifest import load_manifest  # noqa: E402
from kiln.data.prepare import PrepareConfig, prepare  # noqa: E402
from kiln.data.sources import ParquetSource  # noqa: E402
from kiln.errors import ConfigError  # noqa: E402
from kiln.infer.commands import export  # noqa: E402
from kiln.infer.generate import Sampling, generate  # noqa: E402
from kiln.launch.on_ray import train  # noqa: E402
from kiln.storage import resolve  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MICRO_BATCH = 4


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus, tiny_llama):
    """(checkpoint dir, the transformers model, a dataset tokenized with its tokenizer)."""
    tmp = tmp_path_factory.mktemp("finetune")
    texts = [p.read_text() for p in sorted(Path(corpus[0]).glob("*.py"))]
    ckpt = tmp / "tiny-llama"
    model, _ = tiny_llama(
        ckpt,
        texts,
        hidden_size=64,
        intermediate_size=176,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        rope_theta=1000.0,
    )
    data = tmp / "data"
    prepare(PrepareConfig(inputs=corpus, output=str(data), tokenizer=str(ckpt), seq_len=32, shard_tokens=1 << 15))
    return ckpt, model, data


@pytest.fixture(scope="module")
def families(tmp_path_factory, corpus):
    """A directory for each family's checkpoint to go in, and a dataset tokenized with their
    tokenizer (one BPE, the same for every family: `hf_models.saved`)."""
    tmp = tmp_path_factory.mktemp("families")
    saved("gpt2-untied", tmp / "tokenizer-source", corpus)
    data = tmp / "data"
    prepare(
        PrepareConfig(
            inputs=corpus, output=str(data), tokenizer=str(tmp / "tokenizer-source"), seq_len=32, shard_tokens=1 << 15
        )
    )
    return tmp, data


# Qwen2's q/k/v biases, Mistral's sliding window, an explicit head_dim and GPT-2's untied head:
# each loads on Ray's workers, trains and exports as its own family (Llama 3's RoPE scaling: the
# LoRA chat recipe below).
@pytest.mark.parametrize(
    "kind, model_type", [("qwen2", "qwen2"), ("mistral", "llama"), ("llama-head-dim", "llama"), ("gpt2-untied", "gpt2")]
)
def test_finetune_each_family_on_ray_and_export_it(ray_cluster, families, corpus, tmp_path, kind, model_type):
    address, _, _ = ray_cluster
    root, data = families
    ckpt = root / kind
    original = saved(kind, ckpt, corpus)
    summary = train(
        _config(ckpt, data, tmp_path, f"ft-{kind}", "train.max_steps=6", "logging.log_model=false"), address=address
    )
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    history = sorted(client.get_metric_history(summary.run_id, "loss/train"), key=lambda m: m.step)
    assert abs(history[0].value - _first_step_loss(original, data)) <= 1e-4  # it started from the checkpoint
    assert history[-1].value < history[0].value  # and it learned
    out = tmp_path / "export"
    loaded, _ = export(summary.checkpoint, str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        assert (theirs(x).logits - loaded.build()(x)[..., :VOCAB]).abs().max().item() <= 1e-5
        assert (original(x).logits - theirs(x).logits).abs().max().item() > 1e-3  # the export is the trained one


def _config(ckpt, data, tmp, name, *more):
    return load_config(
        REPO / "jobs/configs/debug.yaml",
        [
            f"model.init_from={ckpt}",
            f"data.path={data}",
            "parallel.num_workers=2",
            "train.max_steps=8",
            f"train.micro_batch_size={MICRO_BATCH}",
            "train.eval_every=0",
            "schedule.warmup_steps=2",
            f"logging.tracking_uri={sqlite_store(tmp)}",
            "logging.experiment=finetune",
            f"logging.run_name={name}",
            f"train.storage_path={tmp}/runs",
            *more,
        ],
    )


def _first_step_loss(model, data) -> float:
    """What step 1 must report if the run started from `model`: the mean of each replica's
    first micro-batch loss, computed by transformers."""
    manifest = load_manifest(resolve(str(data)))
    losses = []
    for rank in range(2):
        batch = next(iter(ParquetSource(manifest, rank, 2, MICRO_BATCH).train_batches()))
        with torch.no_grad():
            logits = model(batch[:, :-1]).logits
        losses.append(
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
        )
    return sum(losses) / len(losses)


@pytest.mark.parametrize("stage", [2, 3])
def test_finetune_a_pretrained_llama_on_ray_and_export_it(ray_cluster, pretrained, tmp_path, stage, monkeypatch):
    from mlflow.tracking import MlflowClient

    address, _, _ = ray_cluster
    ckpt, original, data = pretrained
    register = [f"logging.register_as=tiny-llama-{stage}", f"logging.export_to={tmp_path}/final"]
    summary = train(
        _config(ckpt, data, tmp_path, f"ft-zero{stage}", f"parallel.zero_stage={stage}", *register), address=address
    )
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")  # for models:/ URIs
    history = sorted(client.get_metric_history(summary.run_id, "loss/train"), key=lambda m: m.step)
    assert abs(history[0].value - _first_step_loss(original, data)) <= 1e-4  # it started from the checkpoint
    assert history[-1].value < history[0].value - 0.05  # and it learned

    out = tmp_path / "export"
    loaded, files = export(summary.checkpoint, str(out))
    for name in files:  # logging.export_to wrote the same export when the run ended
        assert (tmp_path / "final" / name).read_bytes() == (out / name).read_bytes(), name
    assert loaded.cfg.arch == "llama" and loaded.cfg.kv_heads == 2 and not loaded.cfg.tie_embeddings
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = loaded.build()
    x = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)[..., :300]).abs().max().item() <= 1e-5
        assert (original(x).logits[..., :300] - ours(x)[..., :300]).abs().max().item() > 1e-3  # it changed
    prompt = [5, 17, 42]
    mine = generate(
        ours,
        [prompt],
        Sampling(max_new_tokens=16, temperature=0, stop_at_eot=False),
        loaded.tokenizer.eot_id,
        loaded.vocab_size,
    ).tokens[0]
    ref = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert mine == ref[0, len(prompt) :].tolist()
    _the_run_logged_and_registered_its_model(client, summary, stage, loaded, ours, tmp_path, data)


def _the_run_logged_and_registered_its_model(client, summary, stage, loaded, ours, tmp_path, pretrained_data):
    """The run's MLflow model: an output of the run with its final metrics, version 1 in the
    registry, and a pyfunc whose greedy text is Kiln's."""
    import mlflow

    assert summary.model == f"models:/tiny-llama-{stage}/1"
    [output] = client.get_run(summary.run_id).outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert model.source_run_id == summary.run_id and model.status == "READY"
    assert client.get_model_version(f"tiny-llama-{stage}", "1").source == model.artifact_location
    assert {m.key for m in model.metrics} >= {"model/loss/train", "model/loss/val"}
    steps = [m.step for m in client.get_metric_history(summary.run_id, "loss/train")]
    assert len(steps) == len(set(steps)), steps  # the model's metrics add no second point to the curve
    pyfunc = mlflow.pyfunc.load_model(summary.model)
    prompt = "def load(s):"
    text = pyfunc.predict([prompt], params={"temperature": 0.0, "max_new_tokens": 12})[0]
    ids = loaded.tokenizer.encode_batch([prompt])[0].tolist()
    expected = generate(
        ours, [ids], Sampling(max_new_tokens=12, temperature=0), loaded.tokenizer.eot_id, loaded.vocab_size
    ).tokens[0]
    assert text == loaded.tokenizer.decode(expected)
    if stage == 2:
        assert _served_over_http(summary.model, prompt, tmp_path) == text
        _by_alias_leaving_no_copy(client, summary, pretrained_data, prompt, text, tmp_path)


def _by_alias_leaving_no_copy(client, summary, pretrained_data, prompt, text, tmp_path) -> None:
    """`kiln eval` logs to the model's run, `models:/NAME@ALIAS` resolves, and neither command
    leaves its download of the model in the temp directory."""
    import contextlib
    import io
    import tempfile

    from kiln.cli import main
    from kiln.tracking.model import evaluate_model

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    before, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        result, logged_to = evaluate_model(
            summary.model, str(pretrained_data), "val", 8, 0, "", client.tracking_uri, ""
        )
        client.set_registered_model_alias("tiny-llama-2", "champion", "1")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert (
                main(
                    [
                        "generate",
                        "--model",
                        "models:/tiny-llama-2@champion",
                        "--prompt",
                        prompt,
                        "--temperature",
                        "0",
                        "--max-new-tokens",
                        "12",
                        "--tracking-uri",
                        client.tracking_uri,
                    ]
                )
                == 0
            )
    finally:
        tempfile.tempdir = before
    assert text in printed.getvalue(), printed.getvalue()
    assert list(scratch.iterdir()) == []
    assert logged_to == summary.run_id and 0 < result.bits_per_byte < 20
    logged = client.get_run(summary.run_id).data.metrics
    assert logged["eval/val/bits_per_byte"] == pytest.approx(result.bits_per_byte)
    assert logged["eval/val/tokens"] == result.tokens > 0


def _served_over_http(model_uri: str, prompt: str, tmp: Path) -> str:
    """`mlflow models serve` (local env manager) on loopback, asked once over HTTP."""
    import json
    import os
    import subprocess
    import sys
    import urllib.request

    from kiln.launch.local import free_port

    port = free_port()
    bin_dir = Path(sys.executable).parent
    mlflow_cli = str(bin_dir / "mlflow")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")  # as in an activated venv
    server_log = tmp / "serve.log"
    with open(server_log, "w") as out:
        server = subprocess.Popen(
            [
                mlflow_cli,
                "models",
                "serve",
                "-m",
                model_uri,
                "--env-manager",
                "local",
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        body = json.dumps({"inputs": [prompt], "params": {"temperature": 0.0, "max_new_tokens": 12}}).encode()
        deadline = time.time() + 180
        while True:
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(request, timeout=30) as response:
                    return json.loads(response.read())["predictions"][0]
            except OSError as e:
                if server.poll() is not None or time.time() > deadline:
                    raise AssertionError(f"mlflow models serve did not answer: {server_log.read_text()[-3000:]}") from e
                time.sleep(1)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def test_data_of_another_tokenizer_is_refused_before_launch(pretrained, byte_dataset, tmp_path):
    from kiln.launch.preflight import preflight

    ckpt, _, _ = pretrained
    with pytest.raises(ConfigError, match="was tokenized with a different tokenizer .* --tokenizer"):
        preflight(_config(ckpt, byte_dataset, tmp_path, "wrong-tokenizer"))
    with pytest.raises(ConfigError, match="model.init_from .* leave model.vocab_size and model.n_layer at 0"):
        preflight(_config(ckpt, pretrained[2], tmp_path, "shape", "model.n_layer=4"))


def test_init_from_and_export_to_s3(pretrained, s3_server, tmp_path, monkeypatch):
    """model.init_from an s3:// prefix (copied once into the local cache, then checked and
    loaded like a directory) and kiln export to one, on the loopback S3 server."""
    from ray_nodes import S3_ENV

    from kiln.launch.preflight import preflight
    from kiln.parallel.engine import build_model
    from kiln.storage import resolve

    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    ckpt, original, data = pretrained
    prefix = resolve("s3://kiln-test/models/tiny-llama", s3_server)
    for f in ckpt.iterdir():
        prefix.join(f.name).write_bytes(f.read_bytes())
    checked = preflight(
        _config(
            "s3://kiln-test/models/tiny-llama",
            data,
            tmp_path,
            "from-s3",
            "parallel.zero_stage=2",
            f"data.s3_endpoint={s3_server}",
        )
    )
    model = build_model(checked.cfg, checked.model, {}, torch.device("cpu")).eval()
    x = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        assert (model(x) - original(x).logits).abs().max().item() <= 1e-5
    assert len(list((tmp_path / "cache" / "checkpoints").iterdir())) == 1  # one copy, no staging left

    _, files = export(str(ckpt), "s3://kiln-test/exports/tiny", s3_endpoint=s3_server)
    assert sorted(resolve("s3://kiln-test/exports/tiny", s3_server).list_files()) == sorted(files)
    with pytest.raises(ConfigError, match="--overwrite"):
        export(str(ckpt), "s3://kiln-test/exports/tiny", s3_endpoint=s3_server)
    with pytest.raises(ConfigError, match="not an export Kiln wrote"):  # the bucket's root holds other things
        export(str(ckpt), "s3://kiln-test", s3_endpoint=s3_server, overwrite=True)
    from kiln.hf_checkpoint import local_copy

    back = transformers.AutoModelForCausalLM.from_pretrained(
        local_copy("s3://kiln-test/exports/tiny", s3_server)
    ).eval()
    with torch.no_grad():
        assert (back(x).logits - original(x).logits).abs().max().item() <= 1e-5


# A Llama 3-style chat template: headers around each role, <|eot_id|> ending each turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _llama3_chat_checkpoint(d: Path, corpus) -> tuple:
    """A tiny Llama with Llama 3.1's RoPE scaling and a BPE tokenizer carrying Llama 3's special
    tokens and chat template, saved as a downloaded checkpoint is; (the model, chat records)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [p.read_text() for p in sorted(Path(corpus[0]).glob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    model = build("llama3-rope")  # its vocab is the tokenizer's, VOCAB
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "chat_template": LLAMA3_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    lines = [line.strip() for text in texts for line in text.splitlines() if len(line.strip()) > 20]
    records = [
        {
            "messages": [
                {"role": "system", "content": "You write Python."},
                {"role": "user", "content": lines[i]},
                {"role": "assistant", "content": lines[i + 1]},
            ]
        }
        for i in range(0, min(len(lines) - 2, 900), 3)
    ]
    return model, records


def test_the_llama3_lora_chat_recipe_end_to_end(ray_cluster, corpus, tmp_path, monkeypatch):
    """README's fine-tuning quickstart, for real: chat records prepared in the checkpoint's own
    template, jobs/configs/llama3-lora-chat.yaml's LoRA adapters trained on Ray at ZeRO-2, each
    conversation attending within itself (the validation loss falls), the model merged, logged and registered, exported with its chat
    template, and `kiln generate --chat` replying as transformers does to the same template, as
    does the registered MLflow model asked with `chat`."""
    from mlflow.tracking import MlflowClient

    from kiln.infer.commands import run_generate

    address, _, _ = ray_cluster
    base = tmp_path / "llama-3-tiny-instruct"
    original, records = _llama3_chat_checkpoint(base, corpus)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = tmp_path / "data"
    prepare(
        PrepareConfig(
            inputs=[str(tmp_path / "chat.jsonl")],
            output=str(data),
            tokenizer=str(base),
            seq_len=64,
            chat_field="messages",
        )
    )
    cfg = load_config(
        REPO / "jobs/configs/llama3-lora-chat.yaml",
        [
            f"model.init_from={base}",
            f"data.path={data}",
            "train.max_steps=8",
            "train.grad_accum_steps=1",
            "train.precision=fp32",
            "train.eval_every=4",
            "train.eval_batches=4",
            "train.checkpoint_every=8",
            "optim.lr=1e-2",
            "schedule.warmup_steps=2",
            f"logging.tracking_uri={sqlite_store(tmp_path)}",
            f"train.storage_path={tmp_path}/runs",
        ],
    )
    assert cfg.model.lora.rank == 16 and cfg.parallel.zero_stage == 2 and cfg.parallel.num_workers == 2
    summary = train(cfg, address=address)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    val = sorted(client.get_metric_history(summary.run_id, "loss/val"), key=lambda m: m.step)
    assert len(val) == 2 and val[-1].value < val[0].value, [(m.step, m.value) for m in val]
    assert summary.model == "models:/llama3-lora-chat/1"
    # chat data: each conversation attended to alone (data.document_mask = auto), on both workers
    assert client.get_run(summary.run_id).data.params["data.document_mask"] == "true"

    out = tmp_path / "llama3-lora-chat-export"
    loaded, _ = export(summary.checkpoint, str(out))
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == LLAMA3_TEMPLATE
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        assert (theirs(x).logits - loaded.build()(x)[..., :VOCAB]).abs().max().item() <= 1e-5
        assert (original(x).logits - theirs(x).logits).abs().max().item() > 1e-3  # it trained

    prompt = "Write a function that parses JSON."
    reply = run_generate(
        str(out), [prompt], Sampling(max_new_tokens=16, temperature=0), 1, "cpu", lambda _: None, chat=True
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")  # the base's
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    stops = [tokenizer.eos_token_id, loaded.tokenizer.eot_id]  # the end of a turn, and of a text
    ref = theirs.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=stops)

    def until_stop(tokens: list[int]) -> list[int]:
        return next((tokens[:i] for i, t in enumerate(tokens) if t in stops), tokens)

    assert until_stop(reply.generated[0].tokens[0]) == until_stop(ref[0, len(ids) :].tolist())

    # Served: the registered MLflow model replies in the same template.
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")  # for models:/ URIs
    served = mlflow.pyfunc.load_model(summary.model).predict(
        [prompt], params={"chat": True, "temperature": 0.0, "max_new_tokens": 16}
    )
    assert served == [loaded.tokenizer.decode(reply.generated[0].tokens[0])]
