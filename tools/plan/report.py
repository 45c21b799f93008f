"""The plan as a JSON document and as the human table `python -m tools.plan` prints."""
from __future__ import annotations

from typing import Any

import numpy as np

from storage.schema import bytes_per_gaussian
from tools.plan.core import (
    GSPLAT_BACKWARD_BYTES,
    GSPLAT_FORWARD_BYTES,
    OURS_BACKWARD_BYTES,
    OURS_FORWARD_BYTES,
    Plan,
    link_bytes,
)


def _imbalance(x: np.ndarray) -> float:
    return float(x.max() / x.mean()) if x.mean() > 0 else 1.0


def plan_document(plan: Plan, network_gbps: float, cache_gb: float | None) -> dict[str, Any]:
    """Every figure of the plan: per rank, per step (the mean of the planned steps), and summed."""
    traffic = plan.mean_traffic()
    travel = np.mean([s.travelling() for s in plan.steps], axis=0)  # [2] ours, gsplat
    splats = float(np.mean([s.pairs.sum() for s in plan.steps]))
    links = {system: link_bytes(traffic, system) for system in ("ours", "gsplat")}
    bytes_per_s = network_gbps * 1e9 / 8
    work = np.bincount(plan.layout.block_rank, weights=plan.layout.work, minlength=plan.ranks)
    cache = plan.rank_cache_bytes()
    doc: dict[str, Any] = {
        "ranks": plan.ranks,
        "gaussians": int(plan.rank_gaussians().sum()),
        "blocks": int(plan.rank_blocks().sum()),
        "sample_weight": plan.weight,
        "sh_degree": plan.sh_degree,
        "bytes_per_gaussian": bytes_per_gaussian(plan.sh_degree),
        "steps_planned": len(plan.steps),
        "cameras_per_step": len(plan.steps[0].cameras),
        "per_rank": {
            "gaussians": plan.rank_gaussians().tolist(),
            "blocks": plan.rank_blocks().tolist(),
            "state_bytes": plan.rank_state_bytes().tolist(),
            "cache_bytes": [int(b) for b in cache],
            "splats_sent_per_step": traffic["ours sent"].tolist(),
            "splats_received_per_step": traffic["ours received"].tolist(),
            "link_bytes_per_step": links["ours"].tolist(),
        },
        "imbalance": {
            "gaussians": _imbalance(plan.rank_gaussians()),
            "blocks": _imbalance(plan.rank_blocks()),
            "ownership_work": _imbalance(work),
            "cache": _imbalance(cache),
            "link_bytes": _imbalance(links["ours"]),
        },
        "per_step": {
            "splats": splats,
            "travelling_ours": float(travel[0]),
            "travelling_gsplat": float(travel[1]),
            "bytes_ours_fwd": float(travel[0] * OURS_FORWARD_BYTES),
            "bytes_ours_fwd_bwd": float(travel[0] * (OURS_FORWARD_BYTES + OURS_BACKWARD_BYTES)),
            "bytes_gsplat_fwd": float(travel[1] * GSPLAT_FORWARD_BYTES),
            "bytes_gsplat_fwd_bwd": float(travel[1] * (GSPLAT_FORWARD_BYTES + GSPLAT_BACKWARD_BYTES)),
            "network_gbps": network_gbps,
            # The slowest rank's link: every rank waits for it in the all-to-all.
            "seconds_ours": float(links["ours"].max() / bytes_per_s),
            "seconds_gsplat": float(links["gsplat"].max() / bytes_per_s),
        },
        # Each planned step: a rank's splat bytes out and in, which the trainer logs as
        # `bytes_sent` - `grad_bytes_sent` (and received), and at most the gradients' return
        # (only splats that got a gradient send theirs: which ones, only the rendering knows).
        "steps": [_step_record(step) for step in plan.steps],
        "cache": {
            "needed_bytes_max": int(cache.max()),
            "budget_bytes": None if cache_gb is None else int(cache_gb * 1e9),
            "ranks_that_fit": None if cache_gb is None else int((cache <= cache_gb * 1e9).sum()),
        },
    }
    return doc


def _step_record(step) -> dict[str, Any]:
    t = step.rank_traffic()
    sent, received = t["ours sent"], t["ours received"]
    return {"cameras": step.cameras.tolist(), "camera_ranks": step.ranks.tolist(),
            "splat_bytes_sent": (sent * OURS_FORWARD_BYTES).tolist(),
            "splat_bytes_received": (received * OURS_FORWARD_BYTES).tolist(),
            "grad_bytes_sent_max": (received * OURS_BACKWARD_BYTES).tolist(),
            "grad_bytes_received_max": (sent * OURS_BACKWARD_BYTES).tolist()}


def print_plan(doc: dict[str, Any], header: list[str]) -> None:
    for line in header:
        print(line)
    r = doc["per_rank"]
    print(f"\n{'rank':>4s} {'Gaussians':>15s} {'blocks':>7s} {'state GB':>9s} {'cache GB':>9s} "
          f"{'sent splats/step':>17s} {'received/step':>14s} {'link GB/step':>13s}")
    for i in range(doc["ranks"]):
        print(f"{i:4d} {r['gaussians'][i]:15,d} {r['blocks'][i]:7d} {r['state_bytes'][i] / 1e9:9.2f} "
              f"{r['cache_bytes'][i] / 1e9:9.2f} {r['splats_sent_per_step'][i]:17,.0f} "
              f"{r['splats_received_per_step'][i]:14,.0f} {r['link_bytes_per_step'][i] / 1e9:13.3f}")
    print("imbalance (max/mean): " + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in doc["imbalance"].items()))
    s = doc["per_step"]
    print(f"\nper step ({doc['cameras_per_step']} cameras, mean of {doc['steps_planned']} planned steps): "
          f"{s['splats']:,.0f} splats (Gaussian-camera pairs)")
    print(f"{'':22s} {'travelling splats':>18s} {'share':>7s} {'fwd GB':>9s} {'fwd+bwd GB':>11s} "
          f"{'s at ' + format(s['network_gbps'], 'g') + ' Gb/s':>14s}")
    for name, key in (("ours (octree regions)", "ours"), ("gsplat round robin", "gsplat")):
        t = s[f"travelling_{key}"]
        print(f"{name:22s} {t:18,.0f} {t / max(s['splats'], 1):7.1%} {s[f'bytes_{key}_fwd'] / 1e9:9.3f} "
              f"{s[f'bytes_{key}_fwd_bwd'] / 1e9:11.3f} {s[f'seconds_{key}']:14.3f}")
    print(f"(ours {OURS_FORWARD_BYTES} B forward + at most {OURS_BACKWARD_BYTES} B back a travelling splat, gsplat "
          f"{GSPLAT_FORWARD_BYTES} + {GSPLAT_BACKWARD_BYTES}; seconds: the busiest rank's link, the larger direction)")
    c = doc["cache"]
    line = f"\ncache: the busiest rank pins {c['needed_bytes_max'] / 1e9:.2f} GB of blocks for one step"
    if c["budget_bytes"] is not None:
        line += (f"; --cache-gb {c['budget_bytes'] / 1e9:g} holds it on {c['ranks_that_fit']} of {doc['ranks']} ranks")
    print(line)
