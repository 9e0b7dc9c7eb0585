"""Entry point for `ray job submit`: `kiln data prepare` on the cluster it runs in.

    ray job submit --runtime-env jobs/runtime_env.yaml -- python jobs/prepare.py \
        --input s3://corpora/code/ --output s3://datasets/code-bpe --tokenizer bpe --seq-len 2048
"""

import os
import sys

# The package beside this script first: a job runs the code submitted with it.
_PLATFORM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform")
if os.path.isdir(os.path.join(_PLATFORM, "kiln")):
    sys.path.insert(0, _PLATFORM)

from kiln.cli import main  # noqa: E402 (after the path line, so the submitted copy wins)

if __name__ == "__main__":
    sys.exit(main(["data", "prepare", *sys.argv[1:]]))
