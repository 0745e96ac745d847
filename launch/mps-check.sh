#!/usr/bin/env bash
# Multi-rank GPU tests on ONE GPU: every rank on device 0 under CUDA MPS, for correctness where a machine has
# fewer GPUs than ranks. Timings from such a run mean nothing; each rank gets its share of the SMs, which the
# driver reports to it, so persistent grids are sized for the share (see docs/design.md, "Testing"). Logs
# under $OUT (default ./mps-check-out).
#   source .whl/prelude.sh && bash launch/mps-check.sh            # world p2p ops ops_decomposed ops_fp8 collectives embedding moe fused_collectives
#   FLUXRT_TOPOLOGY=virtual:2x1 MPS_FILES=multinode MPS_SOLO_FILES= bash launch/mps-check.sh   # the hierarchical path
#   MPS_FILES="p2p ops" MPS_RANKS=2 bash launch/mps-check.sh [TREE]   # TREE: another checkout to test
#   MPS_SOLO_FILES (default rank_killed): files run in one process, which start their own 2-rank jobs
set -uo pipefail
tree=${1:-$(cd "$(dirname "$0")/.." && pwd)}
OUT=${OUT:-$PWD/mps-check-out}
mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin FLUXRT_TEST_DEVICE=0 PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/fluxrt-mps} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/fluxrt-mpslog}
export FLUXRT_CACHE_DIR=${FLUXRT_CACHE_DIR:-/tmp/fluxrt-kernel-cache-$(basename "$tree")}
# MPS_SHARE=1 (default): each rank's kernels get 1/ranks of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so one
# rank's grid of spinning blocks cannot hold every SM while its peers' blocks wait to be scheduled; 0: no limit
if [ "${MPS_SHARE:-1}" = 1 ]; then export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / ${MPS_RANKS:-2})); fi
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "mps-check: could not start the MPS daemon" >&2; exit 1; }
trap 'echo quit | nvidia-cuda-mps-control' EXIT
cd "$tree"
export PYTHONPATH=$tree${PYTHONPATH:+:${PYTHONPATH#"$tree":}}
timeout 120 python3 -m fluxrt.toolchain > "$OUT/build.log" 2>&1; echo "== build rc=$?"
fail=0
for f in ${MPS_FILES:-world p2p ops ops_decomposed ops_fp8 collectives embedding moe fused_collectives}; do   # fluxrt-run passes CUDA_*, FLUXRT_* and PYTHONPATH to the ranks
  limit_var="MPS_LIMIT_${f^^}"
  # shellcheck disable=SC2086
  timeout -k 5 "${!limit_var:-${MPS_LIMIT:-150}}" python3 -m fluxrt.launch --oversubscribe -n "${MPS_RANKS:-2}" -- \
    python3 -m pytest "tests/gpu/test_$f.py" -q -p no:cacheprovider --color=no -rs ${MPS_PYTEST_ARGS:-} > "$OUT/$f.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && fail=1
  echo "== $f rc=$rc"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$f.log" | tail -"${MPS_TAIL:-8}"
done
# files that start MPI jobs of their own run in one process (the ranks they start share the GPU under MPS)
for f in ${MPS_SOLO_FILES-rank_killed}; do
  timeout -k 5 "${MPS_LIMIT:-150}" python3 -m pytest "tests/gpu/test_$f.py" -q -p no:cacheprovider --color=no -rs -s \
    ${MPS_PYTEST_ARGS:-} > "$OUT/$f.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && fail=1
  echo "== $f rc=$rc"
  grep -E "^(FAILED|ERROR)|passed|failed|after the kill" "$OUT/$f.log" | tail -"${MPS_TAIL:-8}"
done
exit $fail
