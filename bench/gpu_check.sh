#!/usr/bin/env bash
# The GPU path, end to end, on one device (under 5 minutes on an H200): the GPU-marked tests and the triton kernel
# cases (compiled, on CUDA tensors), nano-vllm's 256-sequence throughput on the Qwen3-0.6B shape in bf16,
# batch-1 decode against the 4.3 TB/s roofline, and eager vs graphed decode at batch 1 and 64.
#
#   bench/gpu_check.sh                 # on a GPU
#   bench/gpu_check.sh --device cpu    # small sizes on a CPU: the demo model, triton through its interpreter,
#                                      # so a first GPU run is not the script's first run
# JSON lines from the benches on stdout; test and log output on stderr. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."

device=cuda
if [[ "${1:-}" == "--device" ]]; then
  device="${2:?--device needs cuda or cpu}"
fi
py=${PYTHON:-python3}
step() { echo "== $* ($(date -u +%H:%M:%S))" >&2; }

if [[ "$device" == "cuda" ]]; then
  $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA device')"
  step "GPU-marked tests"
  $py -m pytest -q -p no:cacheprovider -m gpu tests >&2
  step "Qwen3-0.6B-shaped checkpoint, bf16"
  $py -m bench.checkpoints --dtype bfloat16 >&2
  step "256 sequences, random input and output lengths in [100, 1024] (nano-vllm's benchmark)"
  $py -m bench.engine --model qwen3-0.6b --dtype bfloat16 --attention-backend triton --cuda-graphs auto \
    --random-lens 100,1024 --num-requests 256 --max-num-batched-tokens 16384
  step "decode: batch-1 roofline, eager vs graphed at batch 1 and 64"
  $py -m bench.decode --model qwen3-0.6b --dtype bfloat16 --attention-backend triton --batches 1,64 --context 512
  # last: compiling every kernel variant the cases cover is the slowest part of a first run
  step "triton kernel and engine cases, compiled, on CUDA tensors"
  $py -m pytest -q -p no:cacheprovider tests/engine/test_triton_attention.py >&2
else
  # triton kernels run on CPU tensors only through the interpreter, which must be on before triton is imported.
  export TRITON_INTERPRET=1
  step "GPU-marked tests (they skip without a device)"
  $py -m pytest -q -p no:cacheprovider -m gpu tests >&2 || [[ $? == 5 ]]  # 5: everything deselected/skipped
  step "demo model, 16 sequences, random lengths in [8, 32], triton (interpreted)"
  $py -m bench.engine --model demo --device cpu --dtype float32 --attention-backend triton --cuda-graphs auto \
    --random-lens 8,32 --num-requests 16 --max-num-batched-tokens 256
  step "decode: demo model at batch 1 and 4, eager only (graphs need CUDA)"
  $py -m bench.decode --model demo --device cpu --dtype float32 --attention-backend triton --batches 1,4 \
    --context 64 --reps 3
fi
step "done"
