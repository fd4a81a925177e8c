"""EncoderCache: the vision tower's outputs by image key, LRU-bounded in bytes, so an image sent again (a
multi-turn chat about one picture) is encoded once. Tensors in, tensors out; when to encode is the encode
queue's decision."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EncodedImage:
    """One image's embeddings [num_tokens, text hidden] and its DeepStack features (one per fed layer)."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


class EncoderCache:
    """Least recently used first out once the entries pass max_bytes. An entry larger than the whole bound is
    not kept (the requests that waited on it still hold it: encode_queue.py)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes: must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[bytes, EncodedImage] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> EncodedImage | None:
        """The entry, freshly used, or None. (Hits and misses are counted per request by the encode queue.)"""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: EncodedImage) -> None:
        size = entry.num_bytes
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old.num_bytes
        if size > self.max_bytes:
            return
        while self._entries and self.num_bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        self._entries[key] = entry
        self.num_bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0
