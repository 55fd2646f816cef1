#!/usr/bin/env bash
# One device call: install, the whole test suite (CUDA tests included), the demo at full size, and a
# timing of eager / Inductor / fusepass on the reference problems (SKIP_TIMING=1 skips it). Logs go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fusepass_gpu}; mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -m pytest -q -n 8 -p no:cacheprovider -rs "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
python3 demos/quickstart.py 2>&1 | tee "$OUT/quickstart.log" | tail -8
[ -n "${SKIP_TIMING:-}" ] || python3 tools/time_problems.py 2>&1 | tee "$OUT/timing.log" | tail -30
