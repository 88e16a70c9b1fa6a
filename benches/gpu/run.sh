#!/usr/bin/env bash
# The GPU check in one command, for a device machine (no network there): installs the carried
# wheelhouse, then runs benches/gpu/gpu_check.py (the GPU tests, then three benchmarks, each
# stage in its own bounded process; about 8 minutes at most), writing gpu_check.json,
# gpu_check.log and tests.xml under $OUT.
#
# Here, first: benches/gpu/make_wheelhouse.sh (the pagedllm abi3 wheel + llguidance into
# benches/gpu/wheelhouse/, git-ignored). Then one device call from the repository root:
#     run(command="bash benches/gpu/run.sh", carry=["benches/gpu/wheelhouse"], timeout_s=570)
# Without a wheelhouse the source tree is used (carry python/pagedllm/_core.abi3.so then).
#
#     bash benches/gpu/run.sh --dry-run     # the same stages on this CPU, in seconds
# Further arguments go to gpu_check.py: --stages env,attention (a subset), --tests ID,ID (only
# those tests in the tests stage), --budget-scale F.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-$ROOT/gpu_check_out}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cd "$ROOT"

WHEELS="$HERE/wheelhouse"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE=${PAGEDLLM_SITE:-/tmp/pagedllm_site}
    rm -rf "$SITE"
    # --no-deps: everything else the engine imports is in the device image (KINDS.md)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$WHEELS"/*.whl || { echo "installing $WHEELS failed" >&2; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    # the wheel must hold this tree's Python code, or the run checks code that is not here
    if ! diff -rq -x __pycache__ -x '*.so' "$ROOT/python/pagedllm" "$SITE/pagedllm" >&2; then
        echo "the wheelhouse is stale against python/pagedllm: rerun make_wheelhouse.sh" >&2
        exit 3
    fi
elif [ -f python/pagedllm/_core.abi3.so ]; then
    echo "no wheelhouse: running from the source tree" >&2
    export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "neither $WHEELS/*.whl nor python/pagedllm/_core.abi3.so: run make_wheelhouse.sh here" >&2
    exit 3
fi
# before any stage: the extension (the device image has no Rust toolchain) and the engine's
# imports (llguidance comes from the wheelhouse)
"$PY" -c "import pagedllm._core, pagedllm; from pagedllm import LLM; print('pagedllm from', pagedllm.__file__)" \
    || { echo "pagedllm does not import: run benches/gpu/make_wheelhouse.sh here first" >&2; exit 3; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem \
    --format=csv | tee "$OUT/nvidia_smi.csv"
exec "$PY" "$HERE/gpu_check.py" --out "$OUT" "$@"
