"""Block keys: an octree cell named by its depth and its Morton code at that depth.

The string form ``"<depth>-<code in hex>"`` is what the store uses as a folder name,
so parsing it is also the store's defence against hostile paths.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_DEPTH = 21  # 3 * 21 = 63 bits of Morton code fit in an int64

_KEY_RE = re.compile(r"^([0-9]|1[0-9]|2[01])-([0-9a-f]{1,16})$")


class BlockKeyError(ValueError):
    """A block key string that is not a well-formed octree cell name."""


@dataclass(frozen=True, order=True)
class BlockKey:
    depth: int  # 0 is the root cell
    code: int  # Morton code of the cell among the 8**depth cells of its depth

    def __post_init__(self) -> None:
        if not (0 <= self.depth <= MAX_DEPTH):
            raise BlockKeyError(f"block depth {self.depth} outside [0, {MAX_DEPTH}]")
        if not (0 <= self.code < 8**self.depth):
            raise BlockKeyError(f"block code {self.code} outside [0, 8**{self.depth})")

    @property
    def name(self) -> str:
        return f"{self.depth}-{self.code:x}"

    def __str__(self) -> str:
        return self.name

    def morton_rank(self) -> int:
        """Position of the cell's first descendant at MAX_DEPTH: sorting leaves by it gives Morton order."""
        return self.code << (3 * (MAX_DEPTH - self.depth))

    def parent(self) -> "BlockKey":
        if self.depth == 0:
            raise BlockKeyError("the root cell has no parent")
        return BlockKey(self.depth - 1, self.code >> 3)

    def child(self, octant: int) -> "BlockKey":
        return BlockKey(self.depth + 1, (self.code << 3) | octant)


def parse_key(text: str) -> BlockKey:
    """Parse and validate a key string; raises BlockKeyError naming the bad text."""
    m = _KEY_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise BlockKeyError(f"malformed block key {text!r} (expected '<depth>-<hex code>')")
    return BlockKey(int(m.group(1)), int(m.group(2), 16))
