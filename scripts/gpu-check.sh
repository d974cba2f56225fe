#!/usr/bin/env bash
# GPU acceptance check, sized for a short lease: one GPU, a bare machine with Python and torch,
# GPU_CHECK_BUDGET_S seconds in all (default 480: eight minutes). In order:
#   0. the wheels torch does not bring, skipped when they import already. Offline machines: put the
#      wheels of the missing dependencies (zstandard, blake3, orjson, gigatoken, torchao for --fp8)
#      in $WHEELS (default .whl/, git-ignored): they go into $WHEELS_TARGET (default
#      /tmp/tokenloom-site) without an index, and the native extension is built in place. With no
#      such folder: `pip install -e .[dev,fp8]` from the index.
#   1. the bench rows first: bench/run_all.py --gpu, bf16 ~1B-parameter GPT-2 and Llama shapes,
#      our `train` defaults against the compiled nanoGPT-style loop (and the eager loop, and
#      --fp8 where the GPU has float8), then fp8's loss against bf16 after 300 steps on real text
#      (TOKENLOOM_BENCH_DATA=PREFIX, TOKENLOOM_BENCH_TOKENIZER=DIR; without them that row says
#      so), written into bench/RESULTS.md's GPU block;
#      --rows NAME[,NAME...] runs only those benches' rows (run_all.py --gpu --only: the block's
#      other rows are kept), e.g. --rows moe_bench,checkpoint_bench;
#   2. a profile of our step at the GPT-2 shape (bench/profile_step.py: kernels by device time,
#      host synchronisations per step) into gpu-check-profile.txt, when train_bench's rows ran;
#   --tests-first (a short lease, e.g. 10 minutes): step 3 runs first, cut off BENCH_RESERVE_S
#      (default 150) before the budget's end, then step 1's rows within what is left (step 2 is
#      skipped); GPU_CHECK_TESTS may then name groups of paths separated by ";", each its own
#      pytest run in that order (the files an issue's failing tests live in first), e.g.
#        GPU_CHECK_BUDGET_S=570 GPU_CHECK_TESTS="tests/train/test_layouts_cli.py \
#          tests/train/parallel/test_wgrad.py tests/train/parallel/test_ddp_single.py; \
#          tests/train/test_gloo_one_gpu.py" scripts/gpu-check.sh --tests-first --rows train_bench
#   3. unless --bench-only: the gpu-marked tests (kernels on the device, the fused loss, one-GPU
#      cli.py train runs against the CPU, every layout on NCCL when 2+ GPUs are visible), then the
#      kernels test directory on the device (only when GPU_CHECK_TESTS is unset), each on GPU_TEST_WORKERS pytest-xdist workers
#      (default 4: most are cli.py runs of tiny models, bound by process start and compilation;
#      GPU_CHECK_TESTS narrows the first run to some paths); each stops at the budget's end
#      with SIGINT, so pytest still names the tests that failed before it, and says so (the kill
#      comes only KILL_AFTER_S, default 60, after the SIGINT: pytest prints its summary first).
# Without CUDA it prints one line and does nothing. Output also goes to gpu-check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
bench_only=0
tests_first=0
rows=""
while [ $# -gt 0 ]; do
    case "$1" in
        --bench-only) bench_only=1 ;;
        --tests-first) tests_first=1 ;;
        --rows) [ $# -ge 2 ] || { echo "gpu-check: --rows needs bench names, e.g. --rows moe_bench" >&2; exit 2; }
                rows=${2//,/ }; shift ;;
        *) echo "gpu-check: unknown argument $1 (--bench-only, --tests-first, --rows NAME[,NAME...])" >&2; exit 2 ;;
    esac
    shift
done
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
budget=${GPU_CHECK_BUDGET_S:-480}
left() { echo $((budget - SECONDS)); }
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$gpus" = 0 ]; then
    echo "gpu-check: no CUDA device visible to torch on this machine; nothing checked (run it where nvidia-smi lists a GPU)"
    exit 0
fi
exec > >(tee gpu-check.log) 2>&1
echo "gpu-check: $gpus CUDA device(s): $("$PY" -c "import torch; print(', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))")"
echo "== 0. dependencies"
if "$PY" -c "import tokenloom._native, pytest, torchao, yaml, click" 2>/dev/null; then
    echo "installed already"
else
    WHEELS=${WHEELS:-.whl}
    if [ -d "$WHEELS" ]; then
        target=${WHEELS_TARGET:-/tmp/tokenloom-site}
        "$PY" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile --upgrade \
            --target "$target" "$WHEELS"/*.whl
        export PYTHONPATH="$PWD:$target${PYTHONPATH:+:$PYTHONPATH}"
        "$PY" setup.py -q build_ext --inplace
    else
        "$PY" -m pip install --disable-pip-version-check -q -e ".[dev,fp8]"
    fi
fi
run_within_budget() {  # name, reserve_s, command...: the command, cut off reserve_s before the budget ends
    local name=$1 reserve=$2; shift 2
    local limit=$(( $(left) - reserve ))
    if [ "$limit" -lt 30 ]; then
        echo "gpu-check: $name skipped: the ${budget} s budget is spent (GPU_CHECK_BUDGET_S raises it)"
        return 0
    fi
    local rc=0
    # SIGINT first: pytest then prints the summary of what failed so far before it stops
    timeout -s INT -k "${KILL_AFTER_S:-60}" "$limit" "$@" || rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then  # timeout's: the budget ended (137: SIGINT was not enough)
        echo "gpu-check: $name stopped at the ${budget} s budget (GPU_CHECK_BUDGET_S raises it); any FAILED above failed before it"
    elif [ "$rc" != 0 ]; then
        echo "gpu-check: $name failed (exit status $rc)"
        failed=1
    fi
}
failed=0
bench_rows() {
    echo "== 1. bench rows (bench/RESULTS.md's GPU block), $(left) s of the budget left"
    # shellcheck disable=SC2086  # $rows: one word per bench name
    run_within_budget "bench rows" 0 "$PY" bench/run_all.py --gpu ${rows:+--only $rows}
    sed -n '/<!-- gpu-rows -->/,/<!-- \/gpu-rows -->/p' bench/RESULTS.md
}
profile() {
    if [ -z "$rows" ] || [[ " $rows " == *" train_bench "* ]]; then
        echo "== 2. profile of our step (gpu-check-profile.txt), $(left) s of the budget left"
        "$PY" bench/profile_step.py > gpu-check-profile.txt 2>&1 || echo "gpu-check: the profile failed (see gpu-check-profile.txt)"
        tail -n 60 gpu-check-profile.txt
    fi
}
gpu_tests() {  # reserve_s: left for what follows
    local reserve=$1
    echo "== 3. gpu-marked tests, then the kernels on the device, $(left) s of the budget left"
    # GPU_CHECK_TESTS: the test paths for the gpu-marked run (default tests: all of them), e.g. the
    # files an issue's GPU items live in, so they are not the ones the budget cuts off; groups
    # separated by ";" run one after another
    workers=(-n "${GPU_TEST_WORKERS:-4}" --durations=10 --tb=short -rfEs)
    local group
    IFS=';' read -r -a groups <<< "${GPU_CHECK_TESTS:-tests}"
    for group in "${groups[@]}"; do
        # shellcheck disable=SC2086  # one word per path
        run_within_budget "gpu-marked tests ($group)" "$reserve" "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" -m gpu $group
    done
    if [ -z "${GPU_CHECK_TESTS:-}" ]; then
        run_within_budget "kernels tests" "$reserve" "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" tests/train/kernels
    fi
}
if [ "$tests_first" = 1 ]; then
    [ "$bench_only" = 1 ] || gpu_tests "${BENCH_RESERVE_S:-150}"
    bench_rows
else
    bench_rows
    profile
    if [ "$bench_only" = 1 ]; then
        echo "gpu-check: done, bench only (log: gpu-check.log)"
        exit 0
    fi
    gpu_tests 0
fi
echo "gpu-check: done (log: gpu-check.log)"
exit "$failed"
