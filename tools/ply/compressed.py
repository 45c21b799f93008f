"""The compressed 3DGS PLY of SuperSplat and `gsplat.export_splats(format="ply_compressed")`.

Gaussians come in chunks of 256 rows. A `chunk` row holds the float bounds of the chunk's means,
log scales and (optionally) DC colours; a `vertex` row packs a Gaussian in four uint32s:
position 11/10/11 bits within the bounds, rotation as the index of the largest quaternion
component (2 bits) and the other three in 10 bits each, log scale 11/10/11 bits, and colour plus
opacity in 8 bits each. An `sh` row holds the higher SH coefficients in 8 bits each, mapping
[-4, 4) onto 0..255 (f_rest order as the standard PLY). The format is lossy: decoding returns the
centre of each quantisation step.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from octree.semantics import SH_C0
from storage.schema import num_sh_rest
from tools.ply.format import AtomicFile, PlyError, PlyHeader, RowWriter, columns, element_data
from tools.ply.standard import SH_DEGREE_OF_REST, Splats, check_splats

CHUNK_ROWS = 256
_POSITION_BOUNDS = ("min_x", "min_y", "min_z", "max_x", "max_y", "max_z")
_SCALE_BOUNDS = ("min_scale_x", "min_scale_y", "min_scale_z", "max_scale_x", "max_scale_y", "max_scale_z")
_COLOR_BOUNDS = ("min_r", "min_g", "min_b", "max_r", "max_g", "max_b")
_PACKED = ("packed_position", "packed_rotation", "packed_scale", "packed_color")
_SCALE_CLAMP = 20.0  # log-scale bounds are clamped to +-20, as gsplat does
_SH_RANGE = 8.0  # quantised SH span: [-4, 4)
_OPACITY_EPS = 0.5 / 255  # decoded opacity stays inside (0, 1) so its logit is finite
_ROT_SCALE = math.sqrt(2.0)  # the three small quaternion components lie in [-1/sqrt2, 1/sqrt2]
_LAYOUT_111011 = ((21, 11), (11, 10), (0, 11))  # (shift, bits) of x, y, z


def _unorm(v: np.ndarray, bits: int) -> np.ndarray:  # values in [0, 1] -> uint32 of `bits` bits
    top = (1 << bits) - 1
    return np.clip(np.floor(v * top + 0.5), 0, top).astype(np.uint32)


def _from_unorm(packed: np.ndarray, shift: int, bits: int) -> np.ndarray:  # -> float32 in [0, 1]
    top = (1 << bits) - 1
    return ((packed >> np.uint32(shift)) & np.uint32(top)).astype(np.float32) / np.float32(top)


def _within(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """x normalised to [0, 1] between per-row bounds (0 where the bounds coincide)."""
    span = hi - lo
    return np.where(span > 0, (x - lo) / np.where(span > 0, span, 1), 0).astype(np.float32)


def _pack3(v: np.ndarray) -> np.ndarray:  # [n, 3] in [0, 1] -> [n] uint32 (11/10/11 bits)
    out = np.zeros(len(v), dtype=np.uint32)
    for axis, (shift, bits) in enumerate(_LAYOUT_111011):
        out |= _unorm(v[:, axis], bits) << np.uint32(shift)
    return out


def _unpack3(packed: np.ndarray) -> np.ndarray:  # [n] uint32 -> [n, 3] in [0, 1]
    return np.stack([_from_unorm(packed, shift, bits) for shift, bits in _LAYOUT_111011], axis=1)


def _pack_rotation(quats: np.ndarray) -> np.ndarray:  # [n, 4] wxyz -> [n] uint32
    q = quats / np.linalg.norm(quats, axis=1, keepdims=True)
    largest = np.argmax(np.abs(q), axis=1)
    rows = np.arange(len(q))
    q = q * np.where(q[rows, largest] < 0, -1.0, 1.0)[:, None].astype(q.dtype)
    others = np.array([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])[largest]
    small = _unorm(q[rows[:, None], others] / _ROT_SCALE + 0.5, 10)
    packed = largest.astype(np.uint32) << np.uint32(30)
    for column, shift in enumerate((20, 10, 0)):
        packed |= small[:, column] << np.uint32(shift)
    return packed


def _unpack_rotation(packed: np.ndarray) -> np.ndarray:  # [n] uint32 -> [n, 4] wxyz, unit length
    small = np.stack([(_from_unorm(packed, shift, 10) - 0.5) * _ROT_SCALE for shift in (20, 10, 0)], axis=1)
    largest = (packed >> np.uint32(30)).astype(np.int64)
    q = np.zeros((len(packed), 4), dtype=np.float32)
    rows = np.arange(len(packed))
    q[rows, largest] = np.sqrt(np.maximum(0.0, 1.0 - (small**2).sum(axis=1)))
    others = np.array([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])[largest]
    q[rows[:, None], others] = small
    return q


def encode(splats: Splats) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows in file order -> chunk bounds [C, 18] float32, packed vertices [N, 4] uint32, sh [N, 3K] uint8."""
    n, _ = check_splats(splats, "compressed PLY encoding")
    starts = np.arange(0, n, CHUNK_ROWS)
    sizes = np.diff(np.append(starts, n))

    def bounds(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # per chunk [C, d] and per row [N, d]
        lo, hi = np.minimum.reduceat(x, starts, axis=0), np.maximum.reduceat(x, starts, axis=0)
        return np.concatenate([lo, hi], axis=1), np.repeat(lo, sizes, axis=0), np.repeat(hi, sizes, axis=0)

    means = splats["means"].astype(np.float32)
    scales = splats["scales"].astype(np.float32)
    colors = (splats["sh0"].reshape(n, 3) * np.float32(SH_C0) + np.float32(0.5)).astype(np.float32)
    mean_b, mean_lo, mean_hi = bounds(means)
    scale_lo = np.clip(np.minimum.reduceat(scales, starts, axis=0), -_SCALE_CLAMP, _SCALE_CLAMP)
    scale_hi = np.clip(np.maximum.reduceat(scales, starts, axis=0), -_SCALE_CLAMP, _SCALE_CLAMP)
    color_b, color_lo, color_hi = bounds(colors)
    opacity = 1.0 / (1.0 + np.exp(-splats["opacities"].astype(np.float32)))
    color8 = np.concatenate([_within(colors, color_lo, color_hi), opacity[:, None]], axis=1)
    packed_color = np.zeros(n, dtype=np.uint32)
    for i, shift in enumerate((24, 16, 8, 0)):
        packed_color |= _unorm(color8[:, i], 8) << np.uint32(shift)
    vertex = np.stack(
        [
            _pack3(_within(means, mean_lo, mean_hi)),
            _pack_rotation(splats["quats"].astype(np.float32)),
            _pack3(_within(scales, np.repeat(scale_lo, sizes, axis=0), np.repeat(scale_hi, sizes, axis=0))),
            packed_color,
        ],
        axis=1,
    )
    chunk = np.concatenate([mean_b, scale_lo, scale_hi, color_b], axis=1).astype(np.float32)
    rest = splats["shN"].astype(np.float32).transpose(0, 2, 1).reshape(n, -1)
    sh = np.clip(np.trunc((rest / _SH_RANGE + 0.5) * 256), 0, 255).astype(np.uint8)
    return chunk, vertex, sh


def decode(chunk: np.ndarray, vertex: np.ndarray, sh: np.ndarray, first_row: int = 0) -> Splats:
    """chunk [C, 12 or 18] float32 (all chunks of the file), vertex [n, 4] uint32, sh [n, 3K] uint8 of
    rows first_row.. -> splats. Without colour bounds (12 columns) colours are stored directly."""
    n = len(vertex)
    rows = chunk[(first_row + np.arange(n)) // CHUNK_ROWS].astype(np.float32)

    def between(unit: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return (lo + unit * (hi - lo)).astype(np.float32)

    colors = np.stack([_from_unorm(vertex[:, 3], shift, 8) for shift in (24, 16, 8)], axis=1)
    if chunk.shape[1] == 18:
        colors = between(colors, rows[:, 12:15], rows[:, 15:18])
    opacity = np.clip(_from_unorm(vertex[:, 3], 0, 8), _OPACITY_EPS, 1 - _OPACITY_EPS)
    k = sh.shape[1] // 3
    rest = ((sh.astype(np.float32) + 0.5) / 256 - 0.5) * _SH_RANGE
    return {
        "means": between(_unpack3(vertex[:, 0]), rows[:, 0:3], rows[:, 3:6]),
        "scales": between(_unpack3(vertex[:, 2]), rows[:, 6:9], rows[:, 9:12]),
        "quats": _unpack_rotation(vertex[:, 1]),
        "opacities": np.log(opacity / (1 - opacity)).astype(np.float32),
        "sh0": ((colors - 0.5) / np.float32(SH_C0)).astype(np.float32).reshape(n, 1, 3),
        "shN": np.ascontiguousarray(rest.reshape(n, 3, k).transpose(0, 2, 1)),
    }


def header_bytes(count: int, sh_degree: int) -> bytes:
    lines = ["ply", "format binary_little_endian 1.0", f"element chunk {-(-count // CHUNK_ROWS)}"]
    lines += [f"property float {name}" for name in (*_POSITION_BOUNDS, *_SCALE_BOUNDS, *_COLOR_BOUNDS)]
    lines += [f"element vertex {count}"] + [f"property uint {name}" for name in _PACKED]
    lines += [f"element sh {count}"] + [f"property uchar f_rest_{j}" for j in range(3 * num_sh_rest(sh_degree))]
    return ("\n".join(lines) + "\nend_header\n").encode()


class CompressedPlyWriter(RowWriter):
    """Stream Gaussians into a compressed PLY of a known row count; each 256 rows form a chunk, so
    rows should arrive spatially sorted (e.g. block by block in Morton order)."""

    def __init__(self, path: str | os.PathLike, count: int, sh_degree: int) -> None:
        self.count, self.sh_degree, self.written = count, sh_degree, 0
        self._pending: list[Splats] = []
        self._out = AtomicFile(path)
        header = header_bytes(count, sh_degree)
        n_chunks = -(-count // CHUNK_ROWS)
        self._chunk_at = len(header)
        self._vertex_at = self._chunk_at + n_chunks * 18 * 4
        self._sh_at = self._vertex_at + count * 16
        self._out.file.write(header)
        self._out.file.truncate(self._sh_at + count * 3 * num_sh_rest(sh_degree))

    def write(self, splats: Splats) -> None:
        n, degree = check_splats(splats, f"writing {self._out.path}")
        if degree != self.sh_degree:
            raise ValueError(f"writing {self._out.path}: rows of SH degree {degree}, the file has {self.sh_degree}")
        if self.written + sum(len(p["means"]) for p in self._pending) + n > self.count:
            raise ValueError(f"writing {self._out.path}: more than the {self.count} rows the header announced")
        self._pending.append(splats)
        pending = sum(len(p["means"]) for p in self._pending)
        if pending >= CHUNK_ROWS:
            self._flush(pending - pending % CHUNK_ROWS)

    def _flush(self, rows: int) -> None:
        merged = {name: np.concatenate([p[name] for p in self._pending]) for name in self._pending[0]}
        self._pending = [{name: a[rows:] for name, a in merged.items()}] if len(merged["means"]) > rows else []
        chunk, vertex, sh = encode({name: a[:rows] for name, a in merged.items()})
        f, first = self._out.file, self.written
        for at, data in ((self._chunk_at + first // CHUNK_ROWS * 72, chunk.astype("<f4")),
                         (self._vertex_at + first * 16, vertex.astype("<u4")),
                         (self._sh_at + first * sh.shape[1], sh)):  # fmt: skip
            f.seek(at)
            f.write(data.tobytes())
        self.written += rows

    def _finish(self) -> None:
        if self._pending:
            self._flush(sum(len(p["means"]) for p in self._pending))


class CompressedPly:
    """A compressed PLY opened for reading rows in ranges."""

    def __init__(self, header: PlyHeader) -> None:
        self.path: Path = header.path
        for name, needed in (("chunk", _POSITION_BOUNDS + _SCALE_BOUNDS), ("vertex", _PACKED)):
            element = header.element(name)
            missing = [p for p in needed if element is None or p not in element.names]
            if missing:
                raise PlyError(self.path, f"compressed PLY element '{name}' lacks properties {', '.join(missing)}")
        chunk_rows = element_data(header, "chunk")
        bounds = _POSITION_BOUNDS + _SCALE_BOUNDS
        if all(name in chunk_rows.dtype.names for name in _COLOR_BOUNDS):
            bounds += _COLOR_BOUNDS
        self._chunk = columns(chunk_rows, bounds)
        self._vertex = element_data(header, "vertex")
        self.count = len(self._vertex)
        if len(self._chunk) != -(-self.count // CHUNK_ROWS):
            raise PlyError(
                self.path, f"compressed PLY has {len(self._chunk)} chunks for {self.count} Gaussians (one per {CHUNK_ROWS})"
            )
        sh = header.element("sh")
        n_rest = len(sh.names) if sh else 0
        self._rest_names = [f"f_rest_{j}" for j in range(n_rest)]
        if sh and sorted(sh.names) != sorted(self._rest_names):
            raise PlyError(self.path, f"compressed PLY 'sh' element's properties are not f_rest_0 .. f_rest_{n_rest - 1}")
        if n_rest not in SH_DEGREE_OF_REST or (sh and sh.count != self.count):
            raise PlyError(self.path, f"compressed PLY 'sh' element has {n_rest} properties x {sh.count if sh else 0} rows; "
                           f"expected an SH degree's f_rest count x {self.count}")  # fmt: skip
        self.sh_degree = SH_DEGREE_OF_REST[n_rest]
        self._sh = element_data(header, "sh") if n_rest else None

    def read(self, start: int, stop: int) -> Splats:
        vertex = columns(self._vertex[start:stop], _PACKED, np.uint32)
        n = len(vertex)
        sh = columns(self._sh[start:stop], self._rest_names, np.uint8) if self._sh is not None else np.zeros((n, 0), np.uint8)
        return decode(self._chunk, vertex, sh, first_row=start)
