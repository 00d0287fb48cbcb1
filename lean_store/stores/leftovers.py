"""The temporaries of local saves, named so that a later save can tell which are dead.

A save writes into a hidden sibling ``.NAME.lean_store-tmp-<32 hex>`` and renames it over
``NAME`` (:mod:`.commit`). A process killed meanwhile (SIGKILL, the OOM killer, a scheduler's
SIGTERM) leaves that sibling behind, as big as the checkpoint. The 32 hex digits are the
writer's owner tag (8: a CRC-32 of the host name and of the process's PID namespace), its
process ID (8) and 16 random ones. Once a save to ``NAME`` is committed,
:func:`.commit.clear_dead_temporaries` removes the siblings of ``NAME`` that this host and
PID namespace wrote and whose writer no longer runs (or, for this process's own, that no
save of it still writes): by then ``NAME`` holds a newer checkpoint than any of them.

What it never removes: temporaries of other hosts or PID namespaces (containers) and of
lean_store versions before this naming (random names), whose writers cannot be judged from
here; a writer whose PID was reused by another process (kept until that one exits); the
``.NAME.lean_store-old-*`` copy of a rename-aside that a crash interrupted (the previous
checkpoint, to be renamed back by hand).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import zlib
from functools import cache
from pathlib import Path

from ..fork_safe import ForkSafeLock
from .commit_order import key_of

_ACTIVE: set[str] = set()  # this process's temporaries that a save still writes (key_of:
# one entry whatever the spelling of the path, relative, absolute or through a link)
_LOCK = ForkSafeLock()
_HEX = re.compile(r"[0-9a-f]{32}")


@cache
def owner_tag() -> str:
    """8 hex digits naming this host and PID namespace."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    where = socket.gethostname() + "\0" + namespace
    return f"{zlib.crc32(where.encode()):08x}"


NAME_MAX = 255
"""Bytes of one path component on common file systems (ext4, XFS, tmpfs, APFS, NTFS)."""
_SIBLING_EXTRA = len(".") + len(".lean_store-tmp-") + 32  # also "-old-" + 32 hex (commit.py)


def sibling_stem(target: Path) -> str:
    """The part of ``target``'s name that its hidden siblings (``.STEM.lean_store-tmp-<hex>``,
    ``.STEM.lean_store-old-<hex>``) carry: the name itself, or where a sibling's name would
    pass :data:`NAME_MAX` bytes (a name of more than 206 bytes, which a file may have), its
    first bytes and ``~`` and 8 hex digits of its CRC-32: the same for every save of
    ``target``, so a later save still finds a dead one's temporary."""
    raw = os.fsencode(target.name)
    if len(raw) + _SIBLING_EXTRA <= NAME_MAX:
        return target.name
    head = raw[:NAME_MAX - _SIBLING_EXTRA - 9]
    while head and head[-1] & 0xC0 == 0x80:  # not into the middle of a UTF-8 character
        head = head[:-1]
    if head and head[-1] >= 0xC0:
        head = head[:-1]
    return f"{os.fsdecode(head)}~{zlib.crc32(raw):08x}"


def _prefix(target: Path) -> str:
    return f".{sibling_stem(target)}.lean_store-tmp-"


def new_temporary(target: Path) -> Path:
    """A fresh temporary sibling of ``target`` owned by this process, counted as written
    until :func:`finished`."""
    path = target.with_name(f"{_prefix(target)}{owner_tag()}{os.getpid():08x}"
                            f"{secrets.token_hex(8)}")
    with _LOCK:
        _ACTIVE.add(key_of(path))
    return path


def finished(path: Path) -> None:
    """The save writing ``path`` committed or gave it up."""
    with _LOCK:
        _ACTIVE.discard(key_of(path))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # another user's (EPERM), or anything unclear: treated as running
        return True
    return True


def writer_gone(path: Path) -> bool | None:
    """Whether the save that named the temporary ``path`` (``...lean_store-tmp-<32 hex>``) is
    known not to write it any more: True for one of this host and PID namespace whose process
    no longer runs, or one of this process that no save of it still writes; False while it
    may; None where it cannot be judged from here (another host or container, an older
    naming)."""
    if os.name != "posix":  # os.kill(pid, 0) would signal the process elsewhere
        return None
    _, sep, suffix = path.name.rpartition(".lean_store-tmp-")
    if not sep or not _HEX.fullmatch(suffix) or suffix[:8] != owner_tag():
        return None
    pid = int(suffix[8:16], 16)
    if pid == os.getpid():
        with _LOCK:
            return key_of(path) not in _ACTIVE  # else another thread's save, still writing
    return pid > 0 and not _alive(pid)


def dead_temporaries(target: Path) -> list[Path]:
    """The temporaries beside ``target`` whose writer is known not to write them any more."""
    prefix = _prefix(target)
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    return [target.with_name(name) for name in names
            if name.startswith(prefix) and writer_gone(target.with_name(name)) is True]


__all__ = ["dead_temporaries", "finished", "new_temporary", "owner_tag", "sibling_stem",
           "writer_gone"]
