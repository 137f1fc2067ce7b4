#!/usr/bin/env bash
# The CUDA checks, for a host with at least one NVIDIA GPU (`make gpu-check`): the engine, model, TP, PP (NCCL; 2+ GPUs) and
# parity tests on CUDA, the Triton attention kernels compiled and in bfloat16 among them, CUDA graph capture, async scheduling (they pick CUDA by
# themselves when it is present; TP tests skip when there are fewer GPUs than they need), then the GPU
# table (benchmarks/bench_gpu.py) and an eager decode benchmark. Exits non-zero, with a message, when torch sees no CUDA device.
#
#   scripts/gpu-check.sh [extra pytest args]        PYTHON=/path/to/python to use another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

if ! "$PY" - <<'PY'
import sys

import torch

if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
    print(f"gpu-check: no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
          "run this on a GPU host with a CUDA build of torch", file=sys.stderr)
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(i)
    print(f"gpu-check: cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB")
PY
then
    exit 1
fi

echo "gpu-check: tests on CUDA"
"$PY" -m pytest -q -x -rs tests/test_cuda_path.py tests/test_triton_attention.py tests/test_triton_ops.py tests/test_cuda_graphs.py tests/test_async_scheduling.py tests/test_engine_core.py tests/test_engine_models.py \
    tests/test_tiny_model.py tests/test_tensor_parallel.py tests/test_dp_tp.py tests/test_pipeline_parallel.py \
    tests/test_worker_hosts.py "$@"

echo "gpu-check: the GPU table (benchmarks/bench_gpu.py: 1B-shaped model; BENCH_GPU_ARGS adds options)"
"$PY" benchmarks/bench_gpu.py ${BENCH_GPU_ARGS:-}
echo "gpu-check: decode benchmark (default tiny model) without CUDA graphs, for the graphs' share"
"$PY" benchmarks/bench_offline.py --device cuda --num-prompts 32 --input-len 128 --output-len 64 --skip-transformers \
    --enforce-eager
echo "gpu-check: OK"
