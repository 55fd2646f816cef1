#!/usr/bin/env bash
# One device call, from the repository root: install, the whole test suite (CUDA tests included), the
# quickstart demo at full size, and a quick side-by-side forward check with fusepass-bench (eager,
# Inductor, fusepass; fp32 and bf16 autocast; train and eval) on demos/problems/*.py and on
# gemm_scale_batchnorm at 1024 x 8192 -> 8192. Logs and JSON go to $OUT; arguments go to pytest.
# Exit status 0 when every step passed.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fusepass_gpu}; mkdir -p "$OUT"
status=0
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }

# pytest-xdist is not always installed on the device
parallel=(); python3 -c "import xdist" 2>/dev/null && parallel=(-n 8)
python3 -m pytest -q "${parallel[@]}" -p no:cacheprovider -rs "$@" > "$OUT/pytest.log" 2>&1 || status=1
tail -25 "$OUT/pytest.log"

python3 demos/quickstart.py > "$OUT/quickstart.log" 2>&1 || status=1
tail -8 "$OUT/quickstart.log"

QUICK=(--mode train eval --precision fp32 bf16-autocast --seeds 2 --warmup 25 --rep 100)
fusepass-bench demos/problems/*.py "${QUICK[@]}" --json "$OUT/bench_forward.json" \
  > "$OUT/bench_forward.txt" 2> "$OUT/bench_forward.err" || status=1
fusepass-bench demos/problems/gemm_scale_batchnorm.py --size 1024,8192,8192 "${QUICK[@]}" \
  --json "$OUT/bench_forward_1024.json" > "$OUT/bench_forward_1024.txt" 2> "$OUT/bench_forward_1024.err" || status=1
cat "$OUT/bench_forward.txt" "$OUT/bench_forward_1024.txt"
tail -n 3 "$OUT"/bench_forward*.err
exit $status
