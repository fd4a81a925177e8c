"""The string `format`s (date-time, date, time, duration, email, hostname, ipv4, ipv6, uuid, uri) as fixed, fairly
strict spellings: every text they allow is valid, but not every valid one is allowed (RFC 3339's leap second :60)."""
from __future__ import annotations

from collections.abc import Callable

from .grammar import EMPTY, ByteSet, Node, Repeat, alt, byte_set, lit, optional, seq
from .json_numbers import DIGIT, digits
from .json_strings import HEX


def _r(ranges: str) -> ByteSet:
    """A byte class from 'a-z0-9' style ASCII ranges (a trailing '-' is literal)."""
    spans, i = [], 0
    while i < len(ranges):
        if i + 2 < len(ranges) and ranges[i + 1] == "-":
            spans.append((ord(ranges[i]), ord(ranges[i + 2])))
            i += 3
        else:
            spans.append((ord(ranges[i]), ord(ranges[i])))
            i += 1
    return byte_set(spans)


def _date() -> Node:
    year = alt(seq(_r("1-9"), digits(3)), seq(lit("0"), _r("1-9"), digits(2)),
               seq(lit("00"), _r("1-9"), DIGIT), seq(lit("000"), _r("1-9")))
    # divisible by 4 and not by 100, or by 400 (year 0000 does not exist)
    leap = alt(seq(digits(2), alt(seq(lit("0"), _r("48")), seq(_r("2468"), _r("048")), seq(_r("13579"), _r("26")))),
               seq(alt(seq(lit("0"), _r("48")), seq(_r("2468"), _r("048")), seq(_r("13579"), _r("26"))), lit("00")))
    day28 = alt(seq(lit("0"), _r("1-9")), seq(lit("1"), DIGIT), seq(lit("2"), _r("0-8")))
    day30 = alt(day28, lit("29"), lit("30"))
    day31 = alt(day30, lit("31"))
    return alt(seq(year, lit("-"), alt(*map(lit, ("01", "03", "05", "07", "08", "10", "12"))), lit("-"), day31),
               seq(year, lit("-"), alt(*map(lit, ("04", "06", "09", "11"))), lit("-"), day30),
               seq(year, lit("-02-"), day28),
               seq(leap, lit("-02-29")))


def _time() -> Node:
    hour = alt(seq(_r("01"), DIGIT), seq(lit("2"), _r("0-3")))
    minute = seq(_r("0-5"), DIGIT)
    second = minute  # no leap second :60: RFC 3339 allows it, but jsonschema's checker and datetime refuse it
    offset = alt(lit("Z"), seq(_r("+-"), hour, lit(":"), minute))
    return seq(hour, lit(":"), minute, lit(":"), second, optional(seq(lit("."), Repeat(DIGIT, 1, 9))), offset)


def _duration() -> Node:
    n = Repeat(DIGIT, 1, 9)

    def units(letters: str) -> Node:  # one or more of the units, in order
        out: Node | None = None
        for letter in reversed(letters):
            here = seq(n, lit(letter))
            out = here if out is None else alt(seq(here, optional(out)), out)
        return out

    time = seq(lit("T"), units("HMS"))
    return seq(lit("P"), alt(seq(units("YMD"), optional(time)), time, seq(n, lit("W"))))


def _hostname() -> Node:
    label = seq(_r("A-Za-z0-9"), optional(seq(Repeat(_r("A-Za-z0-9-"), 0, 61), _r("A-Za-z0-9"))))
    return seq(label, Repeat(seq(lit("."), label), 0, 126))


def _email() -> Node:
    atom = Repeat(_r("A-Za-z0-9!#$%&'*+/=?^_`{|}~-"), 1, 64)
    return seq(atom, Repeat(seq(lit("."), atom), 0, 31), lit("@"), _hostname())


def _ipv4() -> Node:
    octet = alt(seq(lit("25"), _r("0-5")), seq(lit("2"), _r("0-4"), DIGIT), seq(lit("1"), digits(2)),
                seq(_r("1-9"), DIGIT), DIGIT)
    return seq(octet, *(seq(lit("."), octet) for _ in range(3)))


def _ipv6() -> Node:
    """RFC 3986's IPv6address: eight groups, `::` standing for one or more zero groups, IPv4 tail."""
    h16 = Repeat(HEX, 1, 4)
    ls32 = alt(seq(h16, lit(":"), h16), _ipv4())

    def groups(k: int) -> Node:  # k x "h16:"
        return Repeat(seq(h16, lit(":")), k, k) if k else EMPTY

    def upto(k: int) -> Node:  # [ *k(h16 ":") h16 ]
        return optional(seq(Repeat(seq(h16, lit(":")), 0, k), h16) if k else h16)

    forms = [seq(groups(6), ls32), seq(lit("::"), groups(5), ls32)]
    for before in range(0, 7):  # before = how many h16 may precede "::", minus one
        after = 4 - before
        if after >= 1:
            forms.append(seq(upto(before), lit("::"), groups(after), ls32))
        elif after == 0:
            forms.append(seq(upto(before), lit("::"), ls32))
        elif after == -1:
            forms.append(seq(upto(before), lit("::"), h16))
        else:
            forms.append(seq(upto(before), lit("::")))
    return alt(*forms)


def _uuid() -> Node:
    return seq(*(seq(lit("-") if i else EMPTY, Repeat(HEX, n, n)) for i, n in enumerate((8, 4, 4, 4, 12))))


def _uri() -> Node:
    """An absolute URI: scheme ':' then URI characters (unreserved, reserved, %XX)."""
    scheme = seq(_r("A-Za-z"), Repeat(_r("A-Za-z0-9+.-"), 0, 31))
    char = alt(_r("A-Za-z0-9-._~:/?#[]@!$&'()*+,;="), seq(lit("%"), HEX, HEX))
    return seq(scheme, lit(":"), Repeat(char, 1, None))


FORMATS: dict[str, Callable[[], Node]] = {
    "date-time": lambda: seq(_date(), lit("T"), _time()),
    "date": _date,
    "time": _time,
    "duration": _duration,
    "email": _email,
    "hostname": _hostname,
    "ipv4": _ipv4,
    "ipv6": _ipv6,
    "uuid": _uuid,
    "uri": _uri,
}
