"""Hypothesis strategies that damage valid files the way disks, networks and hand edits do."""
from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import strategies as st

# Header values a corrupt or hostile file declares: counts and sizes at the edges of every integer
# width a reader might use, and far beyond what any file holds.
HUGE_NUMBERS = ("0", "1", "-1", "255", "65537", "2147483647", "2147483648", "4294967297", "9223372036854775807",
                "18446744073709551617", "1000000000000", "1" + "0" * 30, "1" + "0" * 400, "9" * 5000, "1e9", "1e308",
                "1e999", "nan", "inf", "-0")
_NUMBER = re.compile(rb"-?\d+(\.\d+)?(e[+-]?\d+)?")


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes, text_end: int | None = None) -> bytes:
    """`data` with one to three of: bytes flipped, the file truncated, bytes inserted (random, or one
    byte repeated up to 5000 times, as a stuck writer leaves), one of its own bytes stretched (a
    digit into a 5000-digit number, a bracket into deep nesting), a range deleted, or a number
    written as text in the first `text_end` bytes (a header; default all) replaced by a huge or odd
    value."""
    numbers = [m.span() for m in _NUMBER.finditer(data[: len(data) if text_end is None else text_end])]
    kinds = ["flip", "truncate", "insert", "repeat", "stretch", "delete"] + ["number"] * (3 if numbers else 0)
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(kinds))
        at = draw(st.integers(0, max(0, len(out) - 1)))
        if kind == "flip" and out:
            out[at] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del out[at:]
        elif kind == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "repeat":
            out[at:at] = bytes([draw(st.integers(0, 255))]) * draw(st.integers(1, 5000))
        elif kind == "stretch" and out:
            out[at:at] = out[at : at + 1] * draw(st.sampled_from([2, 100, 5000]))
        elif kind == "delete":
            del out[at : at + draw(st.integers(1, 64))]
        elif kind == "number":
            start, end = draw(st.sampled_from(numbers))
            if end <= len(out):
                out[start:end] = draw(st.sampled_from(HUGE_NUMBERS)).encode()
    return bytes(out)


_ODD_VALUES = st.one_of(
    st.sampled_from([0, -1, 1e9, 1e308, -1e308, 10**30, 10**400, 2**63, True, None, "", "x", "../../etc/passwd",
                     "/etc/passwd", "a\x00b", [], {}, [[1.0]], float("nan"), float("inf")]),
    st.integers(), st.floats(), st.text(max_size=8),
    st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=4),
                 lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
                 max_leaves=8),
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON document (keys of objects, indices of lists), the root included."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:6]):  # the first few entries of long lists are enough
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def json_mutations(draw: st.DrawFn, doc: Any) -> bytes:
    """`doc` as JSON text with one to three values replaced by odd ones, deleted, or set on new keys."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        value = draw(_ODD_VALUES)
        if not path:
            doc = value
            continue
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = value
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = value
        else:
            parent.append(value)
    return json.dumps(doc).encode()  # NaN and Infinity as Python writes them: readers must cope
