"""Gaussians sent to the browser as viser's splat node: the visible blocks nearest the camera,
under a client budget, so the browser can orbit them at its own frame rate between server frames."""
from __future__ import annotations

import numpy as np
import viser.transforms as vtf
from torch import Tensor

from storage.table import BlockInfo
from train.render.semantics import SH_C0

CLIENT_BUDGET = 2_000_000  # Gaussians a browser is sent at most (viser sorts them on the client's CPU)


def nearest_within(keys: list[str], table: dict[str, BlockInfo], eye: np.ndarray,  # eye [3]
                   budget: int = CLIENT_BUDGET) -> list[str]:
    """The blocks of `keys` nearest `eye` (distance to the extent box, 0 inside) whose counts
    fit `budget` together, nearest first; the first block that does not fit ends the list."""
    boxes = np.array([table[k].extent for k in keys], dtype=np.float64).reshape(-1, 6)
    gap = np.maximum(np.maximum(boxes[:, :3] - eye, eye - boxes[:, 3:]), 0.0)
    chosen, total = [], 0
    for i in np.argsort(np.linalg.norm(gap, axis=1), kind="stable"):
        count = table[keys[i]].count
        if total + count > budget:
            break
        chosen.append(keys[i])
        total += count
    return chosen


def splat_node_arrays(tensors: dict[str, Tensor]) -> dict[str, np.ndarray]:
    """viser's add_gaussian_splats arrays from a block's parameters: centers [N, 3], covariances
    [N, 3, 3] (R S S^T R^T), rgbs [N, 3] from sh0 alone (viser's node has no view dependence),
    opacities [N, 1] activated."""
    means = tensors["means"].cpu().numpy()
    quats = tensors["quats"].cpu().numpy().astype(np.float64)
    quats /= np.linalg.norm(quats, axis=1, keepdims=True)
    R = vtf.SO3(quats).as_matrix()  # [N, 3, 3]
    M = R * np.exp(tensors["scales"].cpu().numpy().astype(np.float64))[:, None, :]
    rgbs = np.clip(tensors["sh0"].cpu().numpy()[:, 0] * SH_C0 + 0.5, 0.0, 1.0)
    opacities = 1.0 / (1.0 + np.exp(-tensors["opacities"].cpu().numpy().astype(np.float64)))
    return {"centers": means, "covariances": M @ M.transpose(0, 2, 1), "rgbs": rgbs, "opacities": opacities[:, None]}
