"""Kiln's Python API: what the `kiln` command does, for notebooks and scripts.

    import kiln

    kiln.data.prepare(inputs=["corpus/"], output="data/mine", tokenizer="bpe", vocab_size=1024)
    summary = kiln.train("jobs/configs/debug.yaml", overrides=["data.path=data/mine"])
    print(summary.render())             # the summary `kiln train` prints
    summary.metrics["loss/val"]         # every final metric, as MLflow has it
    kiln.runs("kiln-demo", sort="loss/val")   # MLflow's runs of an experiment, best first

A run trains on the Ray cluster at `address` (or $RAY_ADDRESS), else on an embedded local Ray,
exactly as `kiln train` does. Progress is a `tqdm.auto` bar: a widget in Jupyter, a text bar
elsewhere. A mistake raises `kiln.errors.KilnError` (`ConfigError` for a wrong config), whose
message is the line the command would print.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from kiln.config import RunConfig, config_from_dict
from kiln.config import load_config as _load_yaml
from kiln.errors import ConfigError
from kiln.launch.summary import Summary


def load_config(config: str | os.PathLike | dict | RunConfig | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """A validated run config from a YAML path, a dict shaped like one, a `RunConfig`, or None
    (the defaults), with `a.b=c` overrides applied as `--set` applies them."""
    if config is None or isinstance(config, (str, os.PathLike)):
        return _load_yaml(config, list(overrides))
    if isinstance(config, RunConfig):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ConfigError(f"config: expected a YAML path, a dict or a RunConfig, got {type(config).__name__}")
    return config_from_dict(config, overrides)


def train(
    config: str | os.PathLike | dict | RunConfig | None = None,
    overrides: Iterable[str] = (),
    *,
    address: str | None = None,
    progress: bool = True,
    verbose: bool = False,
) -> Summary:
    """Train one run, as `kiln train` does, and return its summary. `progress`: a tqdm.auto
    bar while it trains; `verbose`: Ray's and DeepSpeed's output on the console too."""
    from kiln.launch.on_ray import train as train_on_ray
    from kiln.ui.progress import TqdmBar

    cfg = load_config(config, overrides)
    return train_on_ray(cfg, address=address, bar=TqdmBar() if progress else None, verbose=verbose)


def runs(
    experiment: str, tracking_uri: str = "", sort: str | None = None, limit: int = 50, descending: bool = False
) -> list[dict[str, Any]]:
    """An experiment's runs, newest first or ranked by the metric `sort`: one dict a run, with
    its id, name, status, params and final metrics (the rows `kiln runs` prints)."""
    from kiln.schemas import validated
    from kiln.tracking.runs import fetch_runs, run_record

    for name, value, kind in (
        ("experiment", experiment, str),
        ("tracking_uri", tracking_uri, str),
        ("sort", sort, str | None),
        ("limit", limit, int),
        ("descending", descending, bool),
    ):
        validated(kind, value, f"runs: {name}")

    return [run_record(r) for r in fetch_runs(experiment, tracking_uri, sort, limit, descending=descending)]
