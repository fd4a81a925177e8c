"""--kv-cache-dtype: the pool is stored in the chosen dtype and planned by its bytes; a float32 model's outputs with
half-precision or fp8 storage stay near the float32 cache's; prefix-cache hits and chunked prefill still give a
cold run's ids; the flag validates; the triton kernels cast on write and on read (under TRITON_INTERPRET=1:
tests/engine/triton/kv_dtype_cases.py).
"""
from __future__ import annotations

import pytest
import torch

from rawserve.config import EngineConfig, build_parser
from rawserve.engine.step_plan import ForwardBatch, StepInput
from rawserve.engine.types import SamplingParams

STORED = {"auto": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Largest |logit - float32 cache's logit| on the tiny random model (logits within +-0.7) over a chunked prompt.
# Measured: bf16 1.2e-3, fp16 1.8e-4, fp8_e4m3 1.7e-2, fp8_e5m2 3.4e-2.
LOGIT_TOL = {"bfloat16": 5e-3, "float16": 1e-3, "fp8_e4m3": 0.08, "fp8_e5m2": 0.12}


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def make_runner(model_dir, kv: str, **options):
    from rawserve.engine.model_runner import ModelRunner

    options = {"device": "cpu", "dtype": "float32", "block_size": 16, "num_kv_blocks": 16, **options}
    return ModelRunner(EngineConfig(model_dir=str(model_dir), kv_cache_dtype=kv, **options))


def chunked_logits(runner, ids: list[int], table: list[int]) -> torch.Tensor:
    """Every token's logits: the prompt in two chunks (the second reads the first from the cache), then a decode."""
    rows = [runner.execute(ForwardBatch([StepInput(ids[:30], 0, table)], list(range(30))))]
    rows.append(runner.execute(ForwardBatch([StepInput(ids[30:-1], 30, table)], list(range(len(ids) - 31)))))
    rows.append(runner.execute(ForwardBatch([StepInput(ids[-1:], len(ids) - 1, table)], [0])))
    return torch.cat(rows)


@pytest.mark.parametrize("kv", list(STORED))
def test_pool_is_stored_in_the_kv_dtype_and_planned_by_its_bytes(tiny_qwen3_dir, kv):
    # 2 layers x 16 slots x 2 KV heads x head_dim 32, K and V
    runner = make_runner(tiny_qwen3_dir, kv, num_kv_blocks=None, kv_cache_memory_gb=1 / 1024, max_model_len=512)
    dtype = STORED[kv]
    assert all(k.dtype == dtype and v.dtype == dtype for k, v in runner.kv_caches)
    assert runner.kv_caches[0][0].element_size() == dtype.itemsize
    block_bytes = 2 * 2 * 16 * 2 * 32 * dtype.itemsize
    assert runner.block_bytes == block_bytes
    assert runner.num_blocks == (1 << 20) // block_bytes  # a 1 MiB budget holds twice the blocks at half the bytes
    assert runner.kv_plan.num_bytes == runner.num_blocks * block_bytes
    assert runner.kv_dtype_name == ("float32" if kv == "auto" else kv)


@pytest.mark.parametrize("kv", list(LOGIT_TOL))
def test_outputs_with_narrower_storage_stay_near_the_float32_caches(tiny_qwen3_dir, kv):
    ids, table = prompt(46, 5), [7, 2, 11]
    reference = chunked_logits(make_runner(tiny_qwen3_dir, "auto"), ids, table)
    runner = make_runner(tiny_qwen3_dir, kv)
    logits = chunked_logits(runner, ids, table)
    diff = (logits - reference).abs().max().item()
    assert 0 < diff <= LOGIT_TOL[kv], diff  # not 0: the cache really rounds what attention reads
    # what the pool holds is this step's K rounded to the storage dtype, not the float32 values
    assert torch.equal(runner.kv_caches[0][0][7].to(torch.float32).to(STORED[kv]).view(torch.uint8),
                       runner.kv_caches[0][0][7].view(torch.uint8))


def test_fp8_saturates_rather_than_overflowing():
    from rawserve.engine.attention import torch_backend

    k = torch.tensor([[[1000.0, -1000.0, 3.0]]])
    for dtype, top in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        cache = torch.zeros((1, 2, 1, 3), dtype=dtype)
        torch_backend.write_kv(k * 100, k, cache, cache.clone(), torch.tensor([1]))
        assert cache[0, 1, 0].float().tolist() == [top, -top, 320.0 if dtype == torch.float8_e5m2 else 288.0]


@pytest.mark.parametrize("kv", list(STORED))
def test_prefix_hit_and_chunked_prefill_give_a_cold_runs_ids(tiny_qwen3_dir, kv):
    from rawserve.engine.frontend.llm import LLM

    shared = prompt(35, 0)  # two full blocks and a bit: the second call's prompt hits two cached blocks
    later = shared + prompt(6, 4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    options = {"device": "cpu", "dtype": "float32", "block_size": 16, "num_kv_blocks": 48, "kv_cache_dtype": kv}
    cold = LLM(tiny_qwen3_dir, enable_prefix_caching=False, **options)
    expected = [r.outputs[0].token_ids for r in cold.generate([later, prompt(57, 1)], params)]
    warm = LLM(tiny_qwen3_dir, max_num_batched_tokens=24, **options)  # 41- and 57-token prompts in chunks
    warm.generate([shared, prompt(3, 2)], params)
    hits_before = warm.core.stats().prefix_cache_hits
    got = [r.outputs[0].token_ids for r in warm.generate([later, prompt(57, 1)], params)]
    assert warm.core.stats().prefix_cache_hits - hits_before >= 32, "the second call must hit the cache"
    assert got == expected


def test_the_flag_validates_and_takes_vllms_fp8_alias():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="--kv-cache-dtype: must be one of auto|bfloat16"):
        EngineConfig(kv_cache_dtype="fp4")
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])


def test_startup_summary_names_the_kv_dtype(tiny_qwen3_dir):
    from rawserve.api.status_log import startup_summary
    from rawserve.config import ServerConfig
    from rawserve.engine.core_summary import describe_core

    class Core:  # describe_core reads a core's runner and block size, nothing else
        block_size = 16
        runner = make_runner(tiny_qwen3_dir, "fp8")

    info = {**describe_core(Core()), "num_blocks": 16}
    assert info["kv_cache_dtype"] == "fp8_e4m3"
    line = startup_summary(EngineConfig(model_dir=str(tiny_qwen3_dir)), ServerConfig(), "m", info, 8000)
    assert "KV cache 256 tokens (16 blocks of 16, 0.1 MiB, fp8_e4m3)" in line


@pytest.mark.triton_cases("kv_dtype_cases.py")
def test_triton_kernels_cast_on_write_and_read(triton_case_result):
    """tests/engine/triton/kv_dtype_cases.py, under TRITON_INTERPRET=1 in a subprocess (tests/conftest.py)."""
    assert triton_case_result.passed and not triton_case_result.problems, "\n".join(triton_case_result.problems)
