#!/usr/bin/env bash
# One call on a GPU node (< 10 min): build every kernel, run the GPU test suite under MPI on 2 and 4 ranks
# (as many as the node has GPUs), run the benchmarks, and leave logs and JSON results under $OUT.
#   offline lent node:  source .whl/prelude.sh && bash launch/gpu-check.sh
#   elsewhere:          OUT=/tmp/gpu-check bash launch/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT/logs"
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1
export FLUXRT_CACHE_DIR=${FLUXRT_CACHE_DIR:-/tmp/fluxrt-kernel-cache}
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
summary="$OUT/summary.txt"
: > "$summary"
fail=0

step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/logs/NAME.log, record rc and the last lines
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && fail=1
  { echo "== $name rc=$rc $((SECONDS - t0))s: $*"; tail -n "${TAIL:-4}" "$OUT/logs/$name.log"; } | tee -a "$summary"
}

{ echo "# gpu-check $(date -u +%FT%TZ) commit ${FLUXRT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}";
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } | tee -a "$summary"
run=(python3 -m fluxrt.launch --oversubscribe -n)

step build 180 python3 -m fluxrt.toolchain
for n in 2 4; do
  if [ "$ngpu" -ge "$n" ]; then
    step "tests-np$n" "${TESTS_LIMIT:-300}" "${run[@]}" "$n" -- python3 -m pytest tests/gpu -q -p no:cacheprovider -rs \
      --ignore=tests/gpu/test_gemm.py
  else
    echo "== tests-np$n skipped: $ngpu GPU(s)" | tee -a "$summary"
  fi
done
TAIL=40 step p2p "${P2P_LIMIT:-240}" "${run[@]}" 2 -- python3 -m fluxrt.perf.cli p2p -b 4 -e 1G -n 20 -w 5 --no-progress \
  --json "$OUT/p2p.json" --plot "$OUT/p2p.png"
# The GEMM engine is single-GPU: its tests and benchmark run once, outside MPI.
if [ "${FLUXRT_SKIP_GEMM:-0}" != 1 ]; then
  TAIL=15 step gemm-tests "${GEMM_LIMIT:-150}" python3 -m pytest tests/gpu/test_gemm.py -q -p no:cacheprovider -x
  TAIL=25 step gemm-bench "${GEMM_LIMIT:-150}" python3 perf/bench_gemm.py ${GEMM_BENCH_ARGS:-} --json "$OUT/gemm.json"
fi
tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$OUT/logs"
echo "gpu-check: $([ $fail -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$summary"
exit $fail
