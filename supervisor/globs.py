"""The one glob dialect of the config's allowlists (executables, environment names), and its
translation to a regular expression that the database's claim filter uses. Pure."""

from __future__ import annotations

import re


def glob_regex(pattern: str) -> str:
    """An allowlist glob as an anchored regular expression that means the same in Python's `re` and in
    PostgreSQL's `~`, so that the claim filter in the database and the check here cannot disagree.

    Shell-style, one path component at a time: `*` is any run of characters but `/`, `?` one
    character but `/` (so `/usr/bin/*` allows /usr/bin/env, not /usr/bin/sub/x). Every other
    character is literal: an ASCII character that is not a letter or a digit is escaped with a
    backslash, which both engines read as that character. Character classes are refused by config.
    """
    parts = ["^"]
    for char in pattern:
        if char == "*":
            parts.append("[^/]*")
        elif char == "?":
            parts.append("[^/]")
        elif char.isascii() and not char.isalnum():
            parts.append("\\" + char)
        else:
            parts.append(char)
    parts.append("$")
    return "".join(parts)


def matches(text: str, pattern: str) -> bool:
    # fullmatch: Python's `$` would also match before a trailing newline.
    return re.fullmatch(glob_regex(pattern)[1:-1], text) is not None
