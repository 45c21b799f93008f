"""A COLMAP dataset folder (model + images/) as views in the input frame."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from train.data.colmap import ColmapCamera, read_colmap
from train.data.errors import ColmapError, ImageError
from train.data.fileio import inside
from train.data.intrinsics import Intrinsics
from train.data.views import RawScene, View, camera_box

# COLMAP model -> how its parameters map onto (fx, fy, cx, cy) and (k1, k2, p1, p2, k3).
_PARAMS = {
    "SIMPLE_PINHOLE": ((0, 0, 1, 2), ()),
    "PINHOLE": ((0, 1, 2, 3), ()),
    "SIMPLE_RADIAL": ((0, 0, 1, 2), (3,)),
    "RADIAL": ((0, 0, 1, 2), (3, 4)),
    "OPENCV": ((0, 1, 2, 3), (4, 5, 6, 7)),
}


def colmap_intrinsics(camera: ColmapCamera, cameras_file: Path) -> Intrinsics:
    if camera.model not in _PARAMS:
        raise ColmapError(cameras_file, f"camera model {camera.model} is not supported (supported: "
                          f"{', '.join(_PARAMS)})", f"{camera.origin} (camera {camera.camera_id})")
    pinhole, distortion = _PARAMS[camera.model]
    p = camera.params
    dist = [float(p[i]) for i in distortion] + [0.0] * (5 - len(distortion))
    return Intrinsics(*(float(p[i]) for i in pinhole), camera.width, camera.height, tuple(dist))


def read_colmap_scene(data_dir: Path, allow_external: bool = False) -> RawScene:
    """allow_external: follow image names that lead out of the image folder."""
    model = read_colmap(data_dir)
    image_root = data_dir / "images"
    if not image_root.is_dir():
        raise ImageError(image_root, "image folder is missing (COLMAP datasets keep their images in images/)")
    for img in model.images.values():
        if not allow_external and not inside(image_root, img.name):
            raise ColmapError(model.files["images"], f"image name {img.name!r} lies outside the image folder "
                              f"{image_root} (pass --allow-external-images to follow it)",
                              f"{img.origin} (image {img.image_id})")
    intrinsics = {cid: colmap_intrinsics(cam, model.files["cameras"]) for cid, cam in model.cameras.items()}
    views = [View(img.name, img.image_id, img.viewmat, intrinsics[img.camera_id], image_root, img.name)
             for img in model.images.values()]
    if not views:
        raise ColmapError(model.files["images"], "the model has no images")
    kind = "colmap-binary" if model.binary else "colmap-text"
    pts = model.points
    return RawScene(kind, model.files["cameras"].parent, views, pts.xyz.astype(np.float64), pts.rgb, camera_box(views))
