"""scipy-openblas32 without the `scipy_` prefix: a patched copy of its library that MLX can use
in place of the reference BLAS (`blas` loads it when neither OpenBLAS nor BLIS is installed).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from salabatch import files


class BlasLoadError(Exception):
    """One candidate library could not be used; the message says why."""


PATCH_VERSION = 1
_PREFIX = b"scipy_"
SHT_DYNSYM, SHT_HASH, SHT_GNU_HASH = 11, 5, 0x6FFFFFF6
DT_NULL, DT_HASH, DT_SONAME, DT_GNU_HASH = 0, 4, 14, 0x6FFFFEF5


def patch_scipy_openblas(src: Path, cache_dir: Path | None = None) -> Path:
    """A copy of scipy-openblas32's library whose symbols read without the `scipy_` prefix.

    scipy-openblas32 exports `scipy_cblas_sgemm` etc., so it cannot stand in for `cblas_sgemm`
    as shipped. No compiler is needed: each prefixed dynamic symbol's name offset is advanced by 6
    (the string table is untouched), and since the GNU hash table orders symbols by their old
    names' hashes, it is replaced by a SysV hash table written in its place. SysV chains are
    indexed by symbol index, so no symbol moves. The copy is cached, keyed by the source's path,
    size and mtime.
    """
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}:{PATCH_VERSION}".encode())
    if cache_dir is None:
        cache_dir = files.cache_dir() / "blas"
    out = cache_dir / f"libopenblas-scipy-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    data = bytearray(src.read_bytes())
    _strip_prefix(data)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        tmp.write_bytes(data)
        tmp.chmod(0o755)

    files.write_atomic(out, write)  # a concurrent process sees no file or the whole file
    return out


def _strip_prefix(elf: bytearray) -> None:
    """Edit an ELF64 little-endian shared library in place (see `patch_scipy_openblas`)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise BlasLoadError("not an ELF64 little-endian library")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    by_type = {s[1]: (i, s) for i, s in enumerate(sections)}
    if SHT_DYNSYM not in by_type or SHT_GNU_HASH not in by_type or SHT_HASH in by_type:
        raise BlasLoadError("expected .dynsym and .gnu.hash and no .hash")
    _, dynsym = by_type[SHT_DYNSYM]
    dynstr = sections[dynsym[6]]
    gnu_index, gnu = by_type[SHT_GNU_HASH]

    def name_at(offset: int) -> bytes:
        start = dynstr[4] + offset
        return bytes(elf[start : elf.index(b"\0", start)])

    # Elf64_Sym: name(I) info(B) other(B) shndx(H) value(Q) size(Q); rename defined symbols only
    nsyms = dynsym[5] // 24
    names = []
    for i in range(nsyms):
        at = dynsym[4] + i * 24
        st_name, _, _, shndx = struct.unpack_from("<IBBH", elf, at)
        name = name_at(st_name)
        if shndx != 0 and name.startswith(_PREFIX):
            struct.pack_into("<I", elf, at, st_name + len(_PREFIX))
            name = name[len(_PREFIX) :]
        names.append(name)

    # SysV hash: nbucket, nchain, bucket[nbucket], chain[nchain] as 32-bit words
    nbucket = min(nsyms, (gnu[5] // 4) - 2 - nsyms)
    if nbucket < 1:
        raise BlasLoadError(f".gnu.hash ({gnu[5]} bytes) is too small for a SysV table")
    bucket, chain = [0] * nbucket, [0] * nsyms
    for i in range(nsyms - 1, 0, -1):  # walked from the top so each chain runs in index order
        h = _elf_hash(names[i]) % nbucket
        chain[i], bucket[h] = bucket[h], i
    table = struct.pack(f"<II{nbucket}I{nsyms}I", nbucket, nsyms, *bucket, *chain)
    elf[gnu[4] : gnu[4] + gnu[5]] = table.ljust(gnu[5], b"\0")
    # its section header (name kept): type SHT_HASH, entry size 4
    struct.pack_into("<I", elf, shoff + gnu_index * shentsize + 4, SHT_HASH)
    struct.pack_into("<Q", elf, shoff + gnu_index * shentsize + 56, 4)

    # .dynamic: DT_GNU_HASH becomes DT_HASH (same address). The soname loses its "lib" so that a
    # program loading the genuine libscipy_openblas.so by soname is not handed this copy.
    _, dynamic = next((i, s) for i, s in enumerate(sections) if s[1] == 6)  # SHT_DYNAMIC
    swapped = False
    for at in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, value = struct.unpack_from("<qQ", elf, at)
        if tag == DT_NULL:
            break
        if tag == DT_GNU_HASH:
            struct.pack_into("<qQ", elf, at, DT_HASH, value)
            swapped = True
        elif tag == DT_SONAME and name_at(value).startswith(b"lib"):
            struct.pack_into("<qQ", elf, at, DT_SONAME, value + 3)
    if not swapped:
        raise BlasLoadError("no DT_GNU_HASH entry in .dynamic")


def _elf_hash(name: bytes) -> int:
    """The SysV ELF hash (System V ABI, "Hash Table")."""
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h
