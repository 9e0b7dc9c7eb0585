"""Document masks: prepared rows record where each document or example starts, and a run that
attends within documents (data.document_mask) scores a packed row as the sum of its documents
trained one at a time. Real prepares of stdlib text (plain and instruction data), a real model."""

import dataclasses
import json

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from kiln.config import load_config
from kiln.data.check import resolve_against_data
from kiln.data.manifest import STARTS, load_manifest
from kiln.data.prepare import PrepareConfig, prepare
from kiln.data.sources import ParquetSource
from kiln.errors import ConfigError, DataError
from kiln.model import DOC_START, GPT, IGNORE, config_for, inputs_and_targets
from kiln.storage import resolve

EOT = 256  # the byte tokenizer's end of text


def _examples(corpus) -> list[dict]:
    """Each stdlib function's signature as the prompt, its next two lines as the response."""
    from pathlib import Path

    out = []
    for path in sorted(p for root in corpus for p in Path(root).rglob("*.py")):
        lines = path.read_text().splitlines()
        out += [
            {"prompt": line.strip(), "response": "\n".join(lines[i + 1 : i + 3])}
            for i, line in enumerate(lines)
            if line.lstrip().startswith("def ") and i + 3 < len(lines)
        ]
    return out


@pytest.fixture(scope="module")
def datasets(corpus, tmp_path_factory):
    """(plain text, instruction data) manifests, byte-tokenized into rows of 256 tokens."""
    tmp = tmp_path_factory.mktemp("documents")
    (tmp / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _examples(corpus)))
    plain, sft = tmp / "plain", tmp / "sft"
    prepare(PrepareConfig(inputs=corpus, output=str(plain), tokenizer="byte", seq_len=256, val_fraction=0.2))
    prepare(
        PrepareConfig(
            inputs=[str(tmp / "sft.jsonl")],
            output=str(sft),
            tokenizer="byte",
            seq_len=256,
            val_fraction=0.2,
            prompt_field="prompt",
            response_field="response",
        )
    )
    return load_manifest(resolve(str(plain))), load_manifest(resolve(str(sft)))


def _rows(manifest, documents: bool) -> torch.Tensor:
    return torch.cat([r for _, r in ParquetSource(manifest, 0, 1, 1, documents=documents).epoch("val")])


def test_each_row_records_where_its_documents_start(datasets):
    """A start is the token after an end of text (a document's first), and every such token is
    one; the column is there, in the manifest and the shards; marked rows carry DOC_START on
    exactly those tokens and are otherwise the stored ones."""
    for manifest, least in zip(datasets, (1, 2)):  # a few files; examples of ~100 bytes in rows of 256
        assert manifest.document_starts and STARTS in pq.read_schema(manifest.shard_locations("val")[0].path).names
        plain, marked = _rows(manifest, False), _rows(manifest, True)
        flags = marked >= DOC_START // 2
        assert torch.equal(marked - flags.long() * DOC_START, plain)
        ids = torch.where(plain < 0, -plain - 1, plain)
        after_end = torch.zeros_like(flags)
        after_end[:, 1:] = ids[:, :-1] == EOT
        assert torch.equal(flags[:, 1:], after_end[:, 1:]), "a start is exactly the token after an end of text"
        assert flags.sum() >= (least * len(flags) if least > 1 else 1), (flags.sum(), len(flags))


@pytest.mark.parametrize("flavour", ["debug", "llama-debug"])
@pytest.mark.parametrize("data", ["plain", "instruction"])
def test_a_packed_row_scores_as_its_documents_alone(datasets, flavour, data):
    """Each token's loss in a packed row, attending within its document, equals its loss with
    the document run alone (1e-5): the previous document is neither attended to nor used to
    predict a document's first token (scored in plain text; a prompt's, not scored, in
    instruction data). Without document masks the same rows score otherwise."""
    torch.manual_seed(0)
    model = GPT(config_for(flavour, vocab_size=320, seq_len=256)).eval()
    rows = _rows(datasets[data == "instruction"], True)
    rows = rows[(rows[:, 1:] >= DOC_START // 2).any(1)][:4]  # rows where a document begins after the first token
    inputs, targets, documents = inputs_and_targets(rows, documents=True)
    with torch.no_grad():
        packed = F.cross_entropy(
            model(inputs, documents=documents).transpose(1, 2), targets, ignore_index=IGNORE, reduction="none"
        )
        alone, pieces = torch.zeros_like(packed), 0
        T = inputs.shape[1]
        for b in range(len(rows)):
            for d in documents[b].unique():
                at = (documents[b] == d).nonzero().flatten()
                lo, hi = int(at[0]), int(at[-1]) + 1
                # The document's own tokens: up to the next one's start, or the row's last token.
                doc = rows[b, lo : hi if hi < T else T + 1]
                x, t, _ = inputs_and_targets((doc - (doc >= DOC_START // 2).long() * DOC_START)[None])
                scored = F.cross_entropy(model(x).transpose(1, 2), t, ignore_index=IGNORE, reduction="none")[0]
                alone[b, lo : lo + len(scored)] = scored  # a last input before another document: none
                pieces += 1
        unmasked = F.cross_entropy(model(inputs).transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
    assert len(rows) >= 2 and pieces >= 2 * len(rows)
    assert (packed - alone).abs().max().item() <= 1e-5
    assert abs(packed.sum().item() - alone.sum().item()) <= 1e-5 * alone.sum().item()
    assert (unmasked - packed).abs().max().item() > 1e-3  # the masks change what a token sees


def test_auto_masks_instruction_data_and_not_plain_text(datasets, tmp_path):
    """data.document_mask = auto: true for instruction (and chat) data, false for plain text and
    under a pipeline; true asks for a dataset that records starts, and a pipeline is refused."""
    plain, sft = (m.location.uri for m in datasets)

    def resolved(path, *more):
        cfg = load_config(None, [f"data.path={path}", "train.micro_batch_size=1", "parallel.num_workers=1", *more])
        return resolve_against_data(cfg)[0].data.document_mask

    assert resolved(sft) == "true" and resolved(plain) == "false"
    assert resolved(plain, "data.document_mask=true") == "true" and resolved(sft, "data.document_mask=false") == "false"
    piped = [
        "parallel.num_workers=2",
        "parallel.pipeline_stages=2",
        "parallel.micro_batches=2",
        "parallel.zero_stage=1",
    ]
    assert resolved(sft, *piped) == "false"
    with pytest.raises(ConfigError, match=r"data.document_mask = true with parallel.pipeline_stages = 2"):
        load_config(None, [f"data.path={sft}", "data.document_mask=true", *piped])
    with pytest.raises(ConfigError, match=r"data.document_mask = 'sometimes' is not allowed"):
        load_config(None, ["data.document_mask=sometimes"])


def test_a_dataset_without_starts_is_refused_by_name_and_read_as_before(datasets, tmp_path):
    """A dataset of an older prepare (no starts column in its manifest): auto leaves masks off
    and reads it as before; true names it and says what to do; a source asked for documents
    refuses it."""
    import shutil

    _, sft = datasets
    old = tmp_path / "old"
    shutil.copytree(sft.location.path, old)
    raw = json.loads((old / "manifest.json").read_text())
    del raw["columns"][STARTS]
    (old / "manifest.json").write_text(json.dumps(raw))
    cfg = load_config(None, [f"data.path={old}", "train.micro_batch_size=1", "parallel.num_workers=1"])
    assert resolve_against_data(cfg)[0].data.document_mask == "false"
    with pytest.raises(ConfigError, match=rf"data.document_mask = true: data.path = {old} does not record where"):
        resolve_against_data(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask="true")))
    manifest = load_manifest(resolve(str(old)))
    with pytest.raises(DataError, match="records no document starts"):
        ParquetSource(manifest, 0, 1, 4, documents=True)
    assert torch.equal(_rows(manifest, False), _rows(sft, False))


def test_kiln_eval_scores_instruction_data_within_documents(datasets):
    """`kiln eval`'s scoring (kiln.infer.evaluate) masks instruction data as a run's auto does:
    its loss is the packed rows' loss within documents, not the whole rows'; plain text it
    scores whole."""
    from kiln.data.tokenizer import ByteTokenizer
    from kiln.infer.evaluate import evaluate
    from kiln.infer.load import LoadedModel

    plain, sft = datasets
    torch.manual_seed(0)
    model = GPT(config_for("debug", vocab_size=320, seq_len=256)).eval()
    loaded = LoadedModel(model.cfg, model.state_dict(), ByteTokenizer(), "random", 257)

    def by_hand(manifest, documents: bool) -> float:
        inputs, targets, docs = inputs_and_targets(_rows(manifest, documents), documents)
        with torch.no_grad():
            logits = model(inputs, documents=docs)[..., :257]
        return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE).item()

    got = evaluate(loaded, sft, batch_size=3).loss
    assert abs(got - by_hand(sft, True)) <= 1e-5 and abs(got - by_hand(sft, False)) > 1e-4
    assert abs(evaluate(loaded, plain, batch_size=3, max_batches=4).loss - by_hand_first(plain, model, 12)) <= 1e-5


def by_hand_first(manifest, model, rows: int) -> float:
    """The whole-row loss of a dataset's first `rows` validation rows."""
    inputs, targets, _ = inputs_and_targets(_rows(manifest, False)[:rows])
    with torch.no_grad():
        logits = model(inputs)[..., :257]
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE).item()
