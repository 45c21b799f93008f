"""numba's on-disk cache of the CPU kernels is stamped with a digest of every file that defines a
kernel or a function one inlines: numba alone checks only the kernel's own file, and a kernel kept
the old copy of an inlined function after its file changed."""
from __future__ import annotations

from pathlib import Path

from train.render.cpu import compiled


def test_a_change_to_any_kernel_file_makes_the_cache_stale(tmp_path: Path) -> None:
    sources = (tmp_path / "kernels.py", tmp_path / "fastexp.py")
    sources[0].write_text("def forward(): return fast_exp(1.0)\n")
    sources[1].write_text("def fast_exp(x): return x\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    assert compiled.stale(cache, sources)  # never stamped
    (cache / compiled._STAMP).write_text(compiled.sources_digest(sources) + "\n")
    assert not compiled.stale(cache, sources)
    sources[1].write_text("def fast_exp(x): return 2 * x\n")  # only the inlined file changes
    assert compiled.stale(cache, sources)


def test_forgetting_removes_our_kernels_only(tmp_path: Path) -> None:
    ours = ["kernels.forward-200.py311.nbi", "kernels.forward-200.py311.1.nbc", "fastexp.fast_exp-12.py311.nbi",
            "optim._adam_rows_cpu-80.py311.nbi"]
    theirs = ["lod._merge-40.py311.nbi", "kernels.cpython-311.pyc"]
    for name in ours + theirs:
        (tmp_path / name).write_text("")
    compiled._forget(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(theirs)


def test_the_suite_runs_kernels_compiled_from_these_sources() -> None:
    """conftest's `ensure_compiled` stamped every cache folder with today's sources."""
    dirs = compiled._cache_dirs()
    assert {d.parent.name for d in dirs} >= {"cpu", "train"}
    assert compiled.cached()
    for d in dirs:
        assert (d / compiled._STAMP).read_text().strip() == compiled.sources_digest()
