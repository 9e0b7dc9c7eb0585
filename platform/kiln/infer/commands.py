"""`kiln export` and `kiln generate`: the arguments checked, the model loaded, the work done.

The command front end (`kiln.cli`) owns the terminal; these functions take the writer to stream
text into, so the library itself never prints.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln import guard, hf_export
from kiln import hf_checkpoint as hf
from kiln.errors import ConfigError
from kiln.infer.generate import Generated, Sampling, TextStream, generate
from kiln.infer.load import LoadedModel, load_model

log = logging.getLogger(__name__)

# ---- export --------------------------------------------------------------------------------------
EXPORT = "export"  # the write guard's kind for an export directory


def export(
    spec: str,
    output: str,
    overwrite: bool = False,
    s3_endpoint: str = "",
    dtype: str = "fp32",
    max_shard_size: int | str = hf_export.MAX_SHARD_SIZE,
    adapters: bool = False,
) -> tuple[LoadedModel, list[str]]:
    """Write `spec`'s model as a Hugging Face directory at `output`, whole or not at all. A local
    one is written into a hidden sibling and swapped into place by the write guard (`kiln.guard`);
    an s3:// one (no rename there) is uploaded file by file with config.json last, so a partial
    upload is not a loadable checkpoint. An existing `output` is replaced only with `overwrite`,
    and only if Kiln's marker says it is an export. The weights are in `dtype` (fp32: the
    checkpoint's master weights as they are), in shards of at most `max_shard_size`. With
    `adapters`, a LoRA checkpoint's adapters alone, in PEFT's layout."""
    if output.startswith("s3://"):
        return _export_to_s3(spec, output, overwrite, s3_endpoint, dtype, max_shard_size, adapters)
    check_target(output, overwrite=overwrite, inputs=(spec,))
    out = guard.local_path(output)
    loaded = load_model(spec)
    staged = guard.temp_dir(out.parent, out.name)
    try:
        files = _write(loaded, staged, dtype, max_shard_size, adapters)
        staged.chmod(0o755)  # mkdtemp's 0700 would hide the export from other users
        guard.replace_dir(staged, out, EXPORT, replace=overwrite)
    finally:
        guard.discard(staged, ("temp", EXPORT))  # gone already unless something failed
    return loaded, [*files, guard.MARKER]


def _write(loaded: LoadedModel, directory: Path, dtype: str, max_shard_size: int | str, adapters: bool) -> list[str]:
    """The export's files in `directory`: the whole model (a LoRA one merged), or its adapters."""
    if not adapters:
        return hf_export.write(
            loaded.cfg, loaded.state, loaded.tokenizer, loaded.vocab_size, directory, dtype, max_shard_size
        )
    if loaded.adapters is None or loaded.lora is None:
        raise ConfigError(f"--adapters: {loaded.source} is not a LoRA checkpoint (it has no adapters to write)")
    return hf_export.write_adapters(loaded.cfg, loaded.adapters, loaded.lora, loaded.base, directory, dtype)


def _export_to_s3(
    spec: str,
    output: str,
    overwrite: bool,
    s3_endpoint: str,
    dtype: str,
    max_shard_size: int | str,
    adapters: bool = False,
) -> tuple[LoadedModel, list[str]]:
    from kiln.storage import resolve

    out = resolve(output, s3_endpoint)
    present = out.list_files()
    if present and guard.MARKER not in present:
        raise ConfigError(
            f"--output {output}: holds files and is not an export Kiln wrote (no {guard.MARKER} "
            "marker); it is never overwritten"
        )
    if present and out.join(guard.MARKER).read_bytes().strip() != guard.tag(EXPORT).encode():
        raise ConfigError(f"--output {output}: its {guard.MARKER} marker is not an export's; it is never overwritten")
    if present and not overwrite:
        raise ConfigError(f"--output {output}: already holds an earlier export; pass --overwrite to replace it")
    loaded = load_model(spec)
    with tempfile.TemporaryDirectory(prefix="kiln-export-") as tmp:
        files = _write(loaded, Path(tmp), dtype, max_shard_size, adapters)
        if present:
            # The old export stops loading first.
            guard.delete_stored(out.fs, out.join(hf.CONFIG).path, proof="an export's, by its marker")
        out.join(guard.MARKER).write_bytes(guard.tag(EXPORT).encode() + b"\n")
        for name in sorted(files, key=lambda n: n == hf.CONFIG):  # config.json last
            out.join(name).write_bytes((Path(tmp) / name).read_bytes())
    for stale in set(present) - {*files, guard.MARKER}:
        guard.delete_stored(out.fs, out.join(stale).path, proof="an earlier export's, by its marker")
    return loaded, [*files, guard.MARKER]


def check_target(output: str, flag: str = "--output", overwrite: bool = False, inputs: tuple = ()) -> None:
    """Refuse, before any work, a local export target that could not be written or is not ours
    to replace (`kiln.guard`; an s3:// one is checked by `export`, which has its endpoint)."""
    if output.startswith("s3://"):
        return
    guard.check_dir_target(output, EXPORT, f"{flag} {output}", inputs=inputs, replace=overwrite)


# ---- generate ------------------------------------------------------------------------------------
@dataclass
class GenerateResult:
    completions: list[str]
    generated: list[Generated]

    @property
    def new_tokens(self) -> int:
        return sum(g.new_tokens for g in self.generated)

    @property
    def seconds(self) -> float:
        return sum(g.prefill_s + g.decode_s for g in self.generated)


def read_prompts(prompts: list[str], prompts_file: str | None) -> list[str]:
    """The --prompt values, then the non-empty lines of --prompts (one prompt per line)."""
    found = list(prompts)
    if prompts_file:
        try:
            found += [line for line in Path(prompts_file).read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts {prompts_file}: not a readable text file ({e})") from None
    if not found or any(p == "" for p in found):
        raise ConfigError("give at least one non-empty --prompt, or --prompts FILE with one prompt per line")
    return found


def fit_to_context(s: Sampling, prompt_tokens: int, context: int) -> Sampling:
    """`s` with max_new_tokens cut to what the model's context leaves after the prompt (a
    notice says so); a prompt that fills the context alone is refused, naming the flag."""
    room = context - prompt_tokens
    if room < 1:
        raise ConfigError(
            f"--prompt: {prompt_tokens} tokens fill the model's whole context of {context}; shorten the prompt"
        )
    if s.max_new_tokens <= room:
        return s
    log.warning(
        "--max-new-tokens %d cut to %d: the model's context is %d tokens and the prompt takes %d",
        s.max_new_tokens,
        room,
        context,
        prompt_tokens,
    )
    return dataclasses.replace(s, max_new_tokens=room)


def check_device(device: str) -> str:
    """The torch device `--device` names, checked against this machine before any model is
    loaded; `auto` is the first GPU where torch sees one, else the CPU."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device}: not a torch device; expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: this machine has no CUDA device; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    return device


def run_generate(
    spec: str,
    prompts: list[str],
    s: Sampling,
    batch_size: int,
    device: str,
    write: Callable[[str], object],
    chat: bool = False,
    compile: bool = False,
) -> GenerateResult:
    """Complete each prompt, streaming text to `write` as it decodes. With batch_size 1 each
    completion streams token by token; a batch's completions are written as the batch ends.
    `chat`: each prompt is a user turn in the model's chat template, and the template's end of
    turn (its eos_token) stops a completion too. `compile`: the decode step under torch.compile
    (`kiln.infer.generate.generate`)."""
    loaded = load_model(spec)
    turns = chat_encoder(loaded.tokenizer) if chat else None
    model = loaded.build(device)
    result = GenerateResult([], [])
    for start in range(0, len(prompts), batch_size):
        texts, generated = _complete(model, loaded, prompts[start : start + batch_size], s, write, turns, compile)
        result.completions += texts
        result.generated.append(generated)
    return result


def chat_encoder(tok) -> tuple[Callable[[str], list[int]], tuple[int, ...]]:
    """(a prompt as the ids of a user turn and the assistant's cue, the template's end-of-turn
    ids), as transformers' apply_chat_template(add_generation_prompt=True) tokenizes it."""
    from kiln.data.chat import render, template_of

    companions = getattr(tok, "companions", {})
    template = template_of(companions)
    if template is None:
        raise ConfigError(
            "--chat: the model's tokenizer has no chat template (a chat_template in its "
            "tokenizer_config.json, or chat_template.jinja)"
        )
    stops = tuple(i for i in [tok.special_id("eos_token")] if i is not None)

    def encode(prompt: str) -> list[int]:
        text = render(template, [{"role": "user", "content": prompt}], companions, add_generation_prompt=True)
        return list(map(int, tok.encode_batch([text], special=False)[0]))  # the template placed them

    return encode, stops


def _complete(
    model,
    loaded: LoadedModel,
    batch: list[str],
    s: Sampling,
    write: Callable[[str], object],
    chat: tuple[Callable[[str], list[int]], tuple[int, ...]] | None = None,
    compile: bool = False,
) -> tuple[list[str], Generated]:
    tok = loaded.tokenizer
    ids = [chat[0](p) for p in batch] if chat else [list(map(int, row)) for row in tok.encode_batch(batch)]
    s = fit_to_context(s, max(map(len, ids)), loaded.cfg.seq_len)
    streams = [TextStream(tok.decode) for _ in batch]
    texts = [""] * len(batch)
    single = len(batch) == 1
    if single:
        write(batch[0])

    def on_tokens(step: list[int | None]) -> None:
        for row, t in enumerate(step):
            if t is not None:
                piece = streams[row].push(t)
                texts[row] += piece
                if single:
                    write(piece)

    try:
        stops = chat[1] if chat else ()
        generated = generate(model, ids, s, tok.eot_id, loaded.vocab_size, on_tokens, stop_ids=stops, compile=compile)
    except ValueError as e:  # a prompt too long for the model's context
        raise ConfigError(f"--max-new-tokens {s.max_new_tokens}: {e}") from None
    for row, prompt in enumerate(batch):
        tail = streams[row].flush()
        texts[row] += tail
        write(tail + "\n" if single else f"{prompt}{texts[row]}\n")
    return texts, generated
