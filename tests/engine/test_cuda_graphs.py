"""--cuda-graphs: decode replayed from CUDA graphs gives eager decode's greedy ids (GPU only), and on a CPU the
flag resolves to off (auto) or is refused (on)."""
from __future__ import annotations

import pytest
import torch

from rawserve.config import EngineConfig
from rawserve.engine.cuda_graphs import batch_sizes
from rawserve.engine.model_runner import resolve_cuda_graphs
from rawserve.engine.types import SamplingParams



def test_ladder_ends_at_max_num_seqs():
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_sizes(1000)[-1] == 512


def test_auto_is_off_on_a_cpu_and_on_is_refused():
    cpu = torch.device("cpu")
    assert resolve_cuda_graphs(EngineConfig(attention_backend="triton"), cpu) is False
    assert resolve_cuda_graphs(EngineConfig(cuda_graphs="off", attention_backend="triton"), cpu) is False
    with pytest.raises(ValueError, match="--cuda-graphs: on needs a CUDA device"):
        resolve_cuda_graphs(EngineConfig(cuda_graphs="on", attention_backend="triton"), cpu)
    assert resolve_cuda_graphs(EngineConfig(), torch.device("cuda")) is False  # auto, torch backend: off


def test_on_with_device_auto_and_no_gpu_is_refused_before_loading(tiny_qwen3_dir):
    from rawserve.engine.model_runner import ModelRunner

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    config = EngineConfig(model_dir=str(tiny_qwen3_dir), cuda_graphs="on", attention_backend="triton",
                          num_kv_blocks=8)
    with pytest.raises(ValueError, match="--cuda-graphs: on needs a CUDA device"):
        ModelRunner(config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_decode_gives_eager_greedy_ids(tiny_qwen3_dir):
    """float32: a graph splits long contexts by max_model_len and pads the batch, eager by the step's own
    lengths, so the two differ by rounding; in half precision that may flip a near tie of a random model."""
    from rawserve.engine.frontend.llm import LLM

    # 11 prompts at max_num_seqs 8: batches of 8, then 3 (replayed padded to 4), with prefills eager between
    prompts = [[5, 9, 17, 33, 2 + i] * (1 + i % 4) for i in range(11)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = {}
    for mode in ("off", "on"):
        llm = LLM(tiny_qwen3_dir, device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                  attention_backend="triton", cuda_graphs=mode)
        ids[mode] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        graphs = llm.core.runner.graphs
        if mode == "on":
            assert graphs is not None and graphs.sizes == [1, 2, 4, 8] and graphs.num_replays >= 20
        else:
            assert graphs is None
    assert ids["on"] == ids["off"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_captures_on_cuda_with_triton(tiny_qwen3_dir):
    from rawserve.engine.frontend.llm import LLM

    llm = LLM(tiny_qwen3_dir, device="cuda", num_kv_blocks=64, max_num_seqs=4, attention_backend="triton")
    assert llm.core.runner.graphs is not None and llm.core.runner.graphs.sizes == [1, 2, 4]
