"""LPIPS for evaluation, through the `lpips` package, only where it and its network weights are
installed: nothing is downloaded at run time, and where they are missing the run says so once."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

# torchvision's ImageNet AlexNet, whose features LPIPS (net="alex", as gsplat's trainer) weighs;
# torchvision loads it from torch's hub cache when it is there, and would download it otherwise.
ALEXNET_WEIGHTS = "alexnet-owt-7be5be79.pth"

Metric = Callable[[Tensor, Tensor], float]  # rendered, target [H, W, 3] in [0, 1] -> distance


def load_lpips(device: torch.device) -> tuple[Metric | None, str | None]:
    """(metric, None), or (None, why LPIPS is skipped)."""
    try:
        import lpips
    except Exception as e:  # noqa: BLE001 - not installed, or a torchvision build this torch cannot load
        return None, f"LPIPS skipped: the lpips package does not import here ({type(e).__name__}: {e})"
    weights = Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_WEIGHTS
    if not weights.is_file():
        return None, (f"LPIPS skipped: AlexNet's weights are not at {weights} (nothing is downloaded at run "
                      "time; put the file there, or set TORCH_HOME)")
    net = lpips.LPIPS(net="alex", verbose=False).to(device).eval()

    @torch.no_grad()
    def metric(rendered: Tensor, target: Tensor) -> float:
        as_batch = [x.clamp(0, 1).permute(2, 0, 1)[None] * 2.0 - 1.0 for x in (rendered, target)]  # lpips takes [-1, 1]
        return float(net(*as_batch).mean())

    return metric, None
