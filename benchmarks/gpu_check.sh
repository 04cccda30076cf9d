#!/usr/bin/env bash
# One device call (the `device` tool runs it from the repository root, $OUT collects the logs): the GPU tests of
# TESTS (default: the CUDA-graph tests), then, unless NO_PROFILE is set, kernel profiles and Chrome traces of one
# draft, one verification and one iteration (SmolLM2's shape with random weights, batch 64 x 7.5K, compiled graphs),
# greedy and sampling. Prints the tests' tail and the profiles' summaries last.
#     bash benchmarks/gpu_check.sh
#     TESTS="tests/test_graphs.py kernels/tests/test_kernels_top_p.py" TEST_S=400 NO_PROFILE=1 bash benchmarks/gpu_check.sh
#     TEST_WORKERS=0 bash benchmarks/gpu_check.sh       (tests in one process, without pytest-xdist)
#     PROFILE_S=120 bash benchmarks/gpu_check.sh       (each profile's time limit, default 200 s)
export PYTHONPATH=.:kernels/torch-ext:tests:kernels/tests:benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
# Triton compiles every kernel variant a test asks for: with pytest-xdist installed, several workers compile (and
# run) side by side on the GPU box's cores (TEST_WORKERS, default 8; 0 runs in one process).
workers=()
if [ "${TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${TEST_WORKERS:-8}")
fi
echo "pytest ${workers[*]:-in one process (no pytest-xdist, or TEST_WORKERS=0)}" > "$OUT/tests.txt"
timeout "${TEST_S:-300}" python3 -m pytest -q -p no:cacheprovider -x "${workers[@]}" ${TESTS:-tests/test_graphs.py} \
    >> "$OUT/tests.txt" 2>&1
echo "tests rc $?" >> "$OUT/tests.txt"
if [ -z "${NO_PROFILE:-}" ]; then
    for decoding in greedy sample; do
        extra=""
        [ "$decoding" = sample ] && extra=--sample
        timeout "${PROFILE_S:-200}" python3 benchmarks/profile_forward.py --random-weights --compile $extra \
            --trace "$OUT/$decoding" --new-tokens 32 --top 14 > "$OUT/$decoding.txt" 2>&1
    done
fi
tail -25 "$OUT/tests.txt"
for decoding in greedy sample; do
    [ -f "$OUT/$decoding.txt" ] && grep -A 16 "one draft\|one iteration" "$OUT/$decoding.txt" | grep -v "^--$" | head -40
done
