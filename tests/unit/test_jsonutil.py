"""services/common/jsonutil.py: the nesting scan agrees with the parsed document's depth, and it is
linear, also on strings built to make a string-skipping regex backtrack (it runs on the reward
replica's event loop for every Score request's extra_info_json)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.common.jsonutil import _depth_exceeds, loads, loads_object


def depth_of(value: Any) -> int:
    """Nesting of a parsed document: a scalar 0, [] and {} 1, [[1]] 2."""
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


# Strings full of what a scan must skip: brackets, quotes, backslashes, unicode.
tricky_text = st.text(alphabet=st.sampled_from('[]{}"\\/abc \n\u00e9\u4e2d\U0001f600'), max_size=12)
documents = st.recursive(
    st.none() | st.booleans() | st.integers() | tricky_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(documents, st.integers(min_value=0, max_value=8), st.booleans())
def test_the_scan_agrees_with_the_parsed_depth(value: Any, max_depth: int, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert _depth_exceeds(text, max_depth) == (depth_of(value) > max_depth), text


@pytest.mark.parametrize(("text", "depth"), [
    ('"["', 0),
    ('["\\"[", "]"]', 1),
    ('{"a\\\\": [[{"b": "\\\\\\"{{"}]]}', 4),
    ('[[], [[]], {}]', 3),
    ('"\\u005b"', 0),  # an escaped bracket is no bracket
])
def test_table(text: str, depth: int) -> None:
    assert depth_of(json.loads(text)) == depth
    assert not _depth_exceeds(text, depth) and (depth == 0 or _depth_exceeds(text, depth - 1))


def test_too_deep_is_an_invalid_argument_naming_the_field() -> None:
    assert loads("[" * 64 + "]" * 64, "f") is not None  # exactly the bound parses
    with pytest.raises(InvalidArgument, match=r"^items\[3\]\.extra_info_json: nests deeper than 64 levels"):
        loads_object("[" * 100_000 + "]" * 100_000, "items[3].extra_info_json")
    with pytest.raises(InvalidArgument, match="nests deeper than 2 levels"):
        loads('{"a": [{"b": 1}]}', "f", max_depth=2)
    with pytest.raises(InvalidArgument, match="must be a JSON object, got list"):
        loads_object("[]", "f")
    assert loads_object("", "f") == {}


MB = 1 << 20
ADVERSARIAL = {
    # an unterminated string of escaped quotes: every `"` in it starts a candidate string
    "deep, then an unterminated string of \\\"": "[" * 65 + '"' + '\\"' * (MB // 2),
    "an unterminated string of \\\", then deep": '"' + '\\"' * (MB // 2) + "[" * 65,
    "shallow, then an unterminated string of \\\"": "[" * 10 + '"' + '\\"' * (MB // 2),
    "quotes": '"' * MB + "[" * 65,
    "quote, backslash": '"\\' * (MB // 2) + "[" * 65,
    "one long string, then deep": '["' + "a" * MB + '"]' + "[" * 65,
}


@pytest.mark.parametrize("text", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_a_megabyte_is_checked_in_linear_time(text: str) -> None:
    # A generous bound: linear takes milliseconds here; the quadratic scan this replaces took hours.
    t0 = time.monotonic()
    with pytest.raises(InvalidArgument):
        loads(text, "f")
    assert time.monotonic() - t0 < 2.0
