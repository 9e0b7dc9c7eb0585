"""What a step costs: throughput, MFU, phase times and memory. Names carry a namespace and unit.

`StepMeter` keeps the per-step numbers and the steady-state totals of a run (the first steps,
which carry allocator warm-up, JIT and caches, are left out); the functions below it measure the
device's peak and the memory a rank holds.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import psutil
import torch

from kiln.core.dtypes import torch_dtype
from kiln.core.engine import Engine
from kiln.devices import by_cuda_name
from kiln.model import GPTConfig
from kiln.model_size import flops_per_token

if TYPE_CHECKING:  # the config composes the core's sections: a type here, never an import
    from kiln.config import RunConfig

log = logging.getLogger("kiln.train")

WARMUP_STEPS_EXCLUDED = 5  # steady-state throughput ignores the first steps (allocator, JIT, caches)
# Where no datasheet gives the peak (CPUs), it is probed at warm-up's end and at the next metric
# steps, and the highest rate kept: one probe that a busy neighbour slowed throughout put the
# demo's MFU at 120-123% (a peak read 2.5x low), twice in fresh-clone demos.
PEAK_PROBES = 3
WORKERS = "parallel/workers"  # the ranks training at a step: an elastic run's size over time


class StepMeter:
    """Times each step and turns it into metrics; sums the steady-state steps for the summary.

    Steady-state time counts every second of an iteration (metric reduction and logging
    included) except validation and checkpointing. Checkpoint saves within the steady steps
    (the last one excluded) are summed apart, for `throughput/tokens_per_s_with_checkpoints`.
    """

    def __init__(
        self, cfg: RunConfig, mcfg: GPTConfig, world_size: int, device: torch.device, tokens_per_step: int, done: int
    ):
        self.precision, self.max_steps = cfg.train.precision, cfg.train.max_steps
        self.compiled = cfg.train.compile
        self.world_size, self.device, self.tokens_per_step = world_size, device, tokens_per_step
        self.done = done  # steps done before this process started (a resume)
        self.warmup_end = done + WARMUP_STEPS_EXCLUDED  # the last step left out of the steady state
        self.short = self.max_steps <= self.warmup_end  # no steady state to speak of: every step counts
        self.flops_per_token = flops_per_token(mcfg)
        self.peak = datasheet_peak_flops(device, self.precision, cfg.train.peak_flops)
        self._probes_left = PEAK_PROBES if self.peak is None else 0
        self.steady_time = self.steady_wait = self.steady_save_time = 0.0
        self.steady_steps = 0
        self.first_step_unix = 0.0
        self.first_step_s = 0.0  # the first step's own seconds: a compiled model compiles in it
        self.held: dict[str, float] = {}  # what the engine holds, measured after the first step
        self._skipped_before = 0
        self._start = self._eval_s = 0.0

    def begin(self) -> None:
        self._start, self._eval_s = time.perf_counter(), 0.0

    def step_time(self, step: int) -> float:
        """Seconds since `begin`, the device's queued work included."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._start
        if step == self.done + 1:
            self.first_step_unix = time.time()
            self.first_step_s = seconds
        return seconds

    @property
    def mean_step_s(self) -> float:
        """Mean seconds per steady-state step so far (0 until one is timed: the ETA waits)."""
        return self.steady_time / self.steady_steps if self.steady_steps else 0.0

    def metrics(
        self,
        step: int,
        step_s: float,
        loss: float,
        lr: float,
        phases: dict[str, float],
        data_wait: float,
        engine: Engine,
        rank: int,
    ) -> dict[str, float]:
        """The step's metrics; `loss` and `data_wait` are already averaged over ranks."""
        tok_s = self.tokens_per_step / step_s
        grad_norm = engine.grad_norm()
        out = {
            "loss/train": loss,
            "lr": lr,
            "throughput/tokens_per_s": tok_s,
            "throughput/tokens_per_s_per_device": tok_s / self.world_size,
            "time/step_s": step_s,
            **phases,
            "time/data_wait_s": data_wait,
            "tokens/seen": float(step * self.tokens_per_step),
            WORKERS: float(self.world_size),
        }
        if self._probes_left and step >= self.warmup_end:  # measured under the training's load
            self._probe_peak()
        if self.peak is not None:
            out["mfu"] = self.mfu(tok_s)
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        if self.precision == "fp16":
            out.update(self._fp16(engine, step, rank))
        if step == self.done + 1:
            self.held = engine.memory()  # optimizer state exists after the first step
            out.update(self.held)
        return out

    def _probe_peak(self) -> None:
        """One more probe of the peak, the highest kept; its seconds are left out of the step's."""
        start = time.perf_counter()
        rate = measured_peak_flops(self.device, self.precision)
        self.peak = max(self.peak or 0.0, rate)
        self._probes_left -= 1
        self.evaluated(time.perf_counter() - start)

    def mfu(self, tokens_per_s: float) -> float:
        assert self.peak is not None  # measured or from the datasheet before any MFU is asked for
        return self.flops_per_token * tokens_per_s / (self.peak * self.world_size)

    def _fp16(self, engine: Engine, step: int, rank: int) -> dict[str, float]:
        """Dynamic loss scaling skips the steps whose gradients overflowed: count and say so."""
        skipped, scale = engine.overflow()
        if skipped > self._skipped_before and rank == 0:
            log.warning(
                "step %d: fp16 gradient overflow, step skipped and loss scale lowered (%d skipped so far)",
                step,
                skipped,
            )
        self._skipped_before = skipped
        return {"train/skipped_steps_total": float(skipped), "train/loss_scale": scale}

    def evaluated(self, seconds: float) -> None:
        """`seconds` of this iteration that are not training (validation, a peak probe)."""
        self._eval_s += seconds

    def end(self, step: int, data_wait: float) -> float:
        """The iteration's seconds, from `begin` to now on the host clock (validation excluded),
        counted into the steady state after warm-up. The host reads the step's health verdict
        once its forward is done, so a step's device work lands in it or in the next one, and a
        logged step (`step_time`) waits for all of it."""
        seconds = time.perf_counter() - self._start - self._eval_s
        if step > self.warmup_end or self.short:
            self.steady_time += seconds
            self.steady_wait += data_wait
            self.steady_steps += 1
        return seconds

    def saved(self, step: int, seconds: float) -> None:
        if step != self.max_steps and step > self.warmup_end:
            self.steady_save_time += seconds

    def summary(self) -> dict[str, float]:
        """The run's steady-state throughput, MFU and data-wait share."""
        tokens = self.tokens_per_step * self.steady_steps
        out = {
            "throughput/tokens_per_s": tokens / max(self.steady_time, 1e-9),
            # What checkpointing costs: the same steps with the time their saves took counted in.
            "throughput/tokens_per_s_with_checkpoints": tokens / max(self.steady_time + self.steady_save_time, 1e-9),
        }
        if self.peak is not None:
            out["mfu"] = self.mfu(out["throughput/tokens_per_s"])
        out["time/data_wait_share"] = self.steady_wait / max(self.steady_time, 1e-9)
        out["time/first_step_unix"] = self.first_step_unix
        out["time/first_step_s"] = self.first_step_s
        if self.compiled and self.steady_steps:  # what compiling cost: the first step over a steady one
            out["time/compile_s"] = max(0.0, self.first_step_s - self.mean_step_s)
        return out


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """Achieved FLOP/s of square matmuls: the practical peak where no datasheet applies (CPUs)."""
    n = 512 if device.type == "cpu" else 4096
    # Values do not matter; a generator of its own leaves the training RNG untouched (a resumed
    # run measures at another step, and must draw the same dropout masks as the first).
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    a @ b  # warm-up
    # The best of five windows: a window that a neighbour's burst or the host's CPU steal slowed
    # would understate the peak, and MFU would pass 100% (seen on the 2-core CI machine).
    best = 0.0
    for _ in range(5):
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 5:
            a @ b
            iters += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start))
    return best


def datasheet_peak_flops(device: torch.device, precision: str, configured: float = 0.0) -> float | None:
    """The configured or datasheet peak; None where there is none (CPUs, unknown GPUs)."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        known = by_cuda_name(torch.cuda.get_device_name(device))
        if known is not None:
            return known.peak_flops(precision)
    return None


def measured_peak_flops(device: torch.device, precision: str) -> float:
    """Where no datasheet applies, MFU is relative to the matmul rate this worker achieves,
    measured once training is in steady state (so under the same load as the steps); `StepMeter`
    probes it PEAK_PROBES times and keeps the highest."""
    dtype = torch_dtype(precision)
    rate = measured_matmul_flops(device, dtype)
    if device.type == "cpu" and dtype != torch.float32:
        # CPUs without bf16 matmul units emulate it slower than fp32, while the model's kernels
        # may not: take the faster rate as the peak, so MFU cannot exceed 100% from that alone.
        rate = max(rate, measured_matmul_flops(device, torch.float32))
    return rate


def memory_metrics(device: torch.device) -> dict[str, float]:
    gib = 1024**3
    out = {"memory/rss_gib": psutil.Process().memory_info().rss / gib}
    if device.type == "cuda":
        out["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / gib
        out["memory/max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / gib
    return out


def memory_in_use(device: torch.device) -> dict[str, float]:
    """Bytes this process holds now (not peaks): host RSS, and tensors on its GPU."""
    out = {"host": float(psutil.Process().memory_info().rss)}
    if device.type == "cuda":
        out["device"] = float(torch.cuda.memory_allocated(device))
    return out
