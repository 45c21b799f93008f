"""Datasets: COLMAP (text, binary) and transforms.json scenes as cameras, points and lazily loaded images."""
from train.data.colmap import ColmapCamera, ColmapImage, ColmapModel, ColmapPoints, read_colmap
from train.data.colmap_binary import write_model as write_colmap_binary
from train.data.colmap_text import write_model as write_colmap_text
from train.data.config import DataConfig
from train.data.errors import ColmapError, DatasetError, ImageError, TransformsError
from train.data.images import ImageLoader, ImageSource
from train.data.intrinsics import Intrinsics
from train.data.normalize import normalize_world, transform_points
from train.data.prefetch import ImagePrefetcher, Sample
from train.data.scene import SceneData, load_scene
from train.data.transforms import DatasetWarning

__all__ = [
    "ColmapCamera", "ColmapError", "ColmapImage", "ColmapModel", "ColmapPoints", "DataConfig", "DatasetError",
    "DatasetWarning", "ImageError", "ImageLoader", "ImagePrefetcher", "ImageSource", "Intrinsics", "Sample",
    "SceneData", "TransformsError", "load_scene", "normalize_world", "read_colmap", "transform_points",
    "write_colmap_binary", "write_colmap_text",
]
