"""The standard 3DGS PLY: one float row per Gaussian, laid out exactly as `gsplat.export_splats` writes it.

Row: x y z, f_dc_0..2, f_rest_0..3K-1 (channel-major: f_rest[c*K + k] = shN[k, c]), opacity,
scale_0..2 (log), rot_0..3 (wxyz). Float fields are copied, never converted, so a file read and
written again is identical bit for bit.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from storage.schema import PARAM_NAMES, num_sh_rest
from tools.ply.format import AtomicFile, PlyError, PlyHeader, RowWriter, columns, element_data

Splats = dict[str, np.ndarray]  # gsplat names: means [N,3], scales [N,3], quats [N,4], opacities [N], sh0 [N,1,3], shN [N,K,3]

_FIXED = ("x", "y", "z", "f_dc_0", "f_dc_1", "f_dc_2", "opacity", "scale_0", "scale_1", "scale_2",
          "rot_0", "rot_1", "rot_2", "rot_3")  # fmt: skip
GAUSSIAN_MARKERS = ("f_dc_0", "opacity", "scale_0", "rot_0")  # any of these: the file means to be a 3DGS PLY
SH_DEGREE_OF_REST = {3 * num_sh_rest(d): d for d in range(5)}  # number of f_rest fields -> degree


def property_names(sh_degree: int) -> list[str]:
    rest = [f"f_rest_{j}" for j in range(3 * num_sh_rest(sh_degree))]
    return ["x", "y", "z", "f_dc_0", "f_dc_1", "f_dc_2", *rest, "opacity", "scale_0", "scale_1", "scale_2",
            "rot_0", "rot_1", "rot_2", "rot_3"]  # fmt: skip


def header_bytes(count: int, sh_degree: int) -> bytes:
    lines = ["ply", "format binary_little_endian 1.0", f"element vertex {count}"]
    lines += [f"property float {name}" for name in property_names(sh_degree)]
    return ("\n".join(lines) + "\nend_header\n").encode()


def check_splats(splats: Splats, where: str) -> tuple[int, int]:
    """(rows, sh degree) of a splat dict, or ValueError naming `where` and the problem."""
    missing = [name for name in PARAM_NAMES if name not in splats]
    if missing:
        raise ValueError(f"{where}: splats lack {missing}")
    n = len(splats["means"])
    k = splats["shN"].shape[1] if splats["shN"].ndim == 3 else -1
    degree = next((d for d in range(5) if num_sh_rest(d) == k), None)
    shapes = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,), "sh0": (n, 1, 3), "shN": (n, k, 3)}
    bad = [name for name, shape in shapes.items() if splats[name].shape != shape]
    if bad or degree is None:
        raise ValueError(f"{where}: bad splat shapes {[(b, splats[b].shape) for b in bad] or splats['shN'].shape}")
    return n, degree


def pack_rows(splats: Splats) -> np.ndarray:  # -> [N, 14 + 3K] float32
    n = len(splats["means"])
    sh_rest = splats["shN"].transpose(0, 2, 1).reshape(n, -1)
    parts = [splats["means"], splats["sh0"].reshape(n, 3), sh_rest, splats["opacities"].reshape(n, 1)]
    parts += [splats["scales"], splats["quats"]]
    return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts], axis=1)


class GaussianPlyWriter(RowWriter):
    """Stream Gaussians into a standard PLY of a known row count; the file appears only when complete.

    Non-finite values are refused: gsplat's exporter silently drops such rows, which would make the
    header's count wrong for a streamed file, so the caller decides what to do with them first.
    """

    def __init__(self, path: str | os.PathLike, count: int, sh_degree: int) -> None:
        self.count, self.sh_degree, self.written = count, sh_degree, 0
        self._out = AtomicFile(path)
        self._out.file.write(header_bytes(count, sh_degree))

    def write(self, splats: Splats) -> None:
        n, degree = check_splats(splats, f"writing {self._out.path}")
        if degree != self.sh_degree:
            raise ValueError(f"writing {self._out.path}: rows of SH degree {degree}, the file has {self.sh_degree}")
        if self.written + n > self.count:
            raise ValueError(f"writing {self._out.path}: more than the {self.count} rows the header announced")
        rows = pack_rows(splats)
        bad = int((~np.isfinite(rows).all(axis=1)).sum())
        if bad:
            raise ValueError(f"writing {self._out.path}: {bad} Gaussians have NaN or infinite values")
        self._out.file.write(rows.astype("<f4", copy=False).tobytes())
        self.written += n



class GaussianPly:
    """A standard 3DGS PLY opened for reading rows in ranges (memory-mapped, so any size streams)."""

    def __init__(self, header: PlyHeader) -> None:
        self.path: Path = header.path
        vertex = header.element("vertex")
        names = set(vertex.names) if vertex else set()
        missing = [name for name in _FIXED if name not in names]
        if missing:
            raise PlyError(self.path, f"3DGS PLY lacks properties {', '.join(missing)}")
        n_rest = sum(1 for name in names if name.startswith("f_rest_"))
        if n_rest not in SH_DEGREE_OF_REST or any(f"f_rest_{j}" not in names for j in range(n_rest)):
            raise PlyError(self.path, f"3DGS PLY has {n_rest} f_rest properties, not f_rest_0 .. f_rest_(9, 24 or 45)-1")
        self.sh_degree = SH_DEGREE_OF_REST[n_rest]
        self.count = vertex.count
        self._rows = element_data(header, "vertex")

    def read(self, start: int, stop: int) -> Splats:
        rows = self._rows[start:stop]
        n = len(rows)
        k = num_sh_rest(self.sh_degree)
        rest = columns(rows, [f"f_rest_{j}" for j in range(3 * k)])
        return {
            "means": columns(rows, ("x", "y", "z")),
            "scales": columns(rows, ("scale_0", "scale_1", "scale_2")),
            "quats": columns(rows, ("rot_0", "rot_1", "rot_2", "rot_3")),
            "opacities": columns(rows, ("opacity",))[:, 0],
            "sh0": columns(rows, ("f_dc_0", "f_dc_1", "f_dc_2")).reshape(n, 1, 3),
            "shN": np.ascontiguousarray(rest.reshape(n, 3, k).transpose(0, 2, 1)),
        }
