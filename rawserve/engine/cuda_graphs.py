"""DecodeGraphs: decode steps captured as CUDA graphs for a ladder of batch sizes, replayed with padding.

Only steps where every sequence decodes one token and no row has a LoRA adapter replay; the caller runs any
other step, or a batch past the largest graph, eagerly. Needs the triton backend (the torch one is not capturable).
"""
from __future__ import annotations

import functools
import logging

import torch

from rawserve.engine.attention.metadata import AttentionMetadata, decode_splits

log = logging.getLogger("rawserve.engine")

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured sizes: the ladder up to max_num_seqs (capped at 512), and max_num_seqs itself."""
    top = min(max_num_seqs, BATCH_LADDER[-1])
    return sorted({b for b in BATCH_LADDER if b < top} | {top})


class DecodeGraphs:
    """Static input buffers sized for the largest graph; graph b reads their first b rows.

    Padding rows write no KV (slot -1) and see no context (length 0), so their output is 0 and unused.
    capture=False runs the same padded static batch without graphs: how a CPU test checks the padding.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device,
                 capture: bool = True) -> None:
        self.sizes = batch_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.num_replays = 0  # steps served from the static buffers (tests read it)
        top = self.sizes[-1]
        kw = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(top, **kw)
        self.positions = torch.zeros(top, **kw)
        self.slot_mapping = torch.full((top,), -1, **kw)
        self.seq_lens = torch.zeros(top, **kw)
        self.block_tables = torch.zeros((top, self.max_blocks), **kw)
        self.rows = torch.arange(top, **kw)  # decode b is token b of sequence b
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        num_kv_heads = kv_caches[0][0].shape[2]
        self.forwards: dict[int, functools.partial] = {}  # size -> a call running the model on the buffers' first `size` rows
        for size in self.sizes:
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
                seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], query_start_loc_cpu=[],
                seq_lens_cpu=[], decode_token_ids=self.rows[:size], max_decode_len=max_model_len,
                prefill_seq_ids=[], block_size=block_size, decode_seq_ids=self.rows[:size],
                decode_num_splits=decode_splits(size, num_kv_heads, max_model_len))
            self.forwards[size] = functools.partial(model, self.input_ids[:size], self.positions[:size], kv_caches,
                                                    meta)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [size, hidden]: each graph's final hidden states
        if capture:
            self._capture(device)

    def _capture(self, device: torch.device) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            # Warm up on a side stream (triton compiles, cuBLAS picks its kernels) before capturing.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.inference_mode():
                self.forwards[size]()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                self.outputs[size] = self.forwards[size]()
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        log.info("cuda graphs: decode captured for batch sizes %s", self.sizes)

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.sizes[-1] and max_blocks <= self.max_blocks

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """One decode step from host tensors ([n] each, tables [n, w]) -> hidden states [n, hidden].

        The copies are asynchronous and nothing here waits on the device.
        """
        n, width = block_tables.shape
        size = next(b for b in self.sizes if b >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].zero_()
        graph = self.graphs.get(size)
        if graph is None:
            hidden = self.forwards[size]()
        else:
            graph.replay()
            hidden = self.outputs[size]
        self.num_replays += 1
        return hidden[:n]
