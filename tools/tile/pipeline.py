"""`tile`: a source's rows -> octree leaves -> one store block per leaf, streaming when the input is big.

Passes over the input, chunk by chunk (one chunk, read once, when it fits in the memory budget):
  1. bounds of the finite means (rows with a NaN or infinite value are dropped and counted);
  2. Morton codes of each chunk, sorted into runs; the octree's leaves come from the runs alone;
  3. each chunk's rows grouped by leaf into runs, and the leaves' tight boxes;
then each leaf is gathered from the runs, initialised (k-NN scales for points) and written.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from octree import RootCube, leaves_from_sorted_codes, locate, tight_boxes
from octree.build import group_by_label
from octree.keys import MAX_DEPTH, BlockKey
from octree.semantics import MAX_SH_DEGREE
from storage import Store
from storage.schema import bytes_per_gaussian, empty_state
from tools.tile.config import TileConfig, TileError
from tools.tile.init import LeafNeighbours, gaussians_from_points
from tools.tile.output import OutputPlace
from tools.tile.runs import Runs
from tools.tile.sources import Rows, Source, open_source

# Per row, besides the row itself: int64 codes, labels, order and sort keys while a chunk is grouped.
_ROW_OVERHEAD = 64
_MIN_CHUNK_ROWS = 1024
_KNN_CACHE_SHARE = 4  # the k-NN's leaf cache gets 1/4 of the memory budget


@dataclass(frozen=True)
class TileSummary:
    source: str  # what was read
    out: Path
    gaussians: int
    dropped: int  # rows dropped for NaN or infinite values
    blocks: int
    depths: tuple[int, int]  # shallowest and deepest leaf
    per_block: tuple[int, float, int]  # min, median, max Gaussians per block
    sh_degree: int
    runs: int  # sorted runs of the external sort (1: sorted in memory)
    bytes_on_disk: int
    raw_bytes: int  # every array of every Gaussian uncompressed (float32 / int32)
    build_seconds: float  # octree over the points (codes, sort, leaves)
    seconds: float  # the whole run

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / max(1, self.bytes_on_disk)


class _Chunks:
    """The source's finite rows in chunks; a lone chunk is read once and kept."""

    def __init__(self, source: Source, chunk_rows: int, progress: bool) -> None:
        self.source, self.chunk_rows, self.progress = source, chunk_rows, progress
        self.bounds = range(0, source.count, chunk_rows)
        self._kept: Rows | None = None

    def __len__(self) -> int:
        return len(self.bounds)

    def __iter__(self) -> Iterator[Rows]:
        if self._kept is not None:
            yield self._kept
            return
        for start in tqdm(self.bounds, desc="reading", unit="chunk", disable=not self.progress or len(self) == 1):
            rows = self.source.read(start, min(start + self.chunk_rows, self.source.count))
            finite = _finite_rows(rows)
            rows = rows if finite.all() else {name: a[finite] for name, a in rows.items()}
            if len(self) == 1:
                self._kept = rows
            yield rows


def _finite_rows(rows: Rows) -> np.ndarray:  # [n] bool
    n = len(rows["means"])
    ok = np.ones(n, dtype=bool)
    for a in rows.values():
        if a.dtype.kind == "f":
            ok &= np.isfinite(a.reshape(n, -1)).all(axis=1)
    return ok


def _scan(chunks: _Chunks) -> tuple[int, np.ndarray, np.ndarray]:
    """Pass 1: finite rows, and their bounds [3], [3]."""
    kept, lo, hi = 0, np.full(3, np.inf), np.full(3, -np.inf)
    for rows in chunks:
        means = rows["means"]
        if len(means):
            kept += len(means)
            lo = np.minimum(lo, [means[:, a].min() for a in range(3)])
            hi = np.maximum(hi, [means[:, a].max() for a in range(3)])
    return kept, lo, hi


def _leaves(chunks: _Chunks, root: RootCube, cfg: TileConfig, folder: Path | None) -> tuple[np.ndarray, ...]:
    """Pass 2: sorted Morton code runs -> leaves (depths, codes, counts)."""
    runs = Runs(folder)
    for rows in chunks:
        runs.add({"codes": np.sort(root.codes(rows["means"]))})
    leaves = leaves_from_sorted_codes(runs.column("codes"), cfg.max_per_block, root.max_depth(cfg.min_cell_size))
    runs.clear()
    return leaves


def _group(
    chunks: _Chunks, root: RootCube, depths: np.ndarray, codes: np.ndarray, folder: Path | None
) -> tuple[Runs, np.ndarray]:
    """Pass 3: every chunk's rows grouped by leaf into runs; the leaves' tight boxes [B, 6]."""
    n_leaves = len(codes)
    runs = Runs(folder)
    tight = np.concatenate([np.full((n_leaves, 3), np.inf), np.full((n_leaves, 3), -np.inf)], axis=1)
    for rows in chunks:
        labels, _ = locate(root.codes(rows["means"]), depths, codes)
        order, starts, counts = group_by_label(labels, n_leaves)
        grouped = {name: a[order] for name, a in rows.items()}
        filled = np.flatnonzero(counts)
        if len(filled):
            boxes = tight_boxes(grouped["means"], starts[filled])
            tight[filled, :3] = np.minimum(tight[filled, :3], boxes[:, :3])
            tight[filled, 3:] = np.maximum(tight[filled, 3:], boxes[:, 3:])
        runs.add(grouped, np.append(starts, len(order)))
    return runs, tight


def _sh_degree(source: Source, cfg: TileConfig) -> int:
    if source.kind == "points":
        return 3 if cfg.sh_degree is None else cfg.sh_degree
    if source.sh_degree > MAX_SH_DEGREE:
        raise TileError(f"{source.path}: the trained Gaussians have SH degree {source.sh_degree}; the renderer "
                        f"supports at most {MAX_SH_DEGREE}")
    if cfg.sh_degree is not None and cfg.sh_degree != source.sh_degree:
        raise TileError(
            f"{source.path}: the trained Gaussians have SH degree {source.sh_degree}; --sh-degree {cfg.sh_degree} "
            "would change their parameters (leave it out)"
        )
    return int(source.sh_degree)


def _chunk_rows(source: Source, cfg: TileConfig) -> int:
    sample = source.read(0, min(1, source.count))
    row = sum(a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)) for a in sample.values())
    # Half the budget for a chunk: it is read, then copied in leaf order.
    return max(_MIN_CHUNK_ROWS, cfg.memory_bytes // (2 * (row + _ROW_OVERHEAD)))


def _disk_bytes(folder: Path) -> int:
    return sum(os.path.getsize(Path(d) / f) for d, _, files in os.walk(folder) for f in files)


def _store_attrs(source: Source, root: RootCube, cfg: TileConfig, sh_degree: int) -> dict:
    return {
        "sh_degree": sh_degree,
        "world_transform": source.world_transform.tolist(),
        "octree": {
            **root.to_attrs(),
            "max_per_block": cfg.max_per_block,
            "min_cell_size": cfg.min_cell_size,
            "max_depth": root.max_depth(cfg.min_cell_size),
        },
        "source": {"path": str(source.path), "kind": source.kind, "description": source.description,
                   "images": list(source.images)},
    }


def _write_blocks(
    store: Store, source: Source, runs: Runs, tight: np.ndarray, root: RootCube, depths: np.ndarray, codes: np.ndarray,
    cfg: TileConfig, progress: bool,
) -> None:  # fmt: skip
    """Gather, initialise and write every leaf as a block, then commit them all at once."""
    neighbours = None
    if source.kind == "points":

        def means_of(leaf: int) -> np.ndarray:
            return runs.gather(leaf, ("means",))["means"]

        total = sum(len(m) for m in runs.column("means"))
        neighbours = LeafNeighbours(means_of, tight, total, cfg.memory_bytes // _KNN_CACHE_SHARE)
    cells = root.cells(depths, codes)
    infos = {}
    for leaf in tqdm(range(len(codes)), desc="blocks", unit="block", disable=not progress):
        rows = runs.gather(leaf)
        if neighbours is not None:
            rows = gaussians_from_points(
                rows["means"], rows["colors"], neighbours.distances(leaf), store.sh_degree, cfg.init_opacity,
                min_scale=root.size / 2**MAX_DEPTH, init_scale=cfg.init_scale,
            )  # fmt: skip
        key = BlockKey(int(depths[leaf]), int(codes[leaf])).name
        arrays = {**rows, **empty_state(len(rows["means"]), store.sh_degree)}
        infos[key] = store.write_block(key, arrays, tuple(float(v) for v in cells[leaf]))
    store.commit(infos, state={})


def tile(
    src: str | os.PathLike, out: str | os.PathLike, cfg: TileConfig = TileConfig(), progress: bool = False
) -> TileSummary:
    """Tile SRC into a new store at OUT (see `python -m tools.tile --help`)."""
    started = time.perf_counter()
    source = open_source(Path(src), cfg)
    sh_degree = _sh_degree(source, cfg)
    with OutputPlace(Path(out), cfg.overwrite, cfg.scratch) as place:
        chunks = _Chunks(source, _chunk_rows(source, cfg), progress)
        kept, lo, hi = _scan(chunks)
        if kept == 0:
            raise TileError(f"{source.path}: all {source.count:,} rows have NaN or infinite values")
        folder = place.make_scratch() if len(chunks) > 1 else None
        build_started = time.perf_counter()
        root = RootCube.around(lo, hi)
        depths, codes, counts = _leaves(chunks, root, cfg, folder)
        build_seconds = time.perf_counter() - build_started
        runs, tight = _group(chunks, root, depths, codes, folder)
        # Not durable: fsyncing each of its many small files costs more than the tiling itself; the
        # output is derived data, renamed into place complete, and its chunks carry checksums.
        store = Store.create(place.tmp, attrs=_store_attrs(source, root, cfg, sh_degree), durable=False)
        _write_blocks(store, source, runs, tight, root, depths, codes, cfg, progress)
        bytes_on_disk = _disk_bytes(place.tmp)
        place.finish()
    return TileSummary(
        source=source.description,
        out=Path(out),
        gaussians=kept,
        dropped=source.count - kept,
        blocks=len(codes),
        depths=(int(depths.min()), int(depths.max())),
        per_block=(int(counts.min()), float(np.median(counts)), int(counts.max())),
        sh_degree=sh_degree,
        runs=len(chunks),
        bytes_on_disk=bytes_on_disk,
        raw_bytes=kept * bytes_per_gaussian(sh_degree),
        build_seconds=build_seconds,
        seconds=time.perf_counter() - started,
    )
