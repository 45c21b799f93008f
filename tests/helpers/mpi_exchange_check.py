"""Run under mpirun: every rank sends splats to every other for four cameras, part of them held
by the receiver already (`Held`), gets gradients back for them with rows of every kind (all
zero, negative zero, contributed without gradient, a gradient without the flag), and checks, bit
for bit, that each side got what the other meant and that the bytes on the wire are what the
format says. Prints "ok" on rank 0."""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from train.exchange import Held
from train.mpi import MPIExchange
from train.render import Splats2D
from train.render.splats2d import GRAD_FLOATS, WIRE_FLOATS

CAMERAS = 4


def _rows(src: int, dest: int, cam: int) -> int:
    return 0 if cam == 3 else 3 + 5 * dest + 7 * cam + src  # camera 3: nothing


def _held(src: int, dest: int, cam: int) -> int:
    return min(_rows(src, dest, cam), 4) if cam == 1 else 0  # camera 1's first rows went before


def _splats(src: int, dest: int, cam: int) -> Splats2D:
    m = _rows(src, dest, cam)
    g = torch.Generator().manual_seed(1000 * src + 100 * dest + cam)
    buf = torch.rand(m, WIRE_FLOATS, generator=g)
    buf[:, -2:] = torch.randint(0, 9, (m, 2), generator=g).float()  # radii travel as floats
    return Splats2D.unpack(buf, requires_grad=False)


def _back(src: int, dest: int, cam: int, absgrad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the camera's rank `dest` returns for `src`'s splats: row r % 5 == 0 all zero, 1 a
    negative zero gradient, 2 contributed with a zero gradient, 3 a gradient without the flag."""
    m = _rows(src, dest, cam)
    g = torch.Generator().manual_seed(7 + 1000 * src + 100 * dest + cam)
    grads, ab = torch.randn(m, GRAD_FLOATS, generator=g), torch.rand(m, 2, generator=g)
    flags = torch.ones(m, dtype=torch.bool)
    kind = torch.arange(m) % 5
    grads[kind == 0], flags[kind == 0], ab[kind == 0] = 0.0, False, 0.0
    grads[kind == 1], ab[kind == 1] = -0.0, 0.0
    grads[kind == 2], ab[kind == 2] = 0.0, 0.0
    flags[kind == 3] = False
    return grads, flags, ab


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or not np.array_equal(a.numpy().view(np.uint8), b.numpy().view(np.uint8)):
        raise AssertionError(what)


def main() -> None:
    torch.set_num_threads(1)
    ex = MPIExchange(MPI.COMM_WORLD)
    me, size = ex.rank, ex.size
    for absgrad in (False, True):
        outgoing = {(d, c): _splats(me, d, c) for d in range(size) for c in range(CAMERAS) if d != me}
        others = [(r, c) for r in range(size) for c in range(CAMERAS) if r != me]
        held = Held({(d, c): _held(me, d, c) for d, c in others if _held(me, d, c)},
                    {(s, c): _splats(s, me, c).select(slice(0, _held(s, me, c))) for s, c in others if _held(s, me, c)})
        sent = ex.bytes_sent
        incoming = ex.send_splats(outgoing, CAMERAS, held)
        wire = 4 * WIRE_FLOATS * sum(_rows(me, d, c) - _held(me, d, c) for d in range(size) for c in range(CAMERAS)
                                     if d != me)
        assert ex.bytes_sent - sent == wire, (ex.bytes_sent - sent, wire)
        for cam, parts in incoming.items():
            for src, s in parts:
                _same_bits(s.pack(), _splats(src, me, cam).pack(), f"camera {cam}'s splats from rank {src}")
                assert s.means2d.requires_grad and s.means2d.is_leaf
        assert {(src, cam) for cam, p in incoming.items() for src, _ in p} == \
            {(s, c) for s in range(size) for c in range(CAMERAS) if s != me and _rows(s, me, c)}
        backs = {(src, cam): _back(src, me, cam, absgrad) for cam, p in incoming.items() for src, _ in p}
        sent, grad_sent, rows_sent = ex.bytes_sent, ex.grad_bytes_sent, ex.grad_rows_sent
        out = ex.return_grads(incoming, {k: v[0] for k, v in backs.items()}, {k: v[1] for k, v in backs.items()},
                              {k: v[2] for k, v in backs.items()} if absgrad else None)
        width = GRAD_FLOATS + (2 if absgrad else 0)
        # two bits a splat, and its gradient floats where some bit of them is set (not in rows of
        # kind 0, all zero, nor of kind 2, whose flag alone is set)
        sent_kinds = torch.tensor([1, 3, 4])
        expect = sum((2 * m + 7) // 8 + 4 * width * int(torch.isin(torch.arange(m) % 5, sent_kinds).sum())
                     for (src, cam) in backs for m in [_rows(src, me, cam)])
        assert ex.bytes_sent - sent == ex.grad_bytes_sent - grad_sent == expect, (ex.bytes_sent - sent, expect)
        assert ex.grad_rows_sent - rows_sent == sum(int(torch.isin(torch.arange(_rows(src, me, cam)) % 5, sent_kinds).sum())
                                                    for (src, cam) in backs)
        assert set(out) == {(d, c) for d in range(size) for c in range(CAMERAS) if d != me and _rows(me, d, c)}
        for (dest, cam), (grads, flags, ab) in out.items():
            want = _back(me, dest, cam, absgrad)
            _same_bits(grads, want[0], f"gradients from rank {dest}, camera {cam}")
            assert torch.equal(flags, want[1]), (dest, cam)
            if absgrad:
                _same_bits(ab, want[2], f"absgrad from rank {dest}, camera {cam}")
            else:
                assert ab is None
    ex.barrier()
    if me == 0:
        print("ok")


if __name__ == "__main__":
    main()
