"""`python -m tools.bench store`: block I/O of the scene store against plain .npy files, and how
much I/O the cache's prefetch hides.

Blocks hold the garden scene's real SfM points and colours. "trained" blocks have trained-looking
values in every other array (noise in shN and the Adam moments: the hard case for compression),
"fresh" ones are as right after initialisation (zeros there: the easy case). Each block is
written and read whole, by the store and as one .npy file per array, in the same run, with the
same bytes. Cold reads first drop the files from the page cache (posix_fadvise DONTNEED on our own
files only); hot reads come from the page cache. Throughput is MB/s of raw array bytes.

The paging run pages blocks through a `BlockCache` whose budget holds four blocks, two per step,
while a simulated GPU computes (sleep: it holds no CPU, as a GPU kernel does not) for longer than a
block takes to read. It runs once without and once with prefetching the next step's blocks.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from storage import CodecConfig, Store, StoreError
from storage.schema import block_schema, bytes_per_gaussian
from tools.bench.timing import once
from tools.scenes import scene_block
from train.cli import HelpFormatter

REPO = Path(__file__).resolve().parents[2]
CODECS = {  # every one with crc32c unless named "no crc"
    "lz4 where it pays": CodecConfig(),  # the default
    "lz4 always": CodecConfig(min_saving=0),
    "zstd-1 always": CodecConfig(cname="zstd", clevel=1, min_saving=0),
    "zstd-3 bitsh. always": CodecConfig(cname="zstd", clevel=3, shuffle="bitshuffle", min_saving=0),
    "raw": CodecConfig(cname="none"),
    "raw, no crc": CodecConfig(cname="none", checksum=False),
}


def drop_page_cache(paths: list[Path]) -> None:
    """Evict our own files from the page cache (fsync first: dirty pages cannot be dropped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def npy_write(folder: Path, block: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, a in block.items():
        np.save(folder / f"{name}.npy", a)


def npy_read(folder: Path, names: list[str]) -> dict[str, np.ndarray]:
    return {name: np.load(folder / f"{name}.npy") for name in names}


def throughput(work: Path, blocks: list[dict[str, np.ndarray]], sh_degree: int, codecs: list[str], repeats: int) -> list[str]:
    names = list(block_schema(sh_degree))
    raw = sum(a.nbytes for a in blocks[0].values())
    rows = [
        f"{'codec':<20} {'size':>6} | {'write MB/s':>10} {'npy':>6} {'x npy':>6} | {'cold read':>9} {'npy':>6} {'x npy':>6}"
        f" | {'hot read':>8} {'npy':>6} {'x npy':>6}"
    ]
    for codec_name in codecs:
        store = Store.create(work / f"{codec_name}.zarr", {"sh_degree": sh_degree}, codec=CODECS[codec_name], durable=False)
        t = {"write": [], "npy write": [], "cold": [], "npy cold": [], "hot": [], "npy hot": []}
        infos = []
        for i, block in enumerate(blocks):
            npy_dir = work / f"npy-{codec_name}" / str(i)
            # Alternate who goes first so that neither always meets a warmer machine.
            order = [("write", lambda b=block: infos.append(store.write_block(f"2-{i:x}", b, (0,) * 3 + (1,) * 3))),
                     ("npy write", lambda d=npy_dir, b=block: npy_write(d, b))]
            for label, fn in order if i % 2 == 0 else order[::-1]:
                t[label].append(once(fn))
        store.commit({info.key: info for info in infos})
        stored = sum(p.stat().st_size for p in files_under(work / f"{codec_name}.zarr" / "blocks"))
        for rep in range(repeats):
            for i, info in enumerate(infos):
                npy_dir = work / f"npy-{codec_name}" / str(i)
                ours_files = files_under(work / f"{codec_name}.zarr" / "blocks" / info.key)
                cases = [("", lambda inf=info: store.read_block(inf.key, inf), ours_files),
                         ("npy ", lambda d=npy_dir: npy_read(d, names), files_under(npy_dir))]
                for prefix, fn, files in cases if (rep + i) % 2 == 0 else cases[::-1]:
                    drop_page_cache(files)
                    t[prefix + "cold"].append(once(fn))
                    t[prefix + "hot"].append(once(fn))
        med = {k: statistics.median(v) for k, v in t.items()}
        mbs = {k: raw / v / 1e6 for k, v in med.items()}
        rows.append(
            f"{codec_name:<20} {stored / (raw * len(blocks)):>5.0%} | {mbs['write']:>10.0f} {mbs['npy write']:>6.0f} "
            f"{med['write'] / med['npy write']:>5.2f}x | {mbs['cold']:>9.0f} {mbs['npy cold']:>6.0f} "
            f"{med['cold'] / med['npy cold']:>5.2f}x | {mbs['hot']:>8.0f} {mbs['npy hot']:>6.0f} {med['hot'] / med['npy hot']:>5.2f}x"
        )
    return rows


def paging(work: Path, blocks: list[dict[str, np.ndarray]], sh_degree: int, steps: int) -> list[str]:
    from storage.cache import BlockCache  # torch is only needed here

    root = work / "paging.zarr"
    store = Store.create(root, {"sh_degree": sh_degree}, durable=False)  # the default codec
    keys = [f"2-{i:x}" for i in range(len(blocks))]
    store.commit({k: store.write_block(k, b, (0,) * 3 + (1,) * 3) for k, b in zip(keys, blocks)})
    files = {k: files_under(root / "blocks" / k) for k in keys}
    block_bytes = len(blocks[0]["means"]) * bytes_per_gaussian(sh_degree)
    read_s = []
    for k in keys:
        drop_page_cache(files[k])
        read_s.append(once(lambda key=k: store.read_block(key)))
    compute_s = 1.5 * statistics.median(read_s)
    schedule = [[keys[s % len(keys)], keys[(s + 1) % len(keys)]] for s in range(steps)]
    results, first_wait = {}, {}
    for prefetch in (False, True):
        for k in keys:
            drop_page_cache(files[k])
        cache = BlockCache(store, 4 * block_bytes)
        for s, step in enumerate(schedule):
            cache.pin(step)
            if s == 0:  # the first step has nothing to overlap with, prefetch or not
                first_wait[prefetch] = cache.stats.io_wait_s
            if prefetch and s + 1 < len(schedule):
                cache.prefetch(schedule[s + 1])
            drop_page_cache([f for k in step for f in files[k]])  # the next visit reads from disk again
            time.sleep(compute_s * len(step))
            cache.unpin(step)
        results[prefetch] = cache.stats
        cache.close()
    base, pre = results[False], results[True]
    return [
        f"paging: {len(keys)} blocks of {block_bytes / 1e6:.1f} MB, budget 4 blocks, {steps} steps of 2 blocks,"
        f" cold read {statistics.median(read_s) * 1e3:.0f} ms/block, compute {compute_s * 1e3:.0f} ms/block",
        f"{'':<12} {'I/O wait s':>10} {'I/O s':>7} {'hits':>5} {'misses':>6}",
        f"{'no prefetch':<12} {base.io_wait_s:>10.2f} {base.io_s:>7.2f} {base.hits:>5} {base.misses:>6}",
        f"{'prefetch':<12} {pre.io_wait_s:>10.2f} {pre.io_s:>7.2f} {pre.hits:>5} {pre.misses:>6}",
        f"I/O hidden by prefetch: {1 - pre.io_wait_s / base.io_wait_s:.1%} of the no-prefetch wait"
        f" ({1 - pre.io_wait_s / pre.io_s:.1%} of the prefetch run's own I/O time);"
        f" after the first step: {1 - (pre.io_wait_s - first_wait[True]) / (base.io_wait_s - first_wait[False]):.1%}",
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench store", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("OCTOSPLAT_DATA", REPO.parent / "shared" / "data")) / "test_garden.npz",
                        help="gsplat's garden npz, whose SfM points and colours fill the blocks")
    parser.add_argument("--rows", type=int, default=65536, help="Gaussians per block in the throughput runs")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per codec in the throughput runs")
    parser.add_argument("--repeats", type=int, default=5, help="reads of every block per codec")
    parser.add_argument("--codecs", default=";".join(CODECS), help=f"';'-separated, from {list(CODECS)}")
    parser.add_argument("--sh-degree", type=int, default=3, help="SH degree of the blocks")
    parser.add_argument("--content", default="trained,fresh", help="trained (noise in every array) and/or fresh (just initialised)")
    parser.add_argument("--paging-rows", type=int, default=16384, help="Gaussians per block in the paging run")
    parser.add_argument("--paging-blocks", type=int, default=12, help="blocks in the paging run")
    parser.add_argument("--steps", type=int, default=48, help="steps of the paging run")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir, removed after)")
    args = parser.parse_args(argv)
    codecs = args.codecs.split(";")
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        print(f"error: unknown codec(s) {unknown}; choose from {list(CODECS)}", file=sys.stderr)
        return 2
    if not set(args.content.split(",")) <= {"trained", "fresh"}:
        print(f"error: --content takes trained and/or fresh, got {args.content!r}", file=sys.stderr)
        return 2
    if not args.data.is_file():
        print(f"error: scene points not found at {args.data} (use --data)", file=sys.stderr)
        return 2
    scene = np.load(args.data)
    points, colors = scene["means3d"], scene["colors"]
    work = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.workdir))
    try:
        for content in args.content.split(","):
            blocks = [scene_block(points, colors, args.rows, args.sh_degree, seed, content == "trained") for seed in range(args.blocks)]
            raw = sum(a.nbytes for a in blocks[0].values())
            print(f"{content} blocks: {args.blocks} x {args.rows} Gaussians (sh_degree {args.sh_degree}, {raw / 1e6:.1f} MB raw each), "
                  f"garden points; median of {args.repeats} reads per block; 'x npy' = our time / npy time")
            print("\n".join(throughput(work / content, blocks, args.sh_degree, codecs, args.repeats)))
        paged = [scene_block(points, colors, args.paging_rows, args.sh_degree, 100 + s) for s in range(args.paging_blocks)]
        print("\n".join(paging(work, paged, args.sh_degree, args.steps)))
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0
