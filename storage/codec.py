"""How block arrays are compressed and chunked: one small config, stored in the root attributes."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numcodecs import Blosc
from zarr.abc.codec import BytesBytesCodec
from zarr.codecs import BloscCodec, Crc32cCodec

from storage.errors import StoreFormatError

BLOSC_CNAMES = ("lz4", "lz4hc", "zstd", "blosclz", "zlib")
SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")  # in Blosc's numbering
# Enough bytes to judge an array's compressibility; compressing the sample is paid on every write-back.
SAMPLE_BYTES = 1 << 16
_SAMPLE_RUN = 1024  # elements per sampled run: local structure (runs of zeros) stays visible


@dataclass(frozen=True)
class CodecConfig:
    """Compression of block arrays, chosen per array. The defaults come from `python -m tools.bench
    store` (docs/benchmarks.md): trained Gaussians are noise to a compressor (lz4 + shuffle keeps
    93% of their bytes) and decompressing them costs more time than the smaller reads save, while
    young blocks (zero Adam state and SH bands) shrink twenty-fold. So each array is compressed
    only if a sample of it shrinks by `min_saving`, and stored raw otherwise."""

    cname: str = "lz4"  # Blosc compressor (one of BLOSC_CNAMES), or "none" for raw little-endian bytes
    clevel: int = 5  # Blosc level, 0-9 (ignored for "none")
    shuffle: str = "shuffle"  # byte shuffle groups the exponent bytes of float32s, which compress well
    checksum: bool = True  # crc32c per chunk, so a truncated or flipped chunk fails instead of decoding garbage
    chunk_mb: float = 256.0  # largest chunk; most arrays of a block then are one chunk, read in one request
    min_saving: float = 0.5  # compress an array only if a sample shrinks by this fraction; 0: always

    def __post_init__(self) -> None:
        if self.cname != "none" and self.cname not in BLOSC_CNAMES:
            raise ValueError(f"unknown codec {self.cname!r}; expected 'none' or one of {BLOSC_CNAMES}")
        if not 0 <= self.clevel <= 9:
            raise ValueError(f"codec level {self.clevel} outside [0, 9]")
        if self.shuffle not in SHUFFLES:
            raise ValueError(f"unknown shuffle {self.shuffle!r}; expected one of {SHUFFLES}")
        # Blosc refuses buffers over 2 GiB, so a chunk must stay below that.
        if not 0 < self.chunk_mb <= 1024:
            raise ValueError(f"chunk_mb {self.chunk_mb} outside (0, 1024]")
        if not 0 <= self.min_saving < 1:
            raise ValueError(f"min_saving {self.min_saving} outside [0, 1)")

    def compressors(self, a: np.ndarray) -> list[BytesBytesCodec]:
        """The bytes-to-bytes codecs for array a after zarr's `bytes` serializer, as zarr codec
        objects (see `codec_docs` for the same chain as metadata)."""
        codecs: list[BytesBytesCodec] = []
        if self.compresses(a):
            codecs.append(BloscCodec(cname=self.cname, clevel=self.clevel, shuffle=self.shuffle))
        if self.checksum:
            codecs.append(Crc32cCodec())
        return codecs

    def compresses(self, a: np.ndarray) -> bool:
        """Whether array a is stored Blosc-compressed: only if it pays (see `min_saving`)."""
        return self.cname != "none" and self._saving(a) >= self.min_saving

    def codec_docs(self, a: np.ndarray, compress: bool) -> list[dict[str, Any]]:
        """The zarr v3 `codecs` metadata of array a: little-endian bytes, Blosc if `compress`,
        then crc32c, last, so it covers exactly the bytes that are stored."""
        docs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if compress:
            docs.append({"name": "blosc", "configuration": {"typesize": a.dtype.itemsize, "cname": self.cname,
                                                             "clevel": self.clevel, "shuffle": self.shuffle,
                                                             "blocksize": 0}})
        if self.checksum:
            docs.append({"name": "crc32c"})
        return docs

    def blosc(self) -> Blosc:
        return Blosc(cname=self.cname, clevel=self.clevel, shuffle=SHUFFLES.index(self.shuffle), blocksize=0)

    def _saving(self, a: np.ndarray) -> float:
        """The fraction of bytes Blosc saves on about SAMPLE_BYTES of a: runs of _SAMPLE_RUN
        consecutive elements spread evenly over all of it (a block's packs put each logical array
        in its own rows, so whole rows would sample only some of them)."""
        if self.min_saving == 0 or a.size == 0:
            return 1.0
        flat = a.reshape(-1)
        runs = max(1, SAMPLE_BYTES // (_SAMPLE_RUN * a.itemsize))
        if flat.size > runs * _SAMPLE_RUN:
            starts = np.linspace(0, flat.size - _SAMPLE_RUN, runs).astype(np.int64)
            flat = np.concatenate([flat[s : s + _SAMPLE_RUN] for s in starts])
        sample = np.ascontiguousarray(flat)
        packed = self.blosc().encode(sample)
        return 1.0 - len(packed) / sample.nbytes

    def chunk_rows(self, row_bytes: int) -> int:
        """Rows per chunk for an array whose rows take row_bytes each."""
        return max(1, int(self.chunk_mb * 2**20) // max(1, row_bytes))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any, where: str = "") -> "CodecConfig":
        """Parse a stored codec config; where names the store for the error message."""
        try:
            return cls(**doc)
        except (TypeError, ValueError) as e:
            raise StoreFormatError(f"{where}: bad codec attribute {doc!r}: {e}") from e
