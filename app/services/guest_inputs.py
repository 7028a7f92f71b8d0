"""What a function's guest is started with besides its stdin: argv and environment, and their
bounds. The same rules hold for a deploy's `arg=`/`env=` and a call's `X-Function-Args`."""

from __future__ import annotations

import re
from collections.abc import Iterable

from app.errors import Invalid

# argv after the function's name: a deploy's defaults or a call's own
MAX_ARGS = 64
MAX_ARGS_BYTES = 16 * 1024  # their UTF-8 bytes together
# a shell name, matched whole (fullmatch: no trailing newline slips through)
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_ENV_ENTRIES = 64
MAX_ENV_VALUE_CHARS = 4096

# Added to the environment of a function deployed with cgi=true, for each call; a deploy may not
# set them itself.
CGI_VARIABLES = ("QUERY_STRING", "CONTENT_TYPE", "TW_FUNCTION", "TW_INVOCATION_ID", "TW_TENANT")


def check_args(args: Iterable[object], where: str) -> list[str]:
    """`args` as argv entries (strings without NUL, within the count and byte bounds); `where`
    names their source in the message."""
    out: list[str] = []
    total = 0
    for arg in args:
        if not isinstance(arg, str):
            raise Invalid(f"{where}: every argument must be a string, got {type(arg).__name__}")
        if "\x00" in arg:
            raise Invalid(f"{where}: argument {len(out) + 1} holds a NUL character, which argv cannot carry")
        out.append(arg)
        total += len(arg.encode())
        if len(out) > MAX_ARGS:
            raise Invalid(f"{where}: at most {MAX_ARGS} arguments")
    if total > MAX_ARGS_BYTES:
        raise Invalid(f"{where}: the arguments take {total} bytes (UTF-8), past the limit of {MAX_ARGS_BYTES}")
    return out


def parse_env(items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` entries as an environment. Values may hold any character but NUL (newlines
    too: a PEM certificate, a multi-line configuration); keys are shell names."""
    if len(items) > MAX_ENV_ENTRIES:
        raise Invalid(f"at most {MAX_ENV_ENTRIES} env entries, got {len(items)}")
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not ENV_KEY.fullmatch(key):
            raise Invalid(f"env entries are KEY=VALUE with KEY matching [A-Za-z_][A-Za-z0-9_]* (at most 128), got {item[:80]!r}")
        if len(value) > MAX_ENV_VALUE_CHARS or "\x00" in value:
            raise Invalid(f"the value of env variable {key} must be at most {MAX_ENV_VALUE_CHARS} characters, without NUL")
        if key in CGI_VARIABLES:
            raise Invalid(f"env variable {key} is set by the platform (for functions deployed with cgi=true)")
        env[key] = value
    return env
