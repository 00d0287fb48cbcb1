"""``Layout``: the ordered list of state tensors, and the validator's diff between two layouts."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from .errors import FormatError, LayoutError, listing
from .formats import ScalarFormat, get


@dataclass(frozen=True)
class Entry:
    """One state tensor: its position, name, logical shape and scalar format."""

    index: int
    name: str
    shape: tuple[int, ...]
    format: ScalarFormat

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "shape": list(self.shape),
            "format": self.format.tag,
            "width": self.format.width,
        }

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of raw storage words (container width, not packed)."""
        fmt = self.format
        return self.size * fmt.words_per_value * fmt.storage_dtype.itemsize


@dataclass(frozen=True)
class Difference:
    """One mismatch between an actual and an expected layout."""

    kind: str  # "count" | "missing" | "extra" | "shape" | "format" | "order"
    name: str | None
    expected: Any
    actual: Any

    def __str__(self) -> str:
        if self.kind == "count":
            return f"tensor count: expected {self.expected}, found {self.actual}"
        if self.kind == "missing":
            return f"{self.name!r}: missing (expected {self.expected})"
        if self.kind == "extra":
            return f"{self.name!r}: unexpected tensor ({self.actual})"
        if self.kind == "order":
            return f"{self.name!r}: at index {self.actual}, expected at index {self.expected}"
        return f"{self.name!r}: {self.kind} expected {self.expected}, found {self.actual}"


def _describe(entry: Entry) -> str:
    return f"{entry.format.tag}{list(entry.shape)}"


def _sizes(shape: Any) -> bool:
    """Every side an int >= 0 (checked without a Python frame per side: runs per tensor)."""
    return all(map(isinstance, shape, repeat(int))) and min(shape, default=0) >= 0


def _by_name(entries: Sequence[Entry]) -> dict[str, Entry]:
    """The entries by name; LayoutError at a name met twice."""
    by_name: dict[str, Entry] = {}
    for entry in entries:
        if entry.name in by_name:
            raise LayoutError(f"duplicate tensor name {entry.name!r}")
        by_name[entry.name] = entry
    return by_name


class Layout(Sequence[Entry]):
    """An ordered, immutable list of :class:`Entry` with unique names."""

    __slots__ = ("_entries", "_by_name")

    def __init__(self, entries: Sequence[Entry | tuple]) -> None:
        built: list[Entry] = []
        for i, item in enumerate(entries):
            entry = item if isinstance(item, Entry) else Entry(*item)
            if entry.index != i:
                raise LayoutError(f"entry {entry.name!r} has index {entry.index}, expected {i}")
            if not isinstance(entry.format, ScalarFormat):
                raise FormatError(f"entry {entry.name!r} has no ScalarFormat: {entry.format!r}")
            if not _sizes(entry.shape):
                raise LayoutError(f"entry {entry.name!r} has an invalid shape {entry.shape!r}")
            built.append(entry)
        self._entries = tuple(built)
        self._by_name = _by_name(built)

    @classmethod
    def from_specs(cls, specs: Sequence[tuple[str, Sequence[int], ScalarFormat | str]]) -> Layout:
        """Build from ``(name, shape, format)`` triples, numbering them in order."""
        return cls(
            [
                Entry(i, name, tuple(map(int, shape)), get(f) if isinstance(f, str) else f)
                for i, (name, shape, f) in enumerate(specs)
            ]
        )

    @classmethod
    def from_json(cls, items: Any) -> Layout:
        """Inverse of :meth:`to_json`; malformed input raises LayoutError or FormatError."""
        if not isinstance(items, list):
            raise LayoutError("a layout must be a JSON list of entries")
        entries = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise LayoutError(f"layout entry {i} is not an object")
            name, shape, tag = item.get("name"), item.get("shape"), item.get("format")
            if not isinstance(name, str) or not isinstance(shape, list) or not isinstance(tag, str):
                raise LayoutError(f"layout entry {i} lacks a name, shape or format")
            if not _sizes(shape) or any(map(isinstance, shape, repeat(bool))):
                raise LayoutError(f"layout entry {name!r} has an invalid shape {shape!r}")
            fmt = get(tag)
            if "width" in item and item["width"] != fmt.width:
                raise FormatError(f"layout entry {name!r}: width {item['width']} != {fmt.width}")
            entries.append(Entry(i, name, tuple(map(int, shape)), fmt))
        return cls._checked_entries(entries)

    @classmethod
    def _checked_entries(cls, entries: list[Entry]) -> Layout:
        """A layout of entries already numbered in order, with checked shapes and formats (as
        :meth:`from_json` builds them): only the names' uniqueness is left to check."""
        layout = cls.__new__(cls)
        layout._entries = tuple(entries)
        layout._by_name = _by_name(entries)
        return layout

    def to_json(self) -> list[dict[str, Any]]:
        return [entry.to_json() for entry in self._entries]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            try:
                return self._by_name[key]
            except KeyError:
                raise KeyError(key) from None
        return self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._by_name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash(self._entries)

    def names(self) -> list[str]:
        return [entry.name for entry in self._entries]

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries)

    def subset(self, names: Sequence[str]) -> Layout:
        """The entries named, renumbered in the given order."""
        return Layout.from_specs([(n, self[n].shape, self[n].format) for n in names])

    def diff(
        self,
        expected: Layout,
        *,
        order_matters: bool = True,
        allow_missing: bool = False,
        allow_extra: bool = False,
    ) -> list[Difference]:
        """Every difference between this (actual) layout and ``expected``."""
        diffs: list[Difference] = []
        if len(self) != len(expected) and not (allow_missing or allow_extra):
            diffs.append(Difference("count", None, len(expected), len(self)))
        for entry in expected:
            found = self._by_name.get(entry.name)
            if found is None:
                if not allow_missing:
                    diffs.append(Difference("missing", entry.name, _describe(entry), None))
                continue
            if found.shape != entry.shape:
                diffs.append(Difference("shape", entry.name, list(entry.shape), list(found.shape)))
            if found.format is not entry.format and (
                found.format != entry.format or found.format.width != entry.format.width
            ):
                diffs.append(
                    Difference(
                        "format",
                        entry.name,
                        f"{entry.format.tag} ({entry.format.width} bits)",
                        f"{found.format.tag} ({found.format.width} bits)",
                    )
                )
        if not allow_extra:
            for entry in self:
                if entry.name not in expected:
                    diffs.append(Difference("extra", entry.name, None, _describe(entry)))
        if order_matters:
            want = [e.name for e in expected if e.name in self._by_name]
            got = [e.name for e in self if e.name in expected]
            for expected_name, found_name in zip(want, got):
                if expected_name != found_name:
                    diffs.append(
                        Difference(
                            "order",
                            expected_name,
                            expected[expected_name].index,
                            self[expected_name].index,
                        )
                    )
        return diffs

    def check(self, expected: Layout, **options: Any) -> None:
        """Raise one :class:`LayoutError` listing every difference from ``expected``."""
        diffs = self.diff(expected, **options)
        if diffs:
            raise layout_error(diffs)

    def __repr__(self) -> str:
        inner = ", ".join(f"{e.name}: {_describe(e)}" for e in self._entries[:6])
        more = f", ... ({len(self)} tensors)" if len(self) > 6 else ""
        return f"Layout([{inner}{more}])"


def layout_error(diffs: list[Difference], what: str = "checkpoint layout") -> LayoutError:
    """One LayoutError whose message lists the differences, one per line (the first
    ``MAX_LISTED`` of them and a count of the rest); ``differences`` holds them all."""
    lines = listing([str(d) for d in diffs])
    noun = "difference" if len(diffs) == 1 else "differences"
    return LayoutError(f"{what} does not match ({len(diffs)} {noun}):\n{lines}", diffs)


def stored_rank_shape(entry: Entry) -> tuple[int, ...]:
    return entry.shape or (1,)
