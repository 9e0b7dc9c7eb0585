"""Entry point for `ray job submit`: train with the config given, on the cluster it runs in.

CPU smoke (embedded Ray):
    python jobs/pretrain.py --config jobs/configs/debug.yaml --set train.max_steps=20
On a cluster (RAY_AUTH_MODE=token when it uses token auth):
    ray job submit --working-dir . -- python jobs/pretrain.py --config jobs/configs/debug.yaml
"""

import os
import sys

try:
    import kiln  # noqa: F401  (installed with `pip install -e .` / `make demo`)
except ImportError:  # a checkout whose package is not installed: use platform/ directly
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))

from kiln.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
