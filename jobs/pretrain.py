"""Entry point for `ray job submit`: train with the config given, on the cluster it runs in.

CPU smoke (embedded Ray):
    python jobs/pretrain.py --config jobs/configs/debug.yaml --set train.max_steps=20
On a cluster (RAY_AUTH_MODE=token when it uses token auth):
    ray job submit --runtime-env jobs/runtime_env.yaml -- python jobs/pretrain.py --config jobs/configs/debug.yaml
"""

import os
import sys

# The package beside this script first: a job runs the code submitted with it (the runtime
# env's py_modules does the same for the workers), not a copy a node installed earlier.
_PLATFORM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform")
if os.path.isdir(os.path.join(_PLATFORM, "kiln")):
    sys.path.insert(0, _PLATFORM)

from kiln.cli import main  # noqa: E402 (after the path line, so the submitted copy wins)
from kiln.launch.preflight import AUTO, RESUME_ENV  # noqa: E402

if __name__ == "__main__":
    # A job resubmitted (by a person, a KubeRay RayJob's retry, after its driver died) resumes:
    # train.resume_from defaults to auto here, unless the config, --set or --fork says otherwise.
    os.environ.setdefault(RESUME_ENV, AUTO)
    sys.exit(main(["train", *sys.argv[1:]]))
