"""A configuration's allowed tokens as an id list, and how it masks one logits row in place.

Core side; built by matcher.GrammarRuntime, read by the step's apply_masks."""
from __future__ import annotations

import ctypes
from array import array

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
        keep_eos = eos_ids if (self.accepting or self.num_allowed == 0) else ()
        if self.id_list is not None and self._apply_short(row, keep_eos):
            return
        if self.is_allow_list:
            ids = self.ids
            if keep_eos:
                ids = torch.cat((ids, torch.tensor(keep_eos, dtype=torch.int64, device=ids.device)))
            values = row.index_select(0, ids)
            row.fill_(_NEG_INF)
            row.index_copy_(0, ids, values)
            return
        if keep_eos:
            eos = torch.tensor(keep_eos, dtype=torch.int64, device=row.device)
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

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[V] bool (tests and the brute-force check)."""
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.ids.cpu()] = True
        return mask if self.is_allow_list else ~mask
