"""How a block's 22 logical arrays sit in the 3 zarr arrays of a stored version.

A block version used to be one zarr array per logical array: 45 files and 24 folders, whose
creation and removal cost most of a block write (~17 ms of ~25 ms for a 1.2 MB block on ext4)
and most of a read. The trainer writes a block back on every eviction, so that cost set the
out-of-core overhead. Packed by role and dtype, a version is 7 files in 4 folders:

    params    float32 [P, N]       means | scales | quats | opacities | sh0 | shN  (P = 59 at SH 3)
    state     float32 [2P + 2, N]  exp_avg_* | exp_avg_sq_* (same order) | grad2d | max_radii
    counters  int32   [2, N]       adam_step | count

Each pack is the logical arrays' bytes one after another: rows lo..hi of a pack, read as one
flat run, are the logical array [N, ...] in C order (`params[0:3].reshape(N, 3)` is `means`). So
a read decodes straight into one buffer and every logical array is a contiguous view of it, with
no copy; a packed row-major [N, P] table would need a strided copy per array (2x the read time
of a 47 MB block). Parameters stay apart from the optimizer state so that export and the viewer
read only them, and so that a fresh block's all-zero state compresses while trained parameters
(noise to any compressor) are stored raw. The row map is written into the store's root
attributes (`layout`), so plain zarr users can slice it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from storage.schema import PARAM_NAMES, block_schema

Layout = dict[str, tuple[np.dtype, dict[str, tuple[int, int]]]]  # pack -> (dtype, name -> (lo, hi) rows)


def _members() -> dict[str, tuple[str, ...]]:
    state = tuple(f"exp_avg_{n}" for n in PARAM_NAMES) + tuple(f"exp_avg_sq_{n}" for n in PARAM_NAMES)
    return {"params": PARAM_NAMES, "state": state + ("grad2d", "max_radii"), "counters": ("adam_step", "count")}


def pack_layout(sh_degree: int) -> Layout:
    schema = block_schema(sh_degree)
    layout: Layout = {}
    for pack, names in _members().items():
        dtypes = {schema[n][1] for n in names}
        assert len(dtypes) == 1, f"pack {pack} mixes dtypes {dtypes}"
        rows, lo = {}, 0
        for n in names:
            width = math.prod(schema[n][0])
            rows[n] = (lo, lo + width)
            lo += width
        layout[pack] = (dtypes.pop(), rows)
    assert sorted(n for _, cols in layout.values() for n in cols) == sorted(schema), "a logical array has no pack"
    return layout


def layout_json(layout: Layout) -> dict[str, dict]:
    """The row map as stored in the root attributes."""
    return {pack: {"dtype": dtype.name, "rows": {n: list(c) for n, c in cols.items()}} for pack, (dtype, cols) in layout.items()}


def pack_shapes(layout: Layout, count: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The stored arrays of a block of count Gaussians: (full shape, dtype) of each pack."""
    return {pack: ((max(hi for _, hi in cols.values()), count), dtype) for pack, (dtype, cols) in layout.items()}


def packs_for(layout: Layout, names: Iterable[str]) -> list[str]:
    """The packs holding any of the named logical arrays."""
    wanted = set(names)
    return [pack for pack, (_, cols) in layout.items() if wanted & cols.keys()]


def pack(arrays: Mapping[str, np.ndarray], layout: Layout, count: int) -> dict[str, np.ndarray]:
    """Logical arrays [N, ...] -> packs [rows, N] (one contiguous copy of each array)."""
    out = {}
    for name, (dtype, cols) in layout.items():
        flat = np.concatenate([np.asarray(arrays[n], dtype=dtype).reshape(-1) for n in cols])
        out[name] = flat.reshape(-1, count)
    return out


def unpack(
    packed: Mapping[str, np.ndarray], layout: Layout, names: Iterable[str], schema: Mapping[str, tuple[tuple[int, ...], np.dtype]]
) -> dict[str, np.ndarray]:
    """The named logical arrays as contiguous, writable views of the packs (no copy)."""
    out = {}
    for name in names:
        pack_name = next(p for p, (_, cols) in layout.items() if name in cols)
        lo, hi = layout[pack_name][1][name]
        a = packed[pack_name]
        out[name] = a[lo:hi].reshape(-1).reshape(a.shape[1], *schema[name][0])
    return out
