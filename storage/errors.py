"""The store's error types; every message names the store, the block (when there is one) and the problem."""
from __future__ import annotations

from octree.keys import BlockKeyError


class StoreError(Exception):
    """Base of every error the store and the cache raise on bad input or a bad store."""


class StoreFormatError(StoreError):
    """Not an OctoSplat store, a format version this code does not read, or bad root attributes."""


class StoreCorruptError(StoreError):
    """The store's content contradicts itself: shapes, dtypes or counts disagree with the block table,
    a chunk is truncated or fails its checksum, a block named by a commit is missing."""


class StoreExistsError(StoreError, FileExistsError):
    """Creating a store where one (or something else) already exists."""


class StoreKeyError(StoreError, BlockKeyError):
    """A malformed block key, given by the caller or read from a (possibly hostile) store."""


class BlockNotFoundError(StoreError, KeyError):
    """A block key that the committed table (or the cache) does not hold."""

    def __str__(self) -> str:
        # KeyError's own __str__ shows the repr of its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class BlockDataError(StoreError, ValueError):
    """Arrays handed to the store do not fit the block schema (missing, wrong shape/dtype, NaN/inf, empty)."""


class CommitStateError(StoreError, ValueError):
    """Training state handed to a commit that does not survive a JSON round trip."""


class CommitProtocolError(StoreError):
    """A write that would break the commit protocol: a stale view of HEAD, or a write between flush and commit."""


class CacheBudgetError(StoreError):
    """The cache cannot hold what it is asked to hold without evicting pinned blocks."""


class StoreWriteError(StoreError):
    """The system refused a write (a full disk, a lost mount). Writes only add what no commit names
    yet, so the last commit is intact; the message says which one, and what was being written."""

    def __init__(self, store: str, what: str, error: OSError, head: int | None, step: object) -> None:
        text = error.strerror or str(error)
        if head is None:
            kept = "nothing was committed yet"
        else:
            kept = f"the last commit, {f'step {step}' if step is not None else f'generation {head}'}, is intact"
        super().__init__(f"store {store}: {text[:1].lower() + text[1:]} while writing {what} ({kept})")
