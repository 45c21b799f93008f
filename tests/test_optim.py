"""Sparse per-row Adam against torch.optim.Adam, and the batch/schedule helpers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.schema import PARAM_NAMES, empty_state, param_shapes
from train.assign import assign_cameras
from train.optim import (MOMENT_COLUMNS, AdamConfig, LazyDense, SparseAdam, learning_rates, numpy_arrays,
                         sparse_adam_step)
from train.schedule import Schedule, locality_order, step_cameras


def _block(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {name: torch.randn((n, *shape), generator=g) for name, shape in param_shapes(1).items()}
    t.update({k: torch.from_numpy(v) for k, v in empty_state(n, 1).items()})
    return t


@pytest.mark.parametrize("compiled", [True, False])
def test_rows_stepped_every_time_match_torch_adam(compiled):
    cfg = AdamConfig()
    lrs = learning_rates(cfg, 0, 100, scene_scale=2.0)
    block = _block(7)
    ref = {n: block[n].clone().requires_grad_(True) for n in PARAM_NAMES}
    opt = torch.optim.Adam([{"params": [ref[n]], "lr": lrs[n], "name": n} for n in PARAM_NAMES],
                           betas=cfg.betas, eps=cfg.eps)
    g = torch.Generator().manual_seed(1)
    rows = torch.arange(7)
    for _ in range(5):
        grads = {n: torch.randn(block[n].shape, generator=g) for n in PARAM_NAMES}
        sparse_adam_step(block, grads, rows, lrs, cfg, compiled=compiled)
        for n in PARAM_NAMES:
            ref[n].grad = grads[n].clone()
        opt.step()
    for n in PARAM_NAMES:
        torch.testing.assert_close(block[n], ref[n].detach(), rtol=1e-5, atol=1e-6)
    assert block["adam_step"].tolist() == [5] * 7


def test_compiled_adam_gives_the_same_bits_on_one_core_or_two_and_serial_or_split():
    """A large block's rows are split over the cores, a small one's are not; a row's result must
    not depend on either."""
    import numba

    cfg, n = AdamConfig(), 5000
    lrs = learning_rates(cfg, 0, 100, scene_scale=2.0)
    g = torch.Generator().manual_seed(3)
    shapes = {k: t.shape for k, t in _block(n).items()}
    grads = [{k: torch.randn(shapes[k], generator=g) for k in PARAM_NAMES} for _ in range(3)]
    mask = torch.rand(n, generator=g) < 0.5
    results, threads = [], numba.get_num_threads()
    try:
        for t, parallel_rows in ((1, 10**9), (1, 0), (min(2, numba.config.NUMBA_NUM_THREADS), 0)):
            numba.set_num_threads(t)
            block = _block(n)
            for step_grads in grads:
                optimizer = SparseAdam(step_grads, mask, lrs, cfg, parallel_rows=parallel_rows)
                assert optimizer.step(block, 0, numpy_arrays(block)) == int(mask.sum())
            results.append(block)
    finally:
        numba.set_num_threads(threads)
    for other in results[1:]:
        for k in results[0]:
            assert torch.equal(results[0][k], other[k]), k
    assert not torch.equal(results[0]["means"], _block(n)["means"])


def test_runs_of_rows_stepped_as_one_vector_loop_give_the_row_by_row_bits():
    """Consecutive rows with one bias correction, their arrays contiguous, are stepped as one loop
    over their elements (vectorized); the same values in views of wider arrays take the loop row
    by row. Runs here break at skipped rows and where the bias correction changes."""
    from train.optim import _adam_rows_cpu, _bias_corrections

    rng = np.random.default_rng(0)
    n, d, lo = 1000, 3, 5
    p, m = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(2))
    v = np.abs(rng.standard_normal((n, d))).astype(np.float32)
    g = rng.standard_normal((lo + n, d)).astype(np.float32)  # the batch's gradient, the block at row lo
    rows = np.flatnonzero(rng.random(n) < 0.9)
    steps = np.full(rows.size, 7, np.int32)
    steps[rows.size // 2:] = 8
    bc1, inv = _bias_corrections(steps, 0.9, 0.999)

    def strided(a: np.ndarray) -> np.ndarray:  # the same values in a view whose rows are not contiguous
        wide = np.zeros((a.shape[0], d + 1), np.float32)
        wide[:, :d] = a
        return wide[:, :d]

    runs = [a.copy() for a in (p, g, m, v)]
    row_by_row = [strided(a) for a in (p, g, m, v)]
    for arrays in (runs, row_by_row):
        _adam_rows_cpu(*arrays, rows, bc1, inv, lo, 1e-3, 0.9, 0.999, 1e-15, d, d)
    for a, b in zip(runs, row_by_row):
        assert np.array_equal(a, b)
    assert not np.array_equal(runs[0], p)
    untouched = np.setdiff1d(np.arange(n), rows)
    assert np.array_equal(runs[0][untouched], p[untouched])


@pytest.mark.parametrize("compiled", [True, False])
def test_rows_not_stepped_are_untouched_and_keep_their_own_bias_correction(compiled):
    cfg = AdamConfig()
    lrs = learning_rates(cfg, 0, 100, scene_scale=1.0)
    block = _block(4)
    before = {k: v.clone() for k, v in block.items()}
    grads = {n: torch.ones_like(block[n]) for n in PARAM_NAMES}
    sparse_adam_step(block, grads, torch.tensor([1, 3]), lrs, cfg, compiled=compiled)
    for k in block:
        assert torch.equal(block[k][[0, 2]], before[k][[0, 2]]), k
    # a row's first step moves it by exactly lr (Adam's bias-corrected first step with g = 1)
    torch.testing.assert_close(block["means"][1], before["means"][1] - lrs["means"], rtol=0, atol=1e-6)
    assert block["adam_step"].tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("compiled", [True, False])
def test_a_batch_of_blocks_steps_each_block_as_on_its_own(compiled):
    """The trainer's step: gradients and the contributed mask of a gathered batch, each block at its
    offset, against `sparse_adam_step` on the block's own rows and gradient slice."""
    cfg = AdamConfig()
    lrs = learning_rates(cfg, 0, 100, scene_scale=1.0)
    blocks, alone = [_block(5, seed=1), _block(3, seed=2)], [_block(5, seed=1), _block(3, seed=2)]
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        grads = {n: torch.randn((8, *blocks[0][n].shape[1:]), generator=g) for n in PARAM_NAMES}
        mask = torch.rand(8, generator=g) < 0.6
        optimizer = SparseAdam(grads, mask, lrs, cfg)
        counts = [optimizer.step(b, lo, numpy_arrays(b) if compiled else None) for b, lo in zip(blocks, (0, 5))]
        assert counts == [int(mask[:5].sum()), int(mask[5:].sum())]
        for b, lo, hi in zip(alone, (0, 5), (5, 8)):
            sparse_adam_step(b, {n: x[lo:hi] for n, x in grads.items()}, torch.nonzero(mask[lo:hi]).squeeze(1), lrs, cfg,
                             compiled=False)
    for b, ref in zip(blocks, alone):
        for k in b:
            torch.testing.assert_close(b[k], ref[k], rtol=1e-6, atol=1e-7, msg=k)
    # A rank that sees nothing in a step gathers an empty batch (1-D empty gradients).
    empty = SparseAdam({n: torch.zeros(0) for n in PARAM_NAMES}, torch.zeros(0, dtype=torch.bool), lrs, cfg)
    assert empty.step(_block(0), 0, numpy_arrays(_block(0)) if compiled else None) == 0


def test_means_lr_decays_to_one_percent_and_batch_scaling():
    cfg = AdamConfig()
    assert np.isclose(learning_rates(cfg, 1000, 1000, 3.0)["means"], 1.6e-4 * 3.0 * 0.01)
    b4 = cfg.for_batch(4)
    assert np.isclose(b4.lr["scales"], 5e-3 * 2) and np.isclose(b4.betas[0], 0.9**4)


def test_schedule_is_a_pure_function_and_visits_each_camera_once_per_epoch():
    n, b = 10, 4
    seq = np.concatenate([step_cameras(3, n, b, s) for s in range(5)])  # 20 = two epochs
    assert sorted(seq[:10]) == list(range(10)) and sorted(seq[10:]) == list(range(10))
    assert np.array_equal(step_cameras(3, n, b, 2), step_cameras(3, n, b, 2))
    assert not np.array_equal(seq[:10], np.concatenate([step_cameras(4, n, b, s) for s in range(5)])[:10])


def test_camera_assignment_is_optimal_and_balanced():
    rng = np.random.default_rng(0)
    from itertools import permutations

    for _ in range(20):
        aff = rng.integers(0, 100, size=(6, 3)).astype(float)
        ranks = assign_cameras(aff, per_rank=2)
        assert sorted(ranks) == [0, 0, 1, 1, 2, 2]
        best = max(sum(aff[c, r] for c, r in enumerate(p)) for p in set(permutations([0, 0, 1, 1, 2, 2])))
        assert np.isclose(sum(aff[c, r] for c, r in enumerate(ranks)), best)


def test_locality_schedule_reorders_steps_within_windows_only():
    rng = np.random.default_rng(0)
    n, b, window = 23, 2, 5
    features = rng.normal(size=(n, 6))
    local = Schedule(7, n, b, features, window)
    steps = 4 * window
    random_order = [tuple(step_cameras(7, n, b, s)) for s in range(steps)]
    ordered = [tuple(local.cameras(s)) for s in range(steps)]
    for w in range(4):
        # the same random batches, only their order inside the window changes
        assert sorted(ordered[w * window:(w + 1) * window]) == sorted(random_order[w * window:(w + 1) * window])
        assert ordered[w * window] == random_order[w * window]  # the chain starts where the window does
    centroid = {bt: features[list(bt)].mean(0) for bt in random_order}

    def path(seq):
        return sum(np.linalg.norm(centroid[seq[i + 1]] - centroid[seq[i]]) for i in range(len(seq) - 1)
                   if (i + 1) % window)
    assert path(ordered) < path(random_order)
    # pure: a fresh schedule (a resumed run) asked for steps out of order agrees
    again = Schedule(7, n, b, features, window)
    assert [tuple(again.cameras(s)) for s in reversed(range(steps))] == ordered[::-1]
    assert [tuple(Schedule(7, n, b, features, 0).cameras(s)) for s in range(steps)] == random_order
    # never more than an epoch of steps: each camera comes at most once a window
    assert Schedule(7, n, b, features, 1000).window == n // b


def test_locality_order_is_a_nearest_neighbour_chain():
    points = np.array([[0.0], [10.0], [1.0], [11.0], [2.0]])
    assert locality_order(points).tolist() == [0, 2, 4, 1, 3]


@pytest.mark.parametrize("compiled", [True, False])
def test_global_step_bias_correction_is_torch_adam_on_the_selected_rows(compiled):
    """`--adam visible`: rows selected on some steps only, bias-corrected by the training step,
    equal torch's Adam whose unselected rows (parameters and moments) are put back after each
    step, which is what gsplat's SelectiveAdam does."""
    cfg = AdamConfig()
    lrs = learning_rates(cfg, 0, 100, scene_scale=1.0)
    block = _block(6)
    ref = {n: block[n].clone().requires_grad_(True) for n in PARAM_NAMES}
    opt = torch.optim.Adam([{"params": [ref[n]], "lr": lrs[n]} for n in PARAM_NAMES], betas=cfg.betas, eps=cfg.eps)
    g = torch.Generator().manual_seed(3)
    for step in range(1, 8):
        mask = torch.rand(6, generator=g) < 0.5
        mask[0] = step % 2 == 0  # (row 0 unselected at the first step: its moments stay zero there too)
        grads = {n: torch.randn(block[n].shape, generator=g) for n in PARAM_NAMES}
        SparseAdam(grads, mask, lrs, cfg, global_step=step).step(block, 0, numpy_arrays(block) if compiled else None)
        zero = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
        kept = {n: (ref[n].detach()[~mask].clone(),
                    {k: opt.state[ref[n]][k][~mask].clone() if ref[n] in opt.state else zero[k] for k in zero})
                for n in PARAM_NAMES}
        for n in PARAM_NAMES:
            ref[n].grad = grads[n].clone()
        opt.step()
        with torch.no_grad():
            for n, (p, moments) in kept.items():
                ref[n][~mask] = p
                for k, v in moments.items():
                    opt.state[ref[n]][k][~mask] = v
    for n in PARAM_NAMES:
        torch.testing.assert_close(block[n], ref[n].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [True, False])
def test_dense_adam_put_off_equals_every_row_every_step_and_torch_adam(compiled):
    """`--adam dense`: blocks paged on some steps only, each brought up to date (`LazyDense`)
    before it steps with its gradient (zero on its rows without one), then all of them at the
    end, equal every row stepping every step, bit for bit, and torch's Adam with a decaying lr."""
    cfg, steps = AdamConfig(), 12
    lazy = LazyDense(cfg, steps, scene_scale=2.0)
    blocks = [_block(5, seed=s) for s in range(3)]
    everyone = [{k: v.clone() for k, v in b.items()} for b in blocks]
    ref = [{n: b[n].clone().requires_grad_(True) for n in PARAM_NAMES} for b in blocks]
    opts = [torch.optim.Adam([{"params": [r[n]], "lr": lrs_n, "name": n}
                              for n, lrs_n in learning_rates(cfg, 0, steps, 2.0).items()], betas=cfg.betas, eps=cfg.eps)
            for r in ref]
    g = torch.Generator().manual_seed(5)
    for step in range(1, steps + 1):
        lrs = learning_rates(cfg, step - 1, steps, 2.0)
        paged = torch.rand(3, generator=g) < 0.4
        paged[0] = step in (2, 3, 9)  # block 0 waits 6 steps between its pages
        for b in range(3):
            has = (torch.rand(5, generator=g) < 0.6) & paged[b]  # a block not paged has no gradient
            grads = {n: torch.randn(blocks[b][n].shape, generator=g) * has.view(-1, *[1] * (blocks[b][n].dim() - 1))
                     for n in PARAM_NAMES}
            every_row = torch.ones(5, dtype=torch.bool)
            SparseAdam(grads, every_row, lrs, cfg, global_step=step).step(
                everyone[b], 0, numpy_arrays(everyone[b]) if compiled else None)
            if paged[b]:
                arrays = numpy_arrays(blocks[b]) if compiled else None
                lazy.catch_up(blocks[b], step - 1, arrays)
                SparseAdam(grads, every_row, lrs, cfg, global_step=step).step(blocks[b], 0, arrays)
            for n in PARAM_NAMES:
                ref[b][n].grad = grads[n].clone()
                for group in opts[b].param_groups:
                    group["lr"] = lrs[group["name"]]
            opts[b].step()
    for b in range(3):
        assert lazy.catch_up(blocks[b], steps, numpy_arrays(blocks[b]) if compiled else None) > 0 or b != 0
        assert lazy.catch_up(blocks[b], steps, numpy_arrays(blocks[b]) if compiled else None) == 0  # up to date
        for k in blocks[b]:
            assert torch.equal(blocks[b][k], everyone[b][k]), (b, k)
        for n in PARAM_NAMES:
            torch.testing.assert_close(blocks[b][n], ref[b][n].detach(), rtol=1e-5, atol=1e-6)
        assert blocks[b]["adam_step"].tolist() == [steps] * 5


def test_dense_adam_leaves_rows_without_moments_as_they_are():
    """A new row (zero moments, as gsplat's duplicate and split give) costs nothing to bring up
    to date and does not move."""
    cfg = AdamConfig()
    lazy = LazyDense(cfg, 5000, scene_scale=1.0)
    block = _block(3)
    before = {k: v.clone() for k, v in block.items()}
    assert lazy.catch_up(block, 4000, numpy_arrays(block)) == 3
    for k in PARAM_NAMES:
        assert torch.equal(block[k], before[k])
    assert block["adam_step"].tolist() == [4000] * 3
    with pytest.raises(ValueError, match="past the run"):
        lazy.catch_up(block, 5001)


@pytest.mark.parametrize("parallel_rows", [10**9, 0])
def test_arrays_kept_across_steps_bound_every_nonzero_moment(parallel_rows):
    """The trainer keeps a block's `numpy_arrays` from step to step, with the columns past which
    no moment is nonzero: steps at SH degree 0, then 1, then 0 again (shN's first 9 columns live
    only in the middle steps) must leave every parameter and moment as fresh arrays and the full
    update do, so the bound must grow when the degree does and the moments it let grow must
    still decay afterwards."""
    cfg, n = AdamConfig(), 400
    lrs = learning_rates(cfg, 0, 100, scene_scale=2.0)
    g = torch.Generator().manual_seed(9)
    start = {name: torch.randn((n, *shape), generator=g) for name, shape in param_shapes(3).items()}
    start.update({k: torch.from_numpy(v) for k, v in empty_state(n, 3).items()})
    mask = torch.rand(n, generator=g) < 0.8
    schedule = [0, 0, 0, 9, 9, 9, 0, 0, 0]  # shN's live columns at each step
    kept_block = {k: t.clone() for k, t in start.items()}
    kept = numpy_arrays(kept_block)
    full_block = {k: t.clone() for k, t in start.items()}
    bounds = []
    for step, live in enumerate(schedule, start=1):
        grads = {k: torch.randn(start[k].shape, generator=g.manual_seed(step)) for k in PARAM_NAMES}
        grads["shN"].reshape(n, -1)[:, live:] = 0.0
        SparseAdam(grads, mask, lrs, cfg, global_step=step, parallel_rows=parallel_rows,
                   grad_columns={"shN": live}).step(kept_block, 0, kept)
        SparseAdam(grads, mask, lrs, cfg, global_step=step, parallel_rows=parallel_rows).step(
            full_block, 0, numpy_arrays(full_block))
        bounds.append(int(kept[MOMENT_COLUMNS][PARAM_NAMES.index("shN")]))
    assert bounds == [0, 0, 0, 9, 9, 9, 9, 9, 9]
    for k in full_block:
        assert torch.equal(kept_block[k], full_block[k]), k
    late = full_block["exp_avg_sq_shN"].reshape(n, -1)[:, :9]
    assert (late[mask] > 0).all()  # the middle steps' moments were there to decay in the last ones


@pytest.mark.parametrize("parallel_rows", [10**9, 0])
def test_adam_skips_untrained_sh_coefficients_without_changing_a_bit(parallel_rows):
    """With `grad_columns`, shN's columns past the SH degree in use (whose gradient is zero) are
    not read where their moments are zero: every parameter and moment comes out as the full
    update computes it (moments left nonzero by an earlier run still decay)."""
    cfg, n = AdamConfig(), 300
    lrs = learning_rates(cfg, 0, 100, scene_scale=2.0)
    g = torch.Generator().manual_seed(5)
    start = _block(n, seed=4)
    start["exp_avg_shN"][: n // 2] = torch.rand(start["exp_avg_shN"][: n // 2].shape, generator=g)
    start["exp_avg_sq_shN"][: n // 2] = torch.rand(start["exp_avg_sq_shN"][: n // 2].shape, generator=g)
    # One nonzero moment in a row's tail is enough to step it: the first moment in the last
    # column, or the second alone in a middle one.
    start["exp_avg_shN"].reshape(n, -1)[n // 2 : n // 2 + 10, -1] = 0.5
    start["exp_avg_sq_shN"].reshape(n, -1)[n // 2 + 10 : n // 2 + 20, 7] = 0.25
    mask = torch.rand(n, generator=g) < 0.7
    live = 3  # degree 1: three coefficients of shN's [N, 3, 3] at SH degree 1, the first one live
    results = []
    for columns in (None, {"shN": live}):
        block = {k: t.clone() for k, t in start.items()}
        for step in range(1, 4):
            grads = {k: torch.randn(block[k].shape, generator=g.manual_seed(step)) for k in PARAM_NAMES}
            grads["shN"].reshape(n, -1)[:, live:] = 0.0
            SparseAdam(grads, mask, lrs, cfg, global_step=step, parallel_rows=parallel_rows,
                       grad_columns=columns).step(block, 0, numpy_arrays(block))
        results.append(block)
    full, skipped = results
    for k in full:
        assert torch.equal(full[k], skipped[k]), k
    moved = full["shN"].reshape(n, -1)[:, live:] != start["shN"].reshape(n, -1)[:, live:]
    assert moved[: n // 2][mask[: n // 2]].all() and not moved[n // 2 + 10 :].any()
    assert moved[n // 2 : n // 2 + 10, -1][mask[n // 2 : n // 2 + 10]].all()
    decayed = full["exp_avg_sq_shN"].reshape(n, -1)[n // 2 + 10 : n // 2 + 20, 7]
    assert (decayed[mask[n // 2 + 10 : n // 2 + 20]] < 0.25).all()
