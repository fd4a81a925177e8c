"""What a checkpoint is served as (generate, embed, rerank) and how it pools, from its config.json and its
sentence-transformers files (modules.json, 1_Pooling/config.json, a Normalize module), with --runner and --pooling
over them. Standard library only: the server (which routes) and the core (which pools) read the same answer.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

RUNNERS = ("auto", "generate", "embed", "rerank")
POOLING_CHOICES = ("auto", "mean", "cls", "last")
# Encoders with their own model code (models/bert.py); the *ForSequenceClassification ones are cross-encoders.
ENCODER_ARCHITECTURES = {
    "BertModel": "bert", "BertForSequenceClassification": "bert",
    "XLMRobertaModel": "xlm_roberta", "XLMRobertaForSequenceClassification": "xlm_roberta",
}
# Qwen3-Reranker's prompt: the pair is judged by the chat model, scored by P("yes") against P("no") at the end.
QWEN3_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                       "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                       "<|im_start|>user\n")
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class PoolingConfigError(ValueError):
    """A checkpoint or flag combination that cannot be served as asked; the message names the file or flag."""


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    task: str  # generate | embed | rerank
    method: str = "last"  # last | mean | cls: which final hidden states make the vector
    normalize: bool = False  # L2-normalise the vector (sentence-transformers' Normalize module)
    is_encoder: bool = False  # a BERT-family encoder (bidirectional, no KV cache; models/bert.py)
    # rerank: "classifier" (a cross-encoder's sequence-classification head) or "yes_no" (Qwen3-Reranker)
    scorer: str | None = None
    sigmoid: bool = True  # a 1-label classifier's score is sigmoid(logit), as sentence-transformers' CrossEncoder

    @property
    def is_pooling(self) -> bool:
        return self.task != "generate"

    def describe(self) -> str:
        if not self.is_pooling:
            return "generate"
        norm = ", normalized" if self.normalize else ""
        return f"{self.task} ({self.method} pooling{norm}{', ' + self.scorer if self.scorer else ''})"


def _json(path: pathlib.Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise PoolingConfigError(f"{path}: cannot read ({error})") from None


def _sentence_transformers(root: pathlib.Path) -> tuple[str | None, bool | None]:
    """(pooling method, normalize) from modules.json and its Pooling module's config; (None, None) without them."""
    modules_path = root / "modules.json"
    if not modules_path.is_file():
        return None, None
    modules = _json(modules_path)
    if not isinstance(modules, list):
        raise PoolingConfigError(f"{modules_path}: expected a list of modules")
    method, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            pooling = _json(root / str(module.get("path", "")) / "config.json")
            if not isinstance(pooling, dict):
                raise PoolingConfigError(f"{root / str(module.get('path', ''))}/config.json: expected an object")
            modes = [name for key, name in (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
                                            ("pooling_mode_lasttoken", "last")) if pooling.get(key)]
            other = [k for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                 "pooling_mode_weightedmean_tokens") if pooling.get(k)]
            if len(modes) != 1 or other:
                raise PoolingConfigError(f"{root / str(module.get('path', ''))}/config.json: pooling modes "
                                         f"{modes + other} are not served (one of cls, mean, lasttoken)")
            method = modes[0]
    return method, normalize


def read_pooling_spec(model_dir: str | pathlib.Path, runner: str = "auto", pooling: str = "auto") -> PoolingSpec:
    """The checkpoint's task and pooling. --runner auto: an encoder embeds (or reranks, with a classification head);
    a decoder embeds when it carries sentence-transformers' modules.json (Qwen3-Embedding), else generates.
    `--runner rerank` on a decoder is Qwen3-Reranker's yes/no scoring. --pooling overrides the method."""
    if runner not in RUNNERS:
        raise PoolingConfigError(f"--runner: must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if pooling not in POOLING_CHOICES:
        raise PoolingConfigError(f"--pooling: must be one of {', '.join(POOLING_CHOICES)}, got {pooling!r}")
    root = pathlib.Path(model_dir)
    config = _json(root / "config.json")
    if not isinstance(config, dict):
        raise PoolingConfigError(f"{root / 'config.json'}: expected an object")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    encoder = next((a for a in architectures if a in ENCODER_ARCHITECTURES), None)
    st_method, st_normalize = _sentence_transformers(root)
    if encoder is not None:
        is_classifier = encoder.endswith("ForSequenceClassification")
        task = runner if runner != "auto" else ("rerank" if is_classifier else "embed")
        if task == "generate":
            raise PoolingConfigError(f"--runner generate: {encoder} is an encoder; it serves embed or rerank")
        if task == "rerank" and not is_classifier:
            raise PoolingConfigError(f"--runner rerank: {encoder} has no classification head (a cross-encoder is "
                                     f"*ForSequenceClassification)")
        if task == "embed" and is_classifier:
            raise PoolingConfigError(f"--runner embed: {encoder} is a cross-encoder; it serves rerank")
        labels = config.get("id2label")
        num_labels = len(labels) if isinstance(labels, dict) else int(config.get("num_labels", 1) or 1)
        if is_classifier and num_labels != 1:
            raise PoolingConfigError(f"{root / 'config.json'}: a cross-encoder with {num_labels} labels; rerank "
                                     f"needs one relevance logit")
        activation = str(config.get("sbert_ce_default_activation_function") or "")
        st_config = root / "config_sentence_transformers.json"
        if st_config.is_file():
            data = _json(st_config)
            activation = str(data.get("activation_fn") or activation) if isinstance(data, dict) else activation
        # a cross-encoder's head reads the first token whatever --pooling says
        method = "cls" if task == "rerank" else pooling if pooling != "auto" else (st_method or "cls")
        return PoolingSpec(task, method, bool(st_normalize) if st_method is not None else task == "embed",
                           is_encoder=True, scorer="classifier" if task == "rerank" else None,
                           sigmoid=not activation.endswith("Identity"))
    task = runner if runner != "auto" else ("embed" if st_method is not None else "generate")
    if task == "generate":
        if pooling != "auto":
            raise PoolingConfigError("--pooling: only with an embedding or rerank model (see --runner)")
        return PoolingSpec("generate")
    if task == "rerank":
        return PoolingSpec("rerank", "last", False, scorer="yes_no")
    method = pooling if pooling != "auto" else (st_method or "last")
    # vLLM's default for an embedding model without a Normalize module is to normalise; sentence-transformers'
    # files, when present, decide.
    return PoolingSpec("embed", method, st_normalize if st_method is not None else True)
