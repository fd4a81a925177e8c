#!/usr/bin/env bash
# Run here, before bench/gpu_check.sh runs on a device machine (the session's `run` tool): what that machine lacks.
#
#   bench/device_prep.sh      # then run `bash bench/gpu_check.sh` there, carrying .whl
#
# - shared/fixtures/qwen3-tokenizer: the benches' Qwen3-shaped checkpoints take their tokenizer from the fixtures,
#   and only a shared/ inside the checkout travels there, not ../shared (git ignores shared/; bench.checkpoints reads
#   it first where it is).
# - .whl/: wheels of what its image lacks (it has torch, triton, tokenizers, jinja2, safetensors, h11 and pytest):
#   orjson (rawserve's HTTP side), and jsonschema with its needs (the guided GPU test validates its outputs with it,
#   and skips without). gpu_check.sh installs them there when .whl is carried. The image's Python is 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."

fixtures="${RAWSERVE_TEST_FIXTURES:-../shared/fixtures}"
mkdir -p shared/fixtures
cp -r "$fixtures/qwen3-tokenizer" shared/fixtures/
py=${PYTHON:-python3}
rm -rf .whl
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  orjson jsonschema referencing rpds-py jsonschema-specifications attrs
du -sh shared .whl >&2
