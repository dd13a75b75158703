"""The wire between the isolated tests' two processes (``judge.py``): a 4-byte length, then the
message in a small tagged encoding of plain values, with a parser of its own. Standard library
only; inside the sandbox the host puts this source first in ``judge.py`` (never imported there).
``ast`` and ``json`` would cost every execution milliseconds to import, and ``pickle`` and
``marshal`` must not read what the program's process writes."""

import os


class ProgramGone(Exception):
    """The program's process ended while the judge waited for it."""


#: how deep containers may nest on the wire
MAX_DEPTH = 200
_SEQUENCES = {list: b"l", tuple: b"t", set: b"S", frozenset: b"Z"}
_BUILD = {b"l": list, b"t": tuple, b"S": set, b"Z": frozenset}
_PLAIN = (bool, int, float, complex, str, bytes, bytearray, dict, list, tuple, set, frozenset)
#: the tests' named-tuple classes by (name, fields): a program's named tuple keeps its fields
_NAMED: dict = {}


def dumps(x, handle, depth: int = 0) -> bytes:
    """``x`` encoded; what is not plain becomes a handle: ``handle(x)``, its reference."""
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested more than {MAX_DEPTH} deep cannot cross to the tests")
    if x is None:
        return b"N"
    if x is True or x is False:
        return b"T" if x else b"F"
    t = type(x)
    if t is int:
        return b"i%d;" % x if -1 << 60 < x < 1 << 60 else b"I%d;" % ((x.bit_length() + 8) // 8) + x.to_bytes(
            (x.bit_length() + 8) // 8, "big", signed=True)
    if t is str:
        data = x.encode("utf-8", "surrogatepass")
        return b"s%d;" % len(data) + data
    if t is bytes or t is bytearray:
        return (b"b" if t is bytes else b"B") + b"%d;" % len(x) + bytes(x)
    if t is float:
        return b"f" + x.hex().encode() + b";"
    if t is complex:
        return b"c" + x.real.hex().encode() + b";" + x.imag.hex().encode() + b";"
    if t is dict:
        return b"d%d;" % len(x) + b"".join(dumps(k, handle, depth + 1) + dumps(v, handle, depth + 1)
                                           for k, v in x.items())
    tag = _SEQUENCES.get(t)
    if tag is not None:
        return tag + b"%d;" % len(x) + b"".join(dumps(i, handle, depth + 1) for i in x)
    if isinstance(x, tuple) and type(getattr(t, "_fields", None)) is tuple:  # a named tuple
        return b"n" + dumps((t.__name__, t._fields, tuple(x)), handle, depth + 1)
    for base in _PLAIN:
        if isinstance(x, base):  # a subclass travels as its plain value
            return dumps(base(x), handle, depth)
    return b"h%d;" % handle(x)


def loads(data: bytes, remote):
    """The value ``dumps`` wrote; ``remote(ref)`` for a handle. ``ValueError`` for anything else."""
    value, end = _load(data, 0, remote, 0)
    if end != len(data):
        raise ValueError("trailing bytes on the wire")
    return value


def _number(data: bytes, i: int) -> tuple[bytes, int]:
    end = data.index(b";", i)
    return data[i:end], end + 1


def _load(data: bytes, i: int, remote, depth: int):
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    tag = data[i:i + 1]
    i += 1
    if tag == b"N":
        return None, i
    if tag in (b"T", b"F"):
        return tag == b"T", i
    if tag in (b"i", b"h"):
        text, i = _number(data, i)
        return (int(text) if tag == b"i" else remote(int(text))), i
    if tag in (b"I", b"s", b"b", b"B"):
        text, i = _number(data, i)
        n = int(text)
        if n < 0 or i + n > len(data):
            raise ValueError("a length past the message")
        chunk = data[i:i + n]
        value = (int.from_bytes(chunk, "big", signed=True) if tag == b"I"
                 else chunk.decode("utf-8", "surrogatepass") if tag == b"s" else bytes(chunk) if tag == b"b"
                 else bytearray(chunk))
        return value, i + n
    if tag == b"f":
        text, i = _number(data, i)
        return float.fromhex(text.decode("ascii")), i
    if tag == b"c":
        real, i = _number(data, i)
        imag, i = _number(data, i)
        return complex(float.fromhex(real.decode("ascii")), float.fromhex(imag.decode("ascii"))), i
    if tag == b"d" or tag in _BUILD:
        text, i = _number(data, i)
        items = []
        for _ in range(int(text) * (2 if tag == b"d" else 1)):
            item, i = _load(data, i, remote, depth + 1)
            items.append(item)
        if tag == b"d":
            return dict(zip(items[::2], items[1::2])), i
        return _BUILD[tag](items), i
    if tag == b"n":
        (name, fields, items), i = _load(data, i, remote, depth + 1)
        if not (type(name) is str and type(fields) is tuple and type(items) is tuple and len(fields) == len(items)
                and all(type(f) is str for f in fields)):
            raise ValueError("a malformed named tuple")
        cls = _NAMED.get((name, fields))
        if cls is None:
            from collections import namedtuple

            cls = _NAMED[name, fields] = namedtuple(name, fields, rename=True)  # fields as ``_1`` made by rename
        return cls(*items), i
    raise ValueError(f"unknown tag {tag!r} on the wire")


def write_frame(fd: int, message, handle) -> None:
    data = dumps(message, handle)
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def read_frame(fd: int, remote):
    """The next message, or ``ProgramGone`` at the end of the pipe."""
    return loads(_read_exactly(fd, int.from_bytes(_read_exactly(fd, 4), "big")), remote)


def _read_exactly(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise ProgramGone()
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def no_handles(x) -> int:
    raise TypeError(f"a {type(x).__name__} on the judge's wire")


