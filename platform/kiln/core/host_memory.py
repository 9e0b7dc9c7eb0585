"""Host memory for a training process: glibc's malloc keeps what a step freed for the next one.

PyTorch's CPU tensors come from the C library's malloc. glibc's defaults suit a program whose
allocations shrink: it serves blocks over its mmap threshold (128 KiB at start, raised as such
blocks are freed, up to 32 MiB) with a mapping of their own, unmapped on free, and hands the
free top of its heap back to the OS once that exceeds twice that threshold. A training step
frees and re-allocates the same activations and gradients every step, so every step maps and
faults in tens of megabytes of fresh zeroed pages again. Measured with `bench/plain_loop.py`
on the `debug` GPT, 2 cores, 150 steps: 1.5-1.8M minor page faults and 11-13% of the CPU time
in the kernel; with the settings below 0.11M faults and 3% in the kernel, at the same peak RSS;
about 1.1x the tokens/s in Kiln's bench runs (bench/results/throughput.md).

`keep` sets, once per process and before the model is built:
- the mmap threshold to its 64-bit ceiling, 32 MiB, so blocks up to that size come from the
  heap, where a freed block is reused;
- the trim threshold to 2 GiB (mallopt takes an int), so a freed heap top stays mapped.
The process's resident memory then stays at its high-water mark instead of rising and falling
with each step; the peak is the same.

Hand-written with ctypes because no maintained Python package sets malloc's options at run time.
The alternatives (glibc's `MALLOC_*_` environment variables, or jemalloc/tcmalloc through
LD_PRELOAD) must be in place before the process starts: in every Ray job's runtime environment,
in the shell of a local or torchrun launch. One call as the worker starts covers every launcher.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (4 MiB x sizeof(long)); above it mallopt fails
TRIM_THRESHOLD = 2**31 - 1  # mallopt's value is a C int


def keep_freed_memory() -> tuple[bool, str]:
    """Apply `keep` to this process's malloc: whether it took, and what was done, in words."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to set
        return False, f"left as the C library's defaults ({name or 'no libc found'} is not glibc)"
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return False, f"glibc {version} refused the settings; left as its defaults"
    return True, f"glibc {version} malloc keeps freed memory (mmap threshold 32 MiB, trim threshold 2 GiB)"


def apply_host_malloc(mode: str) -> None:
    """`parallel.host_malloc` in this process, logged: "keep" (above) or "default" (glibc's own)."""
    if mode == "keep":
        log.info("host malloc: %s", keep_freed_memory()[1])
    else:
        log.info("host malloc: the C library's defaults (parallel.host_malloc = %s)", mode)
