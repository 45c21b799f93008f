"""What a block holds: gsplat-named parameters, their Adam state and densification statistics.

Every array has one row per Gaussian; the table below is the whole format of a block.
"""
from __future__ import annotations

import numpy as np

PARAM_NAMES = ("means", "scales", "quats", "opacities", "sh0", "shN")
STAT_NAMES = ("grad2d", "count", "max_radii")
MOMENT_PREFIXES = ("exp_avg_", "exp_avg_sq_")  # Adam's first and second moment of a parameter


def num_sh_rest(sh_degree: int) -> int:
    """K in shN [N, K, 3]: (d+1)^2 - 1 coefficients beyond the DC term."""
    return (sh_degree + 1) ** 2 - 1


def param_shapes(sh_degree: int) -> dict[str, tuple[int, ...]]:
    """Trailing shape of each parameter (the row dimension N is left out)."""
    return {
        "means": (3,),
        "scales": (3,),  # log scales
        "quats": (4,),  # wxyz, unnormalised
        "opacities": (),  # logits
        "sh0": (1, 3),
        "shN": (num_sh_rest(sh_degree), 3),
    }


def moment_names() -> tuple[str, ...]:
    """The Adam moment arrays, `exp_avg_<p>` and `exp_avg_sq_<p>` of every parameter p."""
    return tuple(f"{prefix}{name}" for name in PARAM_NAMES for prefix in MOMENT_PREFIXES)


def block_schema(sh_degree: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name -> (trailing shape, dtype) of every array in a block."""
    schema: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    f32 = np.dtype(np.float32)
    for name, shape in param_shapes(sh_degree).items():
        schema[name] = (shape, f32)
    for name, shape in param_shapes(sh_degree).items():
        for prefix in MOMENT_PREFIXES:
            schema[f"{prefix}{name}"] = (shape, f32)
    schema["adam_step"] = ((), np.dtype(np.int32))  # per-row step count of sparse Adam
    schema["grad2d"] = ((), f32)  # sum of 2D mean gradient norms (densification)
    schema["count"] = ((), np.dtype(np.int32))  # steps the Gaussian was visible
    schema["max_radii"] = ((), f32)  # max screen radius / max(W, H)
    return schema


def empty_state(n: int, sh_degree: int) -> dict[str, np.ndarray]:
    """Zeroed optimizer state and statistics for n fresh Gaussians (parameters not included)."""
    return {
        name: np.zeros((n, *shape), dtype)
        for name, (shape, dtype) in block_schema(sh_degree).items()
        if name not in PARAM_NAMES
    }


def bytes_per_gaussian(sh_degree: int) -> int:
    return sum(
        int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        for shape, dtype in block_schema(sh_degree).values()
    )
