"""A configuration's allowed tokens as an id list, and how it masks one logits row in place.

Core side; built by matcher.GrammarRuntime, read by the step's apply_masks."""
from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence

import torch

_NEG_INF = float("-inf")
# float32 -inf's bits as a 32-bit int: the pattern wmemset repeats over a row
_NEG_INF_BITS = -0x800000
# A short allow list (a key's letters, a digit: most of a JSON output's masks) of at most this many ids is kept as
# Python ints and applied to a CPU row without a torch op (_apply_short).
SHORT_MAX_IDS = 64


def _find_wmemset():
    """libc's wmemset, which fills 4-byte words (glibc: wchar_t is 4 bytes), or None where there is none."""
    if ctypes.sizeof(ctypes.c_wchar) != 4:
        return None
    try:
        fill = ctypes.CDLL(None).wmemset
    except (OSError, AttributeError, TypeError):  # no process-wide symbol table (Windows)
        return None
    fill.restype = ctypes.c_void_p
    fill.argtypes = (ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t)
    return fill


_wmemset = _find_wmemset()
_row_types: dict[int, type] = {}  # a ctypes float array type per row length


def id_tensor(ids: list[int]) -> torch.Tensor:
    """An int64 tensor of a list of ids, through an array: torch.tensor(list) reads each int through Python
    (3.6 ms for 5,000 ids on the loaded box, against 1.2 ms this way), and cold masks make many such lists."""
    if not ids:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array("q", ids), dtype=torch.int64)


def to_device(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: as it is on the CPU; to a CUDA device through pinned memory, not waited for. A
    copy from pageable memory waits for the work queued before it on the stream, so a mask made, or a step's masks
    applied, while the forward runs would wait for the forward to end. The copy is queued on that stream, ahead of
    whatever reads it there."""
    if device.type == "cuda" and ids.is_cpu and ids.numel():
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


class TokenMask:
    """The tokens a configuration allows, kept as the shorter of the allowed or the banned id list.

    Special tokens the grammar names are in it; EOS is not (it depends on the request's EOS ids and
    is added when the configuration accepts). A short allow list for CPU rows (`short`) keeps its ids as Python
    ints too, and makes their tensor only when asked for it.
    """

    __slots__ = ("is_allow_list", "_ids", "id_list", "num_allowed", "accepting")

    def __init__(self, is_allow_list: bool, ids: torch.Tensor | None, num_allowed: int, accepting: bool,
                 id_list: tuple[int, ...] | None = None) -> None:
        self.is_allow_list = is_allow_list
        self._ids = ids  # int64 on the logits' device
        self.id_list = id_list  # a short allow list's ids, sorted
        self.num_allowed = num_allowed
        self.accepting = accepting

    @classmethod
    def short(cls, ids: list[int], accepting: bool) -> TokenMask:
        """A CPU allow list of at most SHORT_MAX_IDS sorted ids. Why: after a forward (in the bench, a row's
        normal_()) each torch op's first call costs ~20 us on this box against ~5 warm, and a key's mask is otherwise
        three of them to apply and one to make: nested20's cold pass applies 335 such masks of 490."""
        return cls(True, None, len(ids), accepting, tuple(ids))

    @property
    def ids(self) -> torch.Tensor:
        ids = self._ids
        if ids is None:  # two threads may both make it: equal tensors, either kept
            ids = self._ids = id_tensor(list(self.id_list))
        return ids

    @property
    def nbytes(self) -> int:
        return 8 * (len(self.id_list) if self._ids is None else self._ids.numel())

    def apply(self, row: torch.Tensor, eos_ids: list[int]) -> None:
        """Set every disallowed logit of `row` ([V]) to -inf, in place. EOS stays only if accepting;
        a configuration that allows nothing at all allows EOS, so the request can end."""
        keep_eos = self.keeps_eos(eos_ids)
        if self.id_list is not None and self._apply_short(row, keep_eos):
            return
        if self.is_allow_list:
            ids = self.ids
            if keep_eos:
                ids = torch.cat((ids, _ids_on(keep_eos, ids.device)))
            values = row.index_select(0, ids)
            row.fill_(_NEG_INF)
            row.index_copy_(0, ids, values)
            return
        if keep_eos:
            eos = _ids_on(keep_eos, row.device)
            saved = row.index_select(0, eos)
            row.index_fill_(0, self.ids, _NEG_INF)
            row.index_copy_(0, eos, saved)
        else:
            row.index_fill_(0, self.ids, _NEG_INF)

    def _apply_short(self, row: torch.Tensor, keep_eos) -> bool:
        """A short allow list on a contiguous float32 CPU row, through the row's memory: its allowed logits read,
        the row filled with -inf by libc's wmemset, and they written back. False (nothing written) where the row or
        an id does not fit that, for the torch ops to take it (and raise on an id out of range, as they do)."""
        if _wmemset is None or not row.is_cpu or row.dtype != torch.float32 or not row.is_contiguous() or \
                row.requires_grad:
            return False
        n = row.numel()
        ids = self.id_list
        if ids and (ids[0] < 0 or ids[-1] >= n):
            return False
        if keep_eos:
            if not all(0 <= e < n for e in keep_eos):
                return False
            ids = ids + tuple(keep_eos)
        address = row.data_ptr()
        row_type = _row_types.get(n)
        if row_type is None:
            row_type = _row_types[n] = ctypes.c_float * n
        values = row_type.from_address(address)
        kept = [values[i] for i in ids]
        _wmemset(address, _NEG_INF_BITS, n)
        for i, value in zip(ids, kept):
            values[i] = value
        return True

    def keeps_eos(self, eos_ids: Sequence[int]) -> Sequence[int]:
        """The end ids this mask leaves alone: all where it accepts or allows nothing (so the request can end)."""
        return eos_ids if (self.accepting or self.num_allowed == 0) else ()

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[V] bool (tests and the brute-force check)."""
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.ids.cpu()] = True
        return mask if self.is_allow_list else ~mask


def apply_rows(logits: torch.Tensor, rows: list[tuple[int, TokenMask, Sequence[int]]]) -> None:
    """Mask rows of a step's logits ([B, V], in place) at once: (row, its mask, its end ids), as each mask's
    apply() would, in the same torch ops whatever the number of rows (16 for mixed rows; apply() takes three or four
    a row). For a GPU's logits, where each op is a kernel launch the host pays for, and a GIL hand-over while the
    mask helper builds (bench.gil_convoy).

    Allow-list rows are gathered, filled with -inf but for their ids (and end ids where kept), and put back;
    ban-list rows get -inf at their ids, the end ids they keep saved before and written back after.
    """
    if not rows:
        return
    device = logits.device
    allow_rows, allow_ids, counts_a, ban_rows, ban_ids, counts_b, kept_rows, kept_ids = [], [], [], [], [], [], [], []
    for i, mask, end_ids in rows:
        keep = mask.keeps_eos(end_ids)
        ids = mask.ids
        if mask.is_allow_list:  # its ids, then the end ids it keeps: one run of the columns below
            allow_rows.append(i)
            allow_ids.append(ids)
            if keep:
                allow_ids.append(_ids_on(keep, device))
            counts_a.append(ids.numel() + len(keep))
        else:
            ban_rows.append(i)
            ban_ids.append(ids)
            counts_b.append(ids.numel())
            kept_rows += [i] * len(keep)
            kept_ids += keep
    # one host-to-device copy for every row number, count and kept end id the ops below read
    meta = to_device(id_tensor(allow_rows + counts_a + ban_rows + counts_b + kept_rows + kept_ids), device)
    allow_at, counts_a_at, ban_at, counts_b_at, kept_rows_at, kept_ids_at = meta.split(
        [len(allow_rows), len(counts_a), len(ban_rows), len(counts_b), len(kept_rows), len(kept_ids)])
    if ban_rows:
        saved = logits[kept_rows_at, kept_ids_at] if kept_rows else None
        rows_of = torch.repeat_interleave(ban_at, counts_b_at, output_size=sum(counts_b))
        logits.index_put_((rows_of, torch.cat(ban_ids)), logits.new_full((1,), _NEG_INF))
        if saved is not None:
            logits.index_put_((kept_rows_at, kept_ids_at), saved)
    if allow_rows:
        n = len(allow_rows)
        local = torch.repeat_interleave(torch.arange(n, device=device), counts_a_at, output_size=sum(counts_a))
        cols = torch.cat(allow_ids)
        picked = logits.index_select(0, allow_at)
        kept = torch.full_like(picked, _NEG_INF)
        kept.index_put_((local, cols), picked[local, cols])
        logits.index_copy_(0, allow_at, kept)


# (end ids, device) -> their int64 tensor there, made once rather than copied from host memory at each use
_eos_tensors: dict[tuple, torch.Tensor] = {}
_MAX_EOS_TENSORS = 256  # requests name their own stop ids: past this many sets, the kept ones are dropped


def _ids_on(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    key = (tuple(ids), str(device))
    t = _eos_tensors.get(key)
    if t is None:
        if len(_eos_tensors) >= _MAX_EOS_TENSORS:
            _eos_tensors.clear()
        t = _eos_tensors[key] = to_device(id_tensor(list(key[0])), torch.device(device))
    return t
