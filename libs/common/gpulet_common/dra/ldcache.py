"""The dynamic linker's cache (``/etc/ld.so.cache``), read as the NVIDIA Container
Toolkit reads it to find the driver's libraries.

Format (glibc ``sysdeps/generic/dl-cache.h``, the "new" format every glibc since 2.32
writes, possibly behind an old-format ``ld.so-1.7.0`` table): a 48-byte header
``glibc-ld.so.cache`` ``1.1``, ``nlibs``, ``len_strings``, flags, an extension offset;
then ``nlibs`` entries of 24 bytes (``int32 flags; uint32 key, value; uint32 osversion;
uint64 hwcap``), whose ``key`` (the soname) and ``value`` (the path) are offsets of
NUL-terminated strings from the start of that header.

:func:`parse` is total: whatever the bytes (the file comes from a host or a driver
container, never trusted), it returns the entries it could read, or raises
:class:`LdCacheError` when the header is not there; an entry whose strings run off the
end is skipped. :func:`write` renders a cache (the mock driver root's; tests compare
:func:`parse` with ``ldconfig -p`` on the real one).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

MAGIC: Final = b"glibc-ld.so.cache1.1"
OLD_MAGIC: Final = b"ld.so-1.7.0"
HEADER: Final = struct.Struct("<20sIIB3xI12x")
ENTRY: Final = struct.Struct("<iIIIQ")
MAX_ENTRIES: Final = 1 << 16
MAX_STRING: Final = 4096
# flags: the type (FLAG_ELF_LIBC6) and the architecture of a 64-bit library.
FLAG_ELF_LIBC6: Final = 0x0003
FLAG_X8664_LIB64: Final = 0x0300
FLAG_AARCH64_LIB64: Final = 0x0A00
LIB64: Final = (FLAG_X8664_LIB64, FLAG_AARCH64_LIB64)


class LdCacheError(ValueError):
    """Not an ld.so.cache this reader knows."""


@dataclass(frozen=True)
class Entry:
    soname: str
    path: str
    flags: int

    @property
    def lib64(self) -> bool:
        return self.flags & 0xFF == FLAG_ELF_LIBC6 and self.flags & 0xFF00 in LIB64


def _string(data: bytes, start: int, offset: int) -> str | None:
    at = start + offset
    if offset <= 0 or at >= len(data):
        return None
    end = data.find(b"\0", at, at + MAX_STRING)
    if end < 0:
        return None
    try:
        return data[at:end].decode()
    except UnicodeDecodeError:
        return None


def parse(data: bytes) -> list[Entry]:
    """The cache's entries, in its order (the linker's preference); LdCacheError when
    ``data`` holds no new-format header."""
    start = data.find(MAGIC)
    if start < 0 or (start > 0 and not data.startswith(OLD_MAGIC)):
        raise LdCacheError("no glibc-ld.so.cache1.1 header")
    if len(data) < start + HEADER.size:
        raise LdCacheError("truncated header")
    _, nlibs, _, _, _ = HEADER.unpack_from(data, start)
    room = (len(data) - start - HEADER.size) // ENTRY.size
    out: list[Entry] = []
    for i in range(min(nlibs, room, MAX_ENTRIES)):
        flags, key, value, _, _ = ENTRY.unpack_from(data, start + HEADER.size + i * ENTRY.size)
        soname, path = _string(data, start, key), _string(data, start, value)
        if soname and path:
            out.append(Entry(soname, path, flags))
    return out


def write(entries: list[tuple[str, str]], flags: int = FLAG_ELF_LIBC6 | FLAG_X8664_LIB64) -> bytes:
    """A new-format cache of (soname, path) pairs."""
    strings = bytearray()
    offsets: list[tuple[int, int]] = []
    base = HEADER.size + ENTRY.size * len(entries)
    for soname, path in entries:
        key = base + len(strings)
        strings += soname.encode() + b"\0"
        value = base + len(strings)
        strings += path.encode() + b"\0"
        offsets.append((key, value))
    out = bytearray(HEADER.pack(MAGIC, len(entries), len(strings), 2, 0))
    for key, value in offsets:
        out += ENTRY.pack(flags, key, value, 0, 0)
    return bytes(out + strings)
