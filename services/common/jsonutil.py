"""JSON payloads from callers (reward `extra_info_json`, environment payloads), parsed with a
nesting bound: a 100k-deep document is an INVALID_ARGUMENT naming the field, not a RecursionError.

    info = loads_object(item.extra_info_json, "items[3].extra_info_json", max_depth=64)
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import InvalidArgument

DEFAULT_MAX_DEPTH = 64


# A JSON string: to its closing quote, or to the end of the text if it never closes. The
# quantifiers are possessive and the match always succeeds at a quote, so each character is read a
# bounded number of times; a string full of `\"` is not retried from every quote inside it (that
# retry is quadratic, and the scan runs on the caller's event loop).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def _depth_exceeds(text: str, max_depth: int) -> bool:
    """Whether brackets outside strings nest deeper than MAX_DEPTH (scanned before parsing, so the
    parser never recurses that far). Linear in len(TEXT): strings are cut out in one pass, then the
    brackets are counted up to the first one past MAX_DEPTH. A string that never closes hides the
    rest of the text (the parser then rejects the document)."""
    depth = 0
    for m in _BRACKETS.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False


def loads(text: str, field: str, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Parse TEXT; InvalidArgument(FIELD, ...) when it is not JSON or nests deeper than MAX_DEPTH."""
    # Cheap precheck: a document can only be deep if it has that many opening brackets.
    if text.count("[") + text.count("{") > max_depth and _depth_exceeds(text, max_depth):
        raise InvalidArgument(field, f"nests deeper than {max_depth} levels (security.limits.max_json_depth)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(field, f"is not valid JSON ({exc.msg} at {exc.pos})") from exc
    except ValueError as exc:  # an integer past Python's digit limit (sys.set_int_max_str_digits)
        raise InvalidArgument(field, f"is not valid JSON here ({exc})") from None
    except RecursionError:  # defensive: the scan above should have caught it
        raise InvalidArgument(field, f"nests deeper than {max_depth} levels") from None


def loads_object(text: str, field: str, *, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """Like `loads`, and the document must be a JSON object ("" is the empty object)."""
    if not text:
        return {}
    value = loads(text, field, max_depth=max_depth)
    if not isinstance(value, dict):
        raise InvalidArgument(field, f"must be a JSON object, got {type(value).__name__}")
    return value
