"""Parallelism applied to a plain model from outside: the DeepSpeed engine (ZeRO 0-3, offload)
and torch's FSDP2 behind the core's `Engine` seam, pipeline stages, DeepSpeed's ops, and
`run_worker`, the one worker set-up every launcher calls. The only package that imports
DeepSpeed."""
