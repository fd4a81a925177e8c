"""lm-evaluation-harness itself (`local-completions`, tokenizer_backend=remote) against a live server: a
three-document multiple-choice task and a rolling-loglikelihood task, each document's loglikelihood equal to
transformers' on the same checkpoint within 1e-4."""
from __future__ import annotations

import json
import os

import pytest

from tests.api.demo_server import MODEL, demo_dir, serve_demo
from tests.api.test_openai_server import wait_idle

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

MC_DOCS = [
    {"question": "The dragon flew over the", "choices": ["castle", "sea", "little village"], "answer": 0},
    {"question": "Once upon a time there was a", "choices": ["princess", "tiny mouse", "king"], "answer": 1},
    {"question": "The knight drew his", "choices": ["sword", "breath", "map of the land"], "answer": 2},
]
ROLLING_DOCS = [
    {"text": "Once upon a time, a dragon lived in a cave above the village."},
    {"text": "The princess walked to the river and sang a quiet song."},
]
MC_TASK = """task: rawserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""
ROLLING_TASK = """task: rawserve_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""


@pytest.fixture(scope="module")
def server():
    yield from serve_demo(dict(num_kv_blocks=128, max_model_len=512))


def write_tasks(directory) -> None:
    for name, docs, template in (("mc", MC_DOCS, MC_TASK), ("rolling", ROLLING_DOCS, ROLLING_TASK)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (directory / f"{name}.yaml").write_text(template.format(path=data))


def test_lm_eval_harness_loglikelihoods_equal_transformers(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from rawserve.text.tokenizer import Tokenizer
    from tests.checkpoints import load_hf_model

    write_tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["rawserve_mc", "rawserve_rolling"], task_manager=TaskManager(
            include_path=str(tmp_path), include_defaults=False), log_samples=True, batch_size=1,
        model_args={"base_url": f"{server.base}/v1/completions", "model": MODEL, "tokenizer_backend": "remote",
                    "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True})
    samples = results["samples"]

    directory = demo_dir()
    encoder = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    tok = Tokenizer.from_dir(directory)
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    model = load_hf_model(directory)

    def encode(text: str) -> list[int]:
        return encoder.encode(text, add_special_tokens=False).ids

    def loglikelihood(context: list[int], continuation: list[int]) -> float:
        ids = context + continuation
        with torch.no_grad():
            rows = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        return sum(rows[i - 1, ids[i]].item() for i in range(len(context), len(ids)))

    mc = sorted(samples["rawserve_mc"], key=lambda s: s["doc_id"])
    assert len(mc) == 3
    for sample in mc:
        doc = MC_DOCS[sample["doc_id"]]
        got = [resp[0][0] for resp in sample["resps"]]
        # The harness's own split: the context's trailing spaces join the continuation, and the continuation's
        # ids are the whole text's after the context's.
        want = []
        for choice in doc["choices"]:
            context, continuation = doc["question"], " " + choice
            whole, head = encode(context + continuation), encode(context)
            want.append(loglikelihood(head, whole[len(head):]))
        assert got == pytest.approx(want, abs=1e-4)
        assert all(value < 0 for value in got)
    rolling = sorted(samples["rawserve_rolling"], key=lambda s: s["doc_id"])
    assert len(rolling) == 2
    for sample in rolling:
        text = ROLLING_DOCS[sample["doc_id"]]["text"]
        got = sample["resps"][0][0]
        got = got[0] if isinstance(got, (list, tuple)) else got
        assert got == pytest.approx(loglikelihood([prefix], encode(text)), abs=1e-4)
    assert 0 <= results["results"]["rawserve_mc"]["acc,none"] <= 1
    wait_idle(server)
