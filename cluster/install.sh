#!/bin/sh
# Kiln into a virtual environment: what `make install` runs on a workstation or CI, and what
# cluster/Dockerfile runs to build the image, so that the image's steps are the ones every
# `make test` exercises.
#
#   cluster/install.sh VENV [editable]
#
# Environment: PY (the Python that makes VENV; python3), TORCH_VERSION (constraints.txt's), TORCH_INDEX
# (a further wheel index for torch, e.g. https://download.pytorch.org/whl/cpu, whose 2.13.0+cpu
# outranks PyPI's CUDA build; default none),
# CONSTRAINTS (constraints.txt: the versions CI tested), EXTRAS (Kiln's extras, comma-separated:
# server, gpu, profile; default none). Run from the repository root.
set -eu
VENV=$1
MODE=${2:-}
PY=${PY:-python3}
CONSTRAINTS=${CONSTRAINTS:-constraints.txt}
TORCH_VERSION=${TORCH_VERSION:-$(sed -n 's/^torch==//p' "$CONSTRAINTS")}
PIP="$VENV/bin/pip install -q -c $CONSTRAINTS"

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip setuptools wheel
# torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
$PIP ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "torch==$TORCH_VERSION"
# DeepSpeed's sdist imports torch while building; build no CUDA ops (JIT on demand instead).
DS_BUILD_OPS=0 $PIP --no-build-isolation "deepspeed>=0.19,<0.20"
KILN=".${EXTRAS:+[$EXTRAS]}"
if [ "$MODE" = editable ]; then
    $PIP -e "$KILN"
else
    $PIP "$KILN"
fi
# Build DeepSpeed's shared-memory allreduce and CPU Adam ops now (~3 min once), into this
# environment's own cache (kiln.parallel.ops), rather than inside the first training run.
"$VENV/bin/python" -m kiln.parallel.ops
