"""The MPI exchange: buffer-based collectives over numpy arrays, no pickling on the hot path.

Per step: `Alltoall` of per-camera splat counts (with the leading rows of each part that the
receiver holds already from the occlusion pass, `Held`, which stay off the wire), `Alltoallv` of
packed float32 splats (12 floats each); back the other way `Alltoallv` of two bits per splat
(whether its gradient row comes, and the rasterizer's contributed flag) and `Alltoallv` of the
9 gradient floats of each splat whose row is not all zero: a splat no pixel blended has none.
Layouts on both sides are (rank, camera ascending), so no ids travel. On a GPU a message is
packed on the device and crosses to the host in one copy, and what arrives goes to the device
in one copy.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import Tensor

from train.exchange import Held, Incoming
from train.render import Splats2D
from train.render.splats2d import GRAD_FLOATS, WIRE_FLOATS



def _displacements(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _mask_bytes(rows: np.ndarray) -> np.ndarray:  # [R, n_cameras] rows of each part -> bytes of its two bits a row
    return (2 * rows + 7) // 8


def _per_rank(per_part: list, shape_of: np.ndarray) -> np.ndarray:  # counts in (rank, camera) order -> [R] sums
    return np.asarray(per_part, dtype=np.int64).reshape(shape_of.shape).sum(1)


class MPIExchange:
    def __init__(self, comm: MPI.Comm, device: str | torch.device = "cpu") -> None:
        self.comm = comm
        self.device = torch.device(device)  # where received splats and gradients are handed over
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.grad_bytes_sent = 0  # of those, the gradients' return (`return_grads`)
        self.grad_bytes_received = 0
        self.grad_rows_sent = 0  # gradient rows sent back: the splats rendered here for another rank that a pixel blended
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

    def send_splats(self, outgoing: dict[tuple[int, int], Splats2D], n_cameras: int,
                    held: Held | None = None) -> Incoming:
        t0 = time.perf_counter()
        held = held if held is not None else Held()
        # per destination: each camera's part length, then the leading rows of it left off the wire
        counts = np.zeros((self.size, 2, n_cameras), dtype=np.int64)
        parts = []
        for dest in range(self.size):
            for cam in range(n_cameras):
                s = outgoing.get((dest, cam))
                if s is not None and len(s):
                    skip = held.skipped.get((dest, cam), 0)
                    if not 0 <= skip <= len(s):
                        raise RuntimeError(f"camera {cam}'s part for rank {dest}: {skip} of {len(s)} rows held there")
                    counts[dest, :, cam] = len(s), skip
                    if skip < len(s):
                        parts.append((s.select(slice(skip, None)) if skip else s).pack())
        received = np.empty_like(counts)
        self.comm.Alltoall(counts, received)
        send = torch.cat(parts).cpu().numpy() if parts else np.zeros((0, WIRE_FLOATS), np.float32)
        wire_out, wire_in = counts[:, 0] - counts[:, 1], received[:, 0] - received[:, 1]
        buf = torch.from_numpy(self._alltoallv(send, wire_out.sum(1), wire_in.sum(1), WIRE_FLOATS)).to(self.device)
        self._sent, self._received = counts[:, 0], received[:, 0]
        incoming: Incoming = {}
        offset = 0
        for src in range(self.size):
            for cam in range(n_cameras):
                m, k = int(received[src, 0, cam]), int(received[src, 1, cam])
                mine = held.check(src, cam, k)
                if m:
                    s = Splats2D.unpack(buf[offset : offset + m - k], requires_grad=mine is None)
                    if mine is not None:
                        s = Splats2D.cat([mine, s]).as_leaves()
                    incoming.setdefault(cam, []).append((src, s))
                    offset += m - k
        self.seconds += time.perf_counter() - t0
        return incoming

    def return_grads(
        self, incoming: Incoming, grads: dict[tuple[int, int], Tensor], contributed: dict[tuple[int, int], Tensor],
        absgrad: dict[tuple[int, int], Tensor] | None = None,
    ) -> dict[tuple[int, int], tuple[Tensor, Tensor, Tensor | None]]:
        t0 = time.perf_counter()
        assert self._sent is not None and self._received is not None, "return_grads before send_splats"
        n_cameras = self._sent.shape[1]
        width = GRAD_FLOATS + (2 if absgrad is not None else 0)
        by_source = {(src, cam): s for cam, lst in incoming.items() for src, s in lst}
        parts, flags = [], []
        for src in range(self.size):
            for cam in range(n_cameras):
                if self._received[src, cam]:
                    m = len(by_source[(src, cam)])
                    flags.append(contributed.get((src, cam), torch.zeros(m, dtype=torch.bool, device=self.device)))
                    cols = [grads.get((src, cam), torch.zeros(m, GRAD_FLOATS, device=self.device)).to(torch.float32)]
                    if absgrad is not None:
                        cols.append(absgrad.get((src, cam), torch.zeros(m, 2, device=self.device)).to(torch.float32))
                    parts.append(torch.cat(cols, 1))
        send = torch.cat(parts).cpu().numpy() if parts else np.zeros((0, width), np.float32)
        flag = torch.cat(flags).cpu().numpy() if flags else np.zeros(0, bool)
        # Two bits a splat, its row's and its contributed flag; the row itself only where its
        # bits are not all zero (a splat no pixel blended has no gradient: most of a frustum's
        # behind its surfaces).
        nonzero = send.view(np.int32).any(axis=1)
        sent0, received0 = self.bytes_sent, self.bytes_received
        cuts = np.cumsum(self._received.ravel())[:-1]
        going = np.split(nonzero, cuts)  # per (source, camera) we rendered
        masks = self._alltoallv_bytes(np.concatenate([np.packbits(np.concatenate([r, f]))
                                                      for r, f in zip(going, np.split(flag, cuts))]),
                                      _mask_bytes(self._received).sum(1), _mask_bytes(self._sent).sum(1))
        bits = [np.unpackbits(m, count=2 * n).astype(bool) for m, n in  # per (dest, camera) of our splats
                zip(np.split(masks, np.cumsum(_mask_bytes(self._sent).ravel())[:-1]), self._sent.ravel())]
        came = [b[: len(b) // 2] for b in bits]
        rows = self._alltoallv(send[nonzero], _per_rank([r.sum() for r in going], self._received),
                               _per_rank([c.sum() for c in came], self._sent), width)
        self.grad_bytes_sent += self.bytes_sent - sent0
        self.grad_bytes_received += self.bytes_received - received0
        self.grad_rows_sent += int(nonzero.sum())
        buf = np.zeros((int(self._sent.sum()), width), np.float32)
        buf[np.concatenate(came)] = rows
        buf = torch.from_numpy(buf).to(self.device)
        back_flags = torch.from_numpy(np.concatenate([b[len(b) // 2:] for b in bits])).to(self.device)
        out: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor | None]] = {}
        offset = 0
        for dest in range(self.size):
            for cam in range(n_cameras):
                m = int(self._sent[dest, cam])
                if m:
                    chunk = buf[offset : offset + m]
                    out[(dest, cam)] = (chunk[:, :GRAD_FLOATS].contiguous(), back_flags[offset : offset + m],
                                        chunk[:, GRAD_FLOATS:].contiguous() if absgrad is not None else None)
                    offset += m
        self.seconds += time.perf_counter() - t0
        return out

    def _alltoallv_bytes(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        """uint8 rows of one byte: `send` split by destination (counts [R]), what each rank sent here."""
        recv = np.empty(int(recv_counts.sum()), np.uint8)
        self.comm.Alltoallv([np.ascontiguousarray(send, dtype=np.uint8), (send_counts, _displacements(send_counts)),
                             MPI.BYTE], [recv, (recv_counts, _displacements(recv_counts)), MPI.BYTE])
        self.bytes_sent += int(send.nbytes - send_counts[self.rank])
        self.bytes_received += int(recv.nbytes - recv_counts[self.rank])
        return recv

    def send_rows(self, outgoing: dict[int, np.ndarray], width: int) -> np.ndarray:
        counts = np.array([len(outgoing.get(r, ())) for r in range(self.size)], dtype=np.int64)
        received = np.empty_like(counts)
        self.comm.Alltoall(counts, received)
        parts = [np.ascontiguousarray(outgoing[r], dtype=np.uint8).reshape(-1) for r in range(self.size) if counts[r]]
        send = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        return self._alltoallv_bytes(send, counts * width, received * width).reshape(-1, width)

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

