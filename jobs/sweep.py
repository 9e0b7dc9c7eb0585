"""Entry point for `ray job submit`: run (or resume) a sweep on the cluster it runs in.

CPU smoke (embedded Ray; needs the demo dataset from `make demo`):
    python jobs/sweep.py --config jobs/configs/sweeps/optimizers-x-schedules.yaml \
        --set overrides.train.max_steps=20 --set scheduler.grace_period=5 --set overrides.train.eval_every=5
On a cluster (RAY_AUTH_MODE=token when it uses token auth):
    ray job submit --working-dir . -- python jobs/sweep.py --config jobs/configs/sweeps/optimizers-x-schedules.yaml
Resume after an interruption:
    ray job submit --working-dir . -- python jobs/sweep.py --resume optimizers-x-schedules
"""

import os
import sys

try:
    import kiln  # noqa: F401  (installed with `pip install -e .` / `make demo`)
except ImportError:  # a checkout whose package is not installed: use platform/ directly
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))

from kiln.cli import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
