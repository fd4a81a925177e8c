"""Completions as eval harnesses score with them, through a live server: echoed logprobs cover the prompt then the
output, max_tokens 0 with echo samples nothing, prompt_logprobs on every choice, /tokenizer_info; checked against
transformers' log-softmax on the same checkpoint."""
from __future__ import annotations

import json

import pytest

from tests.api.demo_server import MODEL, demo_dir, serve_demo
from tests.api.test_openai_server import raw, wait_idle

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

PROMPT = "Once upon a time, a dragon"


@pytest.fixture(scope="module")
def server():
    yield from serve_demo(dict(num_kv_blocks=128, max_model_len=512))


@pytest.fixture(scope="module")
def reference():
    """transformers' log-softmax rows for a list of ids: row i is the distribution of token i + 1."""
    from tests.checkpoints import load_hf_model

    model = load_hf_model(demo_dir())

    def rows(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return rows


def post(server, path: str, body: dict) -> tuple[int, dict]:
    code, payload = raw(server, "POST", path, json.dumps(body).encode())
    return code, json.loads(payload)


def prompt_ids(server) -> list[int]:
    return post(server, "/tokenize", {"prompt": PROMPT})[1]["tokens"]


def test_echo_logprobs_cover_the_prompt_then_the_output_as_transformers_scores_them(server, reference):
    ids = prompt_ids(server)
    code, body = post(server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 3,
                                                  "temperature": 0, "ignore_eos": True})
    assert code == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == choice["text"] and choice["text"].startswith(PROMPT)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    detok = [post(server, "/detokenize", {"tokens": [t]})[1]["prompt"] for t in ids]
    assert lp["tokens"][:len(ids)] == detok
    generated = post(server, "/tokenize", {"prompt": choice["text"][len(PROMPT):], "add_special_tokens": False})
    rows = reference(ids + generated[1]["tokens"])
    for i in range(1, len(ids) + 3):
        token = (ids + generated[1]["tokens"])[i]
        assert lp["token_logprobs"][i] == pytest.approx(rows[i - 1, token].item(), abs=1e-4)
        top = lp["top_logprobs"][i]
        assert lp["tokens"][i] in top and top[lp["tokens"][i]] == lp["token_logprobs"][i]
        assert 2 <= len(top) <= 3  # the top 2 plus the token itself when it is not among them
        assert max(top.values()) == pytest.approx(rows[i - 1].max().item(), abs=1e-4)
    assert choice["prompt_logprobs"] is None and body["usage"]["completion_tokens"] == 3


def test_max_tokens_0_with_echo_scores_without_sampling_and_logprobs_0_keeps_the_token(server, reference):
    ids = prompt_ids(server)
    code, body = post(server, "/v1/completions", {"prompt": [ids, ids], "echo": True, "logprobs": 0,
                                                  "max_tokens": 0, "prompt_logprobs": 1})
    assert code == 200, body
    rows = reference(ids)
    for choice in body["choices"]:
        lp = choice["logprobs"]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(ids) and lp["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert lp["top_logprobs"][i] == {lp["tokens"][i]: lp["token_logprobs"][i]}  # logprobs 0: itself only
            assert lp["token_logprobs"][i] == pytest.approx(rows[i - 1, ids[i]].item(), abs=1e-4)
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        assert plp[1][str(ids[1])]["logprob"] == lp["token_logprobs"][1]
        assert 1 <= len(plp[1]) <= 2  # the token, and the top 1 when it is another
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 2 * len(ids)
    code, body = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert code == 400 and body["error"]["param"] == "max_tokens"
    code, body = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 0})
    assert code == 400 and body["error"]["param"] == "max_tokens"
    wait_idle(server)


def test_streamed_echo_logprobs_equal_the_whole_response(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=60)
    args = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0, n=2)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for k in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == k]
        assert "".join(c.text for c in mine) == whole.choices[k].text
        assert mine[0].text.startswith(PROMPT)  # the echo comes with its logprobs, in the first chunk
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for c in mine if c.logprobs for v in getattr(c.logprobs, key)] == \
                getattr(whole.choices[k].logprobs, key)
        assert whole.choices[k].model_extra["prompt_logprobs"] is None
    # continuous_usage_stats: every chunk counts the tokens so far; the last one the whole usage.
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == whole.usage.completion_tokens == 8
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)


def test_tokenizer_info_describes_the_served_tokenizer(server):
    code, payload = raw(server, "GET", "/tokenizer_info")
    info = json.loads(payload)
    tokenizer = server.app.tokenizer
    assert code == 200 and info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["model_max_length"] == 512 and info["chat_template"] == server.app.chat_template
