"""Kiln: efficient LLM training on Ray.

The Python API (`kiln.api`): `kiln.train`, `kiln.load_config`, `kiln.runs`, and
`kiln.data.prepare`. They are imported on first use, so `import kiln` stays cheap (every Ray
worker does it).
"""

import importlib

__version__ = "0.1.0"
__all__ = ["train", "load_config", "runs", "data"]

_API = {"train", "load_config", "runs"}


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module("kiln.api"), name)
    if name == "data":
        return importlib.import_module("kiln.data")
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
