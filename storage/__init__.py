"""The scene store (Zarr v3 blocks, atomic commits, GC, validation) and, in `storage.cache`, the block cache.

`storage.cache` is not imported here: it needs torch, and the store alone does not.
"""
from storage.codec import CodecConfig
from storage.errors import (
    BlockDataError,
    BlockNotFoundError,
    CacheBudgetError,
    CommitProtocolError,
    CommitStateError,
    StoreCorruptError,
    StoreError,
    StoreExistsError,
    StoreFormatError,
    StoreKeyError,
)
from storage.store import FORMAT_VERSION, Store
from storage.table import BlockInfo

__all__ = [
    "FORMAT_VERSION",
    "BlockDataError",
    "BlockInfo",
    "BlockNotFoundError",
    "CacheBudgetError",
    "CodecConfig",
    "CommitProtocolError",
    "CommitStateError",
    "Store",
    "StoreCorruptError",
    "StoreError",
    "StoreExistsError",
    "StoreFormatError",
    "StoreKeyError",
]
