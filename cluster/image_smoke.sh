#!/bin/sh
# What `make image` runs inside the CPU image once it is built: the version, then a 5-step
# training run of the debug model on the image's own Python sources, on an embedded Ray.
# (KILN_HOME: the checkout whose jobs/ it reads; the image keeps it at /opt/kiln.)
set -eu
kiln --version
STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
cd "$(mktemp -d)"
kiln data prepare --input "$STDLIB/json/*.py" --output data --tokenizer byte --seq-len 64 --shard-tokens 65536
kiln train --config "${KILN_HOME:-/opt/kiln}/jobs/configs/debug.yaml" --set data.path=data --set train.max_steps=5 \
    --set train.eval_every=0 --set train.checkpoint_every=5 --set logging.tracking_uri=sqlite:///mlflow.db
