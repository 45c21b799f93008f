"""Views larger than the cache (docs/architecture.md §6b): which blocks a step pages together.

A rank whose step sees more of its blocks than its cache holds runs the step in waves
(`train.step.train_step` with `waves`): contiguous Morton ranges of the step's blocks, each
paged, projected into every camera and released, so that only the 2D splats stay; after the
rasterization the waves are paged again to backpropagate and step Adam. A wave takes at most
half of what the budget leaves beside the step's splats where the largest block allows it, so
the next wave loads while one is worked on.

The budget bounds the step's working memory as well as its blocks (`step_bytes`): each
gathered row's copy of the parameters, its gradient sums and its projection are reserved in the
cache (`BlockCache.working`) while a step, or a wave, uses them; a view is split into waves when
its blocks and that memory together exceed the budget. The 2D splats of a step in waves are held
for the whole step, reserved the same way: a view whose splats do not fit beside its largest wave
is refused while its first pass projects, before anything of the step is stepped or written.
The camera a rank renders reserves its rasterizer's memory (`raster_bytes`) once its splats have
arrived; no plan knows that size in advance, so where the pins leave too little room it is
counted over the budget rather than refused.
"""
from __future__ import annotations

from storage import CacheBudgetError
from storage.cache import param_bytes_per_gaussian
from train.render.splats2d import GRAD_FLOATS, WIRE_FLOATS

# What one 2D splat costs its owner while a step runs: its fields (the wire's 12 float32) and
# row id, then the gradient it gets back (9 float32) and its contributed flag.
SPLAT_STEP_BYTES = 4 * (WIRE_FLOATS + GRAD_FLOATS) + 8 + 1
# What projecting one row into a camera allocates besides the splat it may give: the row's index
# and its 2D fields (means, conic, depth, opacity, radii) and culling flag before compaction.
PROJECT_ROW_BYTES = 8 + 4 * (2 + 3 + 1 + 1 + 2) + 1
# What rasterizing one splat allocates (train.render.cpu): its record (16 float32) and the copy
# in depth order, its tile box (4 int64), its offsets into the tile lists (3 int64), its row in
# depth order and its contributed flag, its summed gradient (9 float32); and one tile
# intersection: the candidate, the list entry and its slot (4 + 4 + 8 B) and its gradient (9
# float32). A splat's further intersections are not counted: binning finds them.
RASTER_SPLAT_BYTES = 4 * 16 * 2 + 8 * 4 + 8 * 3 + 4 + 1 + 4 * 9 + 4 + 4 + 8 + 4 * 9
# Per pixel of the rendered image: colour, alpha, transmittance, stop index and saturation depth,
# the gradients of colour and alpha, the ground truth, and the loss's maps (the L1 difference and
# SSIM's filtered images, three channels each).
RASTER_PIXEL_BYTES = 4 * (3 + 1 + 1 + 1 + 1 + 3 + 1 + 3 + 3 * 6)


def _views(keys: list[str], visible: list[list[str]]) -> list[int]:  # [len(keys)] cameras that see each block
    seen: dict[str, int] = {}
    for v in visible:
        for k in v:
            seen[k] = seen.get(k, 0) + 1
    return [seen.get(k, 0) for k in keys]


def _sizes(keys: list[str], views: list[int], cache, backward: bool, blocks: bool) -> list[int]:
    """Per block of `keys`: its working memory in a step (`blocks`: and its own bytes). Each row
    is gathered once (and its gradients summed, `backward`); each of the block's `views` (the
    cameras that see it, `_views`) projects every row, and at most every row gives it a splat."""
    params = param_bytes_per_gaussian(cache.store.sh_degree) * (2 if backward else 1)
    row = params + (cache.row_bytes if blocks else 0)
    return [cache.block_rows(k) * (row + n * (PROJECT_ROW_BYTES + SPLAT_STEP_BYTES)) for k, n in zip(keys, views)]


def step_bytes(keys: list[str], visible: list[list[str]], cache, backward: bool = True) -> int:
    """The working memory a step, or a wave, over blocks `keys` reserves beside them while it runs
    (`visible`: each camera's blocks; `backward`: the pass backpropagates)."""
    return sum(_sizes(keys, _views(keys, visible), cache, backward, blocks=False))


def raster_bytes(splats: int, received: int, width: int, height: int) -> int:
    """The working memory of rasterizing one camera's `splats` (`received` of them from other
    ranks, held with their gradients until these go back) into a `width` x `height` image."""
    return splats * RASTER_SPLAT_BYTES + received * SPLAT_STEP_BYTES + width * height * RASTER_PIXEL_BYTES


def wave_bytes(keys: list[str], visible: list[list[str]], cache, backward: bool = True) -> int:
    """What a wave over blocks `keys` takes of the budget: its blocks and its working memory."""
    return sum(_sizes(keys, _views(keys, visible), cache, backward, blocks=True))


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


def plan_waves(keys: list[str], visible: list[list[str]], cache, backward: bool = True) -> list[list[str]] | None:
    """The step's blocks `keys` (Morton order; `visible`: each camera's) in waves, or None when
    they and the step's working memory fit the cache at once (`backward` False: a forward-only
    pass, which needs less). The waves leave room for the splats every wave holds until the
    step ends, as many as the views could give, where the blocks allow it."""
    views = _views(keys, visible)
    sizes = _sizes(keys, views, cache, backward, blocks=True)
    if sum(sizes) <= cache.budget:
        return None
    room = cache.budget - sum(cache.block_rows(k) * n for k, n in zip(keys, views)) * SPLAT_STEP_BYTES
    # Where that leaves less than the largest block, the smallest waves leave the splats the most
    # room; they may still fit, fewer than the bound: `check_splats` counts them as they come.
    room = max(room, max(sizes))
    return [keys[a:b] for a, b in split_waves(sizes, room)]


def check_splats(held: int, cache, beside: int = 0) -> None:
    """Raise storage.CacheBudgetError when the `held` 2D splats of a step in waves do not fit
    the budget beside `beside` bytes (the largest wave, which must still be paged beside them)."""
    room = cache.budget - beside
    if held * SPLAT_STEP_BYTES > room:
        raise CacheBudgetError(
            f"cache of store {cache.store.name}: the step's view gives {held} or more 2D splats of this rank's "
            f"blocks, which need {held * SPLAT_STEP_BYTES} B ({SPLAT_STEP_BYTES} B each) while the step runs, "
            f"more than the {room} B the budget of {cache.budget} B leaves beside its largest wave: "
            f"the view does not fit even in waves")
