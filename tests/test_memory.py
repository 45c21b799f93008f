"""A block read is its own mapping: memory freed between long-lived blocks leaves the process,
where from the C heap it stays resident (the reference: the same pattern with np.empty). And the
other way round, `train.heap.retain_freed_memory`: a step's buffers, freed and allocated again,
reuse resident memory instead of faulting in fresh pages (counted by the kernel, not timed)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from storage.blockio import MAPPED_BYTES, mapped_empty

REPO = Path(__file__).resolve().parents[1]

# Long-lived 1 MiB arrays (cached blocks) interleaved with short-lived ones (evicted blocks, a
# step's buffers), then the short ones freed: 1 MiB holes between live memory. Prints the RSS
# growth in MiB while both are held and after the short ones are freed.
_PATTERN = """
import json, sys
import numpy as np
from storage.blockio import mapped_empty
empty = mapped_empty if sys.argv[1] == "mapped" else np.empty
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
def filled():
    a = empty((2**18,), np.float32)
    a[:] = 1
    return a
warm = filled(); del warm  # glibc raises its mmap threshold past 1 MiB on the first free
start = rss()
kept, short = [], []
for i in range(200):
    kept.append(filled())
    short.append(filled())
held = rss() - start
del short
print(json.dumps({"held": held, "after_free": rss() - start}))
"""


def _json_of(script: str, arg: str):
    """What `script`, run in a fresh process with `arg`, prints as JSON."""
    proc = subprocess.run([sys.executable, "-c", script, arg], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _pattern(allocator: str) -> dict:
    return _json_of(_PATTERN, allocator)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_freed_block_memory_leaves_the_process_where_the_heap_keeps_it():
    heap, mapped = _pattern("heap"), _pattern("mapped")
    for run in (heap, mapped):
        assert run["held"] >= 390, run  # 400 MiB held either way
    assert heap["after_free"] >= 390, heap  # the holes between kept arrays stay resident
    assert mapped["after_free"] <= 210, mapped  # only the 200 MiB still alive


def test_mapped_arrays_are_writable_and_small_ones_come_from_the_heap():
    a = mapped_empty((4, MAPPED_BYTES // 16), np.float32)
    a[:] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    assert a.flags.writeable and a.shape == (4, MAPPED_BYTES // 16) and float(a[3, -1]) == a.size - 1
    assert a.base is not None  # the mapping
    small = mapped_empty((3, 5), np.float64)
    assert small.shape == (3, 5) and small.flags.owndata
    assert mapped_empty((0, 7), np.float32).shape == (0, 7)


# Three 1.6 MB arrays written and freed, as a step's buffers are, five times; prints the minor
# page faults of each round after the first.
_ROUNDS = """
import json, resource, sys
import numpy as np
from train.heap import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for r in range(5):
    before = faults()
    arrays = [np.empty((3, 280, 490), np.float32) for _ in range(3)]
    for a in arrays:
        a[:] = 1.0
    del arrays, a
    counts.append(faults() - before)
print(json.dumps(counts[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_step_arrays_are_reused_without_page_faults():
    pages = 3 * 3 * 280 * 490 * 4 // 4096  # ~1,200 pages a round
    default, retained = _json_of(_ROUNDS, "default"), _json_of(_ROUNDS, "retain")
    assert min(default) > pages // 2, default  # the reference: glibc gives the memory back and faults it in again
    assert max(retained) < 50, retained  # kept: the next round writes resident pages


# A 40 MB array (past glibc's largest mmap threshold, below the trim threshold) written and
# freed, five times, each round inside `step_memory_from_heap` or not; prints the minor page
# faults of each round after the first, and whether the heap held.
_LARGE_ROUNDS = """
import json, resource, sys
import numpy as np
from contextlib import nullcontext
from train.heap import retain_freed_memory, step_memory_from_heap
assert retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts, held = [], []
for r in range(5):
    with (step_memory_from_heap() if sys.argv[1] == "heap" else nullcontext(False)) as h:
        before = faults()
        a = np.empty(10_000_000, np.float32)
        a[:] = 1.0
        del a
        counts.append(faults() - before)
    held.append(h)
print(json.dumps([counts[1:], held]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_steps_largest_arrays_come_from_the_heap_and_are_reused():
    """Above 32 MiB glibc maps every array afresh whatever its threshold: each round faults it in
    again (the reference; numpy asks for huge pages, so a fault may bring in 2 MiB). Inside
    `step_memory_from_heap` it comes from the heap, and the next round writes resident pages."""
    (mapped, _), (heap, held) = _json_of(_LARGE_ROUNDS, "default"), _json_of(_LARGE_ROUNDS, "heap")
    assert min(mapped) >= 20, mapped  # at least 40 MB / 2 MiB
    assert all(held)
    assert max(heap) < 50, heap
