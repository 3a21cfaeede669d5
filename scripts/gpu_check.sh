#!/bin/bash
# The checks a GPU session runs (docs/runner.md, "On a GPU"): the engine, runner and drafter tests with
# the GPU as the tests' device, then `ar` against `reader` at batch 1 and at batches 8 and 32, each
# bench under its own time limit so that one that runs out leaves the others' results. The compiled CPU
# ops' tests run too: their errors must reach Python on the GPU host's compiler (session 63's H200
# crashed in one of them).
#
#   scripts/gpu_check.sh OUT_DIR [tests|bench|all]
#
# PYTHON (default python3) must import reader_spec (installed, or PYTHONPATH=src) with its dependencies
# and find the default model; WORKERS (default 14; empty: one process, without pytest-xdist) test
# processes share the GPU; TESTS_TIMEOUT,
# BENCH1_TIMEOUT and BENCH832_TIMEOUT bound each part in seconds.
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR [tests|bench|all]}
PART=${2:-all}
PYTHON=${PYTHON:-python3}
WORKERS=${WORKERS-14}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ "$PART" != bench ]; then
  "$PYTHON" -m reader_spec.compiled
  READER_TEST_DEVICE=${DEVICE:-cuda} timeout "${TESTS_TIMEOUT:-600}" "$PYTHON" -m pytest -v -rfE \
    ${WORKERS:+-n $WORKERS} -m "not model" -p no:cacheprovider \
    tests/engine/test_runner.py tests/engine/test_engine.py tests/engine/test_sampling.py \
    tests/engine/test_acceptance.py tests/engine/test_tree.py tests/engine/test_kv_cache.py \
    tests/engine/test_attention.py tests/engine/test_stopping.py tests/engine/test_scheduler.py \
    tests/engine/test_layer_ops.py \
    tests/drafters/test_model_drafter.py tests/drafters/test_reader_drafter.py > "$OUT/tests.log" 2>&1
  echo "tests: exit $?, $(grep -c ' PASSED' "$OUT/tests.log") passed, $(grep -c ' FAILED' "$OUT/tests.log") failed," \
    "$(grep -c ' ERROR' "$OUT/tests.log") errors (a run cut by its time limit has no summary line)"
  grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | cut -c1-300 | head -40
fi

if [ "$PART" != tests ]; then
  bench() {  # name, time limit, then reader bench's arguments
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$PYTHON" -m reader_spec.cli bench --device "${DEVICE:-cuda}" --methods ar reader \
      --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
    echo "bench $name: exit $?"
    sed -n '/^| method/,/^$/p' "$OUT/$name/results.md" 2>/dev/null
  }
  bench batch1 "${BENCH1_TIMEOUT:-300}" --limit 1 --batch-sizes 1
  bench batch8-32 "${BENCH832_TIMEOUT:-300}" --limit 2 --batch-sizes 8 32
fi
