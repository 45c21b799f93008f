"""The CPU kernels as numba caches them on disk, in every process.

numba's freshly compiled copy of a fast-math kernel and the copy it writes to its on-disk cache
do not round alike: the backward kernel's sums over pixels, reassociated by the vectorizer, come
out in another order (found when a clean checkout's first `mpirun -n 1` run trained slightly
different parameters from every later run). So the process that compiled the kernels trained
differently from all the processes after it, and a resumed run or an MPI rank could differ from
another in the last bits. `ensure_compiled()` compiles in a child process when the cache is
missing; the caller then loads what the child saved, as every later process does.

`python -m train.render.cpu.compiled` is that child: it runs every kernel once, with the argument
types the trainer passes.

numba checks a cached kernel against its own file's timestamp only: a kernel that inlines a
function from another file (`fastexp`, `ellipse`, `mat3`) kept running the old code after that
file changed, e.g. after a `git pull`. So the cache is also stamped with a digest of every file
that defines kernels; a different digest empties it and compiles again.
"""
from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
from pathlib import Path

_TRAIN = Path(__file__).resolve().parents[2]
# Every file that defines a kernel or a function a kernel inlines, and the one that sets their target.
_SOURCES = (*sorted(p for p in (_TRAIN / "render" / "cpu").glob("*.py") if p.name != "compiled.py"),
            *(_TRAIN / f"{m}.py" for m in ("codegen", "losses", "optim", "pointers", "ssim", "stats")))
_STAMP = "octosplat-kernels.sha256"  # beside numba's index files

# The projection's float64 kernels: fused multiply-adds, reciprocals and reassociation (16% off the
# projection backward), but not fast-math's "no NaN, no inf", which would let LLVM drop the tests
# that cull splats behind the camera or with overflowing scales.
FINITE_FASTMATH = {"contract", "arcp", "nsz", "reassoc", "afn"}  # a set: numba refuses a frozenset


def _dispatchers() -> list:
    from train import losses, optim, ssim, stats
    from train.render.cpu import binning, kernels, projection

    return [kernels.forward, kernels.backward, kernels.reduce_grads,
            binning._records_and_boxes, binning._test_boxes, binning._argsort_depth, binning._sort_by_tile,
            projection._project, projection._colors, projection._project_vjp, projection._compact,
            optim._adam_rows_cpu, optim._adam_rows_parallel, optim._bias_corrections, optim._adam_block_cpu,
            optim._adam_blocks_cpu, stats._add_stats_blocks,
            ssim._ssim_forward, ssim._ssim_backward, ssim._ssim_row, stats._accumulate,
            losses._add_reg_grads]


def sources_digest(sources: tuple[Path, ...] = _SOURCES) -> str:
    h = hashlib.sha256()
    for path in sources:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _cache_dirs() -> list[Path]:
    """The folders numba caches the kernels in (`__pycache__` beside their files, or under
    NUMBA_CACHE_DIR)."""
    dirs = []
    for dispatcher in _dispatchers():
        path = getattr(getattr(dispatcher, "_cache", None), "_cache_path", None)
        if path is not None and Path(path) not in dirs:
            dirs.append(Path(path))
    return dirs


def stale(cache_dir: Path, sources: tuple[Path, ...] = _SOURCES) -> bool:
    """Whether the kernels cached in `cache_dir` were compiled from other sources than these."""
    stamp = cache_dir / _STAMP
    return not stamp.is_file() or stamp.read_text().strip() != sources_digest(sources)


def cached() -> bool:
    """Whether every kernel has an index in numba's on-disk cache, compiled from these sources."""
    for dispatcher in _dispatchers():
        index = getattr(getattr(getattr(dispatcher, "_cache", None), "_cache_file", None), "_index_path", None)
        if index is not None and not Path(index).is_file():
            return False
    return not any(stale(d) for d in _cache_dirs())


def _forget(cache_dir: Path) -> None:
    """Remove numba's cached kernels of our files from `cache_dir` (not other packages' caches)."""
    stems = {p.stem for p in _SOURCES}
    for path in [*cache_dir.glob("*.nbi"), *cache_dir.glob("*.nbc")]:
        if path.name.split(".", 1)[0] in stems:
            path.unlink(missing_ok=True)


def ensure_compiled() -> None:
    """Compile the kernels into numba's cache in a child process if they are not there yet, or
    were compiled from other sources (about two minutes, once per checkout and change); before
    MPI starts, since MPI processes should not fork."""
    if cached():
        return
    dirs, digest = _cache_dirs(), sources_digest()
    dirs[0].mkdir(parents=True, exist_ok=True)
    # mpirun starts every rank at once: one compiles while the others wait, then find it done
    # (a rank forgetting the cache while another loads it would compile in its own process).
    with open(dirs[0] / (_STAMP + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached():
            return
        print("compiling the CPU kernels (once per checkout, about two minutes) ...", file=sys.stderr, flush=True)
        for d in dirs:
            if stale(d):
                _forget(d)
        proc = subprocess.run([sys.executable, "-m", "train.render.cpu.compiled"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels failed:\n{proc.stderr[-3000:]}")
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / _STAMP).write_text(digest + "\n")


def _compile_all() -> None:
    """Project, rasterize, take the training loss and backpropagate a small scene, step sparse
    Adam on a block (the regularisers' gradients added) and gather its densification statistics;
    then step Adam and add the statistics of two blocks at once."""
    import numpy as np
    import torch

    from storage.schema import PARAM_NAMES, block_schema
    from train.camera import Camera
    from train.losses import Regularizers, photometric_loss
    from train.optim import ADDRESSES, STATS_AT, AdamConfig, SparseAdam, numpy_arrays, sparse_adam_step
    from train.render import project, rasterize
    from train.stats import accumulate_stats, add_stats_blocks, empty_stats

    n, sh_degree = 64, 3
    rng = np.random.default_rng(0)
    block = {name: torch.zeros((n, *shape), dtype=getattr(torch, dtype.name)) for name, (shape, dtype)
             in block_schema(sh_degree).items()}
    block["means"] = torch.from_numpy(rng.uniform(-1.0, 1.0, (n, 3)).astype(np.float32))
    block["scales"] = torch.full((n, 3), -2.5)
    block["quats"] = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).repeat(n, 1)
    block["sh0"] = torch.from_numpy(rng.normal(size=(n, 1, 3)).astype(np.float32))
    viewmat = np.eye(4)
    viewmat[2, 3] = 4.0
    camera = Camera(viewmat, np.array([[40.0, 0, 24], [0, 40.0, 16], [0, 0, 1]]), 48, 32)
    params = {name: block[name].clone().requires_grad_(True) for name in ("means", "scales", "quats", "opacities",
                                                                          "sh0", "shN")}
    out = rasterize(project(params, camera, sh_degree), camera, torch.zeros(3))
    photometric_loss(out.rgb, torch.full_like(out.rgb, 0.5)).backward()
    Regularizers(0.01, 0.01, n).add_grads(params, torch.ones(n, dtype=torch.bool))
    grads = {name: p.grad for name, p in params.items()}
    sparse_adam_step(block, grads, torch.arange(n), AdamConfig().lr, AdamConfig())
    acc = empty_stats(n)
    accumulate_stats(acc, torch.arange(n), torch.ones(n, 2, dtype=torch.int32), torch.zeros(n, 9), camera, 1)
    # and many blocks at once, by their address table: the block's two halves
    halves = [{name: t[i * n // 2:(i + 1) * n // 2].contiguous() for name, t in block.items()} for i in (0, 1)]
    arrays = [numpy_arrays(h) for h in halves]
    table = np.stack([a[ADDRESSES] for a in arrays])
    sizes, los = np.array([n // 2, n - n // 2]), np.array([0, n // 2])
    groups = np.array([0, 1, 2])
    optimizer = SparseAdam(grads, torch.ones(n, dtype=torch.bool), AdamConfig().lr, AdamConfig())
    rows = optimizer.step_blocks(table, sizes, los, np.array([arrays[0][x].shape[1] for x in PARAM_NAMES]), groups)
    add_stats_blocks(table, STATS_AT, sizes, los, groups, rows, acc)


if __name__ == "__main__":
    _compile_all()
