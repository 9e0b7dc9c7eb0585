"""Chat data: conversations rendered with the tokenizer's own chat template, token for token as
transformers' apply_chat_template gives them, with only the assistant turns scored."""

import json
from pathlib import Path

import pytest
import torch

from kiln.data.manifest import load_manifest
from kiln.data.prepare import PrepareConfig, prepare
from kiln.data.sources import ParquetSource
from kiln.storage import resolve

transformers = pytest.importorskip("transformers")

# ChatML, as Qwen's tokenizers carry it.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat(corpus, tmp_path_factory):
    """A ChatML tokenizer directory, multi-turn conversations made of real text, and the dataset
    prepared from them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("chat")
    texts = [p.read_text() for p in sorted(Path(corpus[0]).glob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=500,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    (tmp / "tok").mkdir()
    tok.save(str(tmp / "tok" / "tokenizer.json"))
    (tmp / "tok" / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            }
        )
    )
    lines = [line.strip() for text in texts[:3] for line in text.splitlines() if len(line.strip()) > 20]
    records = [
        {
            "messages": [
                {"role": "system", "content": "You write Python."},
                {"role": "user", "content": lines[i]},
                {"role": "assistant", "content": lines[i + 1]},
                {"role": "user", "content": lines[i + 2]},
                {"role": "assistant", "content": lines[i + 3]},
            ]
        }
        for i in range(0, min(len(lines) - 4, 400), 4)
    ]
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare(
        PrepareConfig(
            inputs=[str(tmp / "chat.jsonl")],
            output=str(tmp / "ds"),
            tokenizer=str(tmp / "tok"),
            seq_len=64,
            val_fraction=0.5,
            chat_field="messages",
        )
    )
    return load_manifest(resolve(str(tmp / "ds"))), records, transformers.AutoTokenizer.from_pretrained(tmp / "tok")


def test_each_conversation_is_the_templates_tokens_and_only_assistant_turns_are_scored(chat):
    manifest, records, theirs = chat
    assert manifest.raw["loss_mask"]["scored"] == "assistant"
    expected = {}
    for r in records:
        ids = theirs.apply_chat_template(r["messages"], tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        expected[tuple(ids)] = r["messages"]
    rows = torch.cat([r for _, r in ParquetSource(manifest, 0, 1, 4).epoch("val")]).reshape(-1)
    eot = theirs.convert_tokens_to_ids("<|endoftext|>")
    ids, scored = torch.where(rows < 0, -rows - 1, rows).tolist(), (rows >= 0).tolist()
    ends = [i for i, t in enumerate(ids) if t == eot]
    assert len(ends) > 10 and not any(scored[i] for i in ends)  # the separator is never a target
    for a, b in zip(ends, ends[1:]):  # each whole conversation between two separators
        messages = expected[tuple(ids[a + 1 : b])]  # the template's tokens, exactly
        said = theirs.decode([t for t, s in zip(ids[a + 1 : b], scored[a + 1 : b]) if s])
        assert said == "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
