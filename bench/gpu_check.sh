#!/usr/bin/env bash
# `make gpu-check`: the GPU check on a bare GPU machine with no network (Python 3.12 with torch,
# transformers, accelerate, peft, numpy, pyarrow and pytest already there). Installs the wheels
# `make gpu-wheels` put in .whl/ (carried next to the checkout) into /tmp/areal-site, puts the
# checkout on PYTHONPATH, and runs bench/gpu_check.py: tier-3 tests, every entry point for a few
# steps on one GPU, bench/gpu.py; one table and runs/gpu-check/gpu_check.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=/tmp/areal-site
STAMP="$SITE/.areal-wheels"  # the wheel names installed there: a second check skips the install
if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "gpu-check: no .whl/ here: the runtime dependencies must already be installed"
elif [ "$(ls .whl)" = "$(cat "$STAMP" 2>/dev/null)" ]; then
  echo "gpu-check: .whl/ already installed in $SITE"
else
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "gpu-check: installing .whl/*.whl failed (run make gpu-wheels where pip reaches PyPI)"; exit 2; }
  ls .whl >"$STAMP"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PY" bench/gpu_check.py "$@"
