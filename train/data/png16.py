"""16-bit PNG, which Pillow reads only as 8-bit RGB: a small decoder and encoder of our own.

Non-interlaced images of colour type grey (0), RGB (2), grey+alpha (4) or RGBA (6) at bit depth 16.
The scanline filters are undone by a compiled loop (Paeth and Average depend on the previous pixel).
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numba
import numpy as np

from train.data.errors import ImageError

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}


def png_bit_depth(header: bytes) -> int | None:
    """The bit depth in a PNG's first 26 bytes, or None if they are not a PNG header."""
    if len(header) < 26 or not header.startswith(_SIGNATURE) or header[12:16] != b"IHDR":
        return None
    return header[24]


@numba.njit(cache=True)
def _unfilter(raw: np.ndarray, height: int, stride: int, bpp: int) -> np.ndarray:  # [H * (1 + stride)] -> [H, stride]
    out = np.zeros((height, stride), np.uint8)
    for y in range(height):
        ftype = raw[y * (stride + 1)]
        row = raw[y * (stride + 1) + 1: (y + 1) * (stride + 1)]
        for i in range(stride):
            a = np.int32(out[y, i - bpp]) if i >= bpp else 0
            b = np.int32(out[y - 1, i]) if y > 0 else 0
            c = np.int32(out[y - 1, i - bpp]) if (y > 0 and i >= bpp) else 0
            if ftype == 0:
                pred = 0
            elif ftype == 1:
                pred = a
            elif ftype == 2:
                pred = b
            elif ftype == 3:
                pred = (a + b) // 2
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if (pa <= pb and pa <= pc) else (b if pb <= pc else c)
            else:
                return out[:0]  # the caller reports the bad filter type
            out[y, i] = (np.int32(row[i]) + pred) & 0xFF
    return out


def read_png16(path: Path, data: bytes) -> np.ndarray:  # -> [H, W, C] uint16
    """Decode the 16-bit PNG `data` read from `path` (named in errors)."""
    pos, chunks, header = 8, [], None
    try:
        while pos < len(data):
            (length,), kind = struct.unpack_from(">I", data, pos), data[pos + 4: pos + 8]
            body = data[pos + 8: pos + 8 + length]
            if len(body) != length:
                raise ImageError(path, f"truncated PNG: chunk {kind!r} at byte {pos}")
            if kind == b"IHDR":
                header = struct.unpack(">IIBBBBB", body)
            elif kind == b"IDAT":
                chunks.append(body)
            elif kind == b"IEND":
                break
            pos += 12 + length
        else:
            raise ImageError(path, "truncated PNG: no IEND chunk")
        if header is None:
            raise ImageError(path, "PNG without IHDR chunk")
        width, height, depth, ctype, _, _, interlace = header
        if depth != 16 or ctype not in _CHANNELS or interlace:
            raise ImageError(path, f"unsupported 16-bit PNG (depth {depth}, colour type {ctype}, interlace {interlace})")
        raw = np.frombuffer(zlib.decompress(b"".join(chunks)), np.uint8)
    except (struct.error, zlib.error) as e:
        raise ImageError(path, f"corrupt PNG: {e}") from None
    channels = _CHANNELS[ctype]
    stride = width * channels * 2
    if len(raw) != height * (stride + 1):
        raise ImageError(path, f"corrupt PNG: {len(raw)} bytes of pixels for {width}x{height}x{channels}")
    out = _unfilter(raw, height, stride, channels * 2)
    if len(out) != height:
        raise ImageError(path, "corrupt PNG: unknown scanline filter")
    return out.view(">u2").reshape(height, width, channels).astype(np.uint16)


def encode_png16(image: np.ndarray) -> bytes:  # [H, W, C] uint16, C in 1..4 -> PNG bytes
    height, width, channels = image.shape
    ctype = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    rows = image.astype(">u2").reshape(height, -1).view(np.uint8)
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1)  # filter type 0 on every row

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 16, ctype, 0, 0, 0)
    return _SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + chunk(b"IEND", b"")
