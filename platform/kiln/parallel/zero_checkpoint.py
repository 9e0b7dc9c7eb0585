"""A ZeRO checkpoint's weights merged whole, for export and generation (`kiln.infer.load`).

DeepSpeed's own `zero_to_fp32` does the merge: the fp32 master weights from every rank's
optimizer partition. It prints its progress; that goes to the debug log, not the terminal.
"""

from __future__ import annotations

import contextlib
import glob
import io
import logging
import os

import torch

log = logging.getLogger(__name__)


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
