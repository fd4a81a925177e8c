"""MTPProposer: Qwen3.5's multi-token-prediction layer (the checkpoint's mtp.* tensors) drafts k tokens from the
target's final hidden states, one MTP forward per draft, its KV pool indexed by the target's block ids.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from rawserve.engine.attention.metadata import AttentionMetadata
from rawserve.engine.kv_cache import KVCacheManager
from rawserve.engine.loader import CheckpointError, load_weights, read_safetensors_header, safetensors_files
from rawserve.engine.model_runner import ModelRunner
from rawserve.engine.models.decoder import LinearOwner, _param
from rawserve.engine.models.qwen35 import GatedAttentionLayer, offset_rms_norm
from rawserve.engine.models.packed import cpu_prepack_supported
from rawserve.engine.multimodal.positions import mrope_positions
from rawserve.engine.quant import QuantPlan, quantize
from rawserve.engine.request import Request
from rawserve.engine.step_plan import ForwardBatch, StepInput

log = logging.getLogger("rawserve.engine.spec")

PREFIX = "mtp."
# The target's hidden states a request keeps for the MTP layer while it does not draft (a prompt's chunks, a
# paused row, a step over disable_by_batch_size): past this many (2 MiB a request at Qwen3.5-0.8B's bf16 width)
# the oldest go, and the MTP attends stale KV there (worse drafts, the same output)
_MAX_STASH_ROWS = 1024


class MTPHead(LinearOwner):
    """Qwen3.5's MTP block as vLLM's Qwen3NextMTP computes it: for the token at position i + 1 and the target's
    final hidden state at i, x = fc(cat(norm_e(embed(token)), norm_h(hidden))), one gated full-attention layer
    at position i (its own KV), then norm; the target's LM head turns that into the draft after token i + 1, and
    the normed output is the hidden state the next draft is made from. Every norm is Qwen3.5's (1 + w)."""

    linear_names = ("fc",)

    def __init__(self, target: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(len(target.layers))
        cfg = target.cfg
        self.target = [target]  # the embedding, rope tables and head are the target's (a list: not a submodule)
        self.fc = _param(cfg.hidden_size, 2 * cfg.hidden_size, dtype=dtype)
        self.pre_fc_norm_embedding = _param(cfg.hidden_size, dtype=dtype)
        self.pre_fc_norm_hidden = _param(cfg.hidden_size, dtype=dtype)
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        attention = next(layer.attention for layer in target.layers if isinstance(layer, GatedAttentionLayer))
        self.layer = GatedAttentionLayer(cfg, dtype, len(target.layers), attention)
        self.eps = cfg.rms_norm_eps
        self.scales: dict[str, torch.Tensor] = {}

    def targets(self) -> dict:
        hidden = self.pre_fc_norm_hidden.shape[0]
        t = {f"{PREFIX}fc.weight": (self.fc, 0, hidden)}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            t[f"{PREFIX}{name}.weight"] = (getattr(self, name), 0, hidden)
        t.update(self.layer.targets(f"{PREFIX}layers.0"))
        return t

    def finish_load(self) -> None:
        self.layer.fuse_qk_norm()
        self.scales = {name: 1.0 + getattr(self, name).detach().float()
                       for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] (tokens i + 1), positions [T] (i) or, for a batch with images, [3, T] (position i's
        M-RoPE position, as the target's), hidden [T, H] (the target's, or this head's own output for a further
        draft) -> normed output [T, H]."""
        target = self.target[0]
        dtype = self.norm.dtype
        e = offset_rms_norm(nn.functional.embedding(input_ids, target.embed_tokens).to(dtype),
                            self.scales["pre_fc_norm_embedding"], self.eps)
        h = offset_rms_norm(hidden.to(dtype), self.scales["pre_fc_norm_hidden"], self.eps)
        x = self.linear(torch.cat((e, h), dim=-1), "fc")
        cos, sin = target.rope_tables(positions)
        x = self.layer(x, cos, sin, kv_cache, meta)
        return offset_rms_norm(x, self.scales["norm"], self.eps)


def load_mtp_head(runner: ModelRunner) -> MTPHead:
    """The MTP block from the target's checkpoint in the target's dtype, its linears quantized as the target's
    under --quantization (ValueError naming the flag when the checkpoint is not a Qwen3.5 one with mtp.*
    tensors)."""
    cfg = runner.model_config
    if cfg.hybrid is None:
        raise ValueError("--speculative-config: method mtp needs a Qwen3.5 checkpoint (its mtp.* tensors)")
    with torch.device("meta"):
        head = MTPHead(runner.model, runner.dtype)
    targets = head.targets()
    names = {e.name for f in safetensors_files(runner.config.model_dir) for e in read_safetensors_header(f)}
    missing = sorted(set(targets) - names)
    if missing:
        raise ValueError(f"--speculative-config: method mtp: the checkpoint lacks {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''} ({len(missing)} of the MTP block's tensors)")
    head.to_empty(device=runner.device)  # new parameters: the targets are taken again
    try:
        # every tensor but the MTP block's is set aside
        load_weights(runner.config.model_dir, head.targets(), set_aside=("",), log_set_aside=False)
    except CheckpointError as error:
        raise ValueError(f"--speculative-config: method mtp: {error}") from None
    head.finish_load()
    if runner.quant is not None:
        quantize_head(head, runner.quant)
    if runner.device.type == "cpu" and cpu_prepack_supported(runner.dtype):  # as the target's linears (2-4x)
        head.prepack()  # what quantize_head left dense
        head.layer.prepack()
    return head.eval()


def quantize_head(head: MTPHead, plan: QuantPlan) -> None:
    """fc and the layer's linears quantized as DecoderModel.defer_quantized quantizes the target's: each shape the
    kernel takes, the rest left dense. After loading, not as the slices arrive: the block is one layer, so its
    dense copy is a small, short-lived peak."""
    for owner in (head, head.layer):
        for name in owner.linear_names:
            param = getattr(owner, name)
            quantized = quantize(param.detach(), plan)
            if quantized is not None:
                owner.quant[name] = quantized
                setattr(owner, name, nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=False))


@dataclasses.dataclass(slots=True)
class MTPProgress:
    """What of a request the MTP layer's KV holds, and the target's hidden states it has not yet consumed.
    Row i of the MTP KV is (token i + 1, the target's hidden state at i), at position i: `num_rows` rows, in
    these blocks. `hidden` [m, H] are the target's final hidden states at positions hidden_start.. (cut, when
    read, to the positions whose token is accepted)."""
    num_rows: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)
    hidden: torch.Tensor | None = None
    hidden_start: int = 0

    def add(self, start: int, rows: torch.Tensor) -> None:
        """The target's hidden states at positions start.. from a forward; later ones replace earlier ones (a
        hybrid recomputes its accepted tokens after a rejection, a preempted request its whole sequence)."""
        if self.hidden is not None and self.hidden_start <= start <= self.hidden_start + self.hidden.shape[0]:
            rows = torch.cat((self.hidden[:start - self.hidden_start], rows))
            start = self.hidden_start
        if rows.shape[0] > _MAX_STASH_ROWS:
            start += rows.shape[0] - _MAX_STASH_ROWS
            rows = rows[-_MAX_STASH_ROWS:]
        self.hidden, self.hidden_start = rows, start


class MTPProposer:
    """Drafts for DraftModelProposer's seam (propose_batch). Before drafting, each row catches the MTP KV up
    with the target's hidden states of its newly accepted tokens; the last of those rows gives the first draft,
    and each further draft feeds the head's own output back at the next position."""

    def __init__(self, runner: ModelRunner, blocks: KVCacheManager) -> None:
        self.runner = runner
        self.head = load_mtp_head(runner)
        cfg = runner.model_config
        shape = (blocks.num_blocks, blocks.block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed, not empty: attention reads a whole block, and a masked NaN would still poison its sums
        self.kv_cache = (torch.zeros(shape, dtype=runner.kv_dtype, device=runner.device),
                         torch.zeros(shape, dtype=runner.kv_dtype, device=runner.device))
        self.blocks = blocks
        self.block_size = blocks.block_size
        runner.keep_hidden = True
        log.info("MTP head: 1 layer, KV pool of %d blocks (%.1f MiB)", blocks.num_blocks,
                 2 * self.kv_cache[0].numel() * self.kv_cache[0].element_size() / 2 ** 20)

    def observe(self, scheduled: list[tuple[Request, int]], seqs: list[StepInput]) -> None:
        """After a target forward: keep each generating request's final hidden states (runner.last_hidden)."""
        hidden = self.runner.last_hidden
        if hidden is None:
            return
        offset = 0
        for (req, _), seq in zip(scheduled, seqs):
            n = len(seq.token_ids)
            state = req.spec_state  # verify.RowState, made for every scheduled request (SpecDecoder.observe)
            if state is not None:
                if state.mtp is None:
                    state.mtp = MTPProgress()
                state.mtp.add(seq.num_computed_tokens, hidden[offset:offset + n].clone())
            offset += n
        self.runner.last_hidden = None

    def propose_batch(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] drafts for each request (one, where KV blocks for more cannot be had; none where the
        target's hidden states of its last accepted token are missing)."""
        rows: list[tuple[Request, int, torch.Tensor]] = []
        seqs: list[StepInput] = []
        blocks = self.blocks
        reserve = len(reqs)  # as DraftModelProposer: drafting never makes the scheduler preempt for a decode
        for req, k in zip(reqs, ks):
            progress = req.spec_state.mtp if req.spec_state is not None else None
            last = req.num_tokens - 1  # rows 0 .. last - 1 have their token; row last - 1 drafts
            if progress is None or progress.hidden is None:
                continue
            start = self._valid_rows(req, progress)
            end_known = progress.hidden_start + progress.hidden.shape[0]
            if progress.hidden_start > start:  # a prefix hit, or rows dropped: the pool's rows stand as they are
                start = progress.hidden_start
            if end_known < last or start >= last:
                continue
            hidden = progress.hidden[start - progress.hidden_start:last - progress.hidden_start]
            # Rows up to last - 1, and the further drafts' up to last + k - 2; a hybrid that rejected a draft has
            # its blocks trimmed to its computed tokens, short of `last` (its next step recomputes them anyway)
            for k in range(k, 0, -1):
                needed = blocks.blocks_for(last + k - 1) - len(req.block_ids)
                if needed <= 0 or (needed <= blocks.num_free_blocks - reserve
                                   and blocks.allocate(req.block_ids, last + k - 1)):
                    break
            else:
                continue
            rows.append((req, k, hidden))
            seqs.append(StepInput(req.token_ids[start + 1:last + 1], start, req.block_ids, features=req.features))
        drafts: dict[str, list[int]] = {req.rid: [] for req in reqs}
        if not rows:
            return [drafts[req.rid] for req in reqs]
        tokens, out = self._run(seqs, torch.cat([hidden for _, _, hidden in rows]))
        active = []
        for i, ((req, k, _), token) in enumerate(zip(rows, tokens)):
            drafts[req.rid].append(token)
            progress = req.spec_state.mtp
            progress.num_rows = last = req.num_tokens - 1
            progress.block_ids = req.block_ids[:-(-last // self.block_size)]
            # Consumed; any past `last` are stale (a rejected draft's position, or the uncomputed bonus token's)
            progress.hidden, progress.hidden_start = progress.hidden[:0], last
            active.append(i)
        for j in range(1, max(k for _, k, _ in rows)):
            active = [i for i in active if rows[i][1] > j]
            seqs = [StepInput([drafts[rows[i][0].rid][-1]], rows[i][0].num_tokens - 2 + j, rows[i][0].block_ids,
                              features=rows[i][0].features) for i in active]
            tokens, out_next = self._run(seqs, out[torch.tensor(active, dtype=torch.int64, device=out.device)])
            for i, token in zip(active, tokens):
                drafts[rows[i][0].rid].append(token)
            out = torch.zeros_like(out).index_copy_(0, torch.tensor(active, dtype=torch.int64, device=out.device),
                                                    out_next)
        return [drafts[req.rid] for req in reqs]

    def _run(self, seqs: list[StepInput], hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """One MTP forward -> (each sequence's greedy draft, its last row's output [len(seqs), H])."""
        batch = ForwardBatch.last_tokens(seqs)
        with torch.inference_mode():
            input_ids, positions, meta, rows = self.runner.step_metadata(batch)
            out = self.head(input_ids, self._positions(seqs, positions), hidden, self.kv_cache, meta)[rows]
            tokens = self.runner.model.compute_logits(out).argmax(dim=-1).tolist()
        return tokens, out

    def _positions(self, seqs: list[StepInput], positions: torch.Tensor) -> torch.Tensor:
        """An image request's rows at the target's own M-RoPE positions ([3, T] for the batch, as the runner
        gives the target's layers): MTP row i sits at position i, which past an image is i plus the images'
        rope delta in every stream, and inside one its grid's rows and columns."""
        multimodal = self.runner.multimodal
        if multimodal is None or all(seq.features is None for seq in seqs):
            return positions
        patch, merge = multimodal.preprocess.patch_size, multimodal.preprocess.merge_size
        parts = []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + len(seq.token_ids)
            parts.append(torch.arange(start, end, dtype=torch.int64).expand(3, -1) if seq.features is None
                         else mrope_positions(seq.features.images, start, end, patch, merge))
        return torch.cat(parts, dim=1).to(positions.device)

    def _valid_rows(self, req: Request, progress: MTPProgress) -> int:
        """Rows of req whose MTP KV is in its blocks now: cut to the blocks still the same (a preemption or a
        trim gave others back)."""
        same = 0
        for a, b in zip(progress.block_ids, req.block_ids):
            if a != b:
                break
            same += 1
        return min(progress.num_rows, same * self.block_size)
