"""Sparse, per-row Adam over block tensors, in three modes (`--adam`, `ADAM_MODES`).

- contributed: a row's moments and step count change only on the steps its Gaussian
  reached a pixel; bias correction by the row's own count, so a block that sat on disk for a
  thousand steps resumes exactly where it stopped, and a hidden Gaussian is never touched (what
  exact occlusion culling needs).
- visible (the trainer's default): gsplat's `visible_adam` (SelectiveAdam): the rows a camera
  projected, bias-corrected by the training step.
- dense: torch's Adam over every Gaussian every step, as gsplat's default, without touching every
  block every step. A step of a row with a zero gradient only decays its moments and moves it by
  them, which needs nothing but the row itself and the step's learning rate; so those steps are
  put off until the row is next used (`LazyDense`: before a step renders it, before a refinement,
  an evaluation or the end of the run reads it) and then taken one by one, in order. `adam_step`
  then holds the last step a row has taken; the result does not depend on when the row was paged.

Either way the update of a row never depends on what other rows did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import numba
import numpy as np
import torch
from numba import prange
from torch import Tensor

from storage.schema import PARAM_NAMES, STAT_NAMES
from train.pointers import address, float_rows, float_vector, int32_vector, int64_vector

ADAM_MODES = ("contributed", "visible", "dense")


@dataclass(frozen=True)
class AdamConfig:
    """Learning rates follow gsplat's simple_trainer; `means` is scaled by the scene extent."""

    lr: dict[str, float] = field(
        default_factory=lambda: {
            "means": 1.6e-4,
            "scales": 5e-3,
            "quats": 1e-3,
            "opacities": 5e-2,
            "sh0": 2.5e-3,
            "shN": 2.5e-3 / 20,
        }
    )
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-15
    means_lr_final_factor: float = 0.01  # means lr decays exponentially to this fraction over the run

    def for_batch(self, batch_size: int) -> "AdamConfig":
        """gsplat's rule for batched cameras: lr * sqrt(B), eps / sqrt(B), betas ** B."""
        s = math.sqrt(batch_size)
        return AdamConfig(
            lr={k: v * s for k, v in self.lr.items()},
            betas=(self.betas[0] ** batch_size, self.betas[1] ** batch_size),
            eps=self.eps / s,
            means_lr_final_factor=self.means_lr_final_factor,
        )


def learning_rates(cfg: AdamConfig, step: int, max_steps: int, scene_scale: float) -> dict[str, float]:
    lrs = dict(cfg.lr)
    decay = cfg.means_lr_final_factor ** (min(step, max_steps) / max(1, max_steps))
    lrs["means"] = cfg.lr["means"] * scene_scale * decay
    return lrs


@numba.njit(cache=True, nogil=True, inline="always")
def _any_nonzero(m, v, r, lo, hi):  # m, v [N, D] float32 -> whether any of m[r, lo:hi], v[r, lo:hi] is nonzero
    nz = 0
    for j in range(lo, hi):
        nz |= (m[r, j] != 0) | (v[r, j] != 0)
    return nz != 0


_FLOAT_BYTES = 4


@numba.njit(inline="always")
def _rows_contiguous(a, d):  # whether a's rows [N, d] lie one after the other
    return a.strides[1] == _FLOAT_BYTES and a.strides[0] == d * _FLOAT_BYTES


_ADAM_FASTMATH = {"arcp", "contract", "nsz"}


@numba.njit(inline="always", fastmath=_ADAM_FASTMATH, error_model="numpy")
def _adam_element(gj, mj, vj, step_size, inv, b1f, b2f, c1, c2, epsf):  # -> new m, new v, the step off p
    """One element's Adam with its gradient gj (float32 each): the one formula of both loops of
    `_adam_rows_cpu`, so a run and a row give the same bits."""
    mj = b1f * mj + c1 * gj
    vj = b2f * vj + c2 * gj * gj
    return mj, vj, step_size * mj / (np.sqrt(vj) * inv + epsf)


@numba.njit(inline="always", fastmath=_ADAM_FASTMATH, error_model="numpy")
def _adam_run(p, g, m, v, step_size, inv, b1f, b2f, c1, c2, epsf):  # [n] float32 each, in place
    for e in range(p.size):
        m[e], v[e], dp = _adam_element(g[e], m[e], v[e], step_size, inv, b1f, b2f, c1, c2, epsf)
        p[e] -= dp


# float32 arithmetic, as torch's Adam: in float64 (converting every operand) the loop cost ~9 ns
# an element; with reciprocals and fused multiply-adds allowed it costs ~4. error_model "numpy":
# numba's default tests every division for zero and raises, and that branch keeps LLVM from
# vectorizing a loop (the denominator is at least eps > 0).
@numba.njit(cache=True, fastmath=_ADAM_FASTMATH, nogil=True, error_model="numpy")
def _adam_rows_cpu(p, g, m, v, rows, bc1, inv_bc2_sqrt, lo, lr, b1, b2, eps, cols, hi):
    """p, m, v [N, D] float32 of a block; g [M, D] the gradient of a batch holding the block's
    rows at lo..lo+N, zero past its first `cols` columns (shN's coefficients above the SH degree
    in use); m and v zero in every row past column `hi` (`moment_columns`); rows [R] the block rows
    to update, bc1 [R] float64 and inv_bc2_sqrt [R] float32 their bias corrections
    (`_bias_corrections`).

    Where every column takes the gradient, a run of consecutive rows with the same bias
    corrections (all of them at one global step, `--adam visible`) lies in one stretch of each
    array and is stepped as one vector loop over its elements; row by row, a row of 1-4 columns
    left the square root and the division scalar (each element takes the very same operations)."""
    b1f, b2f, c1, c2 = np.float32(b1), np.float32(b2), np.float32(1.0 - b1), np.float32(1.0 - b2)
    epsf = np.float32(eps)
    d = p.shape[1]
    runs = (d > 0 and cols == d and _rows_contiguous(p, d) and _rows_contiguous(g, d)
            and _rows_contiguous(m, d) and _rows_contiguous(v, d))
    n_rows = rows.shape[0]
    i = 0
    while i < n_rows:
        r = rows[i]
        step_size = np.float32(lr / bc1[i])
        inv = inv_bc2_sqrt[i]
        if runs:
            e = i + 1
            while e < n_rows and rows[e] == rows[e - 1] + 1 and bc1[e] == bc1[i] and inv_bc2_sqrt[e] == inv:
                e += 1
            n = (e - i) * d
            _adam_run(float_vector(p.ctypes.data + r * d * _FLOAT_BYTES, n),
                      float_vector(g.ctypes.data + (lo + r) * d * _FLOAT_BYTES, n),
                      float_vector(m.ctypes.data + r * d * _FLOAT_BYTES, n),
                      float_vector(v.ctypes.data + r * d * _FLOAT_BYTES, n), step_size, inv, b1f, b2f, c1, c2, epsf)
            i = e
            continue
        i += 1
        for j in range(cols):
            m[r, j], v[r, j], dp = _adam_element(g[lo + r, j], m[r, j], v[r, j], step_size, inv, b1f, b2f, c1, c2,
                                                 epsf)
            p[r, j] -= dp
        # A zero gradient on zero moments leaves all three as they are (SH coefficients not yet
        # trained, the most of a row in the first thousands of steps): neither they nor the
        # gradient are read or written; moments left from an earlier run still decay. The tail is
        # first tested whole (a vectorised reduction): column by column it cost half of Adam.
        # Past `hi` it is known zero in every row and not even tested: at SH degree 0 that test
        # read shN's moments, most of Adam's memory traffic.
        if not _any_nonzero(m, v, r, cols, hi):
            continue
        for j in range(cols, hi):
            if m[r, j] == 0 and v[r, j] == 0:
                continue
            mj = b1f * m[r, j]
            vj = b2f * v[r, j]
            m[r, j] = mj
            v[r, j] = vj
            p[r, j] -= step_size * mj / (np.sqrt(vj) * inv + epsf)


@numba.njit(cache=True, nogil=True)
def _bias_corrections(step, b1, b2):  # -> 1 - b1^step (float64), 1 / sqrt(1 - b2^step) (float32)
    """Once per row, not per parameter: the two powers cost more than a parameter's arithmetic."""
    bc1, inv = np.empty(step.size, np.float64), np.empty(step.size, np.float32)
    for i in range(step.size):
        if i > 0 and step[i] == step[i - 1]:  # one step for every row (visible, dense): one pair of powers
            bc1[i], inv[i] = bc1[i - 1], inv[i - 1]
        else:
            bc1[i] = 1.0 - b1 ** step[i]
            inv[i] = np.float32(1.0 / math.sqrt(1.0 - b2 ** step[i]))
    return bc1, inv


# Rows a block must step before they are split over the cores: starting the threads costs
# ~0.1 ms a parameter, more than a few thousand rows take on one core.
PARALLEL_ROWS = 8192
_CHUNKS = 16  # pieces of the rows handed to the threads (rows differ in nothing but position)


@numba.njit(parallel=True, cache=True, nogil=True)
def _adam_rows_parallel(p, g, m, v, rows, bc1, inv_bc2_sqrt, lo, lr, b1, b2, eps, cols, hi):
    """`_adam_rows_cpu` on pieces of `rows` at once: each row still takes the very same compiled
    arithmetic, so its result does not depend on which thread ran it or on how many there are."""
    r = rows.shape[0]
    for c in prange(_CHUNKS):
        a, b = r * c // _CHUNKS, r * (c + 1) // _CHUNKS
        _adam_rows_cpu(p, g, m, v, rows[a:b], bc1[a:b], inv_bc2_sqrt[a:b], lo, lr, b1, b2, eps, cols, hi)


@numba.njit(cache=True, nogil=True)
def _adam_block_cpu(ps, gs, ms, vs, lrs, cols, bounds, adam_step, lo, mask, b1, b2, eps, global_step, parallel_rows):  # -> rows stepped
    """ps, ms, vs: tuples of a block's [N, D_k] float32 arrays; gs: the batch's [M, D_k]; lrs [K];
    cols [K] the gradients' leading columns that may be nonzero (`_adam_rows_cpu`); bounds [K] the
    block's `moment_columns`, raised to cols where rows were stepped;
    adam_step [N] int32, advanced on the rows whose mask[lo + row] is set; bias correction by
    each row's count, or by global_step where it is positive; split over the cores from
    parallel_rows rows."""
    n = adam_step.shape[0]
    rows, step = np.empty(n, np.int64), np.empty(n, np.int32)
    k = 0
    for r in range(n):
        if mask[lo + r]:
            adam_step[r] += 1
            rows[k], step[k] = r, (adam_step[r] if global_step <= 0 else global_step)
            k += 1
    bc1, inv = _bias_corrections(step[:k], b1, b2)
    for j in range(len(ps)):
        if k >= parallel_rows:
            _adam_rows_parallel(ps[j], gs[j], ms[j], vs[j], rows[:k], bc1, inv, lo, lrs[j], b1, b2, eps, cols[j],
                                bounds[j])
        else:
            _adam_rows_cpu(ps[j], gs[j], ms[j], vs[j], rows[:k], bc1, inv, lo, lrs[j], b1, b2, eps, cols[j], bounds[j])
        if k > 0:
            bounds[j] = max(bounds[j], cols[j])
    return k


# A block's row of the address table (`numpy_arrays`' ADDRESSES): its six parameters, their
# exp_avg and exp_avg_sq, its moment_columns and adam_step, then its statistics (STAT_NAMES).
_P, _M, _V, _BOUNDS, _STEP, STATS_AT = 0, 6, 12, 18, 19, 20
_NO_SPLIT = np.iinfo(np.int64).max  # parallel_rows of a block stepped on one thread


@numba.njit(inline="always")
def _six_rows(a, at, n, widths):  # -> the six [n, widths[j]] float32 arrays at a[at:at + 6]
    return (float_rows(a[at], n, widths[0]), float_rows(a[at + 1], n, widths[1]),
            float_rows(a[at + 2], n, widths[2]), float_rows(a[at + 3], n, widths[3]),
            float_rows(a[at + 4], n, widths[4]), float_rows(a[at + 5], n, widths[5]))


@numba.njit(parallel=True, cache=True, nogil=True)
def _adam_blocks_cpu(table, sizes, los, widths, groups, gs, lrs, cols, mask, b1, b2, eps, global_step, stepped):
    """`_adam_block_cpu` of many blocks in one call: block b's arrays at the addresses table[b]
    (sizes[b] rows; parameter j has widths[j] columns), its rows at los[b] of the batch;
    stepped[b] gets how many rows it stepped. The blocks of a group (groups [G + 1]: runs of
    blocks of about equal rows) go to one thread, each block computed as alone on one core."""
    for grp in prange(groups.size - 1):
        for b in range(groups[grp], groups[grp + 1]):
            n, a = sizes[b], table[b]
            stepped[b] = _adam_block_cpu(_six_rows(a, _P, n, widths), gs, _six_rows(a, _M, n, widths),
                                         _six_rows(a, _V, n, widths), lrs, cols, int64_vector(a[_BOUNDS], 6),
                                         int32_vector(a[_STEP], n), los[b], mask, b1, b2, eps, global_step,
                                         _NO_SPLIT)


@numba.njit(cache=True, fastmath=_ADAM_FASTMATH, nogil=True)
def _catch_up_row_cpu(p, m, v, r, done, to_step, lrs, b1, b2, eps):
    """Steps done+1..to_step of row r of one parameter (p, m, v [N, D] float32) with a zero
    gradient: the arithmetic of `_adam_rows_cpu` with g = 0; lrs [S] the learning rate of each
    1-based step s at s - 1. A row whose moments are all zero stays as it is: it stops there."""
    b1f, b2f, epsf = np.float32(b1), np.float32(b2), np.float32(eps)
    for s in range(done + 1, to_step + 1):
        moving = False
        for j in range(p.shape[1]):
            if m[r, j] != 0 or v[r, j] != 0:
                moving = True
                break
        if not moving:
            return
        step_size = np.float32(lrs[s - 1] / (1.0 - b1 ** s))
        inv_bc2_sqrt = np.float32(1.0 / math.sqrt(1.0 - b2 ** s))
        for j in range(p.shape[1]):
            mj = b1f * m[r, j]
            vj = b2f * v[r, j]
            m[r, j] = mj
            v[r, j] = vj
            p[r, j] -= step_size * mj / (np.sqrt(vj) * inv_bc2_sqrt + epsf)


@numba.njit(cache=True, nogil=True)
def _catch_up_block_cpu(ps, ms, vs, table, adam_step, to_step, b1, b2, eps):  # -> rows brought up
    """Every row of a block (tuples of [N, D_k] arrays as `_adam_block_cpu`) whose adam_step [N]
    is behind to_step takes the steps it missed; table [S, K] the learning rates per step."""
    moved = 0
    for r in range(adam_step.shape[0]):
        if adam_step[r] < to_step:
            for j in range(len(ps)):
                _catch_up_row_cpu(ps[j], ms[j], vs[j], r, adam_step[r], to_step, table[:, j], b1, b2, eps)
            adam_step[r] = to_step
            moved += 1
    return moved


def _adam_rows_torch(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, rows: Tensor, step: Tensor, lr: float, b1: float, b2: float, eps: float
) -> None:  # p, g, m, v [N, ...]; rows, step [R]
    shape = (-1,) + (1,) * (p.dim() - 1)
    stepf = step.to(torch.float64)
    bc1 = (1.0 - b1**stepf).to(torch.float32).view(shape)
    bc2_sqrt = torch.sqrt(1.0 - b2**stepf).to(torch.float32).view(shape)
    g_r = g[rows]
    m_r = m[rows].mul_(b1).add_(g_r, alpha=1.0 - b1)
    v_r = v[rows].mul_(b2).addcmul_(g_r, g_r, value=1.0 - b2)
    p[rows] = p[rows] - (lr / bc1) * m_r / ((v_r.sqrt() / bc2_sqrt).add_(eps))
    m[rows] = m_r
    v[rows] = v_r


_UPDATED = tuple(f"{prefix}{x}" for prefix in ("", "exp_avg_", "exp_avg_sq_") for x in PARAM_NAMES)


MOMENT_COLUMNS = "moment_columns"  # the key of `numpy_arrays`'s bounds
ADAM_ARGUMENTS = "adam_arguments"  # the key of `numpy_arrays`'s (params, exp_avg, exp_avg_sq, bounds, adam_step)
ADDRESSES = "addresses"  # the key of `numpy_arrays`'s [23] int64 address table row (`_P` ... `STATS_AT`)


def moment_columns(arrays: dict[str, np.ndarray]) -> np.ndarray:  # -> [len(PARAM_NAMES)] int64
    """Per parameter, one past the last column (of its [N, D] arrays) where any row's Adam moment
    is nonzero: the compiled step tests no column past it. Kept with the arrays and raised by
    each step, it stays an upper bound as long as nothing but the step makes a moment nonzero in
    place; whatever replaces a block's tensors (paging, densification) makes new arrays, and with
    them a new scan."""
    bounds = np.zeros(len(PARAM_NAMES), np.int64)
    for j, x in enumerate(PARAM_NAMES):
        live = np.flatnonzero((arrays[f"exp_avg_{x}"] != 0).any(axis=0) | (arrays[f"exp_avg_sq_{x}"] != 0).any(axis=0))
        bounds[j] = live[-1] + 1 if live.size else 0
    return bounds


def numpy_arrays(tensors: dict[str, Tensor]) -> dict[str, np.ndarray] | None:
    """The tensors as numpy arrays [N, D] sharing their memory, as `SparseAdam.step` takes them,
    and their `moment_columns` (under MOMENT_COLUMNS); None unless all are contiguous CPU tensors
    (the compiled step updates them in place)."""
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values()):
        return None
    arrays = {name: t.reshape(t.shape[0], math.prod(t.shape[1:])).numpy() for name, t in tensors.items()}
    if "adam_step" in arrays and all(x in arrays for x in _UPDATED):
        arrays[MOMENT_COLUMNS] = moment_columns(arrays)
        # the compiled step's arguments, made once with the views: building the tuples took
        # longer than the step of a block of a few hundred rows
        arrays[ADAM_ARGUMENTS] = (*(tuple(arrays[x] for x in _UPDATED[i : i + 6]) for i in (0, 6, 12)),
                                  arrays[MOMENT_COLUMNS], arrays["adam_step"].reshape(-1))
        if all(x in arrays for x in STAT_NAMES):
            arrays[ADDRESSES] = np.array([address(arrays[x]) for x in (*_UPDATED, MOMENT_COLUMNS, "adam_step",
                                                                      *STAT_NAMES)], np.int64)
    return arrays


@dataclass(frozen=True)
class AdamStep:
    """How a training step's Adam runs: which rows it changes (`mode`, one of ADAM_MODES), the
    step's 1-based number (the bias correction of visible and dense), and for dense the rows'
    missed steps (`lazy`)."""

    mode: str = "contributed"
    number: int = 0
    lazy: "LazyDense | None" = None

    def __post_init__(self) -> None:
        if self.mode not in ADAM_MODES:
            raise ValueError(f"adam mode {self.mode!r}: choose from {', '.join(ADAM_MODES)}")
        if self.mode != "contributed" and self.number < 1:
            raise ValueError(f"adam mode {self.mode!r} needs the step's number (1-based), got {self.number}")
        if (self.mode == "dense") != (self.lazy is not None):
            raise ValueError("adam mode 'dense' takes its LazyDense, and only it does")

    @property
    def global_step(self) -> int:
        """Bias correction by this step, or (0) by each row's own count."""
        return 0 if self.mode == "contributed" else self.number


def joined_parts(parts: list[Tensor]) -> Tensor:  # [M, ...]
    """The parts' rows as one tensor: a lone part as it is, sharing its memory (no copy of every
    row each step), several copied into one."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def joined_rows(blocks: list[dict[str, Tensor]], name: str) -> Tensor:  # [M, ...]
    """Array `name` of the blocks' rows as one tensor (`joined_parts`)."""
    return joined_parts([b[name] for b in blocks])


def put_back_rows(blocks: list[dict[str, Tensor]], name: str, value: Tensor) -> None:  # value [M, ...]
    """Write `joined_rows`'s layout back into the blocks: one multi-tensor copy for all of them."""
    if len(blocks) == 1:
        blocks[0][name].copy_(value)
    else:
        torch._foreach_copy_([b[name] for b in blocks], list(torch.split(value, [len(b[name]) for b in blocks])))


def block_of_rows(sizes: list[int], device: torch.device) -> Tensor:  # [M] int64
    """The index of the block each row of `joined_rows`'s layout comes from."""
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))


class LazyDense:
    """The zero-gradient steps of dense Adam that rows missed while no step used them (module
    docstring), taken when a row is next used: `catch_up(block, done)` brings every row of the
    block to `done` steps."""

    def __init__(self, cfg: AdamConfig, steps: int, scene_scale: float) -> None:
        self.cfg = cfg
        # Row s - 1: the learning rates of 1-based step s, the very floats the trainer passes that step.
        self.table = np.array([[lrs[x] for x in PARAM_NAMES]
                               for lrs in (learning_rates(cfg, s, steps, scene_scale) for s in range(steps))],
                              dtype=np.float64).reshape(steps, len(PARAM_NAMES))

    @torch.no_grad()
    def catch_up(
        self,
        block: dict[str, Tensor],  # every array of one block
        done: int,  # steps the run has taken
        arrays: dict[str, np.ndarray] | None = None,  # `numpy_arrays(block)`; None: torch ops
    ) -> int:
        """Bring every row of `block` to `done` steps in place; returns how many rows were behind."""
        if done > len(self.table):
            raise ValueError(f"catch_up: step {done} is past the run's {len(self.table)} steps")
        (b1, b2), eps = self.cfg.betas, self.cfg.eps
        if arrays is not None:
            p, ms, vs = (tuple(arrays[x] for x in _UPDATED[i : i + 6]) for i in (0, 6, 12))
            return int(_catch_up_block_cpu(p, ms, vs, self.table, arrays["adam_step"].reshape(-1), done,
                                           b1, b2, eps))
        step = block["adam_step"]
        behind = int((step < done).sum())
        if behind:
            for s in range(int(step.min()) + 1, done + 1):
                rows = torch.nonzero(step < s).squeeze(1)
                at = torch.full_like(rows, s)
                for j, name in enumerate(PARAM_NAMES):
                    p = block[name]
                    _adam_rows_torch(p, torch.zeros_like(p), block[f"exp_avg_{name}"], block[f"exp_avg_sq_{name}"],
                                     rows, at, float(self.table[s - 1, j]), b1, b2, eps)
            step.clamp_(min=done)
        return behind

    @torch.no_grad()
    def catch_up_batch(self, blocks: list[dict[str, Tensor]], done: int) -> list[int]:
        """`catch_up` of many blocks at once, for a GPU: their rows joined, one pass of torch ops
        a missed step for all of them (per block it was a pass a missed step for each, and a
        wait for the device to list the rows), the same arithmetic as the compiled loop. Returns
        how many rows of each block were behind (one copy to the host)."""
        if done > len(self.table):
            raise ValueError(f"catch_up: step {done} is past the run's {len(self.table)} steps")
        sizes = [int(b["adam_step"].shape[0]) for b in blocks]
        if not sizes or sum(sizes) == 0:
            return [0] * len(sizes)
        step = joined_rows(blocks, "adam_step")  # [M] int32
        device = step.device
        of_block = block_of_rows(sizes, device)
        behind = torch.zeros(len(sizes) + 1, dtype=torch.int64, device=device)
        behind[:-1].index_add_(0, of_block, (step < done).to(torch.int64))
        behind[-1] = step.min()
        *per_block, first = behind.tolist()
        if first >= done:
            return per_block
        (b1, b2), eps = self.cfg.betas, self.cfg.eps
        names = [x for i in (0, 6, 12) for x in _UPDATED[i : i + 6]]
        joined = {x: joined_rows(blocks, x) for x in names}
        flat = {x: t.reshape(len(step), -1) for x, t in joined.items()}
        for s in range(first + 1, done + 1):
            moving = (step < s)[:, None]  # [M, 1] the rows that missed step s
            step_size_base = 1.0 - b1**s
            inv_bc2_sqrt = float(np.float32(1.0 / math.sqrt(1.0 - b2**s)))
            for j, name in enumerate(PARAM_NAMES):
                p, m, v = flat[name], flat[f"exp_avg_{name}"], flat[f"exp_avg_sq_{name}"]
                step_size = float(np.float32(self.table[s - 1, j] / step_size_base))
                m_new, v_new = m * b1, v * b2
                p_new = p - step_size * m_new / (torch.sqrt(v_new) * inv_bc2_sqrt + eps)
                flat[name] = torch.where(moving, p_new, p)
                flat[f"exp_avg_{name}"] = torch.where(moving, m_new, m)
                flat[f"exp_avg_sq_{name}"] = torch.where(moving, v_new, v)
        for x in names:
            put_back_rows(blocks, x, flat[x].view(joined[x].shape))
        put_back_rows(blocks, "adam_step", step.clamp_(min=done))
        return per_block


def adam_batch(
    blocks: list[dict[str, Tensor]],  # the batch's blocks in batch order, every array of each
    params: dict[str, Tensor],  # name -> [M, ...] the batch's parameters: the blocks' rows joined (a lone block's own tensors)
    grads: dict[str, Tensor],  # name -> [M, ...] their gradients
    mask: Tensor,  # [M] bool: the rows to update
    lrs: dict[str, float],
    cfg: AdamConfig,
    global_step: int = 0,  # > 0: bias correction by this step, not each row's count
) -> None:
    """`SparseAdam` over a whole gathered batch in one pass of torch ops, for a GPU: per block,
    `SparseAdam.step`'s torch path launches some twenty kernels a parameter and syncs with the host
    to find its rows, which for hundreds of blocks a step costs more than the arithmetic. Here
    every row is computed and `torch.where` keeps the unmasked ones as they were, so no row list
    is made; the results go back into the blocks with one multi-tensor copy an array. The
    arithmetic is `_adam_rows_cpu`'s, in float32 with float64 bias corrections."""
    sizes = [int(b["means"].shape[0]) for b in blocks]
    if not sizes or sum(sizes) == 0:
        return
    joined = partial(joined_rows, blocks)
    put_back = partial(put_back_rows, blocks)
    (b1, b2), eps = cfg.betas, cfg.eps
    step = joined("adam_step") + mask.to(torch.int32)  # [M]
    put_back("adam_step", step)
    # Unmasked rows may have taken no step yet (a zero bias correction): they are computed at
    # step 1 and then dropped by the mask.
    t = (step.to(torch.float64).clamp_(min=1.0) if global_step <= 0
         else torch.full_like(step, global_step, dtype=torch.float64))
    bc1 = 1.0 - torch.pow(b1, t)  # [M] float64
    inv_bc2_sqrt = torch.rsqrt(1.0 - torch.pow(b2, t)).to(torch.float32)[:, None]  # [M, 1]
    keep = mask[:, None]
    for name in PARAM_NAMES:
        p = params[name].detach()
        n = p.shape[0]
        p2, g = p.reshape(n, -1), grads[name].detach().reshape(n, -1)
        m, v = joined(f"exp_avg_{name}").reshape(n, -1), joined(f"exp_avg_sq_{name}").reshape(n, -1)
        m_new = m * b1 + g * (1.0 - b1)
        v_new = v * b2 + g * g * (1.0 - b2)
        step_size = (lrs[name] / bc1).to(torch.float32)[:, None]  # [M, 1]
        p_new = p2 - step_size * m_new / (torch.sqrt(v_new) * inv_bc2_sqrt + eps)
        put_back(f"exp_avg_{name}", torch.where(keep, m_new, m).view(p.shape))
        put_back(f"exp_avg_sq_{name}", torch.where(keep, v_new, v).view(p.shape))
        put_back(name, torch.where(keep, p_new, p2).view(p.shape))  # a lone block's params are its own tensors


class SparseAdam:
    """One step of sparse Adam over the blocks of a gathered batch: the batch's gradients and the
    mask of rows to update are converted once, then each block costs one compiled call."""

    def __init__(
        self,
        grads: dict[str, Tensor],  # parameter name -> gradient [M, ...] of the batch
        mask: Tensor,  # [M] bool: the batch rows to update (those that contributed to a pixel)
        lrs: dict[str, float],
        cfg: AdamConfig,
        global_step: int = 0,  # > 0: bias correction by this step (torch's, gsplat's SelectiveAdam), not each row's count
        parallel_rows: int = PARALLEL_ROWS,  # rows of a block from which its step is split over the cores
        grad_columns: dict[str, int] | None = None,  # leading columns of each gradient (as [M, -1]) that may be nonzero (default: all)
    ) -> None:
        self.grads, self.mask, self.lrs, self.cfg = grads, mask, lrs, cfg
        self.global_step, self.parallel_rows = global_step, parallel_rows
        self._compiled = None
        if mask.device.type == "cpu" and all(grads[x].device.type == "cpu" for x in PARAM_NAMES):
            # (explicit widths: a rank that sees nothing this step has an empty batch)
            g = tuple(grads[x].reshape(len(mask), math.prod(grads[x].shape[1:])).contiguous().numpy()
                      for x in PARAM_NAMES)
            cols = np.array([(grad_columns or {}).get(x, a.shape[1]) for x, a in zip(PARAM_NAMES, g)], dtype=np.int64)
            self._compiled = g, mask.numpy(), np.array([lrs[x] for x in PARAM_NAMES]), np.minimum(cols, [a.shape[1] for a in g])

    def step(
        self,
        block: dict[str, Tensor],  # every array of one block (parameters, exp_avg_*, exp_avg_sq_*, adam_step)
        lo: int,  # the block's first row in the batch
        arrays: dict[str, np.ndarray] | None = None,  # `numpy_arrays(block)`, kept by the caller; None: torch ops
    ) -> int:
        """Update `block` in place on its masked rows; returns how many rows were updated."""
        if arrays is not None and self._compiled is not None:
            # One call for the six parameters, its arguments ready: with small blocks (a city's
            # street view steps hundreds of a few hundred rows) the interpreter's work around
            # each call cost more than the call.
            g, m, lr, cols = self._compiled
            p, ms, vs, bounds, adam_step = arrays[ADAM_ARGUMENTS]
            (b1, b2), eps = self.cfg.betas, self.cfg.eps
            return _adam_block_cpu(p, g, ms, vs, lr, cols, bounds, adam_step, lo, m, b1, b2, eps, self.global_step,
                                   self.parallel_rows)
        with torch.no_grad():
            return self._step_torch(block, lo)

    @property
    def compiled(self) -> bool:
        """Whether the batch is on the host, so that blocks are stepped by the compiled kernels."""
        return self._compiled is not None

    def step_blocks(
        self,
        table: np.ndarray,  # [B, 23] int64 the blocks' `numpy_arrays(...)[ADDRESSES]`, their arrays held by the caller
        sizes: np.ndarray,  # [B] int64 rows of each block
        los: np.ndarray,  # [B] int64 each block's first row in the batch
        widths: np.ndarray,  # [6] int64 columns of each parameter (as [N, -1]), in PARAM_NAMES order
        groups: np.ndarray,  # [G + 1] int64 runs of blocks a thread takes (`blockwise.row_groups`)
    ) -> np.ndarray:  # [B] int64 rows stepped in each block
        """`step` of many blocks in one compiled call, each on one core and bit for bit as `step`
        computes it: a step over hundreds of small blocks no longer calls from the interpreter
        once a block."""
        g, m, lr, cols = self._compiled
        (b1, b2), eps = self.cfg.betas, self.cfg.eps
        stepped = np.empty(len(sizes), np.int64)
        _adam_blocks_cpu(table, sizes, los, widths, groups, g, lr, cols, m, b1, b2, eps, self.global_step, stepped)
        return stepped

    def _step_torch(self, block: dict[str, Tensor], lo: int) -> int:
        n, (b1, b2), eps = block["means"].shape[0], self.cfg.betas, self.cfg.eps
        rows = torch.nonzero(self.mask[lo : lo + n]).squeeze(1)
        if rows.numel() == 0:
            return 0
        step = block["adam_step"][rows] + 1  # [R]
        block["adam_step"][rows] = step
        if self.global_step > 0:
            step = torch.full_like(step, self.global_step)
        for name in PARAM_NAMES:
            _adam_rows_torch(block[name], self.grads[name][lo : lo + n], block[f"exp_avg_{name}"],
                             block[f"exp_avg_sq_{name}"], rows, step, self.lrs[name], b1, b2, eps)
        return int(rows.numel())


def sparse_adam_step(
    block: dict[str, Tensor],
    grads: dict[str, Tensor],  # parameter name -> gradient, same shape as the parameter
    rows: Tensor,  # [R] int64, the rows that contributed to a pixel this step
    lrs: dict[str, float],
    cfg: AdamConfig,
    compiled: bool | None = None,  # CPU: the compiled loop (default where the block allows it)
) -> None:
    """Update `block` in place on `rows` only (`SparseAdam` for a block on its own)."""
    mask = torch.zeros(block["means"].shape[0], dtype=torch.bool, device=block["means"].device)
    mask[rows] = True
    arrays = numpy_arrays(block) if compiled is not False else None
    if compiled and arrays is None:
        raise ValueError("compiled=True needs contiguous CPU tensors")
    SparseAdam(grads, mask, lrs, cfg).step(block, 0, arrays)
