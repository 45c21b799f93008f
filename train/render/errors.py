"""The renderer's error type: bad splats, cameras or backends, named in the message."""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor


class RenderError(ValueError):
    """Invalid input to project/rasterize/render (the message names the field and the problem)."""


def all_finite(t: Tensor) -> bool:
    """Whether every value of t is finite. A sum is NaN or inf whenever any value is, and costs a
    thirtieth of `isfinite().all()` on large tensors; only a sum that overflows needs the full check.
    The sum is tested as a Python float: torch's isfinite on it cost more than the sum (~25 us)."""
    if t.numel() == 0 or math.isfinite(t.detach().sum()):
        return True
    return bool(torch.isfinite(t).all())


def nonfinite(field: str) -> RenderError:
    """The error for a field (`splats['means']`, `splats2d.conics`) holding NaN or inf, wherever
    it is found: by a torch pass, or by the kernel that reads it."""
    return RenderError(f"{field}: contains NaN or inf")


def first_nonfinite(fields: Iterable[tuple[str, Tensor | np.ndarray]]) -> RenderError | None:
    """The error for the first (name, values) of the splats' fields holding NaN or inf (shN's
    values: the coefficients the degree reads), or None if every one is finite."""
    for name, values in fields:
        if not (all_finite(values) if isinstance(values, Tensor) else bool(np.isfinite(values).all())):
            return nonfinite(f"splats['{name}']")
    return None
