"""Block contents for the storage tests: real scene points (gsplat's garden SfM points) and seeded
random blocks, plus a digest that names a block's content independently of the store."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from octree.bounds import Box
from octree.keys import BlockKey
from octree.semantics import SH_C0
from storage.schema import block_schema, empty_state, num_sh_rest


def block_digest(arrays: dict[str, np.ndarray], sh_degree: int) -> str:
    """sha256 over every array of the schema, in schema order, shapes and dtypes included."""
    h = hashlib.sha256()
    for name in block_schema(sh_degree):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}{a.shape}{a.dtype.str}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def random_block(rng: np.random.Generator, n: int, sh_degree: int) -> dict[str, np.ndarray]:
    """A block of n Gaussians with every schema array filled (no zeros: every bit is tested)."""
    out = {}
    for name, (shape, dtype) in block_schema(sh_degree).items():
        if dtype.kind == "f":
            out[name] = rng.standard_normal((n, *shape)).astype(dtype)
        else:
            out[name] = rng.integers(0, 2**31 - 1, (n, *shape), dtype=np.int64).astype(dtype)
    out["scales"] = (out["scales"] * 0.3 - 3.0).astype(np.float32)  # log scales of small Gaussians
    out["exp_avg_sq_means"] = np.abs(out["exp_avg_sq_means"])
    return out


def garden_blocks(npz: Path, sh_degree: int, trained: bool = True) -> dict[str, tuple[dict[str, np.ndarray], Box]]:
    """The garden's 138k SfM points initialised as Gaussians the way 3DGS does (kNN scales, colour
    in sh0, opacity 0.1) and split into the 8 octants of their bounding cube.

    trained=False leaves shN and the optimizer state at zero, as right after initialisation;
    trained=True fills them with noise of a plausible magnitude, as after some training.
    """
    from scipy.spatial import cKDTree  # only here: the kill-test writer imports this module and must start fast

    data = np.load(npz)
    means = data["means3d"].astype(np.float32)
    n = len(means)
    dist, _ = cKDTree(means).query(means, k=4)
    scale = np.sqrt((dist[:, 1:] ** 2).mean(axis=1)).clip(1e-7)
    rng = np.random.default_rng(0)
    quats = rng.standard_normal((n, 4)).astype(np.float32)
    arrays = {
        "means": means,
        "scales": np.repeat(np.log(scale)[:, None], 3, axis=1).astype(np.float32),
        "quats": quats,
        "opacities": np.full(n, np.log(0.1 / 0.9), np.float32),
        "sh0": ((data["colors"].astype(np.float32) / 255.0 - 0.5) / SH_C0)[:, None, :],
        "shN": np.zeros((n, num_sh_rest(sh_degree), 3), np.float32),
        **empty_state(n, sh_degree),
    }
    if trained:
        for name, (_, dtype) in block_schema(sh_degree).items():
            if name.startswith("exp_avg") or name == "shN":
                a = arrays[name]
                arrays[name] = (rng.standard_normal(a.shape) * (1e-3 if "sq" in name else 1e-2)).astype(dtype)
                if "sq" in name:
                    arrays[name] = arrays[name] ** 2
        arrays["adam_step"] = rng.integers(0, 3000, n).astype(np.int32)
        arrays["count"] = rng.integers(0, 100, n).astype(np.int32)
        arrays["grad2d"] = np.abs(rng.standard_normal(n)).astype(np.float32)
        arrays["max_radii"] = rng.random(n).astype(np.float32)
    lo = means.min(axis=0)
    size = float((means.max(axis=0) - lo).max()) * 1.0001
    octant = ((means - lo) >= size / 2).astype(np.int64)
    code = octant[:, 0] | (octant[:, 1] << 1) | (octant[:, 2] << 2)
    blocks = {}
    for c in np.unique(code):
        rows = code == c
        o = np.array([c & 1, (c >> 1) & 1, (c >> 2) & 1]) * size / 2 + lo
        cell = tuple(float(v) for v in (*o, *(o + size / 2)))
        blocks[BlockKey(1, int(c)).name] = ({k: np.ascontiguousarray(a[rows]) for k, a in arrays.items()}, cell)
    return blocks  # type: ignore[return-value]
