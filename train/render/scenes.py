"""Renderer test scenes: gsplat's `test_garden.npz` turned into splats the way gsplat's
`load_test_data` does (crop to [-2, 2]^3, scales uniform in (0, 0.02), opacities uniform in
(0, 1), random rotations), stored with our names and activations, SH colour from the point colours."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from train.camera import Camera
from train.render.errors import RenderError
from train.render.semantics import SH_C0, num_sh_bases

_GARDEN_KEYS = ("means3d", "colors", "viewmats", "Ks", "width", "height")


def load_garden(path: str | Path, sh_degree: int = 3, crop: float = 2.0, seed: int = 0,
                sh_noise: float = 0.05) -> tuple[dict[str, Tensor], list[Camera]]:
    """Splats (CPU float32, no grad) and the 3 cameras of `path` (gsplat's test_garden.npz)."""
    try:
        data = np.load(path)
        missing = [k for k in _GARDEN_KEYS if k not in data]
    except (OSError, ValueError) as exc:
        raise RenderError(f"{path}: not a readable npz ({exc})") from exc
    if missing:
        raise RenderError(f"{path}: missing arrays {', '.join(missing)}")
    means = torch.from_numpy(data["means3d"].astype(np.float32))
    colors = torch.from_numpy(data["colors"].astype(np.float32) / 255.0)
    inside = ((means >= -crop) & (means <= crop)).all(-1)
    means, colors = means[inside], colors[inside]
    n = len(means)
    gen = torch.Generator().manual_seed(seed)
    splats = {
        "means": means.contiguous(),
        # Clamped away from 0 and 1, where log and logit would be infinite.
        "scales": torch.log(torch.rand(n, 3, generator=gen).clamp_min(1e-6) * 0.02),
        "quats": torch.nn.functional.normalize(torch.randn(n, 4, generator=gen), dim=-1),
        "opacities": torch.logit(torch.rand(n, generator=gen).clamp(1e-6, 1.0 - 1e-6)),
        "sh0": ((colors - 0.5) / SH_C0)[:, None, :].contiguous(),
        "shN": sh_noise * torch.randn(n, num_sh_bases(sh_degree) - 1, 3, generator=gen),
    }
    width, height = int(data["width"]), int(data["height"])
    cameras = [Camera(vm.astype(np.float64), k.astype(np.float64), width, height, image_id=i, name=f"garden_{i}")
               for i, (vm, k) in enumerate(zip(data["viewmats"], data["Ks"]))]
    return splats, cameras
