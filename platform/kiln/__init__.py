"""Kiln: efficient LLM training on Ray."""
__version__ = "0.1.0"
