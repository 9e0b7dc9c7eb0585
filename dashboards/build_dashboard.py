"""Generates grafana/kiln-training.json, the Grafana dashboard for Kiln training runs.

Panels are declared here, compactly, and written as Grafana's JSON model; a unit test checks
the committed JSON is what this script writes. Regenerate after editing:
    python dashboards/build_dashboard.py

`$run` is the dashboard's run selector (a multi-select over the `run` label);
`$__rate_interval` is Grafana's rate window. Kiln's series come as `ray_kiln_*` from Ray's
metrics endpoint (see platform/kiln/ray/live_metrics.py); `ray_node_*` are Ray's own.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "grafana" / "kiln-training.json"
R = '{run=~"$run"}'
R0 = '{run=~"$run", rank="0"}'

# (title, unit, [(legend, PromQL)], width, description)
PANELS: list[tuple[str, str, list[tuple[str, str]], int, str]] = [
    (
        "Loss",
        "none",
        [("train {{run}}", f"ray_kiln_train_loss{R0}"), ("val {{run}}", f"ray_kiln_val_loss{R0}")],
        12,
        "Training loss (mean over ranks) and the last validation loss.",
    ),
    (
        "Throughput",
        "none",
        [
            ("tokens/s {{run}}", f"max by (run) (ray_kiln_train_tokens_per_second{R})"),
            (
                "tokens/s, counter rate {{run}}",
                f"max by (run) (rate(ray_kiln_train_tokens_total{R}[$__rate_interval]))",
            ),
        ],
        12,
        "Tokens per second over all workers: the last step's, and the rate of the token counter.",
    ),
    (
        "MFU",
        "percentunit",
        [("rank {{rank}} {{run}}", f"ray_kiln_train_mfu_ratio{R}")],
        8,
        "Model FLOPs utilisation: against the datasheet peak on GPUs, a measured matmul rate on CPUs.",
    ),
    (
        "Step time breakdown",
        "s",
        [
            ("data wait", f"avg by (run) (ray_kiln_train_data_wait_seconds{R})"),
            ("forward", f"avg by (run) (ray_kiln_train_forward_seconds{R})"),
            ("backward + all-reduce", f"avg by (run) (ray_kiln_train_backward_seconds{R})"),
            ("optimizer", f"avg by (run) (ray_kiln_train_optimizer_seconds{R})"),
        ],
        8,
        "Mean over ranks of where a step's time goes (pipeline runs split out data wait only).",
    ),
    (
        "Step time per rank",
        "s",
        [("rank {{rank}} {{run}}", f"ray_kiln_train_step_seconds{R}")],
        8,
        "A rank slower than the rest holds every collective back.",
    ),
    (
        "Step time p50 / p99",
        "s",
        [
            (
                "p50 {{run}}",
                "histogram_quantile(0.5, sum by (run, le) "
                f"(rate(ray_kiln_train_step_duration_seconds_bucket{R}[$__rate_interval])))",
            ),
            (
                "p99 {{run}}",
                "histogram_quantile(0.99, sum by (run, le) "
                f"(rate(ray_kiln_train_step_duration_seconds_bucket{R}[$__rate_interval])))",
            ),
        ],
        8,
        "Every step's time, over all ranks, as quantiles: a p99 far above the p50 means stalls "
        "(a slow data read, a straggling rank, a save) that the per-step gauge can miss.",
    ),
    (
        "Data wait share",
        "percentunit",
        [("rank {{rank}} {{run}}", f"ray_kiln_train_data_wait_seconds{R} / ray_kiln_train_step_seconds{R}")],
        8,
        "Share of step time spent waiting for batches; above 20% the input pipeline is the bottleneck.",
    ),
    (
        "Memory per rank",
        "bytes",
        [
            ("RSS rank {{rank}}", f"ray_kiln_memory_rss_bytes{R}"),
            ("device used rank {{rank}}", f"ray_kiln_memory_device_used_bytes{R}"),
            ("device limit rank {{rank}}", f"ray_kiln_memory_device_limit_bytes{R}"),
            ("CUDA allocated rank {{rank}}", f"ray_kiln_memory_cuda_allocated_bytes{R}"),
            ("CUDA reserved rank {{rank}}", f"ray_kiln_memory_cuda_reserved_bytes{R}"),
            ("leak rate per step rank {{rank}}", f"ray_kiln_memory_leak_bytes_per_step{R}"),
        ],
        8,
        "Process RSS; CUDA peaks on GPUs; the device's capacity for scale; the leak check's growth "
        "rate (0 while memory is flat after warm-up).",
    ),
    (
        "Training health",
        "none",
        [
            ("non-finite loss steps {{run}}", f"max by (run) (ray_kiln_train_nonfinite_loss_steps{R})"),
            ("fp16 skipped steps {{run}}", f"max by (run) (ray_kiln_train_skipped_steps{R})"),
            ("grad norm {{run}}", f"ray_kiln_train_grad_norm{R0}"),
            ("learning rate {{run}}", f"ray_kiln_train_learning_rate{R0}"),
        ],
        8,
        "Events a health check watches: non-finite losses, fp16 overflow skips, the gradient norm.",
    ),
    (
        "Checkpoints",
        "s",
        [
            ("age {{run}}", f"time() - max by (run) (ray_kiln_checkpoint_last_timestamp_seconds{R})"),
            ("save time rank {{rank}}", f"ray_kiln_checkpoint_duration_seconds{R}"),
        ],
        8,
        "Seconds since the last checkpoint (since the start before the first), and each save's duration.",
    ),
    (
        "Progress",
        "none",
        [
            ("step {{run}}", f"max by (run) (ray_kiln_train_step{R})"),
            ("max steps {{run}}", f"max by (run) (ray_kiln_train_max_steps{R})"),
            ("checkpoints {{run}}", f"max by (run) (ray_kiln_checkpoints_total{R})"),
        ],
        8,
        "Steps done out of the run's total.",
    ),
    (
        "Node CPU",
        "percent",
        [("{{instance}}", "ray_node_cpu_utilization")],
        8,
        "Ray's node metrics: CPU utilisation of every node in the cluster.",
    ),
    (
        "Node GPU",
        "percent",
        [
            ("util {{instance}} GPU {{GpuIndex}}", "ray_node_gpus_utilization"),
            ("memory {{instance}} GPU {{GpuIndex}}", "ray_node_gram_used"),
        ],
        8,
        "Ray's node metrics: GPU utilisation and memory (MiB); empty on CPU-only clusters.",
    ),
    (
        "Node network",
        "Bps",
        [
            ("receive {{instance}}", "ray_node_network_receive_speed"),
            ("send {{instance}}", "ray_node_network_send_speed"),
        ],
        8,
        "Ray's node metrics: network throughput, where all-reduce traffic shows up across nodes.",
    ),
]

# Series that only exist on GPU nodes: allowed to come back empty where there is none.
GPU_ONLY = ("ray_kiln_memory_cuda_", "ray_node_gpus_", "ray_node_gram_")


def build() -> dict:
    panels, x, y, row_h = [], 0, 0, 8
    for i, (title, unit, targets, width, description) in enumerate(PANELS):
        if x + width > 24:
            x, y = 0, y + row_h
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "description": description,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"x": x, "y": y, "w": width, "h": row_h},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                    for j, (legend, expr) in enumerate(targets)
                ],
            }
        )
        x += width
    return {
        "uid": "kiln-training",
        "title": "Kiln training",
        "tags": ["kiln", "ray"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "run",
                    "type": "query",
                    "label": "Run",
                    "multi": True,
                    "includeAll": True,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": "label_values(ray_kiln_train_step, run)", "refId": "run"},
                    "definition": "label_values(ray_kiln_train_step, run)",
                    "refresh": 2,
                    "sort": 1,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
