"""Background loading of the images training will ask for next, with bounded memory."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import torch

from train.camera import Camera


class Loader(Protocol):
    def load_rgba(self, camera: Camera) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class Sample:
    camera: Camera
    rgb: torch.Tensor  # [H, W, 3] float32 in [0, 1]
    alpha: torch.Tensor | None  # [H, W, 1], None for images without alpha


class ImagePrefetcher:
    """Iterate `(camera, image)` samples in the given order while worker threads load the next ones.

    At most `depth` images are loaded ahead (plus the one the caller holds), so memory stays bounded
    however long the camera sequence is. A load that fails raises in the caller at that sample's turn.
    Decoding and resampling release the GIL, so threads suffice. Use as a context manager (or call
    close) to stop the workers early.
    """

    def __init__(self, loader: Loader, cameras: Iterable[Camera], depth: int = 4, workers: int = 2) -> None:
        if depth < 1 or workers < 1:
            raise ValueError(f"depth and workers must be at least 1, got {depth} and {workers}")
        self._loader = loader
        self._cameras = iter(cameras)
        self._depth = depth
        self._pool = ThreadPoolExecutor(max_workers=min(workers, depth), thread_name_prefix="prefetch")
        self._pending: deque[tuple[Camera, Future]] = deque()
        self._fill()

    def _fill(self) -> None:
        while len(self._pending) < self._depth:
            camera = next(self._cameras, None)
            if camera is None:
                return
            self._pending.append((camera, self._pool.submit(self._loader.load_rgba, camera)))

    def __iter__(self) -> Iterator[Sample]:
        return self

    def __next__(self) -> Sample:
        if not self._pending:
            self.close()
            raise StopIteration
        camera, future = self._pending.popleft()
        try:
            rgb, alpha = future.result()
        except BaseException:
            self.close()
            raise
        self._fill()
        return Sample(camera, rgb, alpha)

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "ImagePrefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
