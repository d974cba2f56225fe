#!/usr/bin/env bash
# GPU acceptance check (issue 15). On a machine with CUDA it runs, in order:
#   1. the gpu-marked tests (Triton kernels compiled on the device against their
#      references, the fused loss, the kernel selector, flex document attention; one-GPU
#      cli.py train runs (compile, document masking, a one-rank NCCL ZeRO-1 launch) against
#      the same run on the CPU; every layout through cli.py on NCCL when 2 or more GPUs are
#      visible, 4-rank layouts when 4 are);
#   2. the whole kernels test directory on the device (references vs compiled/Triton);
#   3. a bf16 run of a ~1B-parameter GPT against the plain eager loop, writing the GPU
#      rows (tokens/s, MFU) of bench/RESULTS.md (bench/run_all.py --gpu).
# Without CUDA it prints one line and does nothing. Output also goes to gpu-check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$gpus" = 0 ]; then
    echo "gpu-check: no CUDA device visible to torch on this machine; nothing checked (run it where nvidia-smi lists a GPU)"
    exit 0
fi
exec > >(tee gpu-check.log) 2>&1
echo "gpu-check: $gpus CUDA device(s): $("$PY" -c "import torch; print(', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))")"
echo "== 1. gpu-marked tests"
"$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests
echo "== 2. kernels on the device"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/train/kernels
echo "== 3. bf16 ~1B GPT: GPU rows of bench/RESULTS.md"
"$PY" bench/run_all.py --gpu
sed -n '/<!-- gpu-rows -->/,/<!-- \/gpu-rows -->/p' bench/RESULTS.md
echo "gpu-check: done (log: gpu-check.log)"
