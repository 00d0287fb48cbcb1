"""Files of other formats (safetensors, a Hugging Face sharded checkpoint, torch ``.pt``,
TorchLean) read as :func:`.diff.diff` reads a checkpoint: a layout and each tensor's raw words
in row blocks, so ``lean-store diff`` compares a converted checkpoint with its source bit for
bit. The words come from the conversion readers (:func:`lean_store.interop.convert.open_input`:
headers validated, safetensors memory-mapped); these formats carry no checksums to verify."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..chunking import Region, iter_regions
from ..layout import Layout, stored_rank_shape


class InputBlocks:
    """An opened conversion input, read block by block like a :class:`Checkpoint`."""

    def __init__(self, inp: Any) -> None:
        self._input = inp
        self.layout: Layout = inp.layout
        self.extra: dict[str, Any] = dict(inp.extra)  # attributes a conversion would carry

    def blocks(self, name: str, *, unit: tuple[int, ...], reuse: bool = False
               ) -> Iterator[tuple[Region, np.ndarray]]:
        entry = self.layout[name]
        pair = (2,) if entry.format.words_per_value == 2 else ()
        words = self._input.read_words(entry).reshape(stored_rank_shape(entry) + pair)
        for region in iter_regions(stored_rank_shape(entry), unit):
            yield region, words[region]

    def close(self) -> None:
        self._input.close()

    def __enter__(self) -> InputBlocks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
