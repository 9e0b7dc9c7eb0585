"""Training: the per-worker loop (plain function), DeepSpeed set-up, and the Ray Train launcher."""
