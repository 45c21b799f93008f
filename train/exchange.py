"""How splats reach the rank that renders their camera, and how their gradients come back.

The step is written against `Exchange`; one rank uses `LocalExchange`, where nothing ever
leaves the process, so single-process runs take exactly the code path of distributed ones.
Every rank calls every method in the same order every step, also with nothing to send.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from torch import Tensor

from train.render import Splats2D

# camera index -> [(source rank, splats whose differentiable fields are leaves)]
Incoming = dict[int, list[tuple[int, Splats2D]]]


@dataclass
class Held:
    """Leading rows of the step's parts that an earlier exchange of the same step (the occlusion
    pass's rounds) already delivered: the sender leaves them off the wire and the receiver puts
    its copy in front of what arrives, so the part, and the gradients that go back for it, are
    whole on both sides."""

    skipped: dict[tuple[int, int], int] = field(default_factory=dict)  # (dest rank, camera) -> leading rows not sent
    splats: dict[tuple[int, int], Splats2D] = field(default_factory=dict)  # (source rank, camera) -> rows held here

    def check(self, src: int, cam: int, rows: int) -> Splats2D | None:
        """What this rank holds of (src, cam)'s part, which its sender says is `rows` long."""
        held = self.splats.get((src, cam))
        if (0 if held is None else len(held)) != rows:
            raise RuntimeError(f"rank {src} left {rows} rows of camera {cam}'s splats off the wire, but this rank "
                               f"holds {0 if held is None else len(held)} of them")
        return held


class Exchange(Protocol):
    rank: int
    size: int

    def send_splats(
        self,
        outgoing: dict[tuple[int, int], Splats2D],  # (dest rank, camera index) -> splats (sent packed)
        n_cameras: int,
        held: Held | None = None,  # rows the destinations hold already (not sent), and those held here
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
    grad_bytes_sent = 0
    grad_bytes_received = 0
    grad_rows_sent = 0

    def send_splats(self, outgoing: dict[tuple[int, int], Splats2D], n_cameras: int,
                    held: Held | None = None) -> Incoming:
        if outgoing or (held is not None and (held.skipped or held.splats)):
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
