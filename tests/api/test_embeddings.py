"""/v1/embeddings and /v1/rerank against live servers on tiny random checkpoints shaped as the published ones, checked
against the references: sentence-transformers' encode (Qwen3-Embedding: last-token pooling over a chunked prefill,
in a spawned core; bge-small: a BERT encoder with CLS pooling), transformers' cross-encoder (bge-reranker) and
Qwen3-Reranker's yes/no formula. Requests go through the openai SDK where it has the call; bad ones get 400s.
"""
from __future__ import annotations

import array
import base64
import json
import math
import urllib.error
import urllib.request

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread
from tests.embedding_checkpoints import make_bge_reranker, make_bge_small, make_qwen3_embedding, make_qwen3_reranker

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
sentence_transformers = pytest.importorskip("sentence_transformers")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog and the lazy dog jumps over the fox",
         "what is the capital of china?", "gravity is a force that attracts two bodies"]
TOL = 1e-5


def post(server: ServerThread, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.base + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(server: ServerThread, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(server.base + path, timeout=60) as response:
        return response.status, response.read().decode()


def client(server: ServerThread):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def serve(model_dir, engine: dict | None = None, server: dict | None = None) -> ServerThread:
    return ServerThread(EngineConfig(model_dir=str(model_dir), device="cpu", dtype="float32", **(engine or {})),
                        ServerConfig(port=0, served_model_name="m", **{"engine_mode": "thread", **(server or {})}))


def reference(model_dir, texts: list[str]) -> torch.Tensor:
    model = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


def as_tensor(response) -> torch.Tensor:
    """The vectors in index order; a base64 one (asked for explicitly, the SDK hands it over as is) decoded."""
    return torch.tensor([array.array("f", base64.b64decode(item.embedding)).tolist()
                         if isinstance(item.embedding, str) else item.embedding
                         for item in sorted(response.data, key=lambda d: d.index)])


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, large_vocab_tokenizer_dir):
    return make_qwen3_embedding(tmp_path_factory.mktemp("qwen3-embedding"), tokenizer_dir=large_vocab_tokenizer_dir)


@pytest.fixture(scope="module")
def qwen3_server(qwen3_dir):
    # A spawned core (the vectors cross the process boundary), and a step budget of 8 tokens, so the longer texts
    # are prefilled in chunks and pooled from their last one.
    srv = serve(qwen3_dir, {"max_num_batched_tokens": 8}, {"engine_mode": "process"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_dir):
    return reference(qwen3_dir, TEXTS)


def test_qwen3_embedding_single_and_batched_equal_sentence_transformers(qwen3_server, qwen3_reference):
    api = client(qwen3_server)
    single = api.embeddings.create(model="m", input=TEXTS[1])
    assert single.object == "list" and single.model == "m" and single.data[0].index == 0
    assert torch.allclose(as_tensor(single)[0], qwen3_reference[1], atol=TOL)
    batched = api.embeddings.create(model="m", input=TEXTS)
    got = as_tensor(batched)
    assert got.shape == qwen3_reference.shape
    assert (got - qwen3_reference).abs().max().item() < TOL
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=TOL)  # the checkpoint's Normalize module
    tokenizer = qwen3_server.app.tokenizer
    assert batched.usage.prompt_tokens == batched.usage.total_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)


def test_qwen3_dimensions_truncate_then_renormalise(qwen3_server, qwen3_reference):
    got = as_tensor(client(qwen3_server).embeddings.create(model="m", input=TEXTS, dimensions=16))
    want = torch.nn.functional.normalize(qwen3_reference[:, :16], dim=1)
    assert got.shape == (len(TEXTS), 16)
    assert (got - want).abs().max().item() < TOL


def test_qwen3_base64_is_little_endian_float32(qwen3_server, qwen3_reference):
    status, body = post(qwen3_server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"})
    assert status == 200
    for item in body["data"]:
        values = array.array("f", base64.b64decode(item["embedding"]))
        assert torch.allclose(torch.tensor(values.tolist()), qwen3_reference[item["index"]], atol=TOL)
    # through the SDK, asked for explicitly
    sdk = as_tensor(client(qwen3_server).embeddings.create(model="m", input=TEXTS, encoding_format="base64"))
    assert (sdk - qwen3_reference).abs().max().item() < TOL


def test_token_id_inputs_equal_their_text(qwen3_server, qwen3_reference):
    ids = [qwen3_server.app.tokenizer.encode(t) for t in TEXTS[:2]]
    api = client(qwen3_server)
    assert torch.allclose(as_tensor(api.embeddings.create(model="m", input=ids[0]))[0], qwen3_reference[0], atol=TOL)
    got = as_tensor(api.embeddings.create(model="m", input=ids))
    assert (got - qwen3_reference[:2]).abs().max().item() < TOL


def test_over_context_is_a_400_unless_truncation_is_asked(qwen3_server):
    long_ids = [9707] * 2100  # past the 2,048-token context
    status, body = post(qwen3_server, "/v1/embeddings", {"input": long_ids})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body = post(qwen3_server, "/v1/embeddings", {"input": "hello " * 3000})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, cut = post(qwen3_server, "/v1/embeddings", {"input": long_ids, "truncate_prompt_tokens": 5})
    assert status == 200 and cut["usage"]["prompt_tokens"] == 5
    status, tail = post(qwen3_server, "/v1/embeddings", {"input": long_ids[-5:]})
    assert cut["data"][0]["embedding"] == pytest.approx(tail["data"][0]["embedding"], abs=TOL)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 65}, "dimensions"),  # the model has 64
    ({"input": [10 ** 9]}, "input"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({}, "input"),
])
def test_bad_embedding_requests_get_openai_shaped_400s(qwen3_server, body, param):
    status, answer = post(qwen3_server, "/v1/embeddings", body)
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param


def test_an_embedding_model_refuses_generation_and_says_what_it_is(qwen3_server):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        status, answer = post(qwen3_server, path, body)
        assert status == 400 and answer["error"]["code"] == "unsupported_task", (path, answer)
    status, models = get(qwen3_server, "/v1/models")
    assert json.loads(models)["data"][0]["task"] == "embed"
    status, metrics = get(qwen3_server, "/metrics")
    assert 'rawserve:pooling_requests_total{model_name="m",task="embed"}' in metrics
    assert 'pooling_requests_total{model_name="m",task="embed"} 0' not in metrics  # earlier tests' requests


def test_bge_small_encoder_embeddings_equal_sentence_transformers(tmp_path):
    model_dir = make_bge_small(tmp_path / "bge")
    want = reference(model_dir, TEXTS)
    srv = serve(model_dir)
    try:
        api = client(srv)
        got = as_tensor(api.embeddings.create(model="m", input=TEXTS))
        assert (got - want).abs().max().item() < TOL
        one = as_tensor(api.embeddings.create(model="m", input=TEXTS[2]))[0]
        assert (one - want[2]).abs().max().item() < TOL
        cut = as_tensor(api.embeddings.create(model="m", input=TEXTS, dimensions=10, encoding_format="base64"))
        assert (cut - torch.nn.functional.normalize(want[:, :10], dim=1)).abs().max().item() < TOL
        status, answer = post(srv, "/v1/embeddings", {"input": [5] * 600})  # over the 512 positions
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    finally:
        srv.stop()


def test_bge_reranker_scores_equal_the_cross_encoder(tmp_path):
    model_dir = make_bge_reranker(tmp_path / "reranker")
    query = "what is the capital of china"
    docs = ["beijing is the capital of china", "paris france", "the lazy dog", "a city on a river"]
    cross = sentence_transformers.CrossEncoder(str(model_dir), device="cpu")
    want = [float(s) for s in cross.predict([(query, d) for d in docs])]
    # the same, by hand from transformers: sigmoid of the one logit
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(**tok([query] * len(docs), docs, padding=True, return_tensors="pt")).logits[:, 0]
    assert torch.allclose(torch.sigmoid(logits), torch.tensor(want), atol=1e-6)
    srv = serve(model_dir)
    try:
        status, body = post(srv, "/v1/rerank", {"model": "m", "query": query,
                                                "documents": [docs[0], {"text": docs[1]}, *docs[2:]]})
        assert status == 200, body
        scores = {r["index"]: r["relevance_score"] for r in body["results"]}
        assert [scores[i] for i in range(len(docs))] == pytest.approx(want, abs=TOL)
        assert [r["index"] for r in body["results"]] == sorted(range(len(docs)), key=lambda i: -want[i])
        assert body["results"][0]["document"] == {"text": docs[body["results"][0]["index"]]}
        status, top = post(srv, "/rerank", {"query": query, "documents": docs, "top_n": 2, "return_documents": False})
        assert status == 200 and [r["index"] for r in top["results"]] == [r["index"] for r in body["results"][:2]]
        assert all("document" not in r for r in top["results"]) and top["usage"]["total_tokens"] > 0
        for bad, param in (({"query": query, "documents": []}, "documents"),
                           ({"query": "", "documents": ["a"]}, "query"),
                           ({"query": query, "documents": [{"title": "x"}]}, "documents.0"),
                           ({"query": query, "documents": ["a"], "top_n": 0}, "top_n"),
                           ({"query": query, "documents": ["a"] * 2049}, "documents"),
                           ({"query": query, "documents": ["the " * 600]}, "documents.0")):
            status, answer = post(srv, "/v1/rerank", bad)
            assert status == 400 and answer["error"]["param"] == param, (bad, answer)
        status, answer = post(srv, "/v1/embeddings", {"input": "a"})
        assert status == 400 and answer["error"]["code"] == "unsupported_task"
        assert json.loads(get(srv, "/v1/models")[1])["data"][0]["task"] == "rerank"
    finally:
        srv.stop()


def test_qwen3_reranker_scores_are_its_yes_no_softmax(tmp_path, large_vocab_tokenizer_dir):
    import transformers

    from rawserve.engine.pooling import QWEN3_RERANK_INSTRUCTION, QWEN3_RERANK_PREFIX, QWEN3_RERANK_SUFFIX

    model_dir = make_qwen3_reranker(tmp_path / "qwen3-reranker", tokenizer_dir=large_vocab_tokenizer_dir)
    query = "What is the capital of China?"
    docs = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies.", "hello"]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    prefix = tok.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False)
    want = []
    for doc in docs:  # the model card's formula: log_softmax over (no, yes) at the last position, exp of yes
        body = tok.encode(f"<Instruct>: {QWEN3_RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}",
                          add_special_tokens=False)
        with torch.no_grad():
            last = model(torch.tensor([prefix + body + suffix])).logits[0, -1]
        want.append(torch.log_softmax(torch.stack([last[no], last[yes]]), 0)[1].exp().item())
    assert max(want) - min(want) > 1e-3  # the documents score apart, so the order is tested too
    srv = serve(model_dir, {"runner": "rerank", "max_num_batched_tokens": 32})
    try:
        status, body = post(srv, "/v1/rerank", {"query": query, "documents": docs})
        assert status == 200, body
        scores = {r["index"]: r["relevance_score"] for r in body["results"]}
        assert [scores[i] for i in range(len(docs))] == pytest.approx(want, abs=TOL)
        assert [r["index"] for r in body["results"]] == sorted(range(len(docs)), key=lambda i: -want[i])
    finally:
        srv.stop()
    generative = serve(model_dir)  # the same checkpoint with --runner auto generates, and has no embeddings
    try:
        status, answer = post(generative, "/v1/embeddings", {"input": "hello"})
        assert status == 400 and answer["error"]["code"] == "unsupported_task"
        assert json.loads(get(generative, "/v1/models")[1])["data"][0]["task"] == "generate"
    finally:
        generative.stop()


def test_sigmoid_score_formula_matches_math():
    from rawserve.api.rerank import _score
    from rawserve.engine.pooling import PoolingSpec

    assert _score(PoolingSpec("rerank", "cls", scorer="classifier"), [0.3]) == pytest.approx(1 / (1 + math.exp(-0.3)))
    assert _score(PoolingSpec("rerank", "cls", scorer="classifier", sigmoid=False), [0.3]) == 0.3
    assert _score(PoolingSpec("rerank", scorer="yes_no"), [2.0, -1.0]) == pytest.approx(1 / (1 + math.exp(-3.0)))
