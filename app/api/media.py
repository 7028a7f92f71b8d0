"""Media types (RFC 9110 section 8.3.1) a function may declare for its invoke responses."""

from __future__ import annotations

import re

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_QUOTED = r'"(?:[\t !#-\[\]-~]|\\[\t -~])*"'
# type/subtype, then `; name=value` parameters; printable ASCII only, so no control character
# (CR, LF, NUL...) can reach a response header
MEDIA_TYPE_PATTERN = rf"^{_TOKEN}/{_TOKEN}(?:[ \t]*;[ \t]*{_TOKEN}=(?:{_TOKEN}|{_QUOTED}))*$"
_MEDIA_TYPE = re.compile(MEDIA_TYPE_PATTERN.removeprefix("^").removesuffix("$"))
MAX_MEDIA_TYPE_LENGTH = 255
DEFAULT_MEDIA_TYPE = "application/octet-stream"


def is_media_type(value: str) -> bool:
    return len(value) <= MAX_MEDIA_TYPE_LENGTH and _MEDIA_TYPE.fullmatch(value) is not None


def safe_media_type(value: str) -> str:
    """The value if it can be sent as a Content-Type header, else the default (a value stored
    before deploys were checked can never break an invoke)."""
    return value if is_media_type(value) else DEFAULT_MEDIA_TYPE
