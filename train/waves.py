"""Views larger than the cache (docs/architecture.md §6b): which blocks a step pages together.

A rank whose step sees more of its blocks than its cache holds runs the step in waves
(`train.step.train_step` with `waves`): contiguous Morton ranges of the step's blocks, each
paged, projected into every camera and released, so that only the 2D splats stay; after the
rasterization the waves are paged again to backpropagate and step Adam. A wave takes at most
half the budget where the largest block allows it, so the next wave loads while one is worked on.

The 2D splats are held beside the cache for the whole step, so the budget bounds them too: a
view whose splats alone do not fit is refused while its first pass projects, before anything of
the step is stepped or written.
"""
from __future__ import annotations

from storage import CacheBudgetError
from train.render.splats2d import GRAD_FLOATS, WIRE_FLOATS

# What one 2D splat costs its owner while a step in waves runs: its fields (the wire's 12
# float32) and row id, then the gradient it gets back (9 float32) and its contributed flag.
SPLAT_STEP_BYTES = 4 * (WIRE_FLOATS + GRAD_FLOATS) + 8 + 1


def split_waves(sizes: list[int], budget: int) -> list[tuple[int, int]]:  # [(start, stop)] of sizes
    """Consecutive runs of `sizes` of at most `budget` each, half of it if every size allows
    (a size over the budget makes a run of its own: the cache refuses it with its own error)."""
    cap = budget // 2 if max(sizes, default=0) <= budget // 2 else budget
    runs, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > cap:
            runs.append((start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


def plan_waves(keys: list[str], cache) -> list[list[str]] | None:
    """The step's blocks `keys` (Morton order) in waves, or None when they fit the cache at once."""
    sizes = [cache.block_rows(k) * cache.row_bytes for k in keys]
    if sum(sizes) <= cache.budget:
        return None
    return [keys[a:b] for a, b in split_waves(sizes, cache.budget)]


def check_splats(held: int, cache) -> None:
    """Raise storage.CacheBudgetError when the `held` 2D splats of a step in waves exceed the budget."""
    if held * SPLAT_STEP_BYTES > cache.budget:
        raise CacheBudgetError(
            f"cache of store {cache.store.name}: the step's view gives {held} or more 2D splats of this rank's "
            f"blocks, which need {held * SPLAT_STEP_BYTES} B ({SPLAT_STEP_BYTES} B each) while the step runs, "
            f"more than the budget of {cache.budget} B: the view does not fit even in waves")
