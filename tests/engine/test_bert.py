"""The pooling path in the engine core: BERT-family encoders (models/bert.py) against transformers, token types of
a sentence pair, whole-sequence scheduling, and a decoder's mean pooling summed across prefill chunks."""
from __future__ import annotations

import pytest

from rawserve.config import EngineConfig
from rawserve.engine.types import PoolingParams, SamplingParams
from rawserve.text.tokenizer import Tokenizer
from tests.embedding_checkpoints import make_bge_small, make_qwen3_embedding, wordpiece_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "what is the capital of china?"]


def run(core, prompts: list[list[int]], pooling: list[PoolingParams]) -> list[list[float]]:
    """Each prompt as a pooling request, stepped to the end -> their vectors."""
    for i, (ids, params) in enumerate(zip(prompts, pooling)):
        core.add_request(f"r{i}", ids, SamplingParams(max_tokens=0, pooling=params))
    vectors = {}
    while core.has_unfinished:
        for out in core.step():
            assert out.finished and out.finish_reason == "length"
            vectors[out.request_id] = out.pooled
    return [vectors[f"r{i}"] for i in range(len(prompts))]


def make_core(model_dir, **engine):
    from rawserve.engine.core import EngineCore

    return EngineCore(EngineConfig(model_dir=str(model_dir), device="cpu", dtype="float32", **engine))


@pytest.fixture(scope="module")
def bge_dir(tmp_path_factory):
    return make_bge_small(tmp_path_factory.mktemp("bge"))


def test_bert_mean_pooling_equals_transformers_hidden_states(bge_dir):
    tok = Tokenizer.from_dir(bge_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    core = make_core(bge_dir, pooling="mean")
    assert core.pooling.method == "mean" and core.pooling.is_encoder
    got = run(core, prompts, [PoolingParams("mean")] * len(prompts))
    model = transformers.BertModel.from_pretrained(bge_dir).eval()
    for ids, vector in zip(prompts, got):
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        assert torch.allclose(torch.tensor(vector), hidden.mean(0), atol=1e-5)


def test_bert_cross_encoder_uses_the_pairs_token_types(tmp_path):
    directory = tmp_path / "bert-ce"
    directory.mkdir()
    vocab_size = wordpiece_tokenizer(directory)
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=128, num_labels=1)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():  # token types that matter: type 1's row far from type 0's
        model.bert.embeddings.token_type_embeddings.weight[1].add_(1.0)
        model.classifier.weight.mul_(50.0)  # the head's 0.02-scale init would squash every difference
    model.save_pretrained(directory, safe_serialization=True)
    tok = Tokenizer.from_dir(directory)
    pairs = [("what is the capital of china", "beijing"), ("hello", "the lazy dog jumps")]
    encoded = [tok.encode_pair(q, d) for q, d in pairs]
    core = make_core(directory)
    assert core.pooling.task == "rerank" and core.runner.pooled_size == 1
    got = run(core, [ids for ids, _ in encoded],
                 [PoolingParams("cls", type_split=types.index(1)) for _, types in encoded])
    for (ids, types), vector in zip(encoded, got):
        with torch.no_grad():
            logit = model(torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0, 0]
        assert vector == pytest.approx([logit.item()], abs=1e-5)
    # all type 0 gives another score: the types were used
    other = run(core, [encoded[0][0]], [PoolingParams("cls")])
    assert abs(other[0][0] - got[0][0]) > 1e-4


def test_encoder_requests_run_whole_and_an_oversized_one_is_refused(bge_dir):
    tok = Tokenizer.from_dir(bge_dir)
    ids = tok.encode(TEXTS[1])  # 11 tokens
    core = make_core(bge_dir, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="one step"):
        core.add_request("long", ids * 2, SamplingParams(max_tokens=0, pooling=PoolingParams("cls")))
    with pytest.raises(ValueError, match="only pools"):
        core.add_request("gen", ids, SamplingParams(max_tokens=4))
    for i in range(3):
        core.add_request(f"r{i}", ids, SamplingParams(max_tokens=0, pooling=PoolingParams("cls", normalize=True)))
    per_step, outputs = [], []
    while core.has_unfinished:
        step = core.step()
        per_step.append(len(step))
        outputs += step
    assert per_step == [1, 1, 1]  # 11 + 11 > 16: one whole request a step, never a split
    assert all(out.pooled == pytest.approx(outputs[0].pooled) for out in outputs)
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


def test_decoder_mean_pooling_sums_across_prefill_chunks(tmp_path):
    model_dir = make_qwen3_embedding(tmp_path / "qwen3", pooling="mean")
    tok = Tokenizer.from_dir(model_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    chunked = make_core(model_dir, max_num_batched_tokens=4)
    assert chunked.pooling.method == "mean"
    got = run(chunked, prompts, [PoolingParams("mean", normalize=False)] * len(prompts))
    model = transformers.Qwen3Model.from_pretrained(model_dir).eval()
    for ids, vector in zip(prompts, got):
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        assert torch.allclose(torch.tensor(vector), hidden.mean(0), atol=1e-5)


def test_qwen3_embedding_tensors_without_the_model_prefix_load(tmp_path):
    from safetensors import safe_open

    model_dir = make_qwen3_embedding(tmp_path / "qwen3")
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" in f.keys()  # saved from the bare model, as Qwen3-Embedding's are
    core = make_core(model_dir)
    assert core.pooling.task == "embed" and core.pooling.method == "last" and core.pooling.normalize
