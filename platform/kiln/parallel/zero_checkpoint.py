"""A ZeRO checkpoint's weights merged whole, for export and generation (`kiln.infer.load`).

DeepSpeed's own `zero_to_fp32` does the merge: the fp32 master weights from every rank's
optimizer partition. Its `ds_to_universal` does the same for the optimizer state too, so that a
run resumes on another number of data-parallel ranks (`universal_copy`). Both print their
progress; that goes to the debug log, not the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import logging
import os
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

UNIVERSAL_TAG = "universal"  # the tag of a checkpoint's universal copy


def is_zero_sharded(state_dir: str) -> bool:
    """Whether a checkpoint's state directory holds ZeRO 1-3 optimizer partitions."""
    return bool(glob.glob(os.path.join(state_dir, "*zero_pp_rank_*_optim_states.pt")))


def merged_fp32_state(ckpt: str, tag: str) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights, merged from every rank's ZeRO partition of `ckpt/tag`."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        state = dict(get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=tag))
    log.debug("zero_to_fp32: %s", chatter.getvalue())
    return state


@contextlib.contextmanager
def universal_copy(ckpt: str, tag: str) -> Iterator[tuple[str, str]]:
    """`ckpt/tag` converted by DeepSpeed's `ds_to_universal` into its universal checkpoint (one
    folder per parameter: the fp32 weight and each optimizer state, whole), which
    `load_checkpoint` re-slices for any number of data-parallel ranks. Yields (directory, tag)
    of the copy, in this process's temp directory (`kiln-ckpt-<pid>-reshard-*`, which a node's
    next worker removes if this one dies), and removes it after.

    Kiln's model does not set DeepSpeed's `UNIVERSAL_CHECKPOINT_INFO` (Megatron's models do), so
    the conversion injects the default. One extract worker: the shards of one checkpoint are
    read in this process, without a pool of processes that each hold their own copy."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    from kiln import guard

    root = guard.temp_dir(None, f"ckpt-{os.getpid()}-reshard")
    out = root / UNIVERSAL_TAG
    args = argparse.Namespace(
        input_folder=os.path.join(ckpt, tag),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    try:
        chatter = io.StringIO()
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal(args)
        log.debug("ds_to_universal: %s", chatter.getvalue())
        yield str(root), UNIVERSAL_TAG
    finally:
        guard.discard(root)


def gathered_state(engine) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master weight and optimizer state, whole (DeepSpeed's
    `safe_get_full_*`, a collective under ZeRO-3), by `<name>/<state>`: what a reshard must
    keep, compared by the tests and `bench/gpu_reshard.py`."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # ZeRO-1/2 link a parameter to its optimizer state at the first step; a gather right after a
    # load (no step yet) has it linked first (DeepSpeed's own step does the same).
    getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    # Unsharded fp32 (ZeRO-0) has no fp32 mapping: the parameter and the torch optimizer's state are it.
    plain = getattr(engine.optimizer, "state", {})
    full = {}
    for name, p in engine.module.named_parameters():
        fp32 = safe_get_full_fp32_param(p)
        full[f"{name}/fp32"] = (fp32 if fp32 is not None else p.detach().float()).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            value = safe_get_full_optimizer_state(p, key)
            value = value if value is not None else plain.get(p, {}).get(key)
            if value is not None:
                full[f"{name}/{key}"] = value.clone()
    return full
