"""Run under mpirun: render the first 4 training views with ranks owning regions; rank 0 saves
every image and its splat count to an npz, for comparison with a single process."""
from __future__ import annotations

import sys

import numpy as np
import torch
from mpi4py import MPI

from storage import Store
from storage.cache import BlockCache
from train.config import TrainConfig
from train.mpi import MPIExchange
from train.region import Region
from train.step import render_cameras
from train.trainer import assign_step, load_cameras, owned_blocks


def main(data: str, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    exchange = MPIExchange(MPI.COMM_WORLD)
    store = Store.open(store_path, mode="r", gc=False)
    scene = load_cameras(TrainConfig(data=data, store=store_path, data_factor=16), store)
    region = Region.from_table(store.table, owned_blocks(store.table, exchange.rank, exchange.size, scene.train))
    cams = scene.train[:4]
    cam_rank = assign_step(cams, region, exchange, per_rank=len(cams) // exchange.size)
    with BlockCache(store, 1 << 30, "cpu") as cache:
        mine = render_cameras(cams, cam_rank, region, cache, exchange, int(store.attrs["sh_degree"]), torch.zeros(3))
    images = {i: (r.rgb.numpy(), len(r.contributed)) for i, r in mine.items()}
    parts = exchange.gather((images, exchange.bytes_received))
    if exchange.rank == 0:
        merged = {i: v for imgs, _ in parts for i, v in imgs.items()}
        np.savez(out, images=np.stack([merged[i][0] for i in range(len(cams))]),
                 splats=np.array([merged[i][1] for i in range(len(cams))]),
                 received=np.array([b for _, b in parts]), ranks=np.array(cam_rank))

if __name__ == "__main__":
    main(*sys.argv[1:4])
