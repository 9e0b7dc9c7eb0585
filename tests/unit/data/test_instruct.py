"""Instruction data: prompt/response records packed with a response-only loss mask. The mask is
checked against the records themselves, and the loss against one computed by hand."""

import json

import pytest
import torch

from kiln.data.manifest import check_shards, load_manifest
from kiln.data.prepare import PrepareConfig, prepare
from kiln.data.sources import ParquetSource
from kiln.errors import ConfigError, DataError
from kiln.model import GPT, GPTConfig, inputs_and_targets, next_token_loss
from kiln.storage import resolve

EOT = 256


def _records(corpus) -> list[dict]:
    """Real text: each stdlib function's signature as the prompt, its next lines as the response."""
    from pathlib import Path

    out = []
    for path in sorted(Path(corpus[0]).glob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and i + 3 < len(lines):
                out.append({"prompt": line.strip() + " → ", "response": "\n".join(lines[i + 1 : i + 4]) + " ✓"})
    return out


@pytest.fixture(scope="module")
def instruct(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("instruct")
    records = _records(corpus)
    (tmp / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp / "ds"
    prepare(
        PrepareConfig(
            inputs=[str(tmp / "sft.jsonl")],
            output=str(out),
            tokenizer="byte",
            seq_len=32,
            val_fraction=0.5,
            prompt_field="prompt",
            response_field="response",
        )
    )
    return load_manifest(resolve(str(out))), records


def test_only_response_tokens_and_their_end_are_scored(instruct):
    manifest, records = instruct
    check_shards(manifest)  # negative ids are legal in a masked dataset's shards
    assert manifest.raw["loss_mask"]["scored"] == "response"
    rows = torch.cat([r for _, r in ParquetSource(manifest, 0, 1, 4).epoch("val")]).reshape(-1)
    ids, scored = torch.where(rows < 0, -rows - 1, rows).tolist(), (rows >= 0).tolist()
    by_text = {(r["prompt"] + r["response"]).encode(): len(r["prompt"].encode()) for r in records}
    ends = [i for i, t in enumerate(ids) if t == EOT]
    assert len(ends) > 5
    for start, end in zip(ends, ends[1:]):  # each whole example between two ends
        text = bytes(ids[start + 1 : end])
        prompt_bytes = by_text[text]  # it is one of the records, whole
        assert scored[start + 1 : end + 1] == [False] * prompt_bytes + [True] * (end - start - prompt_bytes)


def test_the_loss_counts_only_responses_as_computed_by_hand(instruct):
    manifest, _ = instruct
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, seq_len=32, n_layer=1, n_head=2, d_model=32)).eval()
    _, rows = next(iter(ParquetSource(manifest, 0, 1, 8).epoch("train")))
    rows = rows.long()
    inputs, targets, _ = inputs_and_targets(rows)
    with torch.no_grad():
        logits = model(inputs)
        ours = next_token_loss(logits, targets).item()
        terms = [
            -torch.log_softmax(logits[b, t], -1)[int(rows[b, t + 1])].item()
            for b in range(rows.shape[0])
            for t in range(rows.shape[1] - 1)
            if rows[b, t + 1] >= 0
        ]
    assert 0 < len(terms) < targets.numel()  # some scored, some not
    assert abs(ours - sum(terms) / len(terms)) <= 1e-5
    assert next_token_loss(logits, torch.full_like(targets, -100)).item() == 0.0  # nothing scored: 0, not NaN


def test_instruction_records_are_checked(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected an object with a string field 'response'"):
        prepare(
            PrepareConfig(
                inputs=[str(bad)],
                output=str(tmp_path / "o"),
                tokenizer="byte",
                prompt_field="prompt",
                response_field="response",
            )
        )
    with pytest.raises(ConfigError, match="--prompt-field and --response-field go together"):
        prepare(PrepareConfig(inputs=[str(bad)], output=str(tmp_path / "o"), tokenizer="byte", prompt_field="prompt"))
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_that_adds_bos_puts_one_at_the_start_of_each_example(corpus, tmp_path):
    """A Llama-3-style tokenizer (its post-processor puts <|begin_of_text|> before every text it
    encodes): one BOS per example, its first token, never one before the response."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(
        [p.read_text() for p in sorted(Path(corpus[0]).glob("*.py"))],
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>", "<|begin_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    bos, eot = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    records = _records(corpus)[:200]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare(
        PrepareConfig(
            inputs=[str(tmp_path / "sft.jsonl")],
            output=str(tmp_path / "ds"),
            tokenizer=str(tmp_path / "tok"),
            seq_len=32,
            val_fraction=0.5,
            prompt_field="prompt",
            response_field="response",
        )
    )
    manifest = load_manifest(resolve(str(tmp_path / "ds")))
    rows = torch.cat([r for _, r in ParquetSource(manifest, 0, 1, 4).epoch("val")]).reshape(-1)
    ids = torch.where(rows < 0, -rows - 1, rows).tolist()
    ends = [i for i, t in enumerate(ids) if t == eot]
    examples = [ids[a + 1 : b] for a, b in zip(ends, ends[1:])]
    assert len(examples) > 5
    assert all(e.count(bos) == 1 and e[0] == bos and rows[ends[0] + 1] < 0 for e in examples)
