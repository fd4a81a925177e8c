"""JSON numbers and integers as grammar IR, and minimum/maximum/exclusive*/multipleOf as exact decimal ranges.
At most 19 integer, 16 fraction and 3 exponent digits; integers are never `1.0`; exponents only on a side the bounds
leave open (`minimum: 0` allows `1e5`). A text within one double ulp of an exclusive bound may round onto that bound."""
from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

from .grammar import EMPTY, GrammarError, Node, Repeat, alt, byte_set, lit, optional, seq
from .json_strings import chars

INT_DIGITS = 19  # integer part of integers and numbers
FRAC_DIGITS = 16
EXP_DIGITS = 3

DIGIT = byte_set([(0x30, 0x39)])
_UINT = alt(lit("0"), seq(byte_set([(0x31, 0x39)]), Repeat(DIGIT, 0, INT_DIGITS - 1)))
_FRACTION = optional(seq(lit("."), Repeat(DIGIT, 1, FRAC_DIGITS)))
_EXPONENT = optional(seq(chars("eE"), optional(chars("+-")), Repeat(DIGIT, 1, EXP_DIGITS)))
_MAGNITUDE = seq(_UINT, _FRACTION, _EXPONENT)
NUMBER = seq(optional(lit("-")), _MAGNITUDE)
_INTEGER = seq(optional(lit("-")), _UINT)


def number_node(c: dict, path: str, kind: str) -> Node | None:
    """The node for a number (an integer when `kind` is "integer") under the schema's bounds, or None."""
    if "multipleOf" in c:
        step = c["multipleOf"]
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not step > 0:
            raise GrammarError(f"'multipleOf' at {path} must be a positive number")
        if (1 / _decimal(step)) % 1 != 0:
            raise GrammarError(f"'multipleOf' at {path} is supported only when it means 'integer' "
                               "(1, 0.5, 0.25, ...)")
        kind = "integer"
    lower, upper = _bounds(c, path)
    if kind == "integer":
        lo = None if lower is None else int(lower[0].to_integral_value(ROUND_FLOOR)) + 1 if lower[1] \
            else int(lower[0].to_integral_value(ROUND_CEILING))
        hi = None if upper is None else int(upper[0].to_integral_value(ROUND_CEILING)) - 1 if upper[1] \
            else int(upper[0].to_integral_value(ROUND_FLOOR))
        return _integer(lo, hi)
    return _number(lower, upper)


# ----- exact decimal ranges


def _decimal(value: int | float) -> Decimal:
    return Decimal(value) if isinstance(value, int) else Decimal(repr(value))


Bound = tuple[Decimal, bool]  # (value, exclusive)


def _bounds(c: dict, path: str) -> tuple[Bound | None, Bound | None]:
    """The tightest lower and upper bound from minimum/maximum/exclusive* (draft 4 booleans too)."""
    def number(key: str) -> Decimal:
        v = c[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise GrammarError(f"'{key}' at {path} must be a finite number")
        return _decimal(v)

    lows: list[Bound] = []
    highs: list[Bound] = []
    for key, out, sign in (("minimum", lows, "exclusiveMinimum"), ("maximum", highs, "exclusiveMaximum")):
        if key in c:
            out.append((number(key), c.get(sign) is True))
        if sign in c and not isinstance(c[sign], bool):
            out.append((number(sign), True))
    lower = max(lows, key=lambda b: (b[0], b[1]), default=None)
    upper = min(highs, key=lambda b: (b[0], not b[1]), default=None)
    return lower, upper


def digits(n: int) -> Node:
    return Repeat(DIGIT, n, n) if n else EMPTY


def _same_length(lo: str, hi: str) -> Node:
    """Decimal strings of one length from lo to hi (digit-by-digit, as xgrammar's range regex)."""
    if not lo:
        return EMPTY
    if lo[0] == hi[0]:
        return seq(lit(lo[0]), _same_length(lo[1:], hi[1:]))
    n = len(lo) - 1
    first, last = int(lo[0]), int(hi[0])
    parts = []
    if lo[1:] != "0" * n:
        parts.append(seq(lit(lo[0]), _same_length(lo[1:], "9" * n)))
        first += 1
    if hi[1:] != "9" * n:
        parts.append(seq(lit(hi[0]), _same_length("0" * n, hi[1:])))
        last -= 1
    if first <= last:
        parts.append(seq(byte_set([(0x30 + first, 0x30 + last)]), digits(n)))
    return alt(*parts)


def _uint_range(lo: int, hi: int) -> Node | None:
    """Non-negative integers lo..hi spelled without leading zeros; None when empty."""
    hi = min(hi, 10 ** INT_DIGITS - 1)
    if lo > hi:
        return None
    parts: list[Node] = []
    full: list[int] = []  # lengths >= 2 covered whole: merged into one [1-9][0-9]{a,b}
    for length in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (length - 1) if length > 1 else 0), min(hi, 10 ** length - 1)
        if length > 1 and a == 10 ** (length - 1) and b == 10 ** length - 1:
            full.append(length)
        elif a <= b:
            parts.append(_same_length(str(a), str(b)))
    if full:
        parts.append(seq(byte_set([(0x31, 0x39)]), Repeat(DIGIT, full[0] - 1, full[-1] - 1)))
    return alt(*parts)


def _integer(lo: int | None, hi: int | None) -> Node | None:
    if lo is None and hi is None:
        return _INTEGER
    limit = 10 ** INT_DIGITS - 1
    lo = -limit if lo is None else lo
    hi = limit if hi is None else hi
    if lo > hi:
        return None
    parts = []
    if hi >= 0 and (node := _uint_range(max(lo, 0), hi)) is not None:
        parts.append(node)
    if lo < 0 and (node := _uint_range(max(-hi, 0), -lo)) is not None:  # `-0` when 0 is in range
        parts.append(seq(lit("-"), node))
    return alt(*parts) if parts else None


def _number(lower: Bound | None, upper: Bound | None) -> Node | None:
    zero = (Decimal(0), False)
    parts = []
    # n >= 0: its magnitude lies in [max(lower, 0), upper]
    if upper is None or upper[0] > 0 or (upper[0] == 0 and not upper[1]):
        node = _magnitude(zero if lower is None or lower[0] < 0 else lower, upper)
        if node is not None:
            parts.append(node)
    # n < 0 (and -0): its magnitude -n lies in [-min(upper, 0), -lower]
    if lower is None or lower[0] < 0:
        low = zero if upper is None or upper[0] > 0 else (-upper[0], upper[1])
        node = _magnitude(low, None if lower is None else (-lower[0], lower[1]))
        if node is not None:
            parts.append(seq(lit("-"), node))
    return alt(*parts) if parts else None


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal as (integer part, fraction digits without trailing zeros); exact."""
    whole, _, frac = format(value, "f").partition(".")
    return int(whole), frac.rstrip("0")


def _magnitude(low: Bound, high: Bound | None) -> Node | None:
    """Unsigned number texts whose value lies between low and high; exponents only when unbounded."""
    if low == (Decimal(0), False) and high is None:
        return _MAGNITUDE
    a, a_frac = _split(low[0])
    if high is not None and high[0] >= 10 ** INT_DIGITS:
        high = None  # above every integer part we spell
    parts = []
    if high is None:
        mid = _uint_range(a + 1, 10 ** INT_DIGITS - 1)
        if mid is not None:
            parts.append(seq(mid, _FRACTION))
        edge = _fraction(a_frac, low[1], None, False)
        if edge is not None and a < 10 ** INT_DIGITS:
            parts.append(seq(lit(str(a)), edge))
        return alt(*parts) if parts else None
    b, b_frac = _split(high[0])
    if a > b:
        return None
    if a == b:
        edge = _fraction(a_frac, low[1], b_frac, high[1])
        return None if edge is None else seq(lit(str(a)), edge)
    mid = _uint_range(a + 1, b - 1)
    if mid is not None:
        parts.append(seq(mid, _FRACTION))
    for digits, edge in ((a, _fraction(a_frac, low[1], None, False)), (b, _fraction("", False, b_frac, high[1]))):
        if edge is not None:
            parts.append(seq(lit(str(digits)), edge))
    return alt(*parts) if parts else None


def _fraction(lo: str, lo_excl: bool, hi: str | None, hi_excl: bool) -> Node | None:
    """An optional `.digits` fraction F with lo <= F <= hi (or < when exclusive), compared as 0.<digits>.

    A digit-by-digit walk: `tight_lo` means F's digits so far equal lo's (zero padded), so the next digit
    may not go below lo's; likewise `tight_hi`. hi None means no upper bound (F < 1 anyway).
    """
    memo: dict[tuple[int, bool, bool, bool], Node | None] = {}

    def can_end(pos: int, tight_lo: bool, tight_hi: bool) -> bool:  # the remaining digits are all 0
        if tight_lo and (lo[pos:].strip("0") or lo_excl):
            return False
        return not (tight_hi and hi is not None and not hi[pos:].strip("0") and hi_excl)

    def rest(pos: int, tight_lo: bool, tight_hi: bool, may_end: bool) -> Node | None:
        key = (pos, tight_lo, tight_hi, may_end)
        if key in memo:
            return memo[key]
        if not tight_lo and not tight_hi:
            node: Node | None = Repeat(DIGIT, 0 if may_end else 1, FRAC_DIGITS - pos)
        else:
            parts = [EMPTY] if may_end and can_end(pos, tight_lo, tight_hi) else []
            if pos < FRAC_DIGITS:
                floor = int(lo[pos]) if tight_lo and pos < len(lo) else 0
                ceil = (int(hi[pos]) if pos < len(hi) else 0) if tight_hi and hi is not None else 9
                groups: dict[tuple[bool, bool], list[int]] = {}
                for d in range(floor, ceil + 1):
                    groups.setdefault((tight_lo and d == floor, tight_hi and d == ceil), []).append(d)
                for (next_lo, next_hi), ds in groups.items():
                    after = rest(pos + 1, next_lo, next_hi, True)
                    if after is not None:
                        parts.append(seq(byte_set([(0x30 + ds[0], 0x30 + ds[-1])]), after))
            node = alt(*parts) if parts else None
        memo[key] = node
        return node

    tight_lo = bool(lo) or lo_excl
    tight_hi = hi is not None
    dotted = rest(0, tight_lo, tight_hi, False)
    parts = [EMPTY] if can_end(0, tight_lo, tight_hi) else []
    if dotted is not None:
        parts.append(seq(lit("."), dotted))
    return alt(*parts) if parts else None
