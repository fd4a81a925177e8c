"""Tokenizer: a thread-safe wrapper over `tokenizers` with special/added ids and the vocabulary as bytes.

Owns how ids become bytes (the decoder's exact rules, used by the detokenizer and guided decoding).
It must not import engine, http or api, and never mutates the Rust tokenizer after construction.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence

import tokenizers

from rawserve.process_stats import release_free_heap
from rawserve.text.chat_template import checkpoint_chat_template

# Decode modes the detokenizer understands. "byte_level": every id is raw bytes, the whole output
# is one lossy UTF-8 decode (GPT-2/Qwen/Llama 3). "pieces": SentencePiece-style text pieces plus
# <0xNN> byte-fallback runs and an optional leading-space strip (Llama 2, Mistral, stories260k).
# "window": a decoder we do not model; the detokenizer re-decodes a small window of ids.
BYTE_LEVEL, PIECES, WINDOW = "byte_level", "pieces", "window"
# Texts and id lists longer than this go through `tokenizers`' batch calls, which release the GIL;
# a caller on an event loop hands inputs this long to a thread.
RELEASE_GIL_AT = 4096
# Detokenizer tables kept per set of special ids a request keeps (a table is a list of vocab_size entries).
MAX_SKIP_TABLES = 8


# A text longer than this is counted in windows of it before it is tokenized whole (see _count_in_windows).
COUNT_WINDOW_CHARS = 32768
# How many tokens one window cut may add or remove against tokenizing the whole text: the pieces around a
# cut (a word split in two, a prefix a normalizer adds to each window) differ, the rest is the same.
COUNT_SLACK_PER_CUT = 8


class TooManyTokens(ValueError):
    """Tokenizer.encode's result is over its `max_tokens`; `num_tokens` says by how much (with `at_least`,
    a lower bound found without tokenizing the whole text)."""

    def __init__(self, num_tokens: int, at_least: bool = False) -> None:
        super().__init__(f"the text is {'at least ' if at_least else ''}{num_tokens} tokens")
        self.num_tokens = num_tokens
        self.at_least = at_least


_UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


def _window_end(text: str, start: int) -> int:
    """Where a counting window from `start` ends: at a space or newline near COUNT_WINDOW_CHARS (a word
    boundary, where tokenizers split anyway), else right there."""
    end = start + COUNT_WINDOW_CHARS
    if end >= len(text):
        return len(text)
    cut = max(text.rfind(" ", end - 256, end), text.rfind("\n", end - 256, end))
    return cut if cut > start else end


def _gpt2_byte_map() -> dict[str, int]:
    """The GPT-2 byte-level alphabet reversed: printable char -> the byte it stands for.

    Bytes that are printable Latin-1 stand for themselves; the other 68 are shifted to 256 + n in
    byte order, so every byte has a visible, whitespace-free character.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in visible}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in chars.items()}


CHAR_TO_BYTE = _gpt2_byte_map()


def byte_fallback_value(piece: str) -> int | None:
    """The byte of a `<0xNN>` byte-fallback piece, or None (the same test the ByteFallback decoder makes)."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        digits = piece[3:5]
        if all(c in "0123456789abcdefABCDEF" for c in digits):
            return int(digits, 16)
    return None


def _piece_pipeline(decoder: dict) -> tuple[list[tuple[str, str]], bool, str, int] | None:
    """Parse a SentencePiece-style decoder: (replacements, byte_fallback, strip_char, strip_count).

    Supported: Sequence[Replace*, ByteFallback?, Fuse?, Strip(start=n, stop=0)?] in that order, where
    Strip comes after Fuse (so it strips the whole text, not each piece). Anything else -> None.
    """
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else None
    if not steps:
        return None
    replacements: list[tuple[str, str]] = []
    byte_fallback = fused = False
    strip_char, strip_count = "", 0
    stage = 0  # 0: replaces, 1: after ByteFallback, 2: after Fuse, 3: after Strip
    for step in steps:
        kind = step.get("type")
        pattern = step.get("pattern") or {}
        if kind == "Replace" and stage == 0 and "String" in pattern:
            replacements.append((pattern["String"], step.get("content", "")))
        elif kind == "ByteFallback" and stage == 0:
            byte_fallback, stage = True, 1
        elif kind == "Fuse" and stage <= 1:
            fused, stage = True, 2
        elif kind == "Strip" and stage == 2 and step.get("stop", 0) == 0 and len(step.get("content", "")) == 1:
            strip_char, strip_count, stage = step["content"], int(step.get("start", 0)), 3
        else:
            return None
    if not (fused or byte_fallback or replacements):
        return None
    return replacements, byte_fallback, strip_char, strip_count


def _token_content(value: object) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode/decode text, special and added ids, and each id's raw bytes.

    Thread safety: the Rust tokenizer is only read after construction (no truncation/padding
    changes, which are what make `tokenizers` raise "Already borrowed"); the lazily built byte
    tables are guarded by a lock.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        # A tokenizer.json may carry truncation/padding settings; a server must never cut a prompt
        # silently. Cleared once here, before the tokenizer is shared (never changed afterwards).
        if tokenizer.truncation is not None:
            tokenizer.no_truncation()
        if tokenizer.padding is not None:
            tokenizer.no_padding()
        self._tok = tokenizer
        self.chat_template = chat_template
        added = tokenizer.get_added_tokens_decoder()
        self.added_token_ids: frozenset[int] = frozenset(added)
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        self.bos_token, self.bos_token_id = self._lookup("bos_token", bos_token)
        self.eos_token, self.eos_token_id = self._lookup("eos_token", eos_token)
        decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
        self._pieces = _piece_pipeline(decoder)
        if decoder.get("type") == "ByteLevel":
            self.decode_mode = BYTE_LEVEL
        elif self._pieces is not None:
            self.decode_mode = PIECES
        else:
            self.decode_mode = WINDOW
        self._lock = threading.Lock()
        self._max_token_chars: int | None = None
        self._bytes: list[bytes] | None = None
        self._byte_values: list[int] | None = None  # PIECES: byte of a <0xNN> piece, else -1
        self._skip_tables: dict[frozenset[int], tuple[list[bytes], list[int]]] = {}  # by special ids kept

    def _lookup(self, field: str, token: str | None) -> tuple[str | None, int | None]:
        if not token:
            return None, None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field} {token!r} is not in the tokenizer's vocabulary")
        return token, token_id

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """A tokenizer.json file alone; special tokens and template are given by the caller."""
        try:
            tok = tokenizers.Tokenizer.from_file(os.fspath(path))
        except Exception as error:  # the Rust loader raises a bare Exception on bad JSON or a missing file
            raise ValueError(f"cannot load tokenizer {os.fspath(path)!r}: {error}") from None
        tokenizer = cls(tok, bos_token=bos_token, eos_token=eos_token, chat_template=chat_template)
        release_free_heap()  # the JSON parse's garbage: ~95 MiB of a 152k vocabulary's 114 stays resident without it
        return tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> Tokenizer:
        """A Hugging Face checkpoint directory: tokenizer.json plus tokenizer_config.json.

        bos/eos come from tokenizer_config.json (falling back to special_tokens_map.json), the
        chat template from chat_template.jinja or tokenizer_config.json.
        """
        model_dir = os.fspath(model_dir)
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{model_dir!r} has no tokenizer.json "
                             "(slow/sentencepiece-only tokenizers are not supported)")
        config = read_json_object(os.path.join(model_dir, "tokenizer_config.json"))
        specials = read_json_object(os.path.join(model_dir, "special_tokens_map.json"))
        tokens = {}
        for field in ("bos_token", "eos_token"):
            tokens[field] = _token_content(config.get(field)) or _token_content(specials.get(field))
        return cls.from_file(path, chat_template=checkpoint_chat_template(model_dir), **tokens)

    # ----- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Ids for text; special tokens written in the text are recognised. add_special_tokens
        runs the post-processor (e.g. Llama 3's BOS). With `max_tokens`, a longer result raises
        TooManyTokens before its ids become a Python list (a tenth of a second per million)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if max_tokens is not None and len(text) > max_tokens:
            self._refuse_early(text, max_tokens)
        if len(text) > RELEASE_GIL_AT:
            # The batch call runs without the GIL; the single one holds it for the whole text (about
            # 3 s for 6 MB), which stalls the event loop even when called from a worker thread.
            encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self._tok.encode(text, add_special_tokens=add_special_tokens)
        if max_tokens is not None and len(encoding) > max_tokens:
            raise TooManyTokens(len(encoding))
        return encoding.ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its bytes bound its characters): a text of n
        (normalized) characters is at least n / max_token_chars tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max(1, max(map(len, self.vocab_bytes()), default=1))
        return self._max_token_chars

    def _refuse_early(self, text: str, max_tokens: int) -> None:
        """Raise TooManyTokens for a text surely over `max_tokens`, in memory bounded by the limit rather than
        the text: first its length against max_tokens x the longest token (no tokenizing at all), then a count
        in windows that stops once it is past the limit. A text this lets through is tokenized whole after;
        at that size its Encoding (a hundred-odd bytes a token) is bounded by the limit too."""
        normalizer = self._tok.normalizer
        # A normalizer may shrink text (NFC composes characters): count what the model sees. The Unicode
        # forms leave ASCII as it is, which spares a copy of the commonest long text.
        if normalizer is None or (type(normalizer).__name__ in _UNICODE_FORMS and text.isascii()):
            size = len(text)
        else:
            size = len(normalizer.normalize_str(text))
        floor = -(-size // self.max_token_chars)
        if floor > max_tokens:
            raise TooManyTokens(floor, at_least=True)
        if len(text) <= 2 * COUNT_WINDOW_CHARS:
            return
        count = cuts = 0
        start = 0
        while start < len(text):
            end = _window_end(text, start)
            # Without the GIL; each window's Encoding is dropped before the next is made.
            count += len(self._tok.encode_batch([text[start:end]], add_special_tokens=False)[0])
            start = end
            cuts += 1
            floor = count - COUNT_SLACK_PER_CUT * cuts
            if floor > max_tokens:
                raise TooManyTokens(floor, at_least=True)

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A sentence pair through the tokenizer's pair template (a cross-encoder's query and document) ->
        (ids, token type ids)."""
        encoding = self._tok.encode(first, second, add_special_tokens=True)
        return encoding.ids, encoding.type_ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Several texts at once; the Rust side runs them in parallel without the GIL."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for ids, exactly as `tokenizers` decodes them. Ids past the vocabulary (a model's
        padded embedding rows) decode to nothing, as in `tokenizers`."""
        ids = list(ids)
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0):  # one C-level pass for the common case
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                    raise ValueError(f"token ids must be non-negative integers, got {i!r}")
        size = self.vocab_size
        if ids and max(ids) >= size:  # dropped here too: ids past 2**32 would overflow the Rust call
            ids = [i for i in ids if i < size]
        if len(ids) > RELEASE_GIL_AT:  # as in encode(): the batch call lets go of the GIL
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id) if token_id >= 0 else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ----- ids -> bytes

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes id `token_id` contributes to decoded text (b"" outside the vocabulary)."""
        table = self.vocab_bytes()
        return table[token_id] if 0 <= token_id < len(table) else b""

    def vocab_bytes(self) -> list[bytes]:
        """Every id's raw bytes, index = id. Built once, on first use (about 0.3 s for 150k tokens).

        byte_level: the GPT-2 map reversed (a token with a char outside the map is its UTF-8, as the
        ByteLevel decoder does). pieces: <0xNN> -> that byte, else the text after the decoder's
        Replace steps (▁ -> space). window: the UTF-8 of decoding the id alone (approximate).
        Special tokens keep their text; whether to skip them is the caller's choice.
        """
        if self._bytes is None:
            with self._lock:
                if self._bytes is None:
                    self._build_tables()
        assert self._bytes is not None
        return self._bytes

    def byte_fallback_values(self) -> list[int]:
        """PIECES mode: for each id, the byte of a <0xNN> piece, or -1. Other modes: all -1."""
        self.vocab_bytes()
        assert self._byte_values is not None
        return self._byte_values

    def detokenizer_tables(self, skip_special_tokens: bool, keep: frozenset[int] = frozenset()
                           ) -> tuple[list[bytes], list[int]]:
        """(bytes per id, byte-fallback value per id) as the detokenizer reads them. With
        skip_special_tokens, special ids but those in `keep` (the output parsers' markers) have no bytes
        and the value -2 ("removed before the decoder", so it does not end a byte-fallback run). Built once
        per flag and kept set, and shared by all requests."""
        table = self.vocab_bytes()
        values = self.byte_fallback_values()
        dropped = self.special_token_ids - keep
        if not skip_special_tokens or not dropped:
            return table, values
        key = frozenset(keep & self.special_token_ids)
        tables = self._skip_tables.get(key)
        if tables is None:
            with self._lock:
                tables = self._skip_tables.get(key)
                if tables is None:
                    skip_table, skip_values = list(table), list(values)
                    for i in dropped:
                        skip_table[i], skip_values[i] = b"", -2
                    tables = (skip_table, skip_values)
                    # Kept sets come from the parsers' markers, a handful per server; a bound all the same.
                    if len(self._skip_tables) >= MAX_SKIP_TABLES:
                        self._skip_tables.clear()
                    self._skip_tables[key] = tables
        return tables

    def special_ids_of(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of those `texts` that are special tokens of this vocabulary (the others: not special, or
        not one token), e.g. which output-parser markers skip_special_tokens would drop."""
        ids = (self._tok.token_to_id(text) for text in texts)
        return frozenset(i for i in ids if i is not None and i in self.special_token_ids)

    def _build_tables(self) -> None:
        table = [b""] * self.vocab_size
        values = [-1] * self.vocab_size
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if self.decode_mode == BYTE_LEVEL:
                if all(c in CHAR_TO_BYTE for c in token):
                    table[i] = bytes([CHAR_TO_BYTE[c] for c in token])
                else:
                    table[i] = token.encode("utf-8")
            elif self.decode_mode == PIECES:
                replacements, byte_fallback, _, _ = self._pieces  # type: ignore[misc]
                for old, new in replacements:
                    token = token.replace(old, new)
                value = byte_fallback_value(token) if byte_fallback else None
                if value is not None:
                    values[i] = value
                    table[i] = bytes([value])
                else:
                    table[i] = token.encode("utf-8")
            else:
                table[i] = self._tok.decode([i], skip_special_tokens=False).encode("utf-8")
        self._byte_values = values
        self._bytes = table  # published last: readers check _bytes without the lock

    @property
    def pieces_strip(self) -> tuple[str, int]:
        """PIECES mode: the char the decoder strips from the start of the text, and how many."""
        if self._pieces is None:
            return "", 0
        return self._pieces[2], self._pieces[3]


def read_json_object(path: str) -> dict:
    """A JSON file holding an object ({} when the file is absent); ValueError naming the file otherwise."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path!r}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} must hold a JSON object")
    return data
