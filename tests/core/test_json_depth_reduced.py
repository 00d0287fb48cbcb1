"""``hardening.json_depth`` after its cuts (escapes only when there are any, then adjacent
quote pairs) gives the depth a JSON lexer finds, on seeded random text of the characters
that matter (issue 13: the check runs on every root document a load reads)."""

from __future__ import annotations

import random

import pytest

from lean_store.hardening import json_depth


def _lexer_depth(data: bytes) -> int:
    """Depth of brackets outside strings, reading escapes as a JSON lexer does."""
    depth = deepest = 0
    inside = escaped = False
    for byte in data:
        char = chr(byte)
        if inside:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                inside = False
        elif char == '"':
            inside = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


@pytest.mark.parametrize("seed", range(8))
def test_depth_equals_the_lexers_on_random_text(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        # brackets (balanced or not) and strings holding brackets, quotes and escapes: the
        # text a JSON lexer splits into tokens (escapes only inside strings)
        parts = []
        for _ in range(rng.randrange(0, 30)):
            if rng.random() < 0.6:
                parts.append(rng.choice("[{]} ,:1"))
            else:
                inner = "".join(rng.choice(["[", "]", "{", "}", "x", "\\\\", '\\"', "\\n"])
                                for _ in range(rng.randrange(0, 5)))
                parts.append(f'"{inner}"')
        text = "".join(parts).encode()
        assert json_depth(text) == _lexer_depth(text), text


@pytest.mark.parametrize("text", [
    b'{"a": "[[[", "b": [[]]}', b'["\\"[", [["]"]]]', b'"" "" [""] {"": [{}]}',
    b'{"layout": "[{\\"k\\":[1]}]", "x": [[[[1]]]]}', b'["\\\\", [[]]]', b"",
    b'["\\"[", [[[{"a": "]]"}]]], "x\\\\", [[]], "\\""]', b'[[["\\\\"]]]',
    b'"\\\\\\"" [[', b'{"a": "x\\u005b"} [[[]]]',
])
def test_depth_of_examples(text: bytes) -> None:
    assert json_depth(text) == _lexer_depth(text)
