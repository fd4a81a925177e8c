"""EncodeQueue: the images the scheduler's requests wait on, encoded one at a time (EncodeJob) a slice per step with
the share of the step's token budget the scheduler charges for them, and the finished encodings each request holds
until its prompt has passed the image. Bookkeeping around the jobs; who runs is the scheduler's decision."""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rawserve.engine.mm_inputs import ImageInput
from rawserve.engine.models.vision import VisionTower
from rawserve.engine.multimodal.encode_job import EncodeJob, encode_flops
from rawserve.engine.multimodal.encoder_cache import EncodedImage, EncoderCache
from rawserve.engine.multimodal.prefix_keys import image_key
from rawserve.engine.multimodal.preprocess import PreprocessConfig, pixel_patches

if TYPE_CHECKING:
    from rawserve.engine.request import Request


@dataclass(slots=True)
class _Wanted:
    """An image some requests wait on: {request: the end of the image's tokens in its prompt}, and its job once
    started (only the queue's head has one)."""

    image: ImageInput
    waiters: dict[Request, int] = field(default_factory=dict)
    job: EncodeJob | None = None


@dataclass(slots=True)
class _Held:
    entry: EncodedImage
    holders: set[Request] = field(default_factory=set)


class EncodeQueue:
    """The scheduler asks `ready_tokens` for each chunk of a prompt with images and `charge`s the budget a waiting
    request leaves to the encoder; `drop` ends a request's part (finish, abort, preemption). The core calls `advance`
    once a step: the charged work goes to the head image's job.

    Bounds: one job in flight (the memory plan counts one forward over the largest image, budget.py); a finished
    encoding stays held while a request whose prompt has not passed it holds it, even when the cache cannot keep it
    (encoder cache off, or evicted), so a prompt chunked across steps is never encoded twice."""

    def __init__(self, tower: VisionTower, preprocess: PreprocessConfig, cache: EncoderCache,
                 text_flops_per_token: float) -> None:
        """text_flops_per_token: what a prompt token costs the text model; a step's tokens of budget convert to
        encoder work at this rate."""
        self.tower = tower
        self.preprocess = preprocess
        self.cache = cache
        self.text_flops_per_token = text_flops_per_token
        self._wanted: OrderedDict[bytes, _Wanted] = OrderedDict()
        self._held: dict[bytes, _Held] = {}
        self._holding: dict[Request, dict[bytes, int]] = {}  # request -> {image key: the image's end in its prompt}
        self._planned_flops = 0.0  # charged by this step's schedule, run by its advance
        self.num_images_encoded = 0
        self.encoder_seconds = 0.0
        self.preprocess_seconds = 0.0
        # lookups where a request first reaches an image: found encoded (cache or held) or not
        self.hits = 0
        self.misses = 0

    @property
    def num_wanted(self) -> int:
        return len(self._wanted)

    @property
    def num_jobs(self) -> int:
        """Jobs started and not finished: at most one."""
        return sum(wanted.job is not None for wanted in self._wanted.values())

    @property
    def num_held(self) -> int:
        return len(self._held)

    def ready_tokens(self, req: Request, start: int, num_new: int) -> int:
        """How much of the chunk [start, start + num_new) of `req`'s prompt may run now: all of it, or up to its first
        image whose encoding is not complete. The images it reaches that are encoded are held for `req` until a chunk
        starts past them; those not encoded join the queue with `req` waiting on them."""
        end = start + num_new
        holding = self._holding.get(req)
        if holding:
            for key in [key for key, image_end in holding.items() if image_end <= start]:
                self._release(req, key)
        cut = num_new
        for image in req.features.images:
            first, last = image.offset, image.offset + image.num_tokens
            if last <= start:
                continue
            if first >= end:
                break
            key = image_key(image)
            if cut == num_new:
                if self._hold(req, key, last, first >= start):
                    continue
                cut = max(first, start) - start
            elif key in self._held or key in self.cache:
                continue  # past the cut: held when a chunk reaches it
            self._want(req, image, key, last, first >= start)
        return cut

    def charge(self, budget: int) -> int:
        """Tokens of a step's remaining `budget` the queue's encoding takes: as many as its work not yet charged this
        step is worth, at most the budget."""
        if budget <= 0 or not self._wanted:
            return 0
        group = self.preprocess.merge_size ** 2
        cfg = self.tower.cfg
        remaining = sum(wanted.job.remaining_flops if wanted.job is not None
                        else encode_flops(cfg, wanted.image.num_tokens * group) for wanted in self._wanted.values())
        remaining -= self._planned_flops
        if remaining <= 0:
            return 0
        tokens = min(budget, math.ceil(remaining / self.text_flops_per_token))
        self._planned_flops += tokens * self.text_flops_per_token
        return tokens

    def drop(self, req: Request) -> None:
        """`req` no longer waits or holds (finished, aborted, preempted): a job nobody else waits on is dropped with
        its activations, an encoding nobody else holds is let go (the cache may still keep it)."""
        for key in [key for key, wanted in self._wanted.items() if req in wanted.waiters]:
            waiters = self._wanted[key].waiters
            del waiters[req]
            if not waiters:
                del self._wanted[key]
        for key in list(self._holding.get(req, ())):
            self._release(req, key)

    def entry(self, key: bytes) -> EncodedImage:
        """An encoding the step reads: ready_tokens held it for the request whose chunk reaches it."""
        return self._held[key].entry

    def advance(self) -> None:
        """Run the work this step's schedule charged on the head image's job (then the next one's, one at a time).
        A lone image gets the whole budget a step (its waiting request charges it: Scheduler._charge_encoder), not
        its whole forward: a request that arrives meanwhile waits for one slice, as for one prefill chunk."""
        flops, self._planned_flops = self._planned_flops, 0.0
        while self._wanted and flops > 0:
            key, wanted = next(iter(self._wanted.items()))
            started = time.perf_counter()
            job = wanted.job
            if job is None:
                patches, (_, gh, gw) = pixel_patches(wanted.image, self.preprocess)
                self.preprocess_seconds += time.perf_counter() - started
                job = wanted.job = EncodeJob(self.tower, patches, (gh, gw))
                del patches
                flops -= job.flops_spent
            before = job.flops_spent
            is_done = job.advance(max(flops, 0.0))
            flops -= job.flops_spent - before
            if self.tower.patch_weight.device.type == "cuda":
                torch.cuda.synchronize(self.tower.patch_weight.device)  # time the tower, not its launch
            self.encoder_seconds += time.perf_counter() - started
            if not is_done:
                return
            self._complete(key, wanted)
            if flops < self.text_flops_per_token:  # charge() rounds up to whole tokens: no work for another image
                return

    def _complete(self, key: bytes, wanted: _Wanted) -> None:
        entry = wanted.job.result()
        del self._wanted[key]
        self.num_images_encoded += 1
        self.cache.put(key, entry)
        held = self._held.setdefault(key, _Held(entry))
        for req, image_end in wanted.waiters.items():
            held.holders.add(req)
            self._holding.setdefault(req, {})[key] = image_end

    def _hold(self, req: Request, key: bytes, image_end: int, counts: bool) -> bool:
        """Whether the image is encoded; if so it is now held for `req`. counts: a first reach, counted a hit."""
        holding = self._holding.get(req)
        if holding is not None and key in holding:
            return True
        held = self._held.get(key)
        if held is None:
            entry = self.cache.get(key)
            if entry is None:
                return False
            held = self._held[key] = _Held(entry)
        held.holders.add(req)
        self._holding.setdefault(req, {})[key] = image_end
        self.hits += counts
        return True

    def _want(self, req: Request, image: ImageInput, key: bytes, image_end: int, counts: bool) -> None:
        wanted = self._wanted.get(key)
        if wanted is None:
            wanted = self._wanted[key] = _Wanted(image)
        if req not in wanted.waiters:
            wanted.waiters[req] = image_end
            self.misses += counts

    def _release(self, req: Request, key: bytes) -> None:
        holding = self._holding[req]
        del holding[key]
        if not holding:
            del self._holding[req]
        held = self._held[key]
        held.holders.discard(req)
        if not held.holders:
            del self._held[key]
