"""The MPI exchange: buffer-based collectives over numpy arrays, no pickling on the hot path.

Per step: `Alltoall` of per-camera splat counts, `Alltoallv` of packed float32 splats (12 floats
each), and back the other way `Alltoallv` of 10 floats per splat (9 gradient floats and the
rasterizer's contributed flag). Layouts on both sides are (rank, camera ascending), so no ids travel.
On a GPU a message is packed on the device and crosses to the host in one copy, and what arrives
goes to the device in one copy.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import Tensor

from train.exchange import Incoming
from train.render import Splats2D
from train.render.splats2d import GRAD_FLOATS, WIRE_FLOATS

_BACK_FLOATS = GRAD_FLOATS + 1  # gradients and the contributed flag


def _displacements(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


class MPIExchange:
    def __init__(self, comm: MPI.Comm, device: str | torch.device = "cpu") -> None:
        self.comm = comm
        self.device = torch.device(device)  # where received splats and gradients are handed over
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.seconds = 0.0
        self._sent: np.ndarray | None = None  # [R, n_cameras] splats this rank sent
        self._received: np.ndarray | None = None  # [R, n_cameras] splats this rank received

    def _alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray, width: int) -> np.ndarray:
        recv = np.empty((int(recv_counts.sum()), width), dtype=np.float32)
        sc, rc = send_counts * width, recv_counts * width
        self.comm.Alltoallv(
            [np.ascontiguousarray(send, dtype=np.float32), (sc, _displacements(sc)), MPI.FLOAT],
            [recv, (rc, _displacements(rc)), MPI.FLOAT],
        )
        self.bytes_sent += int(send.nbytes - (send_counts[self.rank] * width * 4))
        self.bytes_received += int(recv.nbytes - (recv_counts[self.rank] * width * 4))
        return recv

    def send_splats(self, outgoing: dict[tuple[int, int], Splats2D], n_cameras: int) -> Incoming:
        t0 = time.perf_counter()
        counts = np.zeros((self.size, n_cameras), dtype=np.int64)
        parts = []
        for dest in range(self.size):
            for cam in range(n_cameras):
                s = outgoing.get((dest, cam))
                if s is not None and len(s):
                    counts[dest, cam] = len(s)
                    parts.append(s.pack())
        received = np.empty_like(counts)
        self.comm.Alltoall(counts, received)
        send = torch.cat(parts).cpu().numpy() if parts else np.zeros((0, WIRE_FLOATS), np.float32)
        buf = torch.from_numpy(self._alltoallv(send, counts.sum(1), received.sum(1), WIRE_FLOATS)).to(self.device)
        self._sent, self._received = counts, received
        incoming: Incoming = {}
        offset = 0
        for src in range(self.size):
            for cam in range(n_cameras):
                m = int(received[src, cam])
                if m:
                    s = Splats2D.unpack(buf[offset : offset + m], requires_grad=True)
                    incoming.setdefault(cam, []).append((src, s))
                    offset += m
        self.seconds += time.perf_counter() - t0
        return incoming

    def return_grads(
        self, incoming: Incoming, grads: dict[tuple[int, int], Tensor], contributed: dict[tuple[int, int], Tensor],
        absgrad: dict[tuple[int, int], Tensor] | None = None,
    ) -> dict[tuple[int, int], tuple[Tensor, Tensor, Tensor | None]]:
        t0 = time.perf_counter()
        assert self._sent is not None and self._received is not None, "return_grads before send_splats"
        n_cameras = self._sent.shape[1]
        width = _BACK_FLOATS + (2 if absgrad is not None else 0)
        by_source = {(src, cam): s for cam, lst in incoming.items() for src, s in lst}
        parts = []
        for src in range(self.size):
            for cam in range(n_cameras):
                if self._received[src, cam]:
                    s = by_source[(src, cam)]
                    flags = contributed.get((src, cam), torch.zeros(len(s), dtype=torch.bool, device=self.device))
                    cols = [grads.get((src, cam), torch.zeros(len(s), GRAD_FLOATS, device=self.device)).to(torch.float32),
                            flags.to(torch.float32)[:, None]]
                    if absgrad is not None:
                        cols.append(absgrad.get((src, cam), torch.zeros(len(s), 2, device=self.device)).to(torch.float32))
                    parts.append(torch.cat(cols, 1))
        send = torch.cat(parts).cpu().numpy() if parts else np.zeros((0, width), np.float32)
        buf = torch.from_numpy(self._alltoallv(send, self._received.sum(1), self._sent.sum(1), width)).to(self.device)
        out: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor | None]] = {}
        offset = 0
        for dest in range(self.size):
            for cam in range(n_cameras):
                m = int(self._sent[dest, cam])
                if m:
                    chunk = buf[offset : offset + m]
                    out[(dest, cam)] = (chunk[:, :GRAD_FLOATS].contiguous(), chunk[:, GRAD_FLOATS] > 0.5,
                                        chunk[:, _BACK_FLOATS:].contiguous() if absgrad is not None else None)
                    offset += m
        self.seconds += time.perf_counter() - t0
        return out

    def send_rows(self, outgoing: dict[int, np.ndarray], width: int) -> np.ndarray:
        counts = np.array([len(outgoing.get(r, ())) for r in range(self.size)], dtype=np.int64)
        received = np.empty_like(counts)
        self.comm.Alltoall(counts, received)
        parts = [np.ascontiguousarray(outgoing[r], dtype=np.uint8).reshape(-1, width)
                 for r in range(self.size) if counts[r]]
        send = np.concatenate(parts) if parts else np.zeros((0, width), np.uint8)
        recv = np.empty((int(received.sum()), width), np.uint8)
        sc, rc = counts * width, received * width
        self.comm.Alltoallv([send, (sc, _displacements(sc)), MPI.BYTE], [recv, (rc, _displacements(rc)), MPI.BYTE])
        self.bytes_sent += int(send.nbytes - counts[self.rank] * width)
        self.bytes_received += int(recv.nbytes - received[self.rank] * width)
        return recv

    def any(self, flag: bool) -> bool:
        out = np.zeros(1, dtype=np.int32)
        self.comm.Allreduce(np.array([int(flag)], dtype=np.int32), out, op=MPI.MAX)
        return bool(out[0])

    def sum(self, values: Tensor) -> Tensor:
        v = values.detach().cpu().numpy().astype(np.float64)
        out = np.empty_like(v)
        self.comm.Allreduce(v, out, op=MPI.SUM)
        return torch.from_numpy(out)

    def gather_rows(self, row: np.ndarray) -> np.ndarray:
        row = np.ascontiguousarray(row, dtype=np.float64)
        out = np.empty((self.size, row.size), dtype=np.float64)
        self.comm.Allgather(row, out)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        return self.comm.gather(obj, root=0)

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def broadcast(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)

    def barrier(self) -> None:
        self.comm.Barrier()

