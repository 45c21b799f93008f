"""Pinhole cameras for generated scenes: poses, intrinsics, naming for hold-out, and coverage."""
from __future__ import annotations

import numpy as np

from train.camera import Camera


def look_at(eye: np.ndarray, target: np.ndarray, up: np.ndarray = np.array([0.0, 0.0, 1.0])) -> np.ndarray:
    """World-to-camera [4, 4] (OpenCV axes: x right, y down, z forward) of a camera at `eye` facing `target`."""
    forward = np.asarray(target, dtype=np.float64) - eye
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, up)
    if np.linalg.norm(right) < 1e-9:  # looking along `up`: any perpendicular will do
        right = np.cross(forward, [1.0, 0.0, 0.0])
    right /= np.linalg.norm(right)
    down = np.cross(forward, right)
    R = np.stack([right, down, forward])
    viewmat = np.eye(4)
    viewmat[:3, :3] = R
    viewmat[:3, 3] = -R @ eye
    return viewmat


def pinhole_K(width: int, height: int, fov_x_deg: float) -> np.ndarray:  # [3, 3], principal point centred
    f = 0.5 * width / np.tan(np.radians(fov_x_deg) / 2)
    return np.array([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])


def heading_cameras(eye: np.ndarray, yaw: np.ndarray, pitch: np.ndarray, width: int, height: int,
                    fov_x: float) -> list[Camera]:  # eye [C, 3], yaw and pitch [C] radians
    """Upright cameras at `eye` looking along yaw (from +x towards +y) and pitch (up is positive)."""
    forward = np.column_stack([np.cos(pitch) * np.cos(yaw), np.cos(pitch) * np.sin(yaw), np.sin(pitch)])
    K = pinhole_K(width, height, fov_x)
    return [Camera(look_at(eye[i], eye[i] + forward[i]), K, width, height) for i in range(len(eye))]


def holdout_slots(n: int, every: int) -> np.ndarray:  # -> [n] int64
    """Which of n cameras standing in a sequence gets the i-th name, so that the names a loader holds
    out (i % every == 0) all stand between training cameras: the first two names swap places, and so
    do the last two when the last name would be held out (this works for every n >= 3 but n = 3 with
    every = 2, where two of the three cameras are held out)."""
    slots = np.arange(n)
    if every >= 2 and n >= 3:
        slots[[0, 1]] = [1, 0]
        if (n - 1) % every == 0 and n - 2 > 1:
            slots[[n - 2, n - 1]] = [n - 1, n - 2]
    return slots


def tour(centres: list[np.ndarray]) -> list[int]:
    """A greedy nearest-neighbour walk through the points from the one nearest the origin, so
    neighbours in the sequence stand near each other (what `holdout_slots` relies on)."""
    points = np.asarray(centres)
    left = list(range(len(points)))
    order = [left.pop(int(np.argmin(np.linalg.norm(points, axis=1))))]
    while left:
        d = np.linalg.norm(points[left] - points[order[-1]], axis=1)
        order.append(left.pop(int(np.argmin(d))))
    return order


COVERAGE_CELLS = 16  # the coverage grid over an image is COVERAGE_CELLS x COVERAGE_CELLS


def coverage_cells(camera: Camera, means: np.ndarray) -> np.ndarray:  # means [N, 3] -> [cells^2] bool
    """Which cells of a coarse grid over the image some mean projects into: a cheap stand-in for
    how much of the image the scene fills. Cells of several parts of a scene OR together."""
    cells = COVERAGE_CELLS
    cam = camera.viewmat[:3, :3] @ means.T + camera.viewmat[:3, 3:]  # [3, N]
    ahead = cam[2] > 0.1
    uv = (camera.K[:2, :2] @ (cam[:2, ahead] / cam[2, ahead]) + camera.K[:2, 2:]) / [[camera.width], [camera.height]]
    inside = ((uv >= 0) & (uv < 1)).all(axis=0)
    cell = np.floor(uv[:, inside] * cells).astype(np.int64)
    hit = np.zeros(cells * cells, dtype=bool)
    hit[cell[0] * cells + cell[1]] = True
    return hit


def best_covered(coverage: np.ndarray, n: int, enough: float) -> np.ndarray:  # coverage [C] -> [n] sorted
    """The first n cameras (in their order) whose share of covered cells reaches `enough`, topped
    up with the best covered others when fewer do."""
    return np.sort(np.argsort(-np.minimum(coverage, enough), kind="stable")[:n])
