#!/usr/bin/env bash
# Builds what benches/gpu/run.sh installs on a device machine (which has no network): the
# pagedllm abi3 wheel and the wheels of the runtime dependencies the device image lacks, into
# benches/gpu/wheelhouse/ (git-ignored; name it in the device call's `carry`).
#
#   benches/gpu/make_wheelhouse.sh [PYTHON]     # PYTHON: one with maturin and pip (default python3)
#
# The device image's python3 is CPython 3.12 on x86-64 and already holds torch, triton,
# transformers, numpy, safetensors, tokenizers, tqdm, jinja2, msgpack, httpx and pytest
# (/work/.library/device/KINDS.md); the engine's one other import is llguidance.
set -euo pipefail
PY=${1:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
WHEELS="$HERE/wheelhouse"
rm -rf "$WHEELS" && mkdir -p "$WHEELS"
# the versions this checkout is tested with, so the device runs what CI runs
LLGUIDANCE=$("$PY" -c "import importlib.metadata as m; print(m.version('llguidance'))")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    -d "$WHEELS" "llguidance==$LLGUIDANCE"
(cd "$ROOT" && "$PY" -m maturin build --release --out "$WHEELS")
ls -l "$WHEELS"
du -sh "$WHEELS"
