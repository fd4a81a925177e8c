"""EngineCore: the loop's one step (schedule, run the model, sample, update) and the request API around it.

Core side: token ids in, RequestOutputs out. No asyncio, HTTP, API or text; stop strings are the frontend's.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import pathlib
import time

import torch

from rawserve.config import EngineConfig
from rawserve.engine.cpu_budget import ThreadPlan, plan_threads
from rawserve.engine.guided.deferred import GRACE_FRACTION, DeferredSamples, merge_outputs
from rawserve.engine.guided.matcher import GuidedRegistry, apply_masks
from rawserve.engine.guided.vocab import is_vocab_index_cached, load_vocab_index
from rawserve.engine.kv_cache import KVCacheManager
from rawserve.engine.lora_registry import LoraRegistry
from rawserve.engine.model_runner import ModelRunner
from rawserve.engine.pooling import PoolingSpec, read_pooling_spec
from rawserve.engine.request import Request
from rawserve.engine.rules import check_request
from rawserve.engine.sampler import Sampler, rows_logprobs
from rawserve.engine.scheduler import Scheduler
from rawserve.engine.spec.verify import SpecDecoder, VerifyHooks
from rawserve.engine.state_cache import StateCacheManager
from rawserve.engine.step_plan import PromptSpan, StepPlan
from rawserve.engine.thread_governor import ThreadGovernor
from rawserve.engine.types import EngineStats, RequestOutput, SamplingParams
from rawserve.process_stats import release_free_heap

log = logging.getLogger("rawserve.engine.core")


class EngineCore:
    """Owns the requests, the scheduler, the KV block manager (`blocks`), the sampler and a model runner.

    `step()` raising is fatal: block tables and counters may then disagree with the KV cache, so the
    caller must fail every request rather than step again. A fault in one request's logits processing,
    sampling or grammar does not raise: that request ends alone with finish_reason "error" (_fail_alone).
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.threads: ThreadPlan | None = None  # set by make_engine_core, which sized torch's threads
        self.governor: ThreadGovernor | None = None  # make_engine_core's, for an auto-sized CPU engine
        # What the checkpoint serves (engine/pooling.py): an encoder gets its own runner (models/bert.py), which
        # keeps no KV cache, so its requests run whole in one step and never hit the prefix cache.
        self.pooling: PoolingSpec = (read_pooling_spec(config.model_dir, config.runner, config.pooling)
                                     if config.model_dir is not None else PoolingSpec("generate"))
        if runner is None and self.pooling.is_encoder:
            from rawserve.engine.models.bert import EncoderRunner

            runner = EncoderRunner(config, self.pooling)
        self.runner = runner if runner is not None else ModelRunner(config)
        is_encoder = self.pooling.is_encoder
        self.max_model_len: int = self.runner.max_model_len
        self.vocab_size: int = self.runner.vocab_size
        self.block_size: int = self.runner.block_size
        self.eos_token_ids: tuple[int, ...] = tuple(self.runner.eos_token_ids)
        self.blocks = KVCacheManager(self.runner.num_blocks, self.block_size,
                                     config.enable_prefix_caching and not is_encoder)
        # A hybrid model's per-sequence states (Qwen3.5): slots beside the KV blocks, sized by the runner's plan
        self.states: StateCacheManager | None = None
        plan = getattr(self.runner, "kv_plan", None)
        if plan is not None and plan.num_state_slots:
            self.states = StateCacheManager(plan.num_state_slots, plan.num_saved_states, self.block_size)
            self.blocks.on_evict = self.states.forget
        # A vision model's tower and encoder cache (engine/multimodal); None for text-only models and encoders
        self.multimodal = getattr(self.runner, "multimodal", None)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_loras=config.max_loras if config.lora_enabled else 0,
                                   whole_prompts=is_encoder, states=self.states,
                                   encoder=self.multimodal.encodes if self.multimodal is not None else None)
        # the adapters requests may name, their users and run-time loads (the scheduler's LoraSlots place them)
        self.loras = LoraRegistry(config, self.runner.model_config, self.scheduler,
                                  is_enabled=self.runner.lora is not None)
        for name, path in config.lora_paths().items():
            self.loras.load(name, path)
        self.sampler = Sampler(self.vocab_size, self.runner.device, config.seed)
        self.spec = self._make_spec()  # --speculative-config's drafts and their verification, or None
        # Constrained rows whose mask was not built when their logits came: sampled in a later step (a drafted
        # row's verification needs its masks in the step, so with speculative decoding the step waits instead)
        self._deferred: DeferredSamples | None = DeferredSamples() if self.spec is None else None
        self._forward_s = 0.0  # the last forward's time (a deferral's grace is a share of it)
        self.requests: dict[str, Request] = {}
        # The vocabulary index guided decoding walks (~35 MiB for Qwen3's 151k tokens) is read from its disk cache
        # at the first guided request (tens of ms, once), so a server that never gets one never holds it. Building
        # it takes seconds (2.5 s for Qwen3 on a first run) and would stall every other request's step: that
        # happens here, at start, and the index is kept only where no cache file could be written. A checkpoint
        # without a tokenizer gets none; its guided requests are refused.
        self._guided: GuidedRegistry | None = None
        self._guided_dir: pathlib.Path | None = None
        # pooling requests' hidden-state sums so far (mean pooling spans several chunks), by rid
        self._pooled: dict[str, torch.Tensor] = {}
        if (config.model_dir is not None and not self.pooling.is_pooling
                and (pathlib.Path(config.model_dir) / "tokenizer.json").is_file()):
            self._guided_dir = pathlib.Path(config.model_dir)
            if not is_vocab_index_cached(self._guided_dir, self.vocab_size):
                index = load_vocab_index(self._guided_dir, self.vocab_size)
                if not is_vocab_index_cached(self._guided_dir, self.vocab_size):
                    self._guided = GuidedRegistry(index, self.runner.device)
                del index
        self.steps = 0
        self._arrivals = itertools.count()
        # Everything alive now (torch, the model, the server if it shares the process) lives as long as the
        # engine. Frozen, a full collection no longer walks it: at 256 running requests an unfrozen gen-2
        # pass cost ~150 ms, one step in a few dozen.
        gc.collect()
        gc.freeze()
        release_free_heap()  # what loading, the profiled step and the vocabulary index freed

    def _make_spec(self) -> SpecDecoder | None:
        spec = self.config.speculative()
        if spec is None:
            return None
        if self.pooling.is_pooling:
            raise ValueError("--speculative-config: this model pools (embeddings or rerank scores); it never decodes")
        log.info("speculative decoding: %s, %d tokens per step", spec.method, spec.num_speculative_tokens)
        draft = None
        if spec.method == "draft_model":
            from rawserve.engine.spec.draft_model import DraftModelProposer

            draft = DraftModelProposer(self.config, spec.model, self.blocks, self.vocab_size)
        elif spec.method == "mtp":  # Qwen3.5's MTP layer, from the target's own checkpoint
            from rawserve.engine.spec.mtp import MTPProposer

            draft = MTPProposer(self.runner, self.blocks)
        return SpecDecoder(spec, self.blocks, self.max_model_len, self.states, draft)

    def guided_registry(self) -> GuidedRegistry:
        """Grammars and the vocabulary index they walk (ValueError, failing that request alone, without one)."""
        if self._guided is None:
            if self._guided_dir is None:
                raise ValueError("guided: this checkpoint has no tokenizer.json to build token masks from")
            self._guided = GuidedRegistry(load_vocab_index(self._guided_dir, self.vocab_size), self.runner.device)
        if self.scheduler.ready is None and self._deferred is not None:  # a row holding a deferred sample waits
            self.scheduler.ready = self._has_no_deferred_sample
        return self._guided

    def _has_no_deferred_sample(self, req: Request) -> bool:
        return not self._deferred.holds(req)

    def close(self) -> None:
        """Let the adapter reads in flight go (each finishes on its own thread and is dropped)."""
        self.loras.close()
        if self._guided is not None:
            self._guided.close()

    def _request_done(self, req: Request) -> None:
        if req.lora is not None:
            self.loras.drop_user(req.lora)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0, *,
                    lora: str | None = None, features: object | None = None, cache_salt: str | None = None) -> None:
        """Queue a request, or raise ValueError saying why it can never run (it then fails alone)."""
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        # The frontend checked these rules already; the core checks again with the same owner (engine/rules.py),
        # since a rule broken here would corrupt shared state (a TypeError inside step() is fatal).
        check_request(prompt_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        total = len(prompt_ids) + params.max_tokens
        # The last sampled token is never fed back, so the KV holds at most total - 1 tokens (and at least the
        # prompt, which a scoring request with max_tokens 0 computes whole).
        needed = self.blocks.blocks_for(max(total - 1, len(prompt_ids)))
        if needed > self.blocks.num_blocks:
            raise ValueError(f"max_tokens: at full length ({total} tokens) the request needs {needed} KV blocks "
                             f"of {self.block_size} tokens; the pool holds only {self.blocks.num_blocks}")
        if params.pooling is not None or self.pooling.is_encoder:
            self._check_pooling(prompt_ids, params)
        if features is not None:
            if self.multimodal is None:
                raise ValueError("this model takes no images (it has no vision tower)")
            self.multimodal.check(prompt_ids, features)
        lora_load = self.loras.load_id(lora) if lora is not None else 0
        req = Request(rid, list(prompt_ids), params, priority=priority, arrival=next(self._arrivals),
                      eos_token_ids=self.eos_token_ids, lora=lora, features=features, cache_salt=cache_salt,
                      lora_load=lora_load)
        if params.guided is not None:
            req.guided = self.guided_registry().state_for(params.guided)
        if params.pooling is not None and params.pooling.method != "last":
            req.is_cacheable = False  # a cached prefix would skip hidden states mean or cls pooling needs
        if self.blocks.enable_prefix_caching and req.is_cacheable:
            req.update_block_hashes(self.block_size)
        self.requests[rid] = req
        if lora is not None:
            self.loras.add_user(lora)
        self.scheduler.add(req)

    def abort_request(self, rid: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Returns its final output, or None for an unknown id
        (already finished, or never added: aborts race with completion, so that is not an error)."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        self.sampler.release(req)
        self._pooled.pop(rid, None)
        if req.guided is not None and self._guided is not None:
            self._guided.forget(req.guided)
            if self._deferred is not None:
                self._deferred.drop(req)
        self._request_done(req)
        self._release_if_idle()
        return RequestOutput(rid, [], finished=True, finish_reason="abort",
                             num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens)

    def stats(self) -> EngineStats:
        blocks = self.blocks
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=blocks.usage, num_free_blocks=blocks.num_free_blocks, num_blocks=blocks.num_blocks,
            prefix_cache_queries=blocks.prefix_cache_queries, prefix_cache_hits=blocks.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, steps=self.steps,
            num_threads=self._num_threads(),
            extra={**self.loras.stats(), **(self.states.stats() if self.states is not None else {}),
                   **(self.multimodal.stats() if self.multimodal is not None else {}),
                   **({"spec": self.spec.stats(self.scheduler.running)} if self.spec is not None else {})})

    def _num_threads(self) -> int:
        if self.governor is not None:
            return self.governor.threads
        return self.threads.num_threads if self.threads is not None else 0

    def take_queue_times(self) -> list[tuple[str, float]]:
        """(rid, seconds from queued to first scheduled) for the requests the last step admitted for the
        first time (the scheduler times them); each is reported once."""
        return self.scheduler.take_queue_times()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, update. One output per request that got a token this step; a
        request in the middle of its prompt outputs nothing until the chunk that finishes it."""
        guided = self._guided
        yielding = guided is not None and guided.yields_to_step
        if yielding:  # the mask helper builds while the forward runs and while the step waits, not beside its host code
            guided.hold_floor()
        try:
            if self._deferred:  # rows whose masks were built since their logits came: sampled now, in time for this
                early = self._sample_deferred()  # step's forward
                self._guided.end_step()  # their next masks build during the forward
                if early:
                    return merge_outputs(early, self._step())
            return self._step()
        finally:
            if self._guided is not None:  # the grammars the step held go back to the guided helper thread
                self._guided.end_step()
            if yielding:
                guided.release_floor()

    def _step(self) -> list[RequestOutput]:
        if self.spec is not None:  # drafts for the rows about to decode, which the scheduler then sizes
            self.spec.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if self.spec is not None and self.states is not None:  # a hybrid's drafted rows keep a rollback state
            scheduled = self.spec.hold_states(scheduled)
        self.steps += 1
        if self.governor is not None:
            self.governor.tick()
        if self.multimodal is not None:  # the encoder slice the schedule charged
            self.multimodal.encodes.advance()
        if not scheduled:
            if self._deferred:  # only rows waiting for their masks: sample those built, else wait for one (no spin)
                outputs = self._sample_deferred()
                if not outputs:
                    self._guided.wait_for_masks()
                    outputs = self._sample_deferred()
                return outputs
            return []
        lora_slots = self.scheduler.lora_slots
        if lora_slots is not None and lora_slots.pending_loads:  # adapters newly resident: weights in place
            for slot, name in lora_slots.take_loads():
                self.runner.lora.load(slot, self.loras[name])
        plan = StepPlan(scheduled)  # the batch's rows: which sample, which carry prompt logprobs
        if self.states is not None:  # prefix hits' saved states into their new slots, before the forward reads them
            self.runner.copy_states(self.states.take_copies())
        # Without speculative decoding a row samples only once its mask is built (a late one is deferred, after a
        # grace: _process_logits). With it, the sampling rows' and drafted positions' masks are built on the guided
        # helper thread while the forward runs, and the step waits for what outlasts it.
        ahead = self._guided.build_ahead([r.guided for r in (plan.sample_reqs if self._deferred is None else [])
                                          + [s.req for s in plan.spec_spans] if r.guided is not None]) \
            if self._guided is not None else None
        # a helper that yields to the step's host code builds during the forward, which on a GPU means until the
        # device is done with it: the step waits for that here, the floor lent, rather than in the sampler holding it
        lend = self._guided is not None and self._guided.yields_to_step and (ahead or self._guided.has_work)
        began = time.perf_counter()
        try:
            if lend:
                self._guided.release_floor()
            if plan.pool_reqs:
                logits, pooled = self.runner.execute_pooling(plan.batch)
                self._add_pooled(plan, pooled)
            else:
                logits = self.runner.execute(plan.batch)  # [len(plan.batch.logit_indices), V] float32
            if lend and self.runner.device.type == "cuda":
                torch.cuda.current_stream(self.runner.device).synchronize()
            self._forward_s = time.perf_counter() - began
        finally:
            if lend:
                self._guided.hold_floor()
            if ahead is not None:
                self._guided.wait_ahead(ahead)
        if self.spec is not None:  # an MTP proposer drafts from the step's hidden states
            self.spec.observe(plan.scheduled, plan.batch.seqs)
        self._commit_forward(plan)
        if plan.prompt_spans:
            self._collect_prompt_logprobs(logits, plan.prompt_spans)
        scored = [self._finish_scored(req) for req in plan.scored_reqs] if plan.scored_reqs else []
        if plan.spec_spans:  # drafted rows: their accepted tokens and the target's next, through the verifier
            failures: list[tuple[Request, str, Exception]] = []
            scored += self.spec.verify(plan.spec_spans, logits, self._verify_hooks, failures)
            scored += [self._fail_alone(req, stage, error) for req, stage, error in failures]
        if not plan.sample_reqs and not self._deferred:
            self._release_if_idle()
            return scored
        # A fault in one request's logits processing, sampling or grammar fails that request alone (_fail_alone);
        # the others' tokens are what they would have been without it. Only the forward and the bookkeeping
        # around it are fatal (see the class).
        failures: list[tuple[Request, str, Exception]] = []
        logits, reqs = self._process_logits(plan, logits, failures)  # [len(reqs), V], row i for reqs[i]
        reqs, tokens, logprobs = self._sample(logits, reqs, failures)
        del logits  # a view of the runner's reused buffer, which an idle engine gives back
        outputs = scored + self._update(reqs, tokens, logprobs, failures)
        outputs += [self._fail_alone(req, stage, error) for req, stage, error in failures]
        self._release_if_idle()
        return outputs

    def _sample(self, logits: torch.Tensor, reqs: list[Request], failures: list
                ) -> tuple[list[Request], list[int], list | None]:
        """Each row's token (row i for reqs[i]) -> (the requests that drew one, their tokens, logprobs or None);
        a row whose sampling failed is left out and added to `failures`."""
        if not reqs:
            return reqs, [], None
        sampled = self.sampler.sample(logits, reqs, may_overwrite=True)
        tokens, logprobs = sampled.token_ids, sampled.logprobs
        if sampled.failed:
            failures += [(reqs[i], "sampling", error) for i, error in sampled.failed.items()]
            ok = [i for i in range(len(reqs)) if i not in sampled.failed]
            reqs, tokens = [reqs[i] for i in ok], [tokens[i] for i in ok]
            logprobs = [logprobs[i] for i in ok] if logprobs is not None else None
        return reqs, tokens, logprobs

    @property
    def _verify_hooks(self) -> VerifyHooks:
        return VerifyHooks(self._mask_rows, self._sample, self._update)

    def _fail_alone(self, req: Request, stage: str, error: Exception) -> RequestOutput:
        """A fault in one request's `stage` (logits processing, sampling, grammar): that request ends with
        finish_reason "error", freed as an abort frees it (KV blocks, penalty row, adapter use, grammar state),
        and the step goes on for the others. Its client gets a server error; the operator, the traceback."""
        log.error("request %s failed in %s; it alone ends, the engine goes on", req.rid, stage, exc_info=error)
        self.abort_request(req.rid)
        return RequestOutput(req.rid, [], finished=True, finish_reason="error", error=f"{stage} failed: {error!r}",
                             num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens)

    def _release_if_idle(self) -> None:
        """The last request is gone: the runner's step buffers go back (the core loop then trims the heap)."""
        if not self.requests:
            self.runner.release_buffers()

    def release_idle_kv(self) -> int:
        """Idle (the core loop calls it with its heap trim): keep the prefix cache's most recent blocks, moved to
        the pool's lowest ids, and give the KV pages above them back. Returns the bytes given back."""
        if self.requests or not self.runner.releases_idle_kv:
            return 0
        return self.runner.release_idle_kv(*self.blocks.compact(self.runner.idle_cached_blocks))

    def _finish_scored(self, req: Request) -> RequestOutput:
        """A max_tokens 0 request whose prompt is now computed: it ends at "length" with no token sampled (a
        pooling request with its vector)."""
        del self.requests[req.rid]
        self.scheduler.finish(req, "length")
        self.sampler.release(req)
        if req.lora is not None:
            self._request_done(req)
        pooled = self._pooled_vector(req) if req.params.pooling is not None else None
        return RequestOutput(req.rid, [], finished=True, finish_reason="length", prompt_logprobs=req.prompt_logprobs,
                             num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=0,
                             num_cached_tokens=req.num_cached_tokens, pooled=pooled)

    def _check_pooling(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """A pooling request this runner can answer (ValueError, failing it alone, otherwise)."""
        pooling = params.pooling
        if pooling is None:
            raise ValueError("this encoder model only pools (embeddings or rerank scores); it cannot generate")
        width = len(pooling.logit_ids) if pooling.logit_ids else self.runner.pooled_size
        if pooling.dimensions is not None and pooling.dimensions > width:
            raise ValueError(f"dimensions: {pooling.dimensions} is more than the model's {width}")
        if pooling.logit_ids:
            if self.pooling.is_encoder:
                raise ValueError("pooling: logit_ids need a language-model head; an encoder has none")
            if max(pooling.logit_ids) >= self.vocab_size:
                raise ValueError(f"pooling: logit_ids must be below the vocabulary size {self.vocab_size}")
        if self.pooling.is_encoder and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: an encoder has no language-model head")
        if self.pooling.is_encoder and len(prompt_ids) > self.scheduler.max_num_batched_tokens:
            # An encoder request runs whole in one step (no KV cache to carry a chunk over)
            raise ValueError(f"the input is {len(prompt_ids)} tokens; an encoder runs it in one step of at most "
                             f"{self.scheduler.max_num_batched_tokens} (--max-num-batched-tokens)")

    def _add_pooled(self, plan: StepPlan, pooled: torch.Tensor) -> None:
        """Keep each pooling request's sum of hidden states (a chunk that starts at 0 starts it afresh: a preempted
        request computes its prompt again)."""
        sums = self._pooled
        for i, (req, start) in enumerate(plan.pool_reqs):
            prior = sums.get(req.rid) if start > 0 else None
            sums[req.rid] = pooled[i] if prior is None else prior + pooled[i]

    def _pooled_vector(self, req: Request) -> list[float]:
        """The request's vector: its pooled hidden state (mean: over its tokens), or the logits of its logit_ids
        there, cut to `dimensions` and then L2-normalised when asked."""
        pooling = req.params.pooling
        vector = self._pooled.pop(req.rid)  # [hidden] float32
        if pooling.method == "mean":
            vector = vector / req.num_prompt_tokens
        if pooling.logit_ids:
            vector = self.runner.logits_of(vector.unsqueeze(0), list(pooling.logit_ids))[0]
        if pooling.dimensions is not None:
            vector = vector[:pooling.dimensions]
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()

    def _commit_forward(self, plan: StepPlan) -> None:
        """The forward wrote the KV of every scheduled token: count them computed, and publish the blocks they
        filled to the prefix cache (before _update may finish a request and free its blocks)."""
        blocks = self.blocks
        caching = blocks.enable_prefix_caching
        states = self.states if caching else None
        for req, num_new in plan.scheduled:
            # A drafted row's drafts are written but not counted: the verifier counts the ones it accepts
            num_computed = min(req.num_computed_tokens + num_new, len(req.token_ids))
            is_drafted = num_computed < req.num_computed_tokens + num_new
            req.num_computed_tokens = num_computed
            if caching and req.is_cacheable:
                req.num_published_blocks = blocks.publish_full_blocks(
                    req.block_ids, req.block_hashes, req.num_published_blocks, num_computed)
                if states is not None and not is_drafted:  # a hybrid's state at a block edge, saved beside that
                    # block (a drafted row's state has run past its computed tokens: the verifier saves it)
                    states.save(req, is_decode=num_computed > req.num_prompt_tokens)
        if states is not None:
            self.runner.copy_states(states.take_copies())

    def _process_logits(self, plan: StepPlan, logits: torch.Tensor, failures: list[tuple[Request, str, Exception]]
                        ) -> tuple[torch.Tensor, list[Request]]:
        """The forward's sampling rows with the per-row logits processors applied -> (rows [R, V], their R
        requests): plan.sample_reqs less those whose processing raised, which go to `failures`.

        Today's processor is each constrained row's grammar mask (EOS and stop ids only where the grammar may
        end), in place. The sampler's own (min_tokens, logit_bias, penalties) follow it, batched over every row.
        """
        reqs = plan.sample_reqs
        if not plan.samples_every_row:  # some rows were prompt-logprob rows: pick the sampling ones
            rows = torch.tensor(plan.sample_rows, dtype=torch.int64, device=logits.device)
            logits = logits.index_select(0, rows)  # [len(sample_reqs), V]
        if self._deferred is not None and self._guided is not None:  # rows whose masks are not built wait
            logits, reqs = self._deferred.split(logits, reqs, self._guided, GRACE_FRACTION * self._forward_s)
        return self._mask_rows(logits, reqs, failures)

    def _sample_deferred(self) -> list[RequestOutput]:
        """A step with no forward: the deferred rows whose masks are built now sample."""
        failures: list[tuple[Request, str, Exception]] = []
        empty = torch.empty(0, self.vocab_size, device=self.runner.device)
        logits, reqs = self._mask_rows(*self._deferred.split(empty, [], self._guided), failures)
        reqs, tokens, logprobs = self._sample(logits, reqs, failures)
        outputs = self._update(reqs, tokens, logprobs, failures)
        outputs += [self._fail_alone(req, stage, error) for req, stage, error in failures]
        self._release_if_idle()
        return outputs

    def _mask_rows(self, logits: torch.Tensor, reqs: list[Request], failures: list[tuple[Request, str, Exception]]
                   ) -> tuple[torch.Tensor, list[Request]]:
        """Each constrained row of logits [len(reqs), V] masked by its grammar's state now, in place -> (rows
        left, their requests): a request whose grammar raises goes to `failures`, its row dropped."""
        constrained = [(i, req.guided, req.guided_end_ids) for i, req in enumerate(reqs) if req.guided is not None]
        if not constrained:
            return logits, reqs
        try:
            apply_masks(logits, constrained)
            return logits, reqs
        except Exception:  # noqa: BLE001 - one grammar's fault: found row by row below, and fails that request alone
            pass
        failed = set()
        for entry in constrained:  # a mask only writes its own row, and writing it again changes nothing
            try:
                apply_masks(logits, [entry])
            except Exception as error:  # noqa: BLE001 - this request's grammar: _fail_alone reports it
                failed.add(entry[0])
                failures.append((reqs[entry[0]], "logits processing", error))
        if not failed:  # a fault that did not come back: every row is masked now
            return logits, reqs
        keep = [i for i in range(len(reqs)) if i not in failed]
        logits = logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
        return logits, [reqs[i] for i in keep]

    def _update(self, reqs: list[Request], tokens: list[int], logprobs: list | None,
                failures: list[tuple[Request, str, Exception]]) -> list[RequestOutput]:
        """Append each sampled token, advance its grammar, decide stop/length, and build the step's outputs.
        A request whose grammar raises goes to `failures`, with no output here."""
        bs = self.block_size
        caching = self.blocks.enable_prefix_caching
        max_model_len = self.max_model_len
        outputs = []
        for i, req in enumerate(reqs):
            token = tokens[i]
            num_before = req.num_output_tokens
            req.token_ids.append(token)
            req.num_output_tokens = num_before + 1
            if caching and len(req.token_ids) % bs == 0 and req.is_cacheable:
                req.update_block_hashes(bs)
            params = req.params
            reason = stop_reason = None
            if num_before >= params.min_tokens:
                if token in req.eos_ids:
                    reason = "stop"
                elif token in req.stop_ids:
                    reason, stop_reason = "stop", token
            guided = req.guided
            if guided is not None and reason is None:
                try:
                    guided.advance(token)
                    complete = guided.is_complete
                except Exception as error:  # noqa: BLE001 - this request's grammar: _fail_alone reports it
                    failures.append((req, "grammar", error))
                    continue
                if complete:  # the output is a whole match and nothing may follow
                    reason = "stop"
            if reason is None and (num_before + 1 >= params.max_tokens or len(req.token_ids) >= max_model_len):
                reason = "length"
            if guided is not None and reason is None and self._guided is not None:
                self._guided.prefetch(guided)  # its next mask: built on the helper thread from the step's end
            entry = logprobs[i] if logprobs is not None else None
            outputs.append(RequestOutput(
                req.rid, [token], finished=reason is not None, finish_reason=reason, stop_reason=stop_reason,
                logprobs=[entry] if entry is not None else None,
                prompt_logprobs=req.prompt_logprobs if num_before == 0 else None,
                num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=num_before + 1,
                num_cached_tokens=req.num_cached_tokens))
            if reason is not None:
                del self.requests[req.rid]
                self.scheduler.finish(req, reason, stop_reason)
                self.sampler.release(req)
                if req.lora is not None:
                    self._request_done(req)
        return outputs

    def _collect_prompt_logprobs(self, logits: torch.Tensor, chunks: list[PromptSpan]) -> None:
        """Rows of a prompt chunk predict the prompt's next tokens; gather their raw logprobs in one pass.

        Accumulated on the request across chunks and sent once, with its first output.
        """
        rows: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        spans = []
        for chunk in chunks:
            req, first_row, start, num_new = chunk.req, chunk.first_row, chunk.start, chunk.num_tokens
            # Row j predicts the token at start + j + 1, a prompt token only while that is < num_prompt.
            count = max(0, min(num_new, req.num_prompt_tokens - 1 - start))
            spans.append((req, start, num_new, len(rows), count))
            rows.extend(range(first_row, first_row + count))
            targets.extend(req.token_ids[start + 1:start + 1 + count])
            num_top.extend([req.params.prompt_logprobs] * count)
        entries = []
        if rows:
            dev = logits.device
            entries = rows_logprobs(logits, torch.tensor(rows, dtype=torch.int64, device=dev),
                                    torch.tensor(targets, dtype=torch.int64, device=dev), num_top)
        for req, start, num_new, offset, count in spans:
            if start == 0:
                req.prompt_logprobs.append(None)  # the first token has no context to be predicted from
            req.prompt_logprobs.extend(entries[offset:offset + count])
            if start + num_new == req.num_prompt_tokens:
                req.prompt_logprobs_done = True


def make_engine_core(config: EngineConfig, threads: ThreadPlan | None = None) -> EngineCore:
    """Module-level factory: functools.partial(make_engine_core, config) pickles into a spawned process.

    Sets torch's intra-op threads from `threads` (default: planned here from config.num_threads) first, so
    the load and the start-up probes already run on them; `core.threads` is the plan with the count torch
    then reports."""
    threads = plan_threads(config.num_threads) if threads is None else threads
    torch.set_num_threads(threads.num_threads)
    threads = dataclasses.replace(threads, num_threads=torch.get_num_threads())
    log.info("engine threads: %d (%s)", threads.num_threads, threads.reason)
    core = EngineCore(config)
    core.threads = threads
    if threads.adaptive and core.runner.device.type == "cpu":
        core.governor = ThreadGovernor(threads.num_threads, torch.set_num_threads)
    return core
