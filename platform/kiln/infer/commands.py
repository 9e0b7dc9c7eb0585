"""`kiln export` and `kiln generate`: the arguments checked, the model loaded, the work done.

The command front end (`kiln.cli`) owns the terminal; these functions take the writer to stream
text into, so the library itself never prints.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln import hf_checkpoint as hf
from kiln.errors import ConfigError
from kiln.infer.generate import Generated, Sampling, TextStream, generate
from kiln.infer.load import LoadedModel, load_model


# ---- export --------------------------------------------------------------------------------------
def export(spec: str, output: str, overwrite: bool = False, s3_endpoint: str = "") -> tuple[LoadedModel, list[str]]:
    """Write `spec`'s model as a Hugging Face directory at `output`, whole or not at all. A local
    one is written into a sibling temp directory and renamed into place; an s3:// one (no
    rename there) is uploaded file by file with config.json last, so a partial upload is not a
    loadable checkpoint. An existing `output` is replaced only with `overwrite`, and only if it
    is an export itself (config.json and weights)."""
    if output.startswith("s3://"):
        return _export_to_s3(spec, output, overwrite, s3_endpoint)
    check_target(output)
    out = Path(output).absolute()
    old = _existing_export(out, overwrite)
    loaded = load_model(spec)
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        files = hf.write(loaded.cfg, loaded.state, loaded.tokenizer, loaded.vocab_size, staged)
        staged.chmod(0o755)  # mkdtemp's 0700 would hide the export from other users
        if old:
            trash = out.with_name(f".{out.name}.replaced-{os.getpid()}")
            out.rename(trash)
            staged.rename(out)
            shutil.rmtree(trash)
        else:
            staged.rename(out)
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)
    return loaded, files


def _export_to_s3(spec: str, output: str, overwrite: bool, s3_endpoint: str) -> tuple[LoadedModel, list[str]]:
    from kiln.storage import resolve

    out = resolve(output, s3_endpoint)
    present = out.list_files()
    if present and not overwrite:
        raise ConfigError(f"--output {output}: already holds files; pass --overwrite to replace an earlier export")
    if present and hf.CONFIG not in present:
        raise ConfigError(f"--output {output}: holds files and is not an export (no config.json); it is never "
                          "overwritten")
    loaded = load_model(spec)
    with tempfile.TemporaryDirectory(prefix="kiln-export-") as tmp:
        files = hf.write(loaded.cfg, loaded.state, loaded.tokenizer, loaded.vocab_size, Path(tmp))
        if present:
            out.join(hf.CONFIG).fs.delete_file(out.join(hf.CONFIG).path)  # the old export stops loading first
        for name in sorted(files, key=lambda n: n == hf.CONFIG):  # config.json last
            out.join(name).write_bytes((Path(tmp) / name).read_bytes())
    for stale in set(present) - set(files):
        out.join(stale).fs.delete_file(out.join(stale).path)
    return loaded, files


def check_target(output: str, flag: str = "--output") -> None:
    """Refuse, before any work, a local export target that could not be written or is not ours
    to replace (an s3:// one is checked by `export`, which has its endpoint)."""
    if output.startswith("s3://"):
        return
    out = Path(output).absolute()
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise ConfigError(f"{flag} {output}: its parent directory must exist and be writable")
    if out.exists() and any(out.iterdir()):
        _refuse_unless_export(out, f"{flag} {output}")


def _refuse_unless_export(out: Path, named: str) -> None:
    if not ((out / hf.CONFIG).is_file() and (out / hf.WEIGHTS).is_file()):
        raise ConfigError(f"{named}: exists and is not an export (no config.json and model.safetensors); "
                          "it is never overwritten")


def _existing_export(out: Path, overwrite: bool) -> bool:
    if not out.exists():
        return False
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
        return False
    if not overwrite:
        raise ConfigError(f"--output {out}: already exists; pass --overwrite to replace an earlier export")
    _refuse_unless_export(out, f"--output {out}")
    return True


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


def run_generate(spec: str, prompts: list[str], s: Sampling, batch_size: int, device: str,
                 write: Callable[[str], object]) -> GenerateResult:
    """Complete each prompt, streaming text to `write` as it decodes. With batch_size 1 each
    completion streams token by token; a batch's completions are written as the batch ends."""
    loaded = load_model(spec)
    model = loaded.build(device)
    result = GenerateResult([], [])
    for start in range(0, len(prompts), batch_size):
        texts, generated = _complete(model, loaded, prompts[start:start + batch_size], s, write)
        result.completions += texts
        result.generated.append(generated)
    return result


def _complete(model, loaded: LoadedModel, batch: list[str], s: Sampling,
              write: Callable[[str], object]) -> tuple[list[str], Generated]:
    tok = loaded.tokenizer
    ids = [list(map(int, row)) for row in tok.encode_batch(batch)]
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
        generated = generate(model, ids, s, tok.eot_id, loaded.vocab_size, on_tokens)
    except ValueError as e:  # a prompt too long for the model's context
        raise ConfigError(f"--max-new-tokens {s.max_new_tokens}: {e}") from None
    for row, prompt in enumerate(batch):
        tail = streams[row].flush()
        texts[row] += tail
        write(tail + "\n" if single else f"{prompt}{texts[row]}\n")
    return texts, generated

