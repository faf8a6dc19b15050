#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: versions and nvidia-smi, the tests marked `gpu` (the qwen_math
# recipe on a small model with the trainer and the embedded engine on the GPU, per precision, with the measured
# train/inference mismatch; each trainer and loop path's tiny recipe on the GPU), and the trainer, rollout and device unit tests under that machine's torch and
# transformers. For a machine with the GPU's own Python and no network: `bash scripts/device_wheels.sh` here
# first, and take .whl/ along; nothing is installed into that Python (the wheels go to /tmp/site, used only
# where it lacks pydantic).
# Usage: [OUT=DIR] [PYTHON=python3] bash scripts/device_checks.sh   -> DIR (default /tmp/device-checks): logs and
# gpu_report.jsonl; the exit status is the gpu tests' (0 with every one skipped where torch sees no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-checks}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
if ! "$PYTHON" -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FLASHREINFORCE_GPU_REPORT=$OUT/gpu_report.jsonl
rm -f "$FLASHREINFORCE_GPU_REPORT"
{ nvidia-smi || echo "no nvidia-smi"; } > "$OUT/nvidia-smi.txt" 2>&1
"$PYTHON" -c "import sys, torch, transformers, pydantic; print(sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'pydantic', pydantic.__version__)" \
  2>&1 | tee "$OUT/versions.txt"
# -o addopts= drops the default -m 'not slow'; the gpu tests are slow ones
"$PYTHON" -m pytest -q -p no:cacheprovider -o addopts= --strict-markers -m gpu -rs tests 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
"$PYTHON" -m pytest -q -p no:cacheprovider tests/unit/trainer/test_trainer.py tests/unit/rollout \
  tests/unit/run/test_devices.py 2>&1 | tee "$OUT/unit_tests.log" | tail -n 3
[ -f "$FLASHREINFORCE_GPU_REPORT" ] && cat "$FLASHREINFORCE_GPU_REPORT"
exit "$status"
