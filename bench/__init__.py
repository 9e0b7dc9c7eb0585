"""Kiln's benchmarks (`make bench`): each module runs as `python -m bench.<name>` from the
repository root and publishes its section to `bench/results/<topic>.md`, newest first."""
