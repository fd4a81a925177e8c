"""Incremental detokenizer: one per request, token ids in, text deltas out, UTF-8 safe.

Concatenated deltas plus flush() equal tokenizer.decode(all ids), and no delta ends in half a
character. Amortised O(1) per token: it never re-decodes the sequence. No engine/http/api imports.
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

from rawserve.text.tokenizer import BYTE_LEVEL, PIECES, WINDOW, Tokenizer



class IncrementalDetokenizer:
    """Turn a stream of ids into text deltas.

    byte_level: each id is raw bytes fed to an incremental UTF-8 decoder (errors="replace"), which
    holds an incomplete character and replaces invalid bytes exactly as the Rust decoder's lossy
    UTF-8 conversion does. pieces: text pieces pass straight through; a run of <0xNN> byte pieces is
    held until a non-byte piece ends it, because the ByteFallback decoder judges the run as a whole.
    window: any other decoder; a short window of ids is re-decoded and text is released when it
    does not end in U+FFFD (vLLM's prefix/read offsets), reconciled with a full decode at flush.
    """

    __slots__ = ("_tokenizer", "_skip", "_dropped", "_mode", "_table", "_size", "_decoder", "_byte_values", "_run",
                 "_strip_char", "_strip_left", "_ids", "_prefix", "_read", "_emitted")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, *, keep_special: Iterable[str] = (),
                 mode: str | None = None) -> None:
        """keep_special: texts of special tokens decoded even with skip_special_tokens: the output parsers'
        markers (<tool_call>, <think>), which many checkpoints make special and the parsers must see.
        mode overrides the tokenizer's decode mode; only "window" makes sense for a tokenizer of
        another mode (it works for any decoder), which tests and the benchmark use to compare."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        kept = tokenizer.special_ids_of(keep_special) if skip_special_tokens else frozenset()
        self._dropped: frozenset[int] = frozenset()
        self._mode = mode or tokenizer.decode_mode
        if self._mode not in (BYTE_LEVEL, PIECES, WINDOW) or (mode not in (None, WINDOW, tokenizer.decode_mode)):
            raise ValueError(f"mode must be {WINDOW!r} or the tokenizer's own {tokenizer.decode_mode!r}, got {mode!r}")
        if self._mode in (BYTE_LEVEL, PIECES):
            self._table, self._byte_values = tokenizer.detokenizer_tables(skip_special_tokens, kept)
            self._size = len(self._table)
        elif kept:
            # `tokenizers` skips all special ids or none: drop the others here, before its decoder, as it does.
            self._dropped = tokenizer.special_token_ids - kept
            self._skip = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._run = bytearray()
        self._strip_char, self._strip_left = tokenizer.pieces_strip if self._mode == PIECES else ("", 0)
        self._ids: list[int] = []
        self._prefix = self._read = 0
        self._emitted: list[str] = []

    def add(self, ids: Sequence[int]) -> str:
        """Text completed by these ids (may be "" while a character or byte run is incomplete)."""
        if not ids:
            return ""
        if min(ids) < 0:
            raise ValueError(f"token ids must be >= 0, got {min(ids)}")
        if self._mode == BYTE_LEVEL:
            table, size = self._table, self._size
            # Ids past the vocabulary (padded embedding rows) decode to nothing, as in `tokenizers`.
            if max(ids) < size:
                data = b"".join([table[i] for i in ids])
            else:
                data = b"".join([table[i] if i < size else b"" for i in ids])
            return self._decoder.decode(data)
        if self._mode == PIECES:
            return self._add_pieces(ids)
        return self._add_window(ids)

    def flush(self) -> str:
        """The rest at the end of the stream: an incomplete character (or byte run) becomes U+FFFD,
        exactly as a full decode renders it. Call it once, when the request finishes."""
        if self._mode == BYTE_LEVEL:
            return self._decoder.decode(b"", final=True)
        if self._mode == PIECES:
            return self._strip(self._end_run())
        return self._flush_window()

    # ----- pieces

    def _add_pieces(self, ids: Sequence[int]) -> str:
        table, size, values, run = self._table, self._size, self._byte_values, self._run
        out: list[str] = []
        for i in ids:
            if i >= size:
                continue
            value = values[i]
            if value >= 0:
                run.append(value)
            elif value == -1:
                if run:
                    out.append(self._end_run())
                out.append(table[i].decode("utf-8"))
        return self._strip("".join(out))

    def _end_run(self) -> str:
        """A finished byte run: its text if it is valid UTF-8 as a whole, else one U+FFFD per byte."""
        run = self._run
        if not run:
            return ""
        try:
            text = run.decode("utf-8")
        except UnicodeDecodeError:
            text = "\ufffd" * len(run)
        run.clear()
        return text

    def _strip(self, text: str) -> str:
        # The decoder's Strip step removes up to n leading strip chars from the whole text once.
        while self._strip_left and text:
            if text[0] != self._strip_char:
                self._strip_left = 0
                break
            text = text[1:]
            self._strip_left -= 1
        return text

    # ----- window

    def _add_window(self, ids: Sequence[int]) -> str:
        decode = self._tokenizer.decode
        if self._dropped:
            ids = [i for i in ids if i not in self._dropped]
        self._ids.extend(ids)
        prefix_text = decode(self._ids[self._prefix:self._read], self._skip)
        new_text = decode(self._ids[self._prefix:], self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd") or not new_text.startswith(prefix_text):
            return ""
        delta = new_text[len(prefix_text):]
        # The ids just released stay as context for the next window, so a decoder that looks at its
        # neighbours (leading-space rules) sees the same surroundings as a full decode.
        self._prefix, self._read = self._read, len(self._ids)
        self._emitted.append(delta)
        return delta

    def _flush_window(self) -> str:
        # One full decode per request (O(n) once): the window may have held text back.
        full = self._tokenizer.decode(self._ids, self._skip)
        emitted = "".join(self._emitted)
        if full.startswith(emitted):
            rest = full[len(emitted):]
        else:  # a decoder whose output depends on distant context; release the window's own tail
            new_text = self._tokenizer.decode(self._ids[self._prefix:], self._skip)
            prefix_text = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip)
            rest = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self._emitted = [emitted + rest]
        return rest
