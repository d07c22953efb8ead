#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): world 1 on one GPU, under 5 minutes; on a machine without
# CUDA it runs the CPU parts and says which device checks it skipped.
#
# On a machine whose Python lacks megatron-core or omegaconf (and cannot reach an index), put their
# wheels in .whl/ first; they are installed into /tmp/site, and the project itself with --no-deps
# (its torch pin is the CPU build's; the machine keeps its own torch).
#
#   scripts/gpu_check.sh            # PASS / FAIL / SKIP per check, then what was proved
#   scripts/gpu_check.sh --json     # and one JSON object on the last line
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c "import lightning_dynatrain" 2>/dev/null; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the checkout itself, no install needed
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec timeout 300 "$PYTHON" scripts/gpu_check.py "$@"
