"""Ray Tune sweeps over Kiln run configs: `kiln sweep --config jobs/configs/sweeps/<name>.yaml`."""
