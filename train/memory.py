"""A ceiling on a rank's resident memory (`--memory-mb`), kept by lowering its cache's budget.

The cache budget bounds what the trainer can count: blocks, loads in flight, a step's working
memory. What it cannot count rides on top: the interpreter and its libraries (~330 MiB), the
heap's fragmentation among step buffers (it grows over a long run), and the rasterizer's lists for
splats other ranks send. So a rank's peak resident memory is the budget plus an excess that only
the kernel can measure. The ceiling measures it: each phase (a step, a refinement, an evaluation)
starts by resetting the kernel's high-water mark (`/proc/self/clear_refs`) and ends by reading it
(`VmHWM`). The budget for what follows is the ceiling less the largest excess seen, less a margin;
a smaller budget pages more blocks in waves but changes no result (waves are exact).

Resetting the high-water mark also resets what `getrusage` reports as the peak, so the ceiling
keeps the process's true peak itself (`peak_bytes`).
"""
from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")
# Of the ceiling, kept free for an excess larger than any seen yet: at 44.5 M Gaussians it rose by
# up to 118 MiB from one step to the next, and 1/32 (79 MiB) let a rank peak 5.5 MiB over.
MARGIN = 1 / 16
FLOOR = 1 / 2  # of the configured budget: below this the ceiling gives up (and says so) rather than page everything


class MemoryCeilingError(RuntimeError):
    pass


def read_hwm() -> int:
    """The process's peak resident bytes since the last reset (`VmHWM`)."""
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise MemoryCeilingError(f"{_STATUS} has no VmHWM line")


def reset_hwm() -> None:
    _CLEAR_REFS.write_text("5")


def check_supported() -> int:
    """The process's peak resident bytes so far, read before this check resets the mark; raises
    MemoryCeilingError where the kernel gives no resettable high-water mark (not Linux, or /proc
    read-only)."""
    try:
        peak = read_hwm()
        reset_hwm()
        return peak
    except OSError as e:
        raise MemoryCeilingError(
            f"--memory-mb needs Linux's resettable peak RSS ({_CLEAR_REFS}, {_STATUS}): {e}") from e


class MemoryCeiling:
    """Holds a rank's peak RSS at `ceiling` bytes by setting its cache's budget (`set_budget`,
    called between phases) to at most `budget` (the configured one) and at least FLOOR of it.
    `peak`: the process's peak before the mark was last reset (`check_supported`'s), else
    getrusage's; `hwm`/`reset`: the kernel's high-water mark (injectable, for tests)."""

    def __init__(self, ceiling: int, budget: int, set_budget: Callable[[int], None], peak: int = 0,
                 hwm: Callable[[], int] = read_hwm, reset: Callable[[], None] = reset_hwm) -> None:
        if ceiling <= 0 or budget <= 0:
            raise ValueError(f"ceiling {ceiling} and budget {budget} must be positive")
        self.ceiling, self.configured = ceiling, budget
        self._set_budget, self._hwm, self._reset = set_budget, hwm, reset
        self.budget = budget  # in force now
        self.excess = 0  # the largest peak-over-budget seen (bytes)
        self.peak_bytes = max(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB
        self.floored = False  # the floor held the budget up: the ceiling could not be kept

    @contextlib.contextmanager
    def phase(self) -> Iterator[None]:
        """Measure the peak of what runs inside, and set the budget for what follows."""
        self.peak_bytes = max(self.peak_bytes, self._hwm())  # what ran since the last phase
        self._reset()
        try:
            yield
        finally:
            self.observe(self._hwm())

    def observe(self, peak: int) -> None:
        """A phase run under the budget in force peaked at `peak` resident bytes."""
        self.peak_bytes = max(self.peak_bytes, peak)
        self.excess = max(self.excess, peak - self.budget)
        want = self.ceiling - self.excess - int(MARGIN * self.ceiling)
        floor = int(FLOOR * self.configured)
        self.floored = want < floor
        budget = min(self.configured, max(floor, want))
        if budget != self.budget:
            self._set_budget(budget)
            self.budget = budget

    def current_peak(self) -> int:
        """The process's peak so far, the phase running now included."""
        return max(self.peak_bytes, self._hwm())
