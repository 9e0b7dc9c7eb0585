"""The end-of-run summary `kiln train` and the local launcher print (and write as JSON)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass

from kiln.clock import startup_breakdown, startup_seconds
from kiln.config import RunConfig
from kiln.core.meter import WORKERS
from kiln.data.manifest import Manifest
from kiln.guard import marked_json
from kiln.tracking.server import ui_command

log = logging.getLogger(__name__)

RUN_SUMMARY = "run-summary"  # the write guard's kind for --summary-json


@dataclass
class Summary:
    run_name: str
    run_id: str
    tracking_uri: str
    experiment: str
    metrics: dict
    unigram_entropy_bits: float
    seconds_to_first_step: float
    checkpoint: str | None
    num_workers: int
    worker_log: str = ""
    """Where Ray's and DeepSpeed's output went (`kiln.ray.console`); empty without Ray."""
    model: str | None = None
    """The run's logged MLflow model (models:/name/version if registered, else models:/<id>)."""

    @classmethod
    def of_run(
        cls,
        cfg: RunConfig,
        manifest: Manifest,
        final: dict,
        run_id: str,
        tracking_uri: str,
        started: float,
        checkpoint: str | None,
    ) -> Summary:
        return cls(
            run_name=cfg.logging.run_name,
            run_id=run_id,
            tracking_uri=tracking_uri,
            experiment=cfg.logging.experiment,
            metrics=final,
            unigram_entropy_bits=float(manifest.raw["unigram_entropy_bits"]),
            seconds_to_first_step=final["time/first_step_unix"] - started,
            checkpoint=checkpoint,
            num_workers=int(final.get(WORKERS, cfg.parallel.max_workers)),  # an elastic run's last
        )

    def scalars(self) -> dict[str, float]:
        """What the summary adds to the run's own metrics, for MLflow: the seconds to the first
        step and each start-up span, and the data's unigram entropy (the loss to beat)."""
        return {
            "time/first_step_s": self.seconds_to_first_step,
            "data/unigram_entropy_bits": self.unigram_entropy_bits,
            **startup_seconds(self.metrics),
        }

    def record(self, run) -> None:
        """The summary in the run's MLflow record (`run`: kiln.tracking's Run): its scalars at
        the last step, its text as `summary.txt`, and Ray's and DeepSpeed's output as
        `logs/workers.log` (redacted as it was written). MLflow failing here costs the record,
        not the run, which has completed."""
        from kiln.tracking.client import errors

        failures: tuple[type[BaseException], ...] = (OSError, *errors())
        try:
            run.log_metrics(self.scalars(), step=int(self.metrics.get("step", 0)))
            run.log_text(self.render() + "\n", "summary.txt")
            if self.worker_log and os.path.isfile(self.worker_log):
                run.log_file(self.worker_log, "logs")
        except failures as e:
            log.warning(
                "the run's summary did not reach MLflow: %s", str(e).splitlines()[0] if str(e) else type(e).__name__
            )

    def to_json(self) -> str:
        return marked_json(RUN_SUMMARY, dataclasses.asdict(self))

    def render(self) -> str:
        m, ln2 = self.metrics, math.log(2)
        val_bits = m["loss/val"] / ln2
        lines = [
            f"Kiln run '{self.run_name}' finished: {m['step']} steps on {self.num_workers} worker(s), "
            f"{m['tokens/seen'] / 1e6:.2f}M tokens",
            f"  train loss        {m['loss/train']:.4f} nats/token  ({m['loss/train'] / ln2:.3f} bits/token)",
            f"  val loss          {m['loss/val']:.4f} nats/token  ({val_bits:.3f} bits/token)",
            f"  unigram entropy   {self.unigram_entropy_bits:.3f} bits/token  "
            f"(val loss is {abs(self.unigram_entropy_bits - val_bits):.3f} bits/token "
            f"{'below' if val_bits < self.unigram_entropy_bits else 'ABOVE'} it)",
            f"  throughput        {m['throughput/tokens_per_s']:,.0f} tokens/s steady state"
            + (f", MFU {100 * m['mfu']:.1f}%" if "mfu" in m else ""),
            f"  first step after  {self.seconds_to_first_step:.1f} s; data wait {100 * m['time/data_wait_share']:.1f}% of step time",
        ]
        steps = startup_breakdown(m)
        if steps:
            lines.append("  start-up          " + ", ".join(f"{what} {s:.1f} s" for what, s in steps))
        if "time/compile_s" in m:
            lines.append(f"  compile           {m['time/compile_s']:.1f} s (the first step, less a steady one)")
        lines += [
            f"  MLflow run        {self.run_id} (experiment '{self.experiment}')",
            f"  open the UI       {ui_command(self.tracking_uri)}",
        ]
        if self.checkpoint:
            lines.append(f"  checkpoint        {self.checkpoint}")
        if self.model:
            lines.append(f"  MLflow model      {self.model} (kiln generate --model {self.model})")
        if self.worker_log:
            lines.append(f"  worker logs       {self.worker_log} (Ray's and DeepSpeed's output; --verbose shows it)")
        return "\n".join(lines)
