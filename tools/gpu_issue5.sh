#!/usr/bin/env bash
# One device call for the fused-GEMM work: install, GEMM variants (tools/tune_gemm.py), the test suite,
# and fusepass-bench over the reference problems. Logs and JSON go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fusepass_gpu}; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
[ -n "${SKIP_GEMM:-}" ] || python3 tools/tune_gemm.py --shapes 2 ${TUNE_ARGS:-} --json "$OUT/tune_gemm.json" > "$OUT/tune_gemm.log" 2>&1
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -n 8 -p no:cacheprovider -rs -x ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -15
# BENCH: specs "SET:MODES:PRECISIONS[:EXTRA]", SET = large (demos/problems) or small (benchmarks/problems),
# e.g. BENCH="large:train,eval:fp32,tf32 small:train:bf16-autocast:--backward". One JSON per spec.
for spec in ${BENCH:-}; do
  IFS=: read -r set modes precisions extra <<< "$spec"
  problems=demos/problems/*.py; [ "$set" = small ] && problems=benchmarks/problems/*_small.py
  extra_name=${extra//[-,]/}; name="bench_${set}_${modes//,/-}_${precisions//,/-}${extra:+_${extra_name:0:40}}"
  fusepass-bench $problems --mode ${modes//,/ } --precision ${precisions//,/ } ${extra//,/ } \
    --json "$OUT/$name.json" 2>"$OUT/$name.err" | tail -40
done
