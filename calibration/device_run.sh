#!/usr/bin/env bash
# Calibrate a lent H200 in one call, in under 5 minutes, writing at most 8 files to $OUT:
#   gpu.txt, run.log, raw.csv, profile.json, fit_report.md, fit.png, pytest_gpu.log.
#
# The machine has Python 3.12, torch 2.11 and triton 3.6 (and pandas, pyarrow, matplotlib,
# pytest, hypothesis) but not simpy, hydra-core, omegaconf or antlr4. Prepare their wheels here,
# once, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       simpy==4.1.1 hydra-core==1.3.2 omegaconf==2.3.0 hydra-joblib-launcher==1.2.0 joblib
#   pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .whl      # the index has no wheel
# then run it through the device tool with carry [".whl"] and timeout_s=360:
#   bash calibration/device_run.sh
# A dry run of the same steps on a CPU (tiny grid, Triton interpreter, no GPU tests):
#   OUT=/tmp/devout DEVICE=cpu bash calibration/device_run.sh
set -uo pipefail
OUT=${OUT:-results/device_run}
DEVICE=${DEVICE:-cuda}
GRID=${GRID:-quick}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
work=$(mktemp -d)

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi";
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u; } \
    > "$OUT/gpu.txt"

if [ "$DEVICE" = cpu ]; then
    export TRITON_INTERPRET=1
    GRID=smoke
fi
timeout 230 python3 -m calibration run grid="$GRID" device="$DEVICE" out_dir="$work" 2>&1 | tee "$OUT/run.log"
for f in raw.csv profile.json fit_report.md fit.png; do
    cp "$work"/*/"$f" "$OUT/" 2>/dev/null || echo "missing $f" >> "$OUT/run.log"
done

if [ "$DEVICE" = cuda ]; then
    timeout 60 python3 -m pytest -m gpu tests/calibration -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
else
    timeout 120 python3 -m pytest tests/calibration/test_kernels.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
fi
rm -rf "$work"
ls -la "$OUT"
