"""The trainer's configuration: one dataclass, one command-line flag per field."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainConfig:
    data: str = ""  # dataset: COLMAP folder (sparse/ + images/) or a folder with transforms.json
    store: str = ""  # scene store written by `python -m tools.tile`
    out: str = "runs/latest"  # logs, metrics, renders and the resolved config
    steps: int = 30_000  # global steps (each trains on batch_size cameras per rank)
    batch_size: int = 1  # cameras per rank per step; the global batch is ranks x batch_size
    sh_degree: int | None = None  # highest SH degree to train (default: the store's)
    sh_degree_interval: int = 1000  # the SH degree used grows by one every this many steps
    cache_mb: float | None = None  # block cache budget (default: a quarter of available memory)
    device: str = "auto"  # cpu | cuda | auto (cuda when available)
    data_factor: int = 1  # image downscale factor
    test_every: int = 8  # every N-th image is held out for evaluation
    locality_window: int = 100  # reorder each window of this many steps (at most an epoch) into a nearest-neighbour chain of where the cameras look, so consecutive steps see the same blocks and an out-of-core cache pages less; 0 keeps gsplat's random order
    eval_every: int = 0  # evaluate every N steps (0: only at the end)
    commit_every: int = 500  # commit the store every N steps (and at the end)
    log_every: int = 10  # write a metrics line every N steps
    keep_commits: int = 2  # committed generations kept by garbage collection
    seed: int = 0
    deterministic: bool = False  # deterministic torch kernels: identical results run to run
    resume: bool = False  # continue from the store's last commit
    stop_at: int = 0  # commit and exit after this step, e.g. one wall-time slice of a cluster job; --resume continues (0: run to --steps); the schedule still spans --steps
    background: tuple[float, float, float] = (0.0, 0.0, 0.0)
    max_eval_images: int = 0  # evaluate at most this many held-out views (0: all)
    progress: bool = True  # show a progress bar on rank 0


def _field_help() -> dict[str, str]:
    """Pull each field's trailing comment from this file, so flags and fields never drift apart."""
    helps: dict[str, str] = {}
    for line in Path(__file__).read_text().splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith("#"):
            name = line.split(":", 1)[0].strip()
            helps[name] = line.split("#", 1)[1].strip()
    return helps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train",
        description="Train a 3DGS scene store out of core (one process, or one MPI rank per GPU).",
    )
    helps = _field_help()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        h = helps.get(f.name, "")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=h)
        elif f.name == "background":
            parser.add_argument(flag, type=float, nargs=3, default=default, metavar=("R", "G", "B"), help=h)
        elif f.name in ("sh_degree", "cache_mb"):
            parser.add_argument(flag, type=int if f.name == "sh_degree" else float, default=None, help=h)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=h, required=f.name in ("data", "store"))
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    values["background"] = tuple(values["background"])
    return TrainConfig(**values)
