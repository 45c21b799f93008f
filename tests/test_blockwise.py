"""Blocks shared among threads (`train.blockwise`): when threads are used, and that every block
is taken exactly once whatever the timing."""
from __future__ import annotations

import threading
import time

import pytest

from train.blockwise import MAX_SHARE, MIN_MEAN_ROWS, block_threads, row_groups, share_blocks


def test_threads_only_for_several_blocks_none_of_them_most_of_the_rows_nor_small():
    r = MIN_MEAN_ROWS
    assert block_threads([0, r, 2 * r, 3 * r], 2) == 2
    assert block_threads([0, r, 2 * r, 3 * r], 1) == 1
    assert block_threads([0, 3 * r], 4) == 1  # one block
    assert block_threads([0, r, 2 * r], 8) == 2  # no more threads than blocks
    big = int(100 * r * MAX_SHARE) + 1
    assert block_threads([0, big, 100 * r], 2) == 1  # a block of most rows: its own kernel splits it
    assert block_threads([0, 50 * r, 100 * r], 2) == 2
    assert block_threads([0, r, 2 * r - 1], 2) == 1  # fewer than MIN_MEAN_ROWS a block on average
    assert block_threads([1, r + 1, 2 * r + 1], 2) == 2  # (the rows counted from the first offset)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_block_goes_to_exactly_one_thread(threads):
    """Each taker records the blocks it drew, sleeping on some so that others overtake it: the
    union is every block, with no block twice; every thread's result comes back."""
    names = []

    def work(blocks):
        names.append(threading.current_thread().name)
        mine = []
        for b in blocks:
            if b % 3 == 0:
                time.sleep(0.001)
            mine.append(b)
        return mine

    results = share_blocks(50, threads, work)
    assert len(results) == threads and len(set(names)) == threads
    taken = [b for r in results for b in r]
    assert sorted(taken) == list(range(50))
    assert all(r == sorted(r) for r in results), "each thread draws in rising order"


def test_an_error_in_a_helper_thread_reaches_the_caller_after_all_ended():
    done = []

    def work(blocks):
        for b in blocks:
            if b == 7:
                raise ValueError("block 7 is bad")
            time.sleep(0.0005)
        done.append(threading.current_thread().name)

    with pytest.raises(ValueError, match="block 7 is bad"):
        share_blocks(30, 2, work)
    assert len(done) == 1, "the other thread finished its blocks before the error was raised"


@pytest.mark.parametrize("sizes", [[9600] * 21, [5, 100000, 3], [1000, 2000], [3, 150, 0, 77] * 90])
@pytest.mark.parametrize("sh_coeffs", [None, 0, 3])
@pytest.mark.parametrize("views", [False, True])
def test_a_batch_gathered_on_threads_is_the_blocks_joined(sizes, sh_coeffs, views, monkeypatch):
    """`train.step.gather` of several blocks (copied by threads, in row ranges of blocks per
    array; or, given the blocks' numpy views, by numpy on this thread) against torch.cat of the
    blocks' arrays, shN cut to its leading coefficients."""
    import numpy as np
    import torch

    import train.step as step_module
    from train.optim import numpy_arrays
    from train.step import gather

    rng = np.random.default_rng(len(sizes))
    shapes = {"means": (3,), "quats": (4,), "scales": (3,), "opacities": (), "sh0": (1, 3), "shN": (15, 3)}
    blocks = {f"b{i}": {k: torch.from_numpy(rng.normal(size=(n, *s)).astype(np.float32)) for k, s in shapes.items()}
              for i, n in enumerate(sizes)}
    keys = list(blocks)
    arrays = [numpy_arrays(blocks[k]) for k in keys] if views else None
    copied = []
    real = step_module._joined_numpy
    monkeypatch.setattr(step_module, "_joined_numpy", lambda *a: copied.append(real(*a)) or copied[-1])
    batch = gather(blocks, keys, requires_grad=True, sh_coeffs=sh_coeffs, arrays=arrays)
    # the views are copied by numpy exactly up to NUMPY_GATHER_BYTES of the batch's rows
    row_bytes = 4 * (14 + 3 * (15 if sh_coeffs is None else sh_coeffs))
    assert (bool(copied) and copied[-1] is not None) == (views and sum(sizes) * row_bytes <= step_module.NUMPY_GATHER_BYTES)
    assert batch.offsets == list(np.cumsum([0, *sizes]))
    for name in shapes:
        want = torch.cat([blocks[k][name] if name != "shN" or sh_coeffs is None else blocks[k][name][:, :sh_coeffs]
                          for k in keys])
        assert torch.equal(batch.params[name].detach(), want), name
        assert batch.params[name].requires_grad and batch.params[name].is_leaf


@pytest.mark.parametrize("sizes", [[10] * 16, [0, 0, 5, 300, 1, 0, 77, 2000, 3], [7], [], [0, 0], [1] * 9 + [1000]])
@pytest.mark.parametrize("groups", [1, 2, 8])
def test_row_groups_are_runs_of_consecutive_blocks_of_about_equal_rows(sizes, groups):
    """Every block in exactly one run, runs in order and at most `groups` of them; a run ends at
    the first block end at or past its share of the rows, so no run holds more than its share
    plus one block."""
    import numpy as np

    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    cuts = row_groups(offsets, groups)
    assert cuts[0] == 0 and cuts[-1] == len(sizes) and (np.diff(cuts) > 0).all()
    assert len(cuts) - 1 <= max(groups, 1) or not sizes
    share, largest = offsets[-1] / groups, max(sizes, default=0)
    for a, b in zip(cuts[:-1], cuts[1:]):
        assert offsets[b] - offsets[a] <= share + largest
    if sizes == [10] * 16:
        assert np.diff(cuts).tolist() == [16 // groups] * groups
