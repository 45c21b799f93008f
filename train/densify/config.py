"""Adaptive density control settings: gsplat's strategy names and defaults, one flag each."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

STRATEGIES = ("default", "mcmc", "none")


class ConfigError(ValueError):
    """A setting out of its range; the message names the flag."""


@dataclass
class DensifyConfig:
    """Adaptive density control (gsplat's strategies and their defaults)"""

    strategy: str = "default"  # adaptive density control: default (gsplat's DefaultStrategy: clone, split, prune, reset opacities), mcmc (gsplat's MCMCStrategy: relocate and grow up to --cap-max) or none
    refine_start_iter: int = 500  # refine after this step
    refine_stop_iter: int | None = None  # no refinement from this step on (default: 15000 for default, 25000 for mcmc)
    refine_every: int = 100  # refine every this many steps
    reset_every: int = 3000  # [default strategy] reset opacities to 2 x prune_opa every this many steps
    pause_refine_after_reset: int = 0  # [default strategy] no refinement until this many steps after a reset
    grow_grad2d: float = 0.0002  # [default strategy] clone or split where the mean 2D gradient (image space in [-1, 1]) exceeds this
    grow_scale3d: float = 0.01  # [default strategy] clone at or below this largest scale (times the scene scale), split above
    grow_scale2d: float = 0.05  # [default strategy] also split above this screen radius (of the image size) before refine_scale2d_stop_iter
    prune_opa: float = 0.005  # [default strategy] prune below this opacity
    prune_scale3d: float = 0.1  # [default strategy] prune above this largest scale (times the scene scale) after the first reset
    prune_scale2d: float = 0.15  # [default strategy] prune above this screen radius before refine_scale2d_stop_iter
    refine_scale2d_stop_iter: int = 0  # [default strategy] use the screen-radius rules until this step (0: never)
    absgrad: bool = False  # [default strategy] grow on the sum of absolute per-pixel 2D gradients (AbsGS; raise grow_grad2d, e.g. 0.0008)
    revised_opacity: bool = False  # [default strategy] split opacities as arXiv:2404.06109 does
    cap_max: int = 1_000_000  # [mcmc] most Gaussians in the scene
    noise_lr: float = 5e5  # [mcmc] scale of the noise on the means (times the means learning rate)
    min_opacity: float = 0.005  # [mcmc] Gaussians at or below this opacity are dead and relocated
    rebalance_above: float = 1.1  # after a refinement, recompute the rank regions when the heaviest carries more than this times the mean work (1: whenever it is not perfectly even)
    max_per_block: int | None = None  # a block above this many Gaussians splits into its octree children, siblings under a quarter of it merge (default: the store's tiling cap)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy {self.strategy!r}: choose from {', '.join(STRATEGIES)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or value is None or isinstance(value, str):
                continue
            flag = "--" + f.name.replace("_", "-")
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{flag} {value}: must be a finite number >= 0")
        for name in ("refine_every", "reset_every", "cap_max", "max_per_block"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {value}: must be at least 1")
        if self.rebalance_above < 1:
            raise ConfigError(f"--rebalance-above {self.rebalance_above}: must be at least 1")
        if not 0 < self.min_opacity < 1 or not 0 < self.prune_opa < 1:
            raise ConfigError("--prune-opa and --min-opacity must lie in (0, 1)")

    @property
    def stop_iter(self) -> int:
        if self.refine_stop_iter is not None:
            return self.refine_stop_iter
        return 25_000 if self.strategy == "mcmc" else 15_000
