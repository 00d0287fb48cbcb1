"""A root ``zarr.json`` parsed with the text of each consolidated member kept.

lean_store writes each array's ``zarr.json`` and places the same text, re-indented at its depth,
in the root's consolidated metadata (``compat.EncodedDocument``); zarr's
``consolidate_metadata`` does the same with its indented ``json.dumps``. An array's own
document then equals its copy in the root when its text, re-indented as the member is, equals
the member's text in the root: a comparison of strings instead of a parse of the document
(about three quarters of the cost of checking an array's own document on load). Any other
text (another indent, key order, spacing, a changed byte) is parsed and compared as values,
as before (:meth:`RootText.same_text` only says when the parse can be skipped).

The root is parsed with the standard library's own scanner (``JSONDecoder.raw_decode`` for
every key and value); only the three enclosing objects (the
root, ``consolidated_metadata`` and its ``metadata``) are walked here, to know where each
member's text starts and ends. The result equals ``json.loads`` of the same text; text this
walk does not take (not UTF-8, a byte order mark, malformed) is left to ``json.loads``.
"""

from __future__ import annotations

import json
import re
from typing import Any

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as json.decoder skips it


def _skip(text: str, at: int) -> int:
    """Where the whitespace starting at ``text[at]`` ends."""
    found = _WS.match(text, at)
    return at if found is None else found.end()


class _NotTaken(Exception):
    """Text the walk leaves to ``json.loads`` (which parses it or reports the error)."""


class RootText:
    """A parsed root document and, for its consolidated members, where each member's text
    lies in the root's text."""

    def __init__(self, doc: Any, text: str | None, spans: dict[str, tuple[int, int]] | None):
        self.doc = doc
        self._text = text
        self._spans = spans

    def same_text(self, node: str, own: bytes) -> bool:
        """True when ``own`` (the bytes of ``node``'s own ``zarr.json``) is the text of
        ``node``'s member in the root's consolidated metadata, re-indented as it is there: then
        it parses to the same value (the inserted indent is whitespace after each newline,
        and JSON text has newlines only between tokens). False means: parse and compare."""
        span = None if self._spans is None else self._spans.get(node)
        if span is None or self._text is None:
            return False
        start, end = span
        member = self._text[start:end]
        try:
            text = own.decode("utf-8")
        except UnicodeDecodeError:
            return False
        cut = member.rfind("\n")
        if cut < 0:
            return text == member
        indent = member[cut + 1:-1]  # before the member's closing brace: its depth
        if indent.strip(" "):
            return False
        return len(text) <= len(member) and text.replace("\n", "\n" + indent) == member


def parse_root(raw: bytes) -> RootText:
    """``raw`` (a root ``zarr.json`` whose size and nesting are already bounded) parsed as
    ``json.loads`` parses it, with its consolidated members' spans where the walk takes it.
    Malformed text: ``ValueError`` (from ``json.loads``)."""
    try:
        text = raw.decode("utf-8")
        if text.startswith("\ufeff"):
            raise _NotTaken
        doc, spans, end = _object(text, _skip(text, 0), ("consolidated_metadata",
                                                                  "metadata"))
        if _skip(text, end) != len(text):
            raise _NotTaken
    except (_NotTaken, ValueError):
        return RootText(json.loads(raw), None, None)
    return RootText(doc, text, spans)


_KEY = re.compile(r'[ \t\n\r]*"([^"\\\x00-\x1f]*)"[ \t\n\r]*:[ \t\n\r]*')  # no escapes
_NEXT = re.compile(r"[ \t\n\r]*([,}])")


def _object(text: str, at: int, path: tuple[str, ...]
            ) -> tuple[dict[str, Any], dict[str, tuple[int, int]] | None, int]:
    """The object starting at ``text[at]`` (a ``{``), the spans of its members (``path``
    empty) or of the members below the keys ``path`` names, and where it ends."""
    if text[at:at + 1] != "{":
        raise _NotTaken
    out: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] | None = {} if not path else None
    at += 1
    if text[_skip(text, at):_skip(text, at) + 1] == "}":
        return out, spans, _skip(text, at) + 1
    while True:
        found = _KEY.match(text, at)
        if found is not None:
            key, at = found.group(1), found.end()
        else:  # a key with escapes: read as json.loads reads it
            at = _skip(text, at)
            if text[at:at + 1] != '"':
                raise _NotTaken
            key, at = _DECODER.raw_decode(text, at)
            at = _skip(text, at)
            if text[at:at + 1] != ":":
                raise _NotTaken
            at = _skip(text, at + 1)
        if path and key == path[0] and text[at:at + 1] == "{":
            value, below, end = _object(text, at, path[1:])
            spans = below  # a key given twice: the last one counts, as in json.loads
        else:
            value, end = _DECODER.raw_decode(text, at)
            if path and key == path[0]:
                spans = None  # not an object: nothing below it to compare
            elif not path:
                assert spans is not None
                spans[key] = (at, end)
        out[key] = value
        if text[end:end + 1] == ",":  # the next key's whitespace is _KEY's
            at = end + 1
            continue
        found = _NEXT.match(text, end)
        if found is None:
            raise _NotTaken
        at = found.end()
        if found.group(1) == "}":
            return out, spans, at


__all__ = ["RootText", "parse_root"]
