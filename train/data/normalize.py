"""gsplat's world normalisation (examples/datasets/normalize.py and colmap.py), as one similarity transform.

1. `similarity_from_cameras`: rotate the cameras' mean up vector onto -y, move the median of the
   points where the camera axes pass closest to the origin there, and scale so the median camera
   distance is 1.
2. `align_principal_axes` (only with a point cloud): centre on the points' median and rotate their
   principal axes onto x, y, z (largest spread on x).
3. If the points' median height lies above their mean, turn the world upside down (a 180 degree
   rotation about x), assuming more points near the ground than in the sky.
"""
from __future__ import annotations

import numpy as np


def transform_points(T: np.ndarray, points: np.ndarray) -> np.ndarray:  # [4, 4], [P, 3] -> [P, 3]
    return points @ T[:3, :3].T + T[:3, 3]


def similarity_from_cameras(camtoworlds: np.ndarray) -> np.ndarray:  # [N, 4, 4] OpenCV -> [4, 4]
    R, t = camtoworlds[:, :3, :3], camtoworlds[:, :3, 3]
    world_up = -R[:, :, 1].mean(axis=0)  # camera -y is up
    world_up /= np.linalg.norm(world_up)
    target = np.array([0.0, -1.0, 0.0])
    c = float(world_up @ target)
    if c > -1.0 + 1e-12:
        v = np.cross(world_up, target)
        skew = np.array([[0.0, -v[2], v[1]], [v[2], 0.0, -v[0]], [-v[1], v[0], 0.0]])
        R_align = np.eye(3) + skew + skew @ skew / (1.0 + c)  # Rodrigues: world_up -> target
    else:  # up is already +y: half a turn about x (gsplat mirrors here instead, which flips handedness)
        R_align = np.diag([1.0, -1.0, -1.0])
    forward = (R_align @ R)[:, :, 2]
    t = t @ R_align.T
    # Where each camera's optical axis passes closest to the origin; their median becomes the centre.
    nearest = t + (forward * -t).sum(-1, keepdims=True) * forward
    translate = -np.median(nearest, axis=0)
    dist = np.median(np.linalg.norm(t + translate, axis=-1))
    scale = 1.0 / dist if dist > 1e-12 else 1.0  # all cameras at one spot: nothing to scale by
    T = np.eye(4)
    T[:3, :3] = R_align * scale
    T[:3, 3] = translate * scale
    return T


def align_principal_axes(points: np.ndarray) -> np.ndarray:  # [P, 3] -> [4, 4] rigid
    centroid = np.median(points, axis=0)
    eigenvalues, eigenvectors = np.linalg.eigh(np.cov(points - centroid, rowvar=False))
    eigenvectors = eigenvectors[:, np.argsort(eigenvalues)[::-1]]
    if np.linalg.det(eigenvectors) < 0:
        eigenvectors[:, 0] *= -1.0
    T = np.eye(4)
    T[:3, :3] = eigenvectors.T
    T[:3, 3] = -eigenvectors.T @ centroid
    return T


def normalize_world(camtoworlds: np.ndarray, points: np.ndarray | None) -> np.ndarray:
    """The similarity [4, 4] taking the input frame to gsplat's normalised frame.

    camtoworlds: [N, 4, 4] camera-to-world, OpenCV axes; points: [P, 3] SfM points, or None (P < 3
    counts as none: principal axes need a spread).
    """
    T = similarity_from_cameras(camtoworlds)
    if points is None or len(points) < 3:
        return T
    moved = transform_points(T, points)
    A = align_principal_axes(moved)
    T = A @ T
    moved = transform_points(A, moved)
    if np.median(moved[:, 2]) > np.mean(moved[:, 2]):
        T = np.diag([1.0, -1.0, -1.0, 1.0]) @ T
    return T
