"""Tiny random embedding and rerank checkpoints for tests, written by transformers and laid out as the published ones
are: Qwen3-Embedding-shaped (a bare Qwen3Model's tensors, a Qwen3-layout tokenizer appending <|endoftext|>,
sentence-transformers' last-token pooling and Normalize), bge-small-shaped (BertModel, a WordPiece tokenizer built
here, CLS pooling and Normalize), bge-reranker-shaped (XLMRobertaForSequenceClassification, 1 label) and
Qwen3-Reranker-shaped (Qwen3ForCausalLM with a Qwen3-layout tokenizer). No hub downloads. The Qwen3-layout
tokenizer is the one tests/checkpoints.py builds (or any given one: the real Qwen3 tokenizer gives the same shapes).
"""
from __future__ import annotations

import json
import pathlib
import shutil


# Words the WordPiece vocabulary holds (whole, and as ## pieces of a few), so test sentences tokenize to real ids.
WORDS = ("the quick brown fox jumps over lazy dog what is capital of china beijing gravity force attracts "
         "two bodies a an and to in paris france city river search query passage document relevant answer "
         "hello world embedding model vector rerank score test sentence long short many words here there").split()


def _sentence_transformers_files(directory: pathlib.Path, dim: int, pooling: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}
    pool = {"word_embedding_dimension": dim, **{key: key == modes[pooling] for key in modes.values()},
            "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False, "include_prompt": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


def _perturb(model, seed: int) -> None:
    """Random init leaves norms at 1 and biases at 0: make them count."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "LayerNorm.weight")):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def _qwen3_tokenizer(directory: pathlib.Path, append_eos: bool, source: pathlib.Path | None) -> None:
    """Copy the Qwen3-layout tokenizer in `source` (None: build one, tests/checkpoints.write_qwen_like_tokenizer)."""
    from tokenizers import Tokenizer, processors

    if source is None:
        import tempfile

        from tests.checkpoints import write_qwen_like_tokenizer

        with tempfile.TemporaryDirectory() as built:
            return _qwen3_tokenizer(directory, append_eos, write_qwen_like_tokenizer(built))
    for name in ("tokenizer_config.json", "vocab.json", "merges.txt"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    if append_eos:  # Qwen3-Embedding's tokenizer ends every input with <|endoftext|>, the token it pools
        eos = tokenizer.token_to_id("<|endoftext|>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
            special_tokens=[("<|endoftext|>", eos)])
    tokenizer.save(str(directory / "tokenizer.json"))


def make_qwen3_embedding(directory: str | pathlib.Path, *, hidden_size: int = 64, num_layers: int = 2,
                         intermediate_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                         pooling: str = "last", seed: int = 0,
                         tokenizer_dir: pathlib.Path | None = None) -> pathlib.Path:
    import torch
    import transformers

    directory = pathlib.Path(directory)
    config = transformers.Qwen3Config(
        vocab_size=151669, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643)
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(config)
    _perturb(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    raw = json.loads((directory / "config.json").read_text())
    raw["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says, over bare-model tensors
    (directory / "config.json").write_text(json.dumps(raw))
    _qwen3_tokenizer(directory, append_eos=True, source=tokenizer_dir)
    _sentence_transformers_files(directory, hidden_size, pooling, normalize=True)
    return directory


def make_qwen3_reranker(directory: str | pathlib.Path, *, seed: int = 0,
                        tokenizer_dir: pathlib.Path | None = None) -> pathlib.Path:
    import torch
    import transformers

    directory = pathlib.Path(directory)
    config = transformers.Qwen3Config(
        vocab_size=151669, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=1000000.0,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    _perturb(model, seed)
    with torch.no_grad():  # the yes/no rows apart from the rest, so their logits differ by document
        model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(directory, safe_serialization=True)
    _qwen3_tokenizer(directory, append_eos=False, source=tokenizer_dir)
    return directory


def wordpiece_tokenizer(directory: pathlib.Path, max_length: int = 512, roberta_pairs: bool = False) -> int:
    """A BERT WordPiece tokenizer.json (and tokenizer_config.json) over WORDS, as bge's is shaped; returns its size.
    roberta_pairs: pairs as XLM-R joins them (A, two separators, B; every token type 0)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = sorted(set("".join(WORDS)))
    vocab_list = specials + sorted(set(WORDS)) + letters + [f"##{c}" for c in letters] + list(".,?!'")
    vocab = {token: i for i, token in enumerate(vocab_list)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] [SEP] $B [SEP]" if roberta_pairs else "[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        # the generic fast class takes token types from tokenizer.json's template (BertTokenizerFast makes its own)
        "tokenizer_class": "PreTrainedTokenizerFast" if roberta_pairs else "BertTokenizerFast", "model_max_length": max_length, "do_lower_case": True,
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]"}))
    return len(vocab_list)


def make_bge_small(directory: str | pathlib.Path, *, hidden_size: int = 64, num_layers: int = 2,
                   intermediate_size: int = 128, num_heads: int = 4, pooling: str = "cls", seed: int = 0
                   ) -> pathlib.Path:
    import torch
    import transformers

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = wordpiece_tokenizer(directory)
    config = transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        intermediate_size=intermediate_size, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
        pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.BertModel(config, add_pooling_layer=True)
    _perturb(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    _sentence_transformers_files(directory, hidden_size, pooling, normalize=True)
    return directory


def make_bge_reranker(directory: str | pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """XLMRobertaForSequenceClassification with 1 label: position ids from padding_idx + 1 (XLM-R's offset)."""
    import torch
    import transformers

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = wordpiece_tokenizer(directory, roberta_pairs=True)
    config = transformers.XLMRobertaConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=0, bos_token_id=2,
        eos_token_id=3, num_labels=1)
    torch.manual_seed(seed)
    model = transformers.XLMRobertaForSequenceClassification(config)
    _perturb(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
