#!/usr/bin/env bash
# The test suite, anywhere. CPU tests always; GPU tests skip with a stated reason where there is no GPU,
# single-GPU tests (GEMM) run in-process where there is one, and the multi-rank GPU suite runs under
# fluxrt-run on 2 and 4 ranks where the node has that many GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

pytest_checked() {  # pytest exit 5 ("no tests collected") is a failure here, never a silent pass
  "$@"
  local rc=$?
  if [ $rc -eq 5 ]; then echo "test.sh: pytest collected no tests: $*" >&2; return 1; fi
  return $rc
}

pytest_checked "$PY" -m pytest tests -q -rs -p no:cacheprovider || exit 1

ngpu=$("$PY" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)
if [ "$ngpu" -lt 2 ]; then
  echo "test.sh: $ngpu GPU(s): the multi-rank GPU suite needs a node with >= 2 GPUs (skipped)"
  exit 0
fi
for n in 2 4; do
  [ "$ngpu" -ge "$n" ] || continue
  echo "test.sh: GPU suite on $n ranks"
  pytest_checked "$PY" -m fluxrt.launch -n "$n" ${FLUXRT_RUN_ARGS:-} -- "$PY" -m pytest tests/gpu -q -rs \
    -p no:cacheprovider --ignore=tests/gpu/test_gemm.py || exit 1
done
