#!/usr/bin/env bash
# The GPU path, end to end, on one device (under 5 minutes on an H200): the GPU-marked tests and the triton kernel
# cases (compiled, on CUDA tensors), nano-vllm's 256-sequence throughput on the Qwen3-0.6B shape in bf16,
# batch-1 decode against the 4.3 TB/s roofline, eager vs graphed decode at batch 1 and 64, and guided decoding's cold
# path (batch 32 with a new schema per row, and an unconstrained stream's ITL beside 8 such streams: issue 34's
# targets, which a 2-CPU box cannot judge).
#
#   bench/gpu_check.sh                 # on a GPU
#   bench/gpu_check.sh --device cpu    # small sizes on a CPU: the demo model, triton through its interpreter,
#                                      # so a first GPU run is not the script's first run
# On a lent device machine: bench/device_prep.sh here first (the tokenizer fixture and wheels it lacks), then
# `bash bench/gpu_check.sh` there with .whl carried. Only the test files that hold GPU-marked tests are collected:
# the rest import test extras (openai, anthropic, ...) that machine does not have.
# JSON lines from the benches on stdout; test and log output on stderr. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."

device=cuda
if [[ "${1:-}" == "--device" ]]; then
  device="${2:?--device needs cuda or cpu}"
fi
py=${PYTHON:-python3}
step() { echo "== $* ($(date -u +%H:%M:%S))" >&2; }

# the files that hold GPU-marked tests
gpu_tests=$(grep -rl --include='test_*.py' "mark.gpu" tests | sort)

if [[ "$device" == "cuda" ]]; then
  $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA device')"
  if compgen -G ".whl/*.whl" >/dev/null; then  # carried from bench/device_prep.sh
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  step "GPU-marked tests"
  $py -m pytest -q -p no:cacheprovider -m gpu $gpu_tests >&2
  step "Qwen3-0.6B-shaped checkpoint, bf16"
  $py -m bench.checkpoints --dtype bfloat16 >&2
  step "256 sequences, random input and output lengths in [100, 1024] (nano-vllm's benchmark)"
  $py -m bench.engine --model qwen3-0.6b --dtype bfloat16 --attention-backend triton --cuda-graphs auto \
    --random-lens 100,1024 --num-requests 256 --max-num-batched-tokens 16384
  step "decode: batch-1 roofline, eager vs graphed at batch 1 and 64"
  $py -m bench.decode --model qwen3-0.6b --dtype bfloat16 --attention-backend triton --batches 1,64 --context 512
  step "guided decoding's cold path (issue 34): batch 32 with 32 new schemas, an unconstrained stream's ITL beside 8"
  $py -m bench.guided --only-ours --skip-decode --cases get_weather --shape tiny --cold-decode --cold-shapes 0.6b \
    --device cuda
  step "the same with the mask helper not yielding to the step's host code (the A/B of GuidedRegistry.YIELD_TO_STEP)"
  $py -m bench.guided --only-ours --skip-decode --cases get_weather --shape tiny --cold-decode --cold-shapes 0.6b \
    --device cuda --helper-yields off --cold-decode-pairs 1
  # last: compiling every kernel variant the cases cover is the slowest part of a first run
  step "triton kernel and engine cases, compiled, on CUDA tensors"
  $py -m pytest -q -p no:cacheprovider tests/engine/test_triton_attention.py >&2
else
  # triton kernels run on CPU tensors only through the interpreter, which must be on before triton is imported.
  export TRITON_INTERPRET=1
  step "GPU-marked tests (they skip without a device)"
  $py -m pytest -q -p no:cacheprovider -m gpu $gpu_tests >&2 || [[ $? == 5 ]]  # 5: everything deselected/skipped
  step "demo model, 16 sequences, random lengths in [8, 32], triton (interpreted)"
  $py -m bench.engine --model demo --device cpu --dtype float32 --attention-backend triton --cuda-graphs auto \
    --random-lens 8,32 --num-requests 16 --max-num-batched-tokens 256
  step "decode: demo model at batch 1 and 4, eager only (graphs need CUDA)"
  $py -m bench.decode --model demo --device cpu --dtype float32 --attention-backend triton --batches 1,4 \
    --context 64 --reps 3
  step "guided cold path: tiny shape, batch 9 (a stream beside 8), triton (interpreted)"
  $py -m bench.guided --only-ours --skip-decode --cases get_weather --shape tiny --cold-decode --cold-shapes tiny \
    --device cpu --attention-backend triton --batch 9 --cold-decode-tokens 8 --cold-itl-tokens 16 --cold-decode-pairs 1
fi
step "done"
