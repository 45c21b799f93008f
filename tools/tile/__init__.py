"""`python -m tools.tile`: turn a point cloud, dataset or trained 3DGS PLY into a scene store."""
from tools.tile.config import TileConfig, TileError
from tools.tile.pipeline import TileSummary, tile

__all__ = ["TileConfig", "TileError", "TileSummary", "tile"]
