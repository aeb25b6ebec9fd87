#!/usr/bin/env bash
# The GPU check on a lent accelerator machine (docs/gpu.md): install the bundle made by
# `make gpu-bundle` (carried as .gpu-bundle) offline, then run `python -m bench.gpu_check`,
# writing gpu_check.json, gpu_check.md and gpu_check.log under $OUT. Extra arguments go to the check.
#
#   on the GPU machine, in a copy of the working tree with .gpu-bundle/:  OUT=results/gpu-run bash bench/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-results/gpu-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -f .gpu-bundle/requirements.txt ]; then
  "$PY" -m pip install -q --no-index --find-links .gpu-bundle --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-check-site -r .gpu-bundle/requirements.txt || { echo "gpu-run: bundle install failed" >&2; exit 3; }
  export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "gpu-run: no .gpu-bundle/requirements.txt (run make gpu-bundle here and carry .gpu-bundle): using the machine's packages" >&2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import sys, torch, transformers; print('gpu-run: python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee "$OUT/gpu_check.log"
"$PY" -m bench.gpu_check --out "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
