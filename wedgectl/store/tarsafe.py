"""A tar stream (gzipped or not) read within bounds: inflated under a cap on its whole size, its headers
parsed one block at a time, an extended header (pax, GNU long name) capped, a member's size checked
before a byte of it is read, and a cap on the number of members. The bundle reader's archive half."""

from __future__ import annotations

import zlib
from collections.abc import Collection
from typing import BinaryIO

from wedgectl.model.errors import BadBundle

_BLOCK = 512
_CHUNK = 1 << 16


class _Inflated:
    """An archive's bytes, gunzipped on the fly when it is gzip, never more than limit bytes in all."""

    def __init__(self, fh: BinaryIO, origin: str, limit: int) -> None:
        self.fh, self.origin = fh, origin
        self.limit = limit
        self.total = 0
        self._buf = bytearray()
        self._pending = fh.read(_CHUNK)
        self._gzip = self._pending[:2] == b"\x1f\x8b"
        self._z = zlib.decompressobj(wbits=31) if self._gzip else None
        self._done = not self._pending

    def _more(self, want: int) -> None:
        """Inflate until the buffer holds want bytes or the input ends; max_length keeps each step small."""
        while len(self._buf) < want and not self._done:
            if not self._pending:
                self._pending = self.fh.read(_CHUNK)
                if not self._pending:
                    self._done = True
                    if self._z is not None and not self._z.eof:
                        out = self._z.flush()  # what zlib still holds; the stream itself ended early
                        if not self._z.eof:
                            raise BadBundle(f"{self.origin}: the archive is truncated")
                        self._count(out)
                    break
            if self._z is None:
                out, self._pending = self._pending, b""
            else:
                if self._z.eof:  # a second gzip member follows (`cat a.gz b.gz`)
                    self._z = zlib.decompressobj(wbits=31)
                try:
                    out = self._z.decompress(self._pending, _CHUNK)
                except zlib.error as exc:
                    raise BadBundle(f"{self.origin}: not a readable bundle archive ({exc})") from None
                self._pending = self._z.unconsumed_tail or self._z.unused_data
            self._count(out)

    def _count(self, out: bytes) -> None:
        self.total += len(out)
        if self.total > self.limit:
            raise BadBundle(f"{self.origin}: the archive expands past {self.limit} bytes; refused")
        self._buf += out

    def read(self, n: int) -> bytes:
        self._more(n)
        with memoryview(self._buf) as view:
            out = bytes(view[:n])  # one copy: a member may be hundreds of MB
        del self._buf[:n]
        return out

    def skip(self, n: int) -> None:
        while n > 0:
            got = len(self.read(min(n, _CHUNK)))
            if not got:
                raise BadBundle(f"{self.origin}: the archive is truncated")
            n -= got


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _pax_records(data: bytes, origin: str) -> dict[str, str]:
    """A pax extended header's 'LEN key=value\\n' records, in one linear pass."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        space = data.find(b" ", pos, pos + 24)
        length = int(data[pos:space]) if space > pos and data[pos:space].isdigit() else 0
        end = pos + length
        if length <= 0 or space < 0 or end > len(data) or data[end - 1:end] != b"\n":
            raise BadBundle(f"{origin}: a malformed pax header in the archive")
        key, _, value = data[space + 1:end - 1].partition(b"=")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        pos = end
    return out


def read_members(fh: BinaryIO, origin: str, names: Collection[str], *, max_member_bytes: int,
                 max_archive_bytes: int, max_header_bytes: int, max_members: int) -> dict[str, bytes]:
    """The regular files among `names` (by their last path part) from a tar stream, refused with
    BadBundle past any bound.

    tarfile is not used to walk the archive: in Python 3.11 it reads a pax header whole, whatever
    size it claims, and parses it with a regex that takes quadratic time. Headers are parsed one
    512-byte block at a time by tarfile.TarInfo.frombuf; the extended ones (pax, GNU long names)
    are capped at max_header_bytes and parsed here.
    """
    import tarfile  # here, not at the top: only a run that writes or reads a bundle pays for it

    stream = _Inflated(fh, origin, max_archive_bytes)
    files: dict[str, bytes] = {}
    override: dict[str, str] = {}
    for _ in range(4 * max_members):  # each member takes at most a pax and a GNU header
        block = stream.read(_BLOCK)
        if not block.strip(b"\0"):  # the end-of-archive blocks, or the end of the stream
            return files
        if len(block) < _BLOCK:
            raise BadBundle(f"{origin}: the archive is truncated")
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise BadBundle(f"{origin}: not a readable bundle archive ({exc})") from None
        size = info.size
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                         tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
            if size > max_header_bytes:
                raise BadBundle(f"{origin}: a tar header of {size} bytes (at most {max_header_bytes}); refused")
            data = stream.read(_padded(size))[:size]
            if info.type == tarfile.XHDTYPE:
                override.update(_pax_records(data, origin))
            elif info.type == tarfile.GNUTYPE_LONGNAME:
                override["path"] = data.rstrip(b"\0").decode("utf-8", "replace")
            continue
        name = override.get("path", info.name)
        if "size" in override:
            size = int(override["size"]) if override["size"].isdigit() else -1
        override = {}
        if size < 0 or size > max_member_bytes:
            raise BadBundle(f"{origin}: {name[:200]} is {size} bytes (at most {max_member_bytes}); refused")
        wanted = name.rsplit("/", 1)[-1] in names and info.type in tarfile.REGULAR_TYPES
        if wanted:
            data = stream.read(size)
            if len(data) < size:
                raise BadBundle(f"{origin}: the archive is truncated")
            files[name.rsplit("/", 1)[-1]] = data
            stream.skip(_padded(size) - size)
        else:
            stream.skip(_padded(size))
    raise BadBundle(f"{origin}: more than {max_members} members; not a bundle")
