"""Planning a run before it exists: per-device memory (`kiln plan`)."""
