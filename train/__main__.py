"""`python -m train --data DATA --store STORE [options]`; under `mpirun -n R`, one rank per process."""
from __future__ import annotations

import json
import os
import sys

from train.pools import configure_pools

configure_pools()  # before numba and torch load

from train.config import ConfigError, parse_config
from train.heap import retain_freed_memory
from train.render.cpu.compiled import ensure_compiled
from train.trainer import EXPECTED_ERRORS, SetupError, resolve_device, run
_INTERRUPTED = 130  # 128 + SIGINT, as shells report a job stopped by Ctrl-C


def launched_ranks() -> int:
    """Ranks of the MPI job that started us (1 outside mpirun), read before MPI is initialised."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        ensure_compiled()  # every process then runs the cached kernels: same results in all of them
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    retain_freed_memory()
    if launched_ranks() > 1:
        return _main_mpi(cfg)
    try:
        summary = run(cfg)
    except EXPECTED_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the store keeps its last commit", file=sys.stderr)
        return _INTERRUPTED
    print(json.dumps(summary, indent=2))
    return _exit_code(summary)


def _exit_code(summary: dict, report: bool = True) -> int:
    """130 after a Ctrl-C that stopped the run early, even though it committed cleanly: a chain
    such as `train && export` must not take a run cut short for a finished one."""
    if summary["stopped_by_signal"]:
        if report:
            print(f"interrupted: stopped at step {summary['steps']} after a clean commit (--resume continues)",
                  file=sys.stderr)
        return _INTERRUPTED
    return 0


def _main_mpi(cfg) -> int:
    import numba
    import torch
    from mpi4py import MPI

    from train.mpi import MPIExchange

    # R ranks share the machine's cores: one thread each, or they fight over every core.
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    comm = MPI.COMM_WORLD
    try:
        summary = run(cfg, MPIExchange(comm, resolve_device(cfg.device)))
    except SetupError as e:  # every rank raised it: each exits, and no output is cut off
        if comm.Get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except BaseException as e:  # noqa: BLE001 - any failure must take every rank down, never hang
        what = f"error: {e}" if isinstance(e, EXPECTED_ERRORS) else f"error: {type(e).__name__}: {e}"
        print(f"rank {comm.Get_rank()}: {what}", file=sys.stderr, flush=True)
        if not isinstance(e, (*EXPECTED_ERRORS, KeyboardInterrupt)):
            import traceback

            traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        comm.Abort(_INTERRUPTED if isinstance(e, KeyboardInterrupt) else 1)
        return 1
    if comm.Get_rank() == 0:
        print(json.dumps(summary, indent=2))
    return _exit_code(summary, report=comm.Get_rank() == 0)


if __name__ == "__main__":
    sys.exit(main())
