"""A CompiledGrammar's per-state edge lists as the automaton reads them: flat ints (as compile_grammar packs them and
a pickle carries them), with the middle copies of a long repeat run left virtual (read off one built copy moved
on), or a hand-made grammar's plain lists. Pure Python, no torch."""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from operator import ne, or_

# A virtual span: (first, stride, count, template, lo, hi). States first .. first + count * stride - 1 are `count`
# copies of the `stride` states from `template` on, copy k moved (k + 1) * stride on: each edge's target
# (its last item) in lo .. hi - 1 (the whole repeat run) moves with it, the others (where the run ends) stay.
Virtual = tuple[int, int, int, int, int, int]


def _source(virtual: list[Virtual], firsts: tuple[int, ...], s: int) -> tuple[int, int, int, int]:
    """(template state, shift, lo, hi) for a virtual state s; (-1, 0, 0, 0) for a state with rows of its own.
    `virtual` sorted, its spans' firsts in `firsts`: the spans are disjoint (each is made at the builder's end), and
    a bisection finds the span: a pass over them (nested20 has 12) was ~2% of the bytecode nested20's later cold passes
    ran."""
    i = bisect_right(firsts, s) - 1
    if i >= 0:
        first, stride, count, template, lo, hi = virtual[i]
        if s < first + count * stride:
            k, j = divmod(s - first, stride)
            return template + j, (k + 1) * stride, lo, hi
    return -1, 0, 0, 0


def _moved(row: list, width: int, shift: int, lo: int, hi: int) -> list:
    if width == 1:
        return [t + shift if lo <= t < hi else t for t in row]
    return [(*edge[:-1], edge[-1] + shift) if lo <= edge[-1] < hi else edge for edge in row]


class PackedRows:
    """Per-state edge lists read from flat ints (a pickled CompiledGrammar): rows[s] is state s's tuple (of ints,
    or of width-tuples); a virtual state's is its template's moved on."""

    __slots__ = ("offsets", "flat", "width", "virtual", "_firsts", "_is_virtual", "_tuples")

    def __init__(self, offsets: Sequence[int], flat: Sequence[int], width: int, virtual: list[Virtual] = ()) -> None:
        self.offsets, self.flat, self.width, self.virtual = offsets, flat, width, sorted(virtual)
        self._firsts = tuple(span[0] for span in self.virtual)
        # per state 1 where it is virtual: asked at a row's first read, where a walk of the spans cost a cold
        # first pass a tenth of its time
        self._is_virtual = bytearray(len(offsets) - 1)
        for first, stride, count, _, _, _ in self.virtual:
            self._is_virtual[first:first + count * stride] = b"\x01" * (count * stride)
        # rows made once per state read: a configuration's expansion and closures read the same few states
        # hundreds of times, and regrouping the flat ints at every read topped a cold mask's profile. Tuples, not
        # lists: the garbage collector untracks a tuple of ints (or of int tuples) at its first collection, where
        # a kept list (thousands per cold pass, most of them empty) is walked by every collection it is young for
        self._tuples: dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, s: int) -> tuple:
        row = self._tuples.get(s)
        if row is None:
            if self._is_virtual[s]:
                src, shift, lo, hi = _source(self.virtual, self._firsts, s)
                row = tuple(_moved(self[src], self.width, shift, lo, hi))
            else:
                a, b = self.offsets[s], self.offsets[s + 1]
                width = self.width
                # most rows read are empty or one edge (~2.5k first reads in nested20's cold pass): those without
                # regrouping, at a third of the zip's cost
                if a == b:
                    row = ()
                elif width == 1:
                    row = tuple(self.flat[a:b])
                elif b - a == width:
                    row = (tuple(self.flat[a:b]),)
                else:
                    row = tuple(zip(*[iter(self.flat[a:b])] * width))
            self._tuples[s] = row
        return row

    def __iter__(self):
        return (self[s] for s in range(len(self)))

    def reader(self) -> Callable[[int], tuple | None]:
        """A C-level s -> row for the rows read before, None where rows[s] must be asked: closures and expansions
        read rows ~14k times in nested20's first pass, ~20 ms of its cProfile as calls of __getitem__."""
        return self._tuples.get


def row_reader(rows) -> Callable[[int], Sequence | None]:
    """A C-level s -> row for any edge lists (plain lists, PackedRows); None where rows[s] must be asked instead."""
    return rows.__getitem__ if isinstance(rows, list) else rows.reader()


def edge_states(rows) -> bytearray:
    """Per state: 1 where it has an edge in these edge lists (a virtual state as its template), found from the edges:
    the owner of each packed edge by bisection of the offsets, then each span copied from its template. For edge
    lists with few edges (epsilon moves, calls: ~150 of nested20's 12,772 states), where has_edges reads every
    state's offsets."""
    if not isinstance(rows, PackedRows):
        return bytearray(1 if row else 0 for row in rows)
    out = bytearray(len(rows))
    offsets = rows.offsets
    for i in range(0, len(rows.flat), rows.width):
        out[bisect_right(offsets, i) - 1] = 1
    for first, stride, count, template, _, _ in rows.virtual:
        out[first:first + count * stride] = out[template:template + stride] * count
    return out


def has_any_edge(rows) -> bool:
    """Whether any state has an edge in these edge lists (a virtual state's are its template's)."""
    if isinstance(rows, PackedRows):
        return len(rows.flat) > 0
    return any(rows)


def has_edges(a, b) -> list[bool]:
    """Per state: any edge in a or b (from the offsets alone when the lists are flat; a virtual state as its
    template)."""
    if not (isinstance(a, PackedRows) and isinstance(b, PackedRows)):
        return [bool(a[s] or b[s]) for s in range(len(a))]  # plain lists have no virtual states
    # The states outside the virtual spans alone (the spans are filled from their templates below): 1,352 of
    # nested20's 12,772, where a pass over all of them was most of a new grammar's Automaton. Compared by C-level
    # maps, and b's offsets not at all when b has no edge (a schema's token edges): a comprehension over the four
    # offsets zipped was still half of GrammarRuntime's making.
    ao, bo = a.offsets, (b.offsets if len(b.flat) else None)
    out = [False] * len(a)
    at = 0
    for begin, end in sorted((first, first + count * stride) for first, stride, count, _, _, _ in a.virtual):
        out[at:begin] = _any_edge(ao, bo, at, begin)
        at = end
    out[at:] = _any_edge(ao, bo, at, len(a))
    for first, stride, count, template, _, _ in a.virtual:
        out[first:first + count * stride] = out[template:template + stride] * count
    return out


def _any_edge(ao: Sequence[int], bo: Sequence[int] | None, begin: int, end: int) -> list[bool]:
    """Per state of begin .. end - 1: whether its offsets in ao (or in bo) say it has an edge."""
    found = map(ne, ao[begin:end], ao[begin + 1:end + 1])
    if bo is not None:
        found = map(or_, found, map(ne, bo[begin:end], bo[begin + 1:end + 1]))
    return list(found)
