"""How splats reach the rank that renders their camera, and how their gradients come back.

The step is written against `Exchange`; one rank uses `LocalExchange`, where nothing ever
leaves the process, so single-process runs take exactly the code path of distributed ones.
Every rank calls every method in the same order every step, also with nothing to send.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from torch import Tensor

from train.render import Splats2D

# camera index -> [(source rank, splats whose differentiable fields are leaves)]
Incoming = dict[int, list[tuple[int, Splats2D]]]


class Exchange(Protocol):
    rank: int
    size: int

    def send_splats(
        self,
        outgoing: dict[tuple[int, int], Splats2D],  # (dest rank, camera index) -> splats (sent packed)
        n_cameras: int,
    ) -> Incoming: ...

    def return_grads(
        self,
        incoming: Incoming,  # what send_splats returned
        grads: dict[tuple[int, int], Tensor],  # (source rank, camera) -> [M, 9] pack_grads layout
        contributed: dict[tuple[int, int], Tensor],  # (source rank, camera) -> [M] bool
        absgrad: dict[tuple[int, int], Tensor] | None = None,  # (source rank, camera) -> [M, 2], sent along if given
    ) -> dict[tuple[int, int], tuple[Tensor, Tensor, Tensor | None]]:
        """(dest, camera) -> (grads [M, 9], contributed [M], absgrad [M, 2] or None) for this rank's splats
        that other ranks rendered. With absgrad every rank passes it (its width is on the wire)."""
        ...

    def send_rows(
        self,
        outgoing: dict[int, np.ndarray],  # dest rank -> [n, width] uint8 rows (a rank's own rows included)
        width: int,
    ) -> np.ndarray:  # [m, width] uint8: what every rank sent here, in source rank order
        """Whole Gaussians (`storage.rows.pack_rows`) to the ranks that own their new blocks."""
        ...

    def any(self, flag: bool) -> bool:
        """True on every rank if any rank passed True."""
        ...

    def sum(self, values: Tensor) -> Tensor:  # [K] float64, summed over ranks
        ...

    def gather_rows(self, row: np.ndarray) -> np.ndarray:  # [K] -> [R, K], on every rank
        ...

    def gather(self, obj: Any) -> list[Any] | None:
        """Small control data (commit tables) to rank 0; None elsewhere. Not for the hot path."""
        ...

    def allgather(self, obj: Any) -> list[Any]:
        """Small control data from every rank, on every rank, in rank order. Not for the hot path."""
        ...

    def broadcast(self, obj: Any) -> Any: ...

    def barrier(self) -> None: ...


class LocalExchange:
    """One rank: every camera is rendered where its splats were projected."""

    rank = 0
    size = 1
    bytes_sent = 0
    bytes_received = 0

    def send_splats(self, outgoing: dict[tuple[int, int], Splats2D], n_cameras: int) -> Incoming:
        if outgoing:
            raise RuntimeError("a single rank has no other rank to send splats to")
        return {}

    def return_grads(
        self, incoming: Incoming, grads: dict[tuple[int, int], Tensor], contributed: dict[tuple[int, int], Tensor],
        absgrad: dict[tuple[int, int], Tensor] | None = None,
    ) -> dict[tuple[int, int], tuple[Tensor, Tensor, Tensor | None]]:
        return {}

    def send_rows(self, outgoing: dict[int, np.ndarray], width: int) -> np.ndarray:
        if set(outgoing) - {0}:
            raise RuntimeError("a single rank has no other rank to send rows to")
        return outgoing.get(0, np.zeros((0, width), np.uint8))

    def any(self, flag: bool) -> bool:
        return flag

    def sum(self, values: Tensor) -> Tensor:
        return values.clone()

    def gather_rows(self, row: np.ndarray) -> np.ndarray:
        return np.asarray(row)[None]

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        pass
