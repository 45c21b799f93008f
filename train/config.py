"""The trainer's configuration: dataclasses whose fields are the command-line flags, one each."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass, field

from octree.semantics import MAX_SH_DEGREE
from train.densify.config import ConfigError, DensifyConfig
from train.optim import ADAM_MODES

__all__ = ["ConfigError", "TrainConfig", "build_parser", "parse_config"]


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
    allow_external_images: bool = False  # follow image paths that lead out of the dataset (transforms.json file_path, COLMAP image names): absolute, or climbing out with '..'
    adam: str = "contributed"  # which Gaussians Adam steps: contributed (those that reached a pixel, bias-corrected by their own step count; hidden ones stay untouched), visible (every one a camera of the step projected, bias-corrected by the training step: gsplat's visible_adam), dense (every one, every step, as torch's Adam in gsplat's default; the steps of unseen ones are taken when they are next used)
    densify: DensifyConfig = field(default_factory=DensifyConfig)

    def __post_init__(self) -> None:
        at_least = {"steps": 0, "batch_size": 1, "sh_degree_interval": 1, "data_factor": 1, "test_every": 1,
                    "locality_window": 0, "eval_every": 0, "commit_every": 1, "log_every": 1, "keep_commits": 1,
                    "stop_at": 0, "max_eval_images": 0}
        for name, lo in at_least.items():
            if getattr(self, name) < lo:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least {lo}")
        if self.sh_degree is not None and not 0 <= self.sh_degree <= MAX_SH_DEGREE:
            raise ConfigError(f"--sh-degree {self.sh_degree}: must be in [0, {MAX_SH_DEGREE}]")
        if self.cache_mb is not None and not (math.isfinite(self.cache_mb) and self.cache_mb > 0):
            raise ConfigError(f"--cache-mb {self.cache_mb}: must be a positive number")
        if self.adam not in ADAM_MODES:
            raise ConfigError(f"--adam {self.adam!r}: choose from {', '.join(ADAM_MODES)}")
        if not all(math.isfinite(v) for v in self.background):
            raise ConfigError(f"--background {self.background}: must be finite")
        if isinstance(self.densify, dict):  # from a config.json
            self.densify = DensifyConfig(**self.densify)


def _field_help(cls: type) -> dict[str, str]:
    """Each field's trailing comment in the class's source, so flags and fields never drift apart."""
    helps: dict[str, str] = {}
    for line in inspect.getsource(cls).splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith("#"):
            helps[line.split(":", 1)[0].strip()] = line.split("#", 1)[1].strip()
    return helps


def _optional_type(hint: typing.Any) -> type | None:
    """int for `int | None`, float for `float | None`; None for anything else."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in typing.get_args(hint) else None


def _add_fields(parser: argparse.ArgumentParser, cls: type, group: str | None = None) -> None:
    helps = _field_help(cls)
    hints = typing.get_type_hints(cls)
    target = parser.add_argument_group(group) if group else parser
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            _add_fields(parser, type(default), (inspect.getdoc(type(default)) or "").splitlines()[0] or None)
            continue
        flag = "--" + f.name.replace("_", "-")
        h = helps.get(f.name, "")
        if isinstance(default, bool):
            target.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=h)
        elif isinstance(default, tuple):
            target.add_argument(flag, type=float, nargs=len(default), default=default, metavar=("R", "G", "B"), help=h)
        elif (optional := _optional_type(hints[f.name])) is not None:
            target.add_argument(flag, type=optional, default=None, help=h)
        elif f.name == "strategy":
            target.add_argument(flag, default=default, help=h)  # validated with the others: one error style
        else:
            target.add_argument(flag, type=type(default), default=default, help=h,
                                required=f.name in ("data", "store"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train",
        description="Train a 3DGS scene store out of core (one process, or one MPI rank per GPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_fields(parser, TrainConfig)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The flags as a TrainConfig; raises ConfigError for a value out of range."""
    values = vars(build_parser().parse_args(argv))
    names = {f.name for f in dataclasses.fields(DensifyConfig)}
    densify = DensifyConfig(**{k: values.pop(k) for k in list(values) if k in names})
    values["background"] = tuple(values["background"])
    return TrainConfig(**values, densify=densify)
