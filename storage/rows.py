"""Row operations over the block schema: every array of a block moves with its rows.

Densification adds, removes and moves Gaussians between blocks; a Gaussian is a row of every
array of `storage.schema.block_schema` (parameters, Adam moments and step count, statistics),
so these helpers take and return whole blocks (`dict[str, Tensor]`, `[N, ...]` each), the way
gsplat's `_update_param_with_optimizer` carries the optimizer state along with its parameters.
`pack_rows` / `unpack_rows` give the byte layout in which rows travel between processes.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from storage.blockio import Schema
from storage.schema import PARAM_NAMES, moment_names

Block = dict[str, Tensor]


def take_rows(block: Mapping[str, Tensor], index: Tensor) -> Block:
    """The rows `index` ([R] int64, or an [N] bool mask) of every array."""
    return {name: t[index] for name, t in block.items()}


def cat_rows(parts: Sequence[Mapping[str, Tensor]]) -> Block:
    """Blocks stacked row-wise, in order (all with the same arrays)."""
    if not parts:
        raise ValueError("cat_rows needs at least one block")
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def spawn_rows(block: Mapping[str, Tensor], sources: Tensor, params: Mapping[str, Tensor] | None = None) -> Block:
    """New rows made from the rows `sources` [R] (int64): copies of every array, with `params`
    (name -> [R, ...]) replacing those parameters and both Adam moments of every parameter at
    zero, as gsplat's duplicate and split give new Gaussians. The per-row Adam step count is
    copied: torch's Adam keeps its step when gsplat grows a parameter, so bias correction of a
    new row continues where its source's stood instead of restarting at step 1."""
    new = take_rows(block, sources)
    for name, value in (params or {}).items():
        if name not in PARAM_NAMES:
            raise KeyError(f"spawn_rows: {name!r} is not a parameter")
        new[name] = value.to(dtype=block[name].dtype, device=block[name].device).reshape(new[name].shape)
    for name in moment_names():
        new[name] = torch.zeros_like(new[name])
    return new


def empty_rows(block: Mapping[str, Tensor]) -> Block:
    """No rows, with the arrays' trailing shapes and dtypes."""
    return {name: t[:0] for name, t in block.items()}


def row_layout(schema: Schema) -> list[tuple[str, tuple[int, ...], np.dtype, int]]:
    """(name, trailing shape, dtype, bytes a row) of each array, in schema order."""
    return [(name, shape, dtype, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
            for name, (shape, dtype) in schema.items()]


def pack_rows(arrays: Mapping[str, np.ndarray], schema: Schema) -> np.ndarray:  # -> [N, row bytes] uint8
    """Rows as bytes, each row's arrays back to back in schema order."""
    layout = row_layout(schema)
    n = len(arrays[layout[0][0]])
    out = np.empty((n, sum(b for *_, b in layout)), np.uint8)
    at = 0
    for name, shape, dtype, nbytes in layout:
        a = np.ascontiguousarray(arrays[name], dtype=dtype).reshape(n, -1)
        out[:, at : at + nbytes] = a.view(np.uint8).reshape(n, nbytes)
        at += nbytes
    return out


def unpack_rows(buf: np.ndarray, schema: Schema) -> dict[str, np.ndarray]:  # [N, row bytes] uint8
    """The arrays of `pack_rows` bytes (copies, each C-contiguous)."""
    layout = row_layout(schema)
    width = sum(b for *_, b in layout)
    if buf.ndim != 2 or buf.shape[1] != width:
        raise ValueError(f"packed rows: shape {buf.shape}, expected [N, {width}]")
    out, at = {}, 0
    for name, shape, dtype, nbytes in layout:
        out[name] = np.ascontiguousarray(buf[:, at : at + nbytes]).view(dtype).reshape(len(buf), *shape)
        at += nbytes
    return out
