"""Parallelism applied to a plain model from outside: the DeepSpeed engine (ZeRO 0-3, offload)
and pipeline stages."""
