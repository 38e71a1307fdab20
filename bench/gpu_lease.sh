#!/usr/bin/env bash
# One short GPU lease's checks, in order of need: the acceptance table, the trace cases, the GPU
# fix bank. Each part has its own time limit, so a slow part costs only its own rows; everything
# lands under $OUT (default ./gpu-out).
#
#   bash bench/gpu_lease.sh            # diag and its dependencies already installed
#   WHEELS=.whl bash bench/gpu_lease.sh  # install the wheels in .whl first (a machine without PyPI)
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>&1 | tee "$OUT/device.txt"
python3 -c 'import torch, diag; print("torch", torch.__version__, "diag", diag.__file__)' 2>&1 | tee -a "$OUT/device.txt"
timeout "${ACCEPTANCE_S:-200}" python3 bench/gpu_acceptance.py --steps 60 2>&1 | tee "$OUT/acceptance.txt"
if [ "${CASES_S:-150}" != 0 ]; then  # CASES_S=0: the traces are already at hand
    timeout "${CASES_S:-150}" python3 bench/gpu_trace_cases.py --out /tmp/gpu-cases 2>&1 | tee "$OUT/cases.txt"
    tar -C /tmp/gpu-cases -cf "$OUT/cases.tar" . 2>/dev/null
fi
timeout "${FIX_BANK_S:-230}" python3 bench/gpu_fix_bank.py --json "$OUT/fix_bank.json" 2>&1 | tee "$OUT/fix_bank.txt"
