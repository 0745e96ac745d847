#!/usr/bin/env bash
# One call on a GPU node: build every kernel, run the GPU test suite under MPI on 2, 4 and 8 ranks
# (as many as the node has GPUs), the sanitizers and the benchmarks, and leave logs and results under $OUT:
#   summary.txt  one block per step (rc, time, last lines of its log)
#   logs.tgz     every step's full log
#   results.tgz  JSON and PNG results (copy them to perf/results/ with the date, machine kind and commit)
#
#   offline lent node:  source .whl/prelude.sh && bash launch/gpu-check.sh
#                       (.whl/: the nvshmem4py, nccl4py and nvmath-python wheels the node lacks)
#   elsewhere:          OUT=/tmp/gpu-check bash launch/gpu-check.sh
#   a subset:           FLUXRT_CHECK=gemm,sass bash launch/gpu-check.sh
# Sections (FLUXRT_CHECK, comma-separated, default all): build tests p2p probe gemm sass sanitize
# collectives ops tune gemmsuite (TEST_FILES narrows the test step, TEST_RANKS its rank counts, RANK_KILLED=0 skips the killed-rank test, SWEEP_OPS the collective sweeps; tune runs
# perf/tune_collectives.py candidates, TUNE_SETS of "fabric small mid large"; gemmsuite times the GEMM shape
# suite against cuBLAS before and after tuning, SUITE and SUITE_DTYPES choose, TUNE_SUSTAINED_MS the tuning's power-limit confirmation (0: off), SUSTAINED_SHAPES the shapes timed alone at the power limit; neither is part of "all"). Step time limits: TESTS_LIMIT (per test file, 300 s default), BENCH_LIMIT (eager collective sweeps: 420 s default, they time in-place calls too), GEMM_LIMIT, SANITIZE_LIMIT (seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
RES="$OUT/results"
mkdir -p "$OUT/logs" "$RES"
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1
export FLUXRT_CACHE_DIR=${FLUXRT_CACHE_DIR:-/tmp/fluxrt-kernel-cache}
CHECK=${FLUXRT_CHECK:-all}
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
summary="$OUT/summary.txt"
: > "$summary"
fail=0

want() { [ "$CHECK" = all ] || [[ ",$CHECK," == *",$1,"* ]]; }

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
ranks=(); for n in 2 4 8; do [ "$ngpu" -ge "$n" ] && ranks+=("$n"); done
read -ra test_ranks <<< "${TEST_RANKS:-${ranks[*]}}"   # the test step's, e.g. TEST_RANKS=2 with CUDA_VISIBLE_DEVICES=0,1
[ ${#ranks[@]} -eq 0 ] && echo "== multi-rank steps skipped: $ngpu GPU(s)" | tee -a "$summary"
read -ra bench_ranks <<< "${BENCH_RANKS:-${ranks[*]}}"   # e.g. BENCH_RANKS=4: sweeps on 4 ranks only
py=$(command -v python3)   # compute-sanitizer resolves a bare name itself, outside any virtualenv

want build && step build 240 python3 -m fluxrt.toolchain
if want tests; then   # one step per file, so that a hang or a cascade in one file leaves the others their time
  for n in "${test_ranks[@]}"; do
    for f in ${TEST_FILES:-tests/gpu/test_*.py}; do
      case "$f" in tests/gpu/test_gemm*.py|tests/gpu/test_grouped_gemm*.py|tests/gpu/test_perf_cublaslt.py) continue;; esac   # single-GPU: the gemm step
      [ "$f" = tests/gpu/test_rank_killed.py ] && continue   # starts its own jobs: below, once
      name=$(basename "$f" .py)
      if [ "$f" = tests/gpu/test_multinode.py ]; then   # the hierarchical path: one node as 2 virtual nodes
        FLUXRT_TOPOLOGY=virtual:2x$((n / 2)) TAIL=12 step "$name-virtual2x$((n / 2))-np$n" "${TESTS_LIMIT:-300}" \
          "${run[@]}" "$n" -- python3 -m pytest "$f" -q -p no:cacheprovider --color=no -rs --maxfail="${MAXFAIL:-5}"
        continue
      fi
      TAIL=12 step "$name-np$n" "${TESTS_LIMIT:-300}" "${run[@]}" "$n" -- python3 -m pytest "$f" -q -p no:cacheprovider --color=no \
        -rs --maxfail="${MAXFAIL:-5}"
    done
  done
  # a rank SIGKILLed mid-call: the others raise within the bound and the job ends (jobs of its own, up to 4 ranks)
  [ "$ngpu" -ge 2 ] && [ "${RANK_KILLED:-1}" = 1 ] && TAIL=12 step rank-killed "${TESTS_LIMIT:-300}" python3 -m pytest tests/gpu/test_rank_killed.py \
    -q -p no:cacheprovider --color=no -rs -s
fi
if want p2p && [ "$ngpu" -ge 2 ]; then
  TAIL=40 step p2p "${BENCH_LIMIT:-240}" "${run[@]}" 2 -- python3 -m fluxrt.perf.cli p2p -b 4 -e 1G -n 20 -w 5 \
    --no-progress --json "$RES/p2p.json" --plot "$RES/p2p.png"
fi
if want probe && [ "$ngpu" -ge 2 ]; then
  TAIL=10 step probe 120 "${run[@]}" "${ranks[-1]}" -- python3 perf/ordering_probe.py --json "$RES/probe.json"
fi
if want collectives; then
  for n in "${bench_ranks[@]}"; do
    for op in ${SWEEP_OPS:-allreduce allgather reduce_scatter alltoall}; do
      TAIL=40 step "$op-np$n" "${BENCH_LIMIT:-420}" "${run[@]}" "$n" -- python3 -m fluxrt.perf.cli "$op" -b 8 -e 1G -f 2 \
        -n 20 -w 5 -c 1 -d bf16 --heap 8G --no-progress --json "$RES/$op-np$n.json" --plot "$RES/$op-np$n.png"
    done
    for op in ${SWEEP_OPS:-allreduce allgather reduce_scatter alltoall}; do
      TAIL=25 step "$op-graph-np$n" "${BENCH_LIMIT:-240}" "${run[@]}" "$n" -- python3 -m fluxrt.perf.cli "$op" -b 16 \
        -e "${GRAPH_MAX:-64M}" -f 4 -n 20 -w 5 -G 10 -c 1 -d bf16 --heap 4G --no-progress --json "$RES/$op-graph-np$n.json"
    done
  done
fi
if [[ ",$CHECK," == *",tune,"* ]]; then   # candidate thresholds and grids, fluxrt configs beside NCCL
  n=${bench_ranks[-1]}
  sets=" ${TUNE_SETS:-fabric small large} "   # which groups of tune runs
  tune() { local name=$1; shift; TAIL=30 step "tune-$name-np$n" "${BENCH_LIMIT:-240}" "${run[@]}" "$n" -- \
    python3 perf/tune_collectives.py "$@" -d bf16 -n 20 -w 5 --no-progress --json "$RES/tune-$name-np$n.json"; }
  if [[ $sets == *" fabric "* ]]; then
    TAIL=20 step "fabric-np$n" "${BENCH_LIMIT:-240}" "${run[@]}" "$n" -- python3 perf/fabric_probe.py \
      --sizes 64M,256M --blocks 16,32,44 --json "$RES/fabric-np$n.json"
  fi
  if [[ $sets == *" small "* ]]; then
    tune allreduce-small allreduce -b 8 -e 1M -f 4 -G 10 --config algo=ll --config algo=ll,ll_max_grid=128 \
      --config algo=oneshot --config algo=auto
    for op in allgather reduce_scatter alltoall; do
      tune "$op-small" "$op" -b 8 -e 1M -f 4 -G 10 --config algo=ll --config algo=push
    done
  fi
  if [[ $sets == *" mid "* ]]; then
    tune allreduce-mid allreduce -b 256K -e 4M -f 2 -G 10 --config algo=oneshot --config algo=oneshot,oneshot_max_grid=64 \
      --config algo=oneshot,oneshot_max_grid=128,oneshot_bytes_per_block=4K \
      --config algo=twoshot,bulk_max_grid=128,bulk_bytes_per_block=4K --config algo=ll,ll_max_bytes=4M
    for op in allgather reduce_scatter alltoall; do
      tune "$op-mid" "$op" -b 512K -e 8M -f 2 -G 10 --config algo=push --config algo=push,bulk_bytes_per_block=4K \
        --config algo=push,bulk_bytes_per_block=4K,bulk_max_grid=128 --config algo=ll,ll_max_bytes=2M
    done
  fi
  if [[ $sets == *" large "* ]]; then
    tune allreduce-large allreduce -b 1M -e 1G -f 4 --config algo=twoshot --config algo=pipe \
      --config algo=pipe,pipe_max_step=32K --config algo=pipe,pipe_max_step=16K
    for op in allgather reduce_scatter alltoall; do
      tune "$op-large" "$op" -b 1M -e 1G -f 4 --config algo=push --config algo=pipe --config algo=pipe,pipe_max_step=64K \
        --config algo=pipe,pipe_max_step=32K
    done
  fi
fi
if want ops; then
  for n in "${bench_ranks[@]}"; do
    for op in ag_gemm gemm_rs; do
      TAIL=20 step "$op-np$n" "${BENCH_LIMIT:-240}" "${run[@]}" "$n" -- python3 -m fluxrt.perf.cli "$op" -d bf16 \
        --json "$RES/$op-np$n.json" --plot "$RES/$op-np$n.png"
    done
    TAIL=20 step "mlp-np$n" "${BENCH_LIMIT:-240}" "${run[@]}" "$n" -- python3 -m fluxrt.perf.cli mlp -d bf16 \
      --json "$RES/mlp-np$n.json"
    TAIL=20 step "allreduce-rmsnorm-np$n" "${BENCH_LIMIT:-240}" "${run[@]}" "$n" -- python3 -m fluxrt.perf.cli \
      allreduce_rmsnorm --json "$RES/allreduce-rmsnorm-np$n.json"
    for op in moe_dispatch moe_combine moe_layer; do
      TAIL=20 step "$op-np$n" "${BENCH_LIMIT:-240}" "${run[@]}" "$n" -- python3 -m fluxrt.perf.cli "$op" \
        --json "$RES/$op-np$n.json" --plot "$RES/$op-np$n.png"
    done
    # shards that are not whole tiles: what the padded path costs against a whole-tile M
    TAIL=10 step "padded-shards-np$n" "${BENCH_LIMIT:-240}" "${run[@]}" "$n" -- python3 perf/padded_shards.py \
      --m $((2048 * n)) $((2040 * n)) --json "$RES/padded-shards-np$n.json"
  done
fi
# The GEMM engine is single-GPU: its tests and benchmark run once, outside MPI.
if want gemm; then
  TAIL=15 step gemm-tests "${GEMM_LIMIT:-150}" python3 -m pytest tests/gpu/test_gemm.py -q -p no:cacheprovider -x
  TAIL=15 step gemm-fp8-tests "${GEMM_LIMIT:-150}" python3 -m pytest tests/gpu/test_gemm_fp8.py -q -p no:cacheprovider -x
  TAIL=15 step gemm-grouped-tests "${GEMM_LIMIT:-150}" python3 -m pytest tests/gpu/test_grouped_gemm.py tests/gpu/test_grouped_gemm_fp8.py -q -p no:cacheprovider -x
  TAIL=6 step cublaslt-baseline-tests 120 python3 -m pytest tests/gpu/test_perf_cublaslt.py -q -p no:cacheprovider
  TAIL=12 step gemm-grouped-bench "${GEMM_LIMIT:-150}" python3 perf/grouped_gemm.py --json "$RES/gemm-grouped.json"
  TAIL=60 step gemm-bench "${GEMM_LIMIT:-150}" python3 perf/bench_gemm.py ${GEMM_BENCH_ARGS:-} --json "$RES/gemm.json"
fi
if [[ ",$CHECK," == *",gemmsuite,"* ]]; then   # the shape suite against cuBLAS: heuristic plans, tuning, tuned plans
  LT=$(python3 -c "import nvmath.bindings.cublasLt" 2>/dev/null && echo --lt)   # cuBLASLt column where nvmath-python is
  for dt in ${SUITE_DTYPES:-bfloat16 float16}; do
    TAIL=14 step "gemm-suite-$dt" "${SUITE_LIMIT:-300}" python3 perf/gemm_suite.py --suite "${SUITE:-default}" -d "$dt" $LT \
      --json "$RES/gemm-suite-$dt.json"
    TAIL=4 step "gemm-tune-$dt" "${SUITE_LIMIT:-300}" python3 -m fluxrt.gemm tune --suite "${SUITE:-default}" -d "$dt" \
      --sustained "${TUNE_SUSTAINED_MS:-0}" --json "$RES/gemm-tune-$dt.json"
    TAIL=14 step "gemm-suite-tuned-$dt" "${SUITE_LIMIT:-300}" python3 perf/gemm_suite.py --suite "${SUITE:-default}" -d "$dt" $LT \
      --json "$RES/gemm-suite-tuned-$dt.json"
    # each alone at the power limit (power, clock, energy per call), the tuned plans, a few shapes (SUSTAINED_SHAPES)
    TAIL=8 step "gemm-sustained-$dt" "${SUITE_LIMIT:-300}" python3 perf/gemm_sustained.py -d "$dt" -n 50 \
      --plans-from "$RES/gemm-tune-$dt.json" --shapes ${SUSTAINED_SHAPES:-8192,8192,8192,NK 16384,1536,4096,KN 461,9128,13208,NK 4096,2048,6144,KN} \
      --json "$RES/gemm-sustained-$dt.json"
  done
  for scale in tensor block; do   # fp8 against cuBLASLt (torch._scaled_mm; fluxrt alone without torch)
    TAIL=4 step "gemm-fp8-$scale" "${SUITE_LIMIT:-300}" python3 perf/gemm_fp8.py --suite "${SUITE:-default}" \
      --scale "$scale" --json "$RES/gemm-fp8-$scale.json"
  done
fi
want sass && TAIL=5 step sass 120 python3 perf/sass_facts.py --json "$RES/sass.json"
if want sanitize; then
  small="test_bf16_shapes and 129 or test_tile_epilogue and set and bfloat16 and B_KxN or test_both_hooks"
  small="$small or test_chunk_reduce_adds and per_consumer and bfloat16 and per_group"
  small="$small or test_chunk_reduce_in_the_tail_sums and per_consumer and bfloat16 and per_group"
  small="$small or test_shard_copy and B_KxN or test_split_k_sanitize_small or test_stream_k_sanitize_small"
  small="$small or test_cluster_along_n_sanitize_small or test_pingpong_sanitize_small or test_fitted_sanitize_small"
  small="$small or test_tall_sanitize_small"
  for tool in memcheck racecheck; do
    # racecheck: the grouped ping-pong and fp8 cases with one tile per CTA (the tests say why)
    one_tile=""; [ "$tool" = racecheck ] && one_tile=" and one_tile_each"
    TAIL=12 step "sanitize-gemm-$tool" "${SANITIZE_LIMIT:-180}" compute-sanitizer --tool "$tool" --error-exitcode 86 \
      --report-api-errors no "$py" -m pytest tests/gpu/test_gemm.py -q -p no:cacheprovider -k "$small"
    for t in "test_gemm_fp8:test_sanitize_small" "test_grouped_gemm:test_k_shorter_than_one_stage_and_n_tail" \
             "test_grouped_gemm:test_pingpong_sanitize_small$one_tile" "test_grouped_gemm_fp8:test_sanitize_small$one_tile"; do
      TAIL=12 step "sanitize-${t%%:*}-$tool" "${SANITIZE_LIMIT:-180}" compute-sanitizer --tool "$tool" --error-exitcode 86 \
        --report-api-errors no "$py" -m pytest "tests/gpu/${t%%:*}.py" -q -p no:cacheprovider -k "${t#*:}"
    done
  done
  # the MoE layer on one rank, overlapped and sequential (dispatch, arrival flags, grouped GEMMs, combine)
  TAIL=12 step sanitize-moe-layer-memcheck "${SANITIZE_LIMIT:-180}" compute-sanitizer --tool memcheck \
    --error-exitcode 86 --report-api-errors no "$py" tests/gpu/mpi_scripts/moe_layer_small.py
  if [ "$ngpu" -ge 2 ]; then   # the communication kernels, small cases, 2 ranks
    for t in "test_p2p.py:ring and (4099 or 1048576)" \
             "test_collectives.py:allreduce and fp32 and sum or alltoallv or broadcast and 4099 or direct and 4099" \
             "test_ops.py:zero_copy or mlp_block"; do
      TAIL=12 step "sanitize-${t%%.py:*}" "${SANITIZE_LIMIT:-180}" "${run[@]}" 2 -- compute-sanitizer --tool memcheck \
        --report-api-errors no --error-exitcode 86 "$py" -m pytest "tests/gpu/${t%%:*}" -q -p no:cacheprovider -k "${t#*:}"
    done
  fi
fi
tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$OUT/logs"
tar -C "$OUT" -czf "$OUT/results.tgz" results && rm -rf "$RES"
echo "gpu-check: $([ $fail -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$summary"
exit $fail
