"""How tensor names become HDF5/Zarr node names, reversibly and safely.

Any non-empty name up to 1024 characters whose node name fits in 255 bytes can be stored.
Characters outside ``[A-Za-z0-9._-]`` are percent-escaped (UTF-8 bytes, ``%XX``), as is a
leading ``.`` or ``_``, so a node name never contains ``/``, never is ``.`` or ``..``, never
starts with the reserved prefixes of HDF5 (``.``) or Zarr (``__``), and the mapping is one to
one. A name whose node name would be ``zarr.json`` in any letter case (the Zarr group's own
metadata document, which sits next to the arrays' directories; on a case-insensitive file
system every case of it is that file) has its first character escaped too: ``zarr.json`` ->
``%7Aarr.json``. Checkpoints written before that rule may hold such a tensor under the
unescaped node name (:func:`legacy_node_name`), and readers accept it there. Names that
differ only in case are rejected because they collide on case-insensitive file systems. A node
name longer than 255 bytes is refused for every backend: a Zarr array is a directory of that
name, and file systems allow 255 bytes per path component; refusing it for HDF5 too keeps
every checkpoint convertible between the backends.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import unquote_to_bytes

from .errors import LayoutError, listing

MAX_NAME_LENGTH = 1024
MAX_NODE_BYTES = 255  # one path component on common file systems (ext4, XFS, APFS, NTFS)
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
# Node names a store keeps for its own files beside the tensors' nodes, lower case: a name
# whose escaped node name is one of these in any ASCII case has its first character escaped.
# (``.zattrs``, ``.zgroup``, ``.zarray``, ``.zmetadata`` of Zarr v2 and ``__``-prefixed names
# need no entry: a leading ``.`` or ``_`` is always escaped.)
RESERVED_NODE_NAMES = frozenset({"zarr.json"})


def node_name(name: str) -> str:
    """The store node name of a tensor name."""
    node = _escaped(name)
    if node.lower() in RESERVED_NODE_NAMES:  # all of [A-Za-z0-9._-]: its first is a letter
        return f"%{ord(node[0]):02X}{node[1:]}"
    return node


def tensor_name(node: str) -> str:
    """The tensor name a node name stands for (:func:`node_name` undone: every ``%XX`` escape
    decoded), for messages about a tensor that a store knows by its node; a node that is no
    escape of a name is returned as it is."""
    if "%" not in node:
        return node
    try:
        return unquote_to_bytes(node).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return node


def tensor_ref(node: str) -> str:
    """``tensor 'name'`` for the tensor stored at ``node``, as messages name it."""
    return f"tensor {tensor_name(node)!r}"


def legacy_node_name(name: str) -> str | None:
    """The node name writers gave ``name`` before :data:`RESERVED_NODE_NAMES` were escaped,
    when it differs from :func:`node_name`'s (a checkpoint written then keeps it there); else
    None. No current node name is ever equal to one of these."""
    node = _escaped(name)
    return node if node.lower() in RESERVED_NODE_NAMES else None


def _escaped(name: str) -> str:
    """``name`` with the characters outside ``[A-Za-z0-9._-]``, and a leading ``.`` or ``_``,
    percent-escaped."""
    if not isinstance(name, str) or not name:
        raise LayoutError(f"tensor names must be non-empty strings, got {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise LayoutError(f"tensor name of {len(name)} characters exceeds {MAX_NAME_LENGTH}")
    if name[0] not in "._" and _SAFE.issuperset(name):  # the common case: nothing to escape
        return name
    out = []
    for i, ch in enumerate(name):
        if ch in _SAFE and not (i == 0 and ch in "._"):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    return "".join(out)


def check_names(names: Iterable[str]) -> None:
    """Reject empty, over-long, duplicate and case-colliding names, all in one error."""
    seen: dict[str, str] = {}
    problems = []
    for name in names:
        try:
            node = node_name(name)
        except LayoutError as exc:
            problems.append(str(exc))
            continue
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            problems.append(
                f"tensor name {name!r} is not valid Unicode text (a lone surrogate, as "
                "os.fsdecode makes of a name that is not UTF-8): HDF5 and Zarr store names as "
                "UTF-8, so it is refused for every backend")
            continue
        if len(node.encode("ascii")) > MAX_NODE_BYTES:
            shown = repr(name) if len(name) <= 40 else repr(name[:40])[:-1] + "...'"
            problems.append(
                f"tensor name {shown} ({len(name)} characters) becomes a {len(node)}-byte node "
                f"name after escaping; file systems allow {MAX_NODE_BYTES} bytes per path "
                "component (a Zarr array is a directory of that name), so it is refused for "
                "every backend: shorten the name"
            )
            continue
        folded = name.casefold()
        if folded in seen:
            other = seen[folded]
            if other == name:
                problems.append(f"duplicate tensor names {other!r} and {name!r}")
            else:
                problems.append(
                    f"tensor names {other!r} and {name!r} differ only in letter case: on a "
                    "case-insensitive file system (macOS, Windows) they are one Zarr array "
                    "directory, so they are refused for every backend (every checkpoint "
                    "converts between them); save the state with one of them renamed")
        seen[folded] = name
    if problems:
        raise LayoutError("unsafe tensor names:\n" + listing(problems))
