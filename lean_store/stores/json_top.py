"""Some top-level members of a JSON object, without building the rest of the document.

A Zarr root ``zarr.json`` with consolidated metadata holds about 1.3 kB of JSON per array; to
tell whether a directory is a lean_store checkpoint only ``zarr_format``, ``node_type`` and
``attributes`` are needed. ``json.loads`` of the whole document built every array's metadata
as dicts (50,000 tensors: ~250 MiB and about a second, twice per save over such a checkpoint).
Here the members asked for are decoded by ``json``'s own decoder and the others are scanned by
it too, with every object they hold dropped as soon as it is parsed, so the same rules (and
errors) apply as for ``json.loads``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

_SPACE = re.compile(r"[ \t\n\r]*")  # what JSON allows between tokens
_KEEP = json.JSONDecoder()
_DROP = json.JSONDecoder(object_pairs_hook=lambda pairs: None)  # objects parsed, not kept


def _skip(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    match = _SPACE.match(text, i)
    return match.end() if match else i


def top_level_members(text: str, wanted: Collection[str]) -> dict[str, Any] | None:
    """The members named in ``wanted`` of the JSON object ``text`` (the last one where a name
    repeats, as ``json.loads`` keeps it); None when ``text`` is not one valid JSON object."""
    try:
        i = _skip(text, 0)
        if text[i:i + 1] != "{":
            return None
        i = _skip(text, i + 1)
        found: dict[str, Any] = {}
        if text[i:i + 1] == "}":
            i += 1
        else:
            while True:
                if text[i:i + 1] != '"':
                    return None
                key, i = _KEEP.raw_decode(text, i)  # a string: it starts with '"'
                i = _skip(text, i)
                if text[i:i + 1] != ":":
                    return None
                i = _skip(text, i + 1)
                if key in wanted:
                    found[key], i = _KEEP.raw_decode(text, i)
                else:
                    _, i = _DROP.raw_decode(text, i)
                i = _skip(text, i)
                sep = text[i:i + 1]
                i = _skip(text, i + 1)
                if sep == "}":
                    break
                if sep != ",":
                    return None
        return found if _skip(text, i) == len(text) else None
    except (ValueError, RecursionError):
        return None


def leading_members(text: str, names: Collection[str]) -> dict[str, Any] | None:
    """The members at the start of the JSON object ``text`` whose names are in ``names``, up
    to the first member of another name or the object's end: ``text`` may be the first part
    of a document only. None when those members are not all whole in ``text`` (it was cut
    short, or is not JSON), or the object does not start with one of ``names``."""
    try:
        i = _skip(text, 0)
        if text[i:i + 1] != "{":
            return None
        found: dict[str, Any] = {}
        while True:
            i = _skip(text, i + 1)
            if text[i:i + 1] != '"':
                return found or None if i < len(text) else None
            key, i = _KEEP.raw_decode(text, i)
            if key not in names:
                return found or None
            i = _skip(text, i)
            if text[i:i + 1] != ":":
                return None
            found[key], i = _KEEP.raw_decode(text, _skip(text, i + 1))
            i = _skip(text, i)  # a value at the very end may be cut short (a number)
            if text[i:i + 1] != ",":
                return found if text[i:i + 1] == "}" else None
    except (ValueError, RecursionError):
        return None


_LAST_MEMBER = re.compile(r',[ \t\n\r]*"([^"\\]{1,64})"[ \t\n\r]*:[ \t\n\r]*'
                          r'("[^"\\]{0,64}"|-?[0-9]{1,18}|true|false|null)[ \t\n\r]*\}[ \t\n\r]*\Z')


def last_member(tail: str) -> tuple[str, Any] | None:
    """(name, value) of the last member of the JSON object whose text ends with ``tail``,
    when that member is a plain string, number, boolean or null. In a valid document the
    member before the object's final ``}`` is one of its own: a member of a nested object
    would be followed by that object's ``}`` as well, and a quote inside a string is escaped."""
    match = _LAST_MEMBER.search(tail)
    if match is None:
        return None
    return match.group(1), json.loads(match.group(2))
