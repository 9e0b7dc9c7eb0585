"""Kiln's models against transformers' own GPT-2 and Llama: checkpoints in and out, logits and
greedy text equal.

Tiny random checkpoints are built with transformers (`save_pretrained`), nothing downloaded.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import KINDS, VOCAB, saved  # noqa: E402

from kiln import hf_checkpoint as hf  # noqa: E402
from kiln.cli import main  # noqa: E402
from kiln.data.tokenizer import ByteTokenizer  # noqa: E402
from kiln.errors import ConfigError  # noqa: E402
from kiln.infer.commands import export  # noqa: E402
from kiln.infer.generate import Sampling, generate  # noqa: E402
from kiln.infer.load import load_model  # noqa: E402


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory, corpus):
    """A transformers model saved in several shards, with a BPE tokenizer of its vocab."""
    d = tmp_path_factory.mktemp("hf") / request.param
    return d, saved(request.param, d, corpus, max_shard_size="40KB")


def test_a_sharded_checkpoint_loads_with_transformers_logits(checkpoint):
    d, model = checkpoint
    assert (d / hf.INDEX).exists() and len(list(d.glob("*.safetensors"))) > 1  # really sharded
    kiln = load_model(str(d)).build()
    x = torch.randint(0, VOCAB, (3, 40))
    with torch.no_grad():
        assert (kiln(x) - model(x).logits).abs().max().item() <= 1e-5


def test_export_loads_in_transformers_and_greedy_text_is_the_same(checkpoint, tmp_path):
    d, _ = checkpoint
    out = tmp_path / "export"
    loaded, files = export(str(d), str(out))
    assert sorted(files) == sorted(p.name for p in out.iterdir())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = loaded.build()
    x = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() <= 1e-5
    prompt = [5, 17, 42, 99]
    s = Sampling(max_new_tokens=24, temperature=0, stop_at_eot=False)
    mine = generate(ours, [prompt], s, loaded.tokenizer.eot_id, VOCAB).tokens[0]
    ref = theirs.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert mine == ref[0, len(prompt) :].tolist()
    assert len(set(mine)) >= 3  # the model is not stuck on one token: the comparison means something
    # transformers gives a qwen2 model its Qwen2Tokenizer, with Qwen's own pre-tokenizer (right for
    # Qwen's tokenizer.json, not for this test's BPE): the file itself is read as it is.
    auto = transformers.PreTrainedTokenizerFast if d.name == "qwen2" else transformers.AutoTokenizer
    tok = auto.from_pretrained(out)
    text = "def f(x):\n    return x  # é ☃"
    assert tok(text).input_ids == loaded.tokenizer.encode_batch([text])[0].tolist()


def test_the_byte_tokenizer_exports_as_a_tokenizers_file(tmp_path):
    from tokenizers import Tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(ByteTokenizer().hf_json())
    tok = Tokenizer.from_file(str(path))
    text = "naïve ☃ code\n\tx = 1"
    assert tok.encode(text).ids == list(text.encode())
    assert tok.decode(list(text.encode())) == text
    assert tok.token_to_id("<|endoftext|>") == 256


def test_export_never_overwrites_what_is_not_an_export(checkpoint, tmp_path):
    d, _ = checkpoint
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="notes"):
            export(str(d), str(mine), overwrite=overwrite)
    assert [p.name for p in mine.iterdir()] == ["todo.txt"]
    out = tmp_path / "export"
    export(str(d), str(out))
    with pytest.raises(ConfigError, match="--overwrite"):
        export(str(d), str(out))
    export(str(d), str(out), overwrite=True)  # an earlier export is replaced whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_are_one_clear_error_each(checkpoint, tmp_path):
    d, _ = checkpoint
    bert = _copy(d, tmp_path / "bert")
    raw = json.loads((bert / "config.json").read_text())
    (bert / "config.json").write_text(json.dumps(raw | {"model_type": "bert"}))
    with pytest.raises(ConfigError, match=r"model_type 'bert' is not supported; expected one of \['gpt2', 'llama', "):
        load_model(str(bert))

    missing = _copy(d, tmp_path / "missing")
    shard = sorted(missing.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"{shard.name}: missing"):
        load_model(str(missing))

    truncated = _copy(d, tmp_path / "truncated")
    shard = sorted(truncated.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ConfigError, match=f"{shard.name}: not a complete safetensors file"):
        load_model(str(truncated))

    wrong = _copy(d, tmp_path / "wrong")
    (wrong / "config.json").write_text(json.dumps(raw | {"vocab_size": VOCAB + 10}))
    with pytest.raises(ConfigError, match="do not fit config.json, which implies"):
        load_model(str(wrong))

    big_vocab = _copy(d, tmp_path / "vocab")
    (big_vocab / "tokenizer.json").write_text(ByteTokenizer().hf_json())
    (big_vocab / "config.json").write_text(json.dumps(raw | {"vocab_size": 200}))
    with pytest.raises(ConfigError, match="257 tokens, the model's vocab_size is 200"):
        load_model(str(big_vocab))


def test_generate_command_streams_text_and_reports_tokens_per_second(checkpoint, capsys):
    d, _ = checkpoint
    args = [
        "generate",
        "--model",
        str(d),
        "--prompt",
        "import json",
        "--prompt",
        "def main(",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        "--no-stop",
    ]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.startswith("import json") and "\ndef main(" in out  # each prompt, then its text
    assert "tokens/s" in err and err.strip().startswith("24 tokens in")
    assert main([*args, "--batch-size", "2"]) == 0  # batched: the same greedy text
    assert capsys.readouterr().out == out


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--top-p", "0"),
        ("--temperature", "nan"),
        ("--batch-size", "0"),
        ("--max-new-tokens", "0"),
        ("--repetition-penalty", "-1"),
    ],
)
def test_sampling_flags_out_of_range_name_the_flag(checkpoint, capsys, flag, value):
    d, _ = checkpoint
    assert main(["generate", "--model", str(d), "--prompt", "x", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"kiln: error: {flag} " in err and "Traceback" not in err


def test_eval_reports_the_loss_and_bits_per_byte_transformers_gives(checkpoint, corpus, tmp_path, capsys):
    """`kiln eval` on data tokenized with the checkpoint's tokenizer: its loss is transformers'
    mean cross-entropy over the same rows, and bits per byte that loss in bits over the text's bytes."""
    import math

    from kiln.data.manifest import load_manifest
    from kiln.data.prepare import PrepareConfig, prepare
    from kiln.data.sources import ParquetSource
    from kiln.storage import resolve

    d, model = checkpoint
    data = tmp_path / "data"
    prepare(PrepareConfig(inputs=corpus[:1], output=str(data), tokenizer=str(d), seq_len=32))
    assert main(["eval", "--model", str(d), "--data", str(data), "--max-batches", "3"]) == 0
    out = capsys.readouterr().out
    loss, bpb = (float(x) for x in (out.split("loss ")[1].split()[0], out.split(", ")[1].split()[0]))
    manifest = load_manifest(resolve(str(data)))
    rows = torch.cat([r for _, (_, r) in zip(range(3), ParquetSource(manifest, 0, 1, 8).epoch("val"))]).long()
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits
    nats = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1), reduction="sum").item()
    from kiln.data.tokenizer import token_bytes

    tok = load_model(str(d)).tokenizer
    text_bytes = int(token_bytes(tok)[rows[:, 1:].numpy()].sum())
    assert abs(loss - nats / rows[:, 1:].numel()) <= 1e-4
    assert abs(bpb - nats / math.log(2) / text_bytes) <= 1e-4


def test_eval_scores_every_row_of_the_split_the_last_partial_batch_included(checkpoint, corpus, tmp_path, capsys):
    """Over the whole val split, in batches of 7 that do not divide it: transformers' loss over
    every row (read straight from the shards), and every target token counted."""
    import pyarrow.parquet as pq

    from kiln.data.manifest import load_manifest
    from kiln.data.prepare import PrepareConfig, prepare
    from kiln.storage import resolve

    d, model = checkpoint
    data = tmp_path / "data"
    prepare(PrepareConfig(inputs=corpus[:1], output=str(data), tokenizer=str(d), seq_len=32))
    manifest = load_manifest(resolve(str(data)))
    rows = torch.tensor(
        [
            r
            for loc in manifest.shard_locations("val")
            for r in pq.read_table(loc.uri, columns=["tokens"]).column("tokens").to_pylist()
        ]
    )
    assert len(rows) % 7, len(rows)  # a partial last batch
    assert main(["eval", "--model", str(d), "--data", str(data), "--batch-size", "7"]) == 0
    out = capsys.readouterr().out
    loss, tokens = float(out.split("loss ")[1].split()[0]), int(out.split(" over ")[1].split()[0].replace(",", ""))
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1)).item()
    assert tokens == rows[:, 1:].numel()
    assert abs(loss - expected) <= 1e-4


def test_a_sliding_window_becomes_the_models_context_and_qwen2_keeps_its_family(checkpoint, tmp_path):
    """Mistral's 48-token window is Kiln's context (within it sliding attention is full attention);
    Qwen2 exports as Qwen2 with its q/k/v biases; an explicit head_dim and an untied GPT-2 head
    round-trip."""
    d, model = checkpoint
    loaded = load_model(str(d))
    out = tmp_path / "export"
    export(str(d), str(out))
    config = json.loads((out / "config.json").read_text())
    if d.name == "mistral":
        assert loaded.cfg.seq_len == 48 and config["max_position_embeddings"] == 48
    if d.name == "qwen2":
        assert loaded.cfg.qkv_bias and config["model_type"] == "qwen2"
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert "model.layers.0.self_attn.q_proj.bias" in f.keys()  # noqa: SIM118
    if d.name == "llama-head-dim":
        assert loaded.cfg.head_dim == 16 != loaded.cfg.d_model // loaded.cfg.n_head and config["head_dim"] == 16
    if d.name == "gpt2-untied":
        assert not loaded.cfg.tie_embeddings and config["tie_word_embeddings"] is False
        assert not torch.equal(loaded.state["lm_head.weight"], loaded.state["wte.weight"])


CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"


def test_an_export_keeps_the_base_tokenizers_config_and_chat_template(corpus, tmp_path):
    """A checkpoint whose tokenizer came with tokenizer_config.json and a chat template: its
    export writes both back as they were, so transformers formats chats as the base did; a
    dataset prepared with that tokenizer keeps them too, for the exports of what trains on it."""

    from kiln.data.manifest import load_manifest
    from kiln.data.prepare import PrepareConfig, prepare
    from kiln.storage import resolve

    base = tmp_path / "base"
    saved("llama-gqa", base, corpus)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "model_max_length": 64,
        "clean_up_tokenization_spaces": False,
    }
    (base / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (base / "chat_template.jinja").write_text(CHAT)
    out = tmp_path / "export"
    export(str(base), str(out))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_text() == (base / name).read_text(), name
    tok = transformers.AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f():"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<|user|>hi<|endoftext|><|assistant|>def f():<|endoftext|>"

    data = tmp_path / "data"
    prepare(PrepareConfig(inputs=corpus[:1], output=str(data), tokenizer=str(base), seq_len=32))
    manifest = load_manifest(resolve(str(data)))
    assert manifest.raw["tokenizer"]["companions"] == ["chat_template.jinja", "tokenizer_config.json"]
    assert manifest.tokenizer().companions == {
        n: (base / n).read_text() for n in manifest.raw["tokenizer"]["companions"]
    }


# A ChatML-like template that uses the special tokens and the generation cue, as Llama 3's and Qwen's do.
CUE_CHAT = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_generate_chat_tokenizes_the_prompt_as_transformers_and_replies_as_it_does(corpus, tmp_path, capsys):

    from kiln.infer.commands import chat_encoder

    base = tmp_path / "chat"
    model = saved("llama-gqa", base, corpus)
    (base / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "chat_template": CUE_CHAT,
            }
        )
    )
    prompt = "  write a parser "
    tok = load_model(str(base)).tokenizer
    encode, stops = chat_encoder(tok)
    theirs = transformers.AutoTokenizer.from_pretrained(base).apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    ids = encode(prompt)
    assert ids == list(theirs) and ids[0] == tok.eot_id  # the template's own BOS, once
    assert stops == (tok.token_to_id("<|endoftext|>"),)  # its end of turn
    assert (
        main(
            [
                "generate",
                "--model",
                str(base),
                "--chat",
                "--prompt",
                prompt,
                "--temperature",
                "0",
                "--max-new-tokens",
                "12",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eot_id)
    expected = tok.decode([t for t in ref[0, len(ids) :].tolist() if t != tok.eot_id])
    assert printed == prompt + expected + "\n", (printed, expected)
