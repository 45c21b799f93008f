"""The viewer's configuration: one validated dataclass, whose fields are the command-line flags."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

DEVICES = ("cpu", "cuda")
COLOUR_MODES = ("owner", "count", "step")
OCCLUSION_MODES = ("on", "off")
BROWSER_LOD_PIXELS = 1.0  # the browser's level of detail: merge what falls within about a pixel (tools/view/lod.py)
MAX_LOD_PIXELS = 64.0
_CAMERAS_RE = re.compile(r"^(all|test|train|orbit:[1-9][0-9]*|[0-9]+(,[0-9]+)*)$")


class ViewError(RuntimeError):
    """Bad input or a store the viewer cannot show; main prints it as one `error:` line."""


@dataclass(frozen=True)
class ViewConfig:
    store: str  # the store written by `python -m tools.tile` or `python -m train`
    data: str | None = None  # dataset (COLMAP or transforms.json) whose cameras to show and render from
    ranks: int = 1  # colour blocks by the owner among this many ranks (the trainer's own partition)
    host: str = "127.0.0.1"
    port: int = 8080
    device: str = "cpu"  # cpu (our numba renderer) or cuda (gsplat)
    cache_mb: float = 512.0  # block cache budget for rendering: only the blocks in view are paged in
    follow: bool = False  # re-read the store's HEAD every few seconds and show the newest commit
    follow_seconds: float = 3.0
    render: str | None = None  # headless: write PNGs of --cameras to this folder and exit
    cameras: str = "all"  # all | train | test | i,j,... (indices into train then test) | orbit:N
    width: int | None = None  # headless image size (default: the camera's own; orbit: 640)
    height: int | None = None
    outline: bool = False  # headless: draw the block boxes over the renders
    map: str | None = None  # headless: write a top-down map of the blocks coloured by owner to this PNG
    colour: str = "owner"  # first colouring of the boxes in the browser
    lod: float | None = None  # merge far blocks per cube of this many pixels; 0 exact (default: browser 1, headless 0)
    occlusion: str = "off"  # on: cull blocks hidden behind nearer ones before paging them (the same image, more rasterizations)

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ViewError(f"--ranks {self.ranks}: must be at least 1")
        if not 0 <= self.port <= 65535:
            raise ViewError(f"--port {self.port}: not a TCP port (0..65535)")
        if self.device not in DEVICES:
            raise ViewError(f"--device {self.device}: choose from {', '.join(DEVICES)}")
        if not (math.isfinite(self.cache_mb) and self.cache_mb > 0):
            raise ViewError(f"--cache-mb {self.cache_mb}: must be a positive number")
        if not (math.isfinite(self.follow_seconds) and self.follow_seconds > 0):
            raise ViewError(f"follow_seconds {self.follow_seconds}: must be positive")
        if not _CAMERAS_RE.match(self.cameras):
            raise ViewError(f"--cameras {self.cameras!r}: expected all, train, test, orbit:N or indices like 3,7")
        for name in ("width", "height"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= 16384:
                raise ViewError(f"--{name} {value}: must be in 1..16384")
        if self.lod is not None and not (math.isfinite(self.lod) and 0 <= self.lod <= MAX_LOD_PIXELS):
            raise ViewError(f"--lod {self.lod}: must be a number of pixels in 0..{MAX_LOD_PIXELS:g} (0: exact)")
        if self.occlusion not in OCCLUSION_MODES:
            raise ViewError(f"--occlusion {self.occlusion}: choose from {', '.join(OCCLUSION_MODES)}")
        if self.colour not in COLOUR_MODES:
            raise ViewError(f"colour {self.colour!r}: choose from {', '.join(COLOUR_MODES)}")
        if self.render and self.data is None and not self.cameras.startswith("orbit:"):
            raise ViewError(f"--cameras {self.cameras}: dataset cameras need --data (or use --cameras orbit:N)")

    @property
    def cache_bytes(self) -> int:
        return max(1, int(self.cache_mb * 2**20))

    @property
    def lod_pixels(self) -> float:
        """Headless renders are exact unless asked; the browser merges what it cannot resolve."""
        if self.lod is not None:
            return self.lod
        return 0.0 if self.headless else BROWSER_LOD_PIXELS

    @property
    def headless(self) -> bool:
        return self.render is not None or self.map is not None
