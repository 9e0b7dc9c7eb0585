"""Entry point for `ray job submit`: run (or resume) a sweep on the cluster it runs in.

CPU smoke (embedded Ray; needs the demo dataset from `make demo`):
    python jobs/sweep.py --config jobs/configs/sweeps/optimizers-x-schedules.yaml \
        --set overrides.train.max_steps=20 --set scheduler.grace_period=5 --set overrides.train.eval_every=5
On a cluster (RAY_AUTH_MODE=token when it uses token auth):
    ray job submit --runtime-env jobs/runtime_env.yaml -- python jobs/sweep.py --config jobs/configs/sweeps/optimizers-x-schedules.yaml
Resume after an interruption:
    ray job submit --runtime-env jobs/runtime_env.yaml -- python jobs/sweep.py --resume optimizers-x-schedules
"""

import os
import sys

# The package beside this script first: a job runs the code submitted with it (the runtime
# env's py_modules does the same for the workers), not a copy a node installed earlier.
_PLATFORM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform")
if os.path.isdir(os.path.join(_PLATFORM, "kiln")):
    sys.path.insert(0, _PLATFORM)

from kiln.cli import main  # noqa: E402 (after the path line, so the submitted copy wins)

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
