"""Prefix-cache keys of a prompt with images: a block's key also covers the images that start at or before its
end, so two prompts with the same token ids (the same placeholders) but other pixels share no KV from the first
image on, while the text before it is shared as any text is."""
from __future__ import annotations

from rawserve.engine.kv_cache import hash_block
from rawserve.engine.mm_inputs import ImageInput


def image_key(image: ImageInput) -> bytes:
    """The image's identity for every cache: its pixels' hash and the size they are resized to."""
    return image.content_hash + image.resized_height.to_bytes(4, "little") + image.resized_width.to_bytes(4, "little")


def extend_image_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, extra: bytes,
                              images: tuple[ImageInput, ...]) -> None:
    """kv_cache.extend_block_hashes for a request with images (in prompt order)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        end = (i + 1) * block_size
        keys = b"".join(image_key(image) for image in images if image.offset < end)
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size:end], extra + b"\x02" + keys if keys else extra))
