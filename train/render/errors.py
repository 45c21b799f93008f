"""The renderer's error type: bad splats, cameras or backends, named in the message."""
from __future__ import annotations


class RenderError(ValueError):
    """Invalid input to project/rasterize/render (the message names the field and the problem)."""
