"""Adaptive density control: the default strategy's rules against gsplat's own DefaultStrategy,
row operations over the block schema, and the schedule of refinements and resets."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gsplat.strategy import DefaultStrategy
from gsplat.strategy.ops import reset_opa

from storage.rows import cat_rows, pack_rows, spawn_rows, take_rows, unpack_rows
from storage.schema import PARAM_NAMES, STAT_NAMES, block_schema, empty_state, moment_names, param_shapes
from train.densify.config import ConfigError, DensifyConfig
from train.densify.default import grow_masks, prune_mask, refine_block, refines_at, reset_opacities, resets_at
from train.densify.keyed import SPLIT, keyed_generator

SH = 2
SCENE_SCALE = 3.0


class FixedDefaultStrategy(DefaultStrategy):
    """gsplat's DefaultStrategy with the opacity reset of gsplat 1.5.3 repaired: its test
    `step % self.reset_every == 0 & step > 0` parses as `step % reset_every == (0 & step) > 0`."""

    def step_post_backward(self, params, optimizers, state, step, info, packed=False):
        super().step_post_backward(params, optimizers, state, step, info, packed=packed)
        if step < self.refine_stop_iter and step % self.reset_every == 0 and step > 0:
            reset_opa(params=params, optimizers=optimizers, state=state, value=self.prune_opa * 2.0)


def _block(n: int, seed: int) -> dict[str, torch.Tensor]:
    """A block whose rows span every rule's two sides: high and low gradients, small and large
    scales, transparent and opaque, small and large screen radii; Adam moments non-zero."""
    g = torch.Generator().manual_seed(seed)
    b = {name: torch.randn((n, *shape), generator=g) for name, shape in param_shapes(SH).items()}
    b["scales"] = torch.log(SCENE_SCALE * 10 ** (torch.rand(n, 3, generator=g) * 3 - 3.2))
    b["opacities"] = torch.logit(torch.rand(n, generator=g) * 0.04).clamp(-12, 12)
    b.update({k: torch.from_numpy(v) for k, v in empty_state(n, SH).items()})
    for name in moment_names():
        b[name] = torch.rand(b[name].shape, generator=g)
    b["adam_step"] = torch.randint(1, 50, (n,), generator=g, dtype=torch.int32)
    b["count"] = torch.randint(0, 6, (n,), generator=g, dtype=torch.int32)
    b["grad2d"] = torch.rand(n, generator=g) * 8e-4 * b["count"]
    b["max_radii"] = torch.rand(n, generator=g) * 0.3
    return b


def _gsplat_side(block: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    params = {n: torch.nn.Parameter(block[n].clone()) for n in PARAM_NAMES}
    optimizers = {n: torch.optim.Adam([params[n]], lr=1e-3) for n in PARAM_NAMES}
    for n, opt in optimizers.items():  # Adam state as a trained run has it
        opt.state[params[n]] = {"step": torch.tensor(7.0), "exp_avg": block[f"exp_avg_{n}"].clone(),
                                "exp_avg_sq": block[f"exp_avg_sq_{n}"].clone()}
    state = {"grad2d": block["grad2d"].clone(), "count": block["count"].to(torch.float32),
             "radii": block["max_radii"].clone(), "scene_scale": SCENE_SCALE}
    return params, optimizers, state


@pytest.mark.parametrize("step,scale2d_stop,revised", [(600, 0, False), (3100, 0, False), (3100, 5000, True)])
def test_a_refinement_equals_gsplat_default_strategy(step, scale2d_stop, revised):
    """Clone, split and prune masks, the resulting rows in order, their Adam moments and the
    running statistics: ours from the block's arrays, gsplat's from its own DefaultStrategy on
    the same parameters, optimizer state and statistics, with the same split samples."""
    block = _block(3000, seed=step)
    cfg = DensifyConfig(refine_scale2d_stop_iter=scale2d_stop, revised_opacity=revised)
    ref = DefaultStrategy(refine_scale2d_stop_iter=scale2d_stop, revised_opacity=revised)
    params, optimizers, state = _gsplat_side(block)

    is_dupli, is_split = grow_masks(block, step, cfg, SCENE_SCALE)
    assert 100 < int(is_dupli.sum()) and 100 < int(is_split.sum())  # both rules have work
    torch.manual_seed(11)
    n_dupli, n_split = ref._grow_gs(params, optimizers, state, step)
    assert (n_dupli, n_split) == (int(is_dupli.sum()), int(is_split.sum()))
    n_prune = ref._prune_gs(params, optimizers, state, step)
    ours = refine_block(block, step, cfg, SCENE_SCALE, torch.Generator().manual_seed(11))
    assert (ours.cloned, ours.split, ours.pruned) == (n_dupli, n_split, n_prune) and n_prune > 0
    assert len(ours.block["means"]) == len(params["means"]) == 3000 + n_dupli + n_split - n_prune
    for n in PARAM_NAMES:
        torch.testing.assert_close(ours.block[n], params[n].detach(), rtol=0, atol=0, msg=n)
        moments = optimizers[n].state[params[n]]
        torch.testing.assert_close(ours.block[f"exp_avg_{n}"], moments["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(ours.block[f"exp_avg_sq_{n}"], moments["exp_avg_sq"], rtol=0, atol=0)
    for name in STAT_NAMES:  # gsplat zeroes its statistics after a refinement, as we do
        assert not ours.block[name].any()
    # the prune rule alone on the original rows, as gsplat decides it
    params, optimizers, state = _gsplat_side(block)
    alone = ref._prune_gs(params, optimizers, state, step)
    assert int(prune_mask(block, step, cfg, SCENE_SCALE).sum()) == alone == 3000 - len(params["means"])


def test_new_rows_keep_their_sources_step_count_and_no_moments():
    block = _block(50, seed=1)
    new = spawn_rows(block, torch.tensor([3, 3, 7]), {"means": torch.zeros(3, 3)})
    assert new["adam_step"].tolist() == block["adam_step"][[3, 3, 7]].tolist()
    assert all(not new[m].any() for m in moment_names())
    assert not new["means"].any() and torch.equal(new["quats"], block["quats"][[3, 3, 7]])
    both = cat_rows([take_rows(block, torch.arange(50) % 2 == 0), new])
    assert len(both["means"]) == 28 and all(len(t) == 28 for t in both.values())


def test_rows_travel_as_bytes_unchanged():
    schema = block_schema(SH)
    block = {n: t.numpy() for n, t in _block(33, seed=2).items()}
    back = unpack_rows(pack_rows(block, schema), schema)
    assert back.keys() == block.keys()
    for n in block:
        assert back[n].dtype == block[n].dtype and back[n].shape == block[n].shape
        np.testing.assert_array_equal(back[n], block[n])
    with pytest.raises(ValueError, match="expected"):
        unpack_rows(np.zeros((2, 5), np.uint8), schema)


def test_opacity_reset_equals_gsplat_reset_opa():
    block = _block(200, seed=3)
    params, optimizers, state = _gsplat_side(block)
    reset_opa(params, optimizers, state, value=0.005 * 2.0)
    reset_opacities(block, prune_opa=0.005)
    torch.testing.assert_close(block["opacities"], params["opacities"].detach(), rtol=0, atol=0)
    assert not block["exp_avg_opacities"].any() and not block["exp_avg_sq_opacities"].any()
    assert float(torch.sigmoid(block["opacities"]).max()) <= 0.01 + 1e-7


def test_refinements_and_resets_fall_on_gsplat_schedule():
    """Which steps refine and which reset, against the fixed DefaultStrategy driven step by step
    (its refinements observed through `_grow_gs`, its resets through the opacities)."""
    cfg = DensifyConfig(refine_start_iter=20, refine_every=10, reset_every=70, pause_refine_after_reset=15,
                        refine_stop_iter=200)
    ref = FixedDefaultStrategy(refine_start_iter=20, refine_every=10, reset_every=70, pause_refine_after_reset=15,
                               refine_stop_iter=200)
    params, optimizers, state = _gsplat_side(_block(20, seed=4))
    state = ref.initialize_state(SCENE_SCALE)
    refined, reset = [], []
    ref._grow_gs = lambda *a, step=None, **k: (refined.append(a[-1]), (0, 0))[1]
    ref._prune_gs = lambda *a, **k: 0
    for step in range(260):
        means2d = torch.zeros(1, 20, 2, requires_grad=True)
        means2d.sum().backward()
        params["opacities"].data.fill_(5.0)
        info = {"width": 8, "height": 8, "n_cameras": 1, "radii": torch.ones(1, 20, 2), "gaussian_ids": None,
                "means2d": means2d}
        ref.step_post_backward(params, optimizers, state, step, info)
        if float(params["opacities"].max()) < 5.0:
            reset.append(step)
    assert [s for s in range(260) if refines_at(s, cfg)] == refined == [30, 40, 50, 60, 90, 100, 110, 120, 130, 160,
                                                                         170, 180, 190]
    assert [s for s in range(260) if resets_at(s, cfg)] == reset == [70, 140]
    assert not any(refines_at(s, DensifyConfig(strategy="none")) or resets_at(s, DensifyConfig(strategy="none"))
                   for s in range(5000))


def test_split_samples_are_keyed_by_seed_step_and_block():
    a = torch.randn(5, generator=keyed_generator(0, 600, "3-1f", SPLIT))
    assert torch.equal(a, torch.randn(5, generator=keyed_generator(0, 600, "3-1f", SPLIT)))
    for other in ((1, 600, "3-1f"), (0, 700, "3-1f"), (0, 600, "3-1e"), (0, 600, "4-1f")):
        assert not torch.equal(a, torch.randn(5, generator=keyed_generator(*other, SPLIT)))


@pytest.mark.parametrize("bad,match", [
    ({"strategy": "adc"}, "--strategy"), ({"grow_grad2d": float("nan")}, "--grow-grad2d"),
    ({"prune_opa": -1.0}, "--prune-opa"), ({"refine_every": 0}, "--refine-every"),
    ({"cap_max": 0}, "--cap-max"), ({"rebalance_above": 0.5}, "--rebalance-above"),
])
def test_bad_settings_are_refused_by_name(bad, match):
    with pytest.raises(ConfigError, match=match):
        DensifyConfig(**bad)
