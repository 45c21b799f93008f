"""What the viewer shows of a store: its committed blocks, each with its owner, size on disk and
the step that last wrote it, read from one commit. Reads only; the store is opened read-only."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from octree.keys import parse_key
from storage import Store, StoreError
from storage.table import BlockInfo, Commit
from train.camera import Camera
from train.region import Ownership
from tools.view.config import ViewError


@dataclass(frozen=True)
class BlockRow:
    """One block as the panel describes it."""

    info: BlockInfo
    owner: int  # rank owning it under the trainer's partition into `ranks` regions
    disk_bytes: int  # bytes of its committed version's files
    step: int | None  # training step of the commit that wrote this version (None: that commit was collected)

    @property
    def key(self) -> str:
        return self.info.key


@dataclass(frozen=True)
class BlockScene:
    """The blocks of one commit, in Morton order."""

    store_path: Path
    head: int
    step: int  # training step of the commit (0: as tiled)
    sh_degree: int
    ranks: int
    rows: list[BlockRow]
    up: tuple[int, int] = (2, 1)  # (axis, sign) of the world axis that points up: +z unless the cameras say otherwise

    @property
    def table(self) -> dict[str, BlockInfo]:
        return {r.key: r.info for r in self.rows}

    @property
    def cells(self) -> np.ndarray:  # [B, 6]
        return np.array([r.info.cell for r in self.rows], dtype=np.float64).reshape(-1, 6)

    @property
    def extents(self) -> np.ndarray:  # [B, 6]
        return np.array([r.info.extent for r in self.rows], dtype=np.float64).reshape(-1, 6)

    @property
    def owners(self) -> np.ndarray:  # [B]
        return np.array([r.owner for r in self.rows], dtype=np.int64)

    @property
    def counts(self) -> np.ndarray:  # [B]
        return np.array([r.info.count for r in self.rows], dtype=np.int64)

    @property
    def gaussians(self) -> int:
        return int(self.counts.sum())

    def row(self, key: str) -> BlockRow:
        for r in self.rows:
            if r.key == key:
                return r
        raise ViewError(f"store {self.store_path}: no block {key} in commit {self.head}")

    def bounds(self) -> np.ndarray:  # [6] union of the cells
        c = self.cells
        return np.concatenate([c[:, :3].min(0), c[:, 3:].max(0)])

    def describe(self, key: str) -> str:
        """The panel's markdown for one block."""
        r = self.row(key)
        i = r.info
        step = "collected" if r.step is None else str(r.step)
        return "\n".join([
            f"**block {i.key}** (depth {parse_key(i.key).depth})",
            f"- Gaussians: {i.count:,}",
            f"- bytes on disk: {r.disk_bytes:,}",
            f"- cell: {_box(i.cell)}",
            f"- bounds (tight): {_box(i.tight)}",
            f"- extent box: {_box(i.extent)}",
            f"- owner: rank {r.owner} of {self.ranks}",
            f"- version: {i.version} (written at step {step})",
            f"- commit: {self.head} (step {self.step})",
        ])


def _box(b: tuple) -> str:
    return "(" + ", ".join(f"{v:.3g}" for v in b[:3]) + ") – (" + ", ".join(f"{v:.3g}" for v in b[3:]) + ")"


def open_store(path: str) -> Store:
    """The store, read-only. Only the table is validated here: a block is checked when it is read,
    so one corrupt block is named and skipped instead of refusing the whole store."""
    try:
        store = Store.open(path, mode="r", verify="table")
    except StoreError as e:
        raise ViewError(str(e)) from e
    if store.head is None:
        store.close()
        raise ViewError(f"store {path} has no commit yet: tile it with `python -m tools.tile`")
    if not store.table:
        store.close()
        raise ViewError(f"store {path}: commit {store.head} holds no blocks")
    return store


def load_blocks(store: Store, path: str, ranks: int, train_cameras: list[Camera]) -> BlockScene:
    """The blocks of the store's current commit; owners as `Trainer` partitions them: the regions
    its trainer saved in the commit when it ran on `ranks` ranks, else balanced over the training
    cameras (by Gaussian count without them)."""
    try:
        ownership = Ownership.current(store.state, store.table, ranks, train_cameras)
    except ValueError as e:
        raise ViewError(f"store {path}: {e}") from e
    steps = _commit_steps(store, Path(path))
    keys = sorted(store.table, key=lambda k: parse_key(k).morton_rank())
    rows = [BlockRow(store.table[k], ownership.owner(k), _disk_bytes(Path(path), store.table[k]),
                     steps.get(store.table[k].version)) for k in keys]
    assert store.head is not None
    return BlockScene(Path(path), store.head, int(store.state.get("step", 0)), store.sh_degree, ranks, rows,
                      up_axis(train_cameras))


def up_axis(cameras: list[Camera]) -> tuple[int, int]:
    """(axis, sign) of the world axis nearest the cameras' mean up (-y in OpenCV axes). gsplat's
    normalisation makes it +z, the default; a store tiled from an unnormalised dataset may differ."""
    if not cameras:
        return 2, 1
    up = np.mean([-c.camtoworld[:3, 1] for c in cameras], axis=0)
    axis = int(np.argmax(np.abs(up)))
    return axis, 1 if up[axis] >= 0 else -1


def _disk_bytes(root: Path, info: BlockInfo) -> int:
    total = 0
    for folder, _, files in os.walk(root / "blocks" / info.key / str(info.version)):
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total


def _commit_steps(store: Store, root: Path) -> dict[int, int]:
    """generation -> training step, for the commits garbage collection kept. Each document is
    validated as `Store.open` validates HEAD's; a damaged old one only loses its step."""
    steps = {}
    commits = root / "commits"
    for name in os.listdir(commits) if commits.is_dir() else []:
        if not name.isdigit():
            continue
        try:
            doc = json.loads((commits / name / "zarr.json").read_text())
            steps[int(name)] = int(Commit.from_doc(doc, int(name), store.name).state.get("step", 0))
        except (OSError, ValueError, StoreError):
            continue
    return steps
