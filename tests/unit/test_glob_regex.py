"""supervisor.globs.glob_regex and matches: an allowlist glob as one regular expression that
Python's `re` and PostgreSQL's ARE (the claim filter, `~`) read the same way.

The reference is the shell's meaning, one path component at a time: fnmatch.fnmatchcase on each
component (fnmatch's `*` would cross `/`, so it is applied per component, never to the whole path).
"""

from __future__ import annotations

import fnmatch
import random
import re

import pytest

from supervisor.globs import glob_regex
from supervisor.globs import matches as _path_matches


def reference(path: str, pattern: str) -> bool:
    """Shell semantics for patterns without `[`: same number of components, each fnmatch-ed."""
    assert "[" not in pattern
    pattern_parts, path_parts = pattern.split("/"), path.split("/")
    return len(pattern_parts) == len(path_parts) and all(
        fnmatch.fnmatchcase(part, glob) for part, glob in zip(path_parts, pattern_parts, strict=True))


# -- the exact translation ----------------------------------------------------------------------

@pytest.mark.parametrize(("pattern", "regex"), [
    ("/usr/bin/env", r"^\/usr\/bin\/env$"),
    ("/usr/bin/*", r"^\/usr\/bin\/[^/]*$"),
    ("/opt/tool-?/run", r"^\/opt\/tool\-[^/]\/run$"),
    ("/a.b", r"^\/a\.b$"),
    ("/a+b", r"^\/a\+b$"),
    ("/a(b)", r"^\/a\(b\)$"),
    ("/a$b^c", r"^\/a\$b\^c$"),
    ("/a\\b", r"^\/a\\b$"),
    ("/a b", r"^\/a\ b$"),
    ("/a_b", r"^\/a\_b$"),
    ("/a{2}|c", r"^\/a\{2\}\|c$"),
    ("/é/ü/日本", "^\\/é\\/ü\\/日本$"),
    ("/**", r"^\/[^/]*[^/]*$"),
    ("", "^$"),
])
def test_translation(pattern, regex):
    assert glob_regex(pattern) == regex


# -- what a pattern matches ---------------------------------------------------------------------

@pytest.mark.parametrize(("pattern", "path", "expected"), [
    # literal
    ("/usr/bin/env", "/usr/bin/env", True),
    ("/usr/bin/env", "/usr/bin/envx", False),
    ("/usr/bin/env", "/usr/bin/en", False),
    ("/usr/bin/env", "/USR/bin/env", False),
    ("/usr/bin/env", "/usr/bin/env\n", False),  # `$` would match before a trailing newline
    # `*`: any run of characters within one component, the empty run included
    ("/usr/bin/*", "/usr/bin/env", True),
    ("/usr/bin/*", "/usr/bin/", True),
    ("/usr/bin/*", "/usr/bin", False),
    ("/usr/bin/*", "/usr/bin/sub/x", False),
    ("/usr/bin/*", "/usr/bin//", False),
    ("/usr/*/env", "/usr/bin/env", True),
    ("/usr/*/env", "/usr/a/b/env", False),
    ("/usr/*/env", "/usr//env", True),
    ("/*", "/x", True),
    ("/*", "/x/y", False),
    ("*", "/x", False),
    ("/opt/tool-*/bin/run", "/opt/tool-2/bin/run", True),
    ("/opt/tool-*/bin/run", "/opt/tool-/bin/run", True),
    ("/opt/tool-*/bin/run", "/opt/tool/bin/run", False),
    ("/opt/*-tool", "/opt/a-b-tool", True),
    ("/a*b*c", "/abc", True),
    ("/a*b*c", "/axxbyyc", True),
    ("/a*b*c", "/axxbyy", False),
    # `?`: exactly one character, never `/`
    ("/bin/?", "/bin/a", True),
    ("/bin/?", "/bin/", False),
    ("/bin/?", "/bin/ab", False),
    ("/bin?x", "/bin/x", False),
    ("/bin/??", "/bin/é!", True),
    ("/bin/?", "/bin/日", True),
    # `.` is a dot, not any character
    ("/bin/a.b", "/bin/a.b", True),
    ("/bin/a.b", "/bin/axb", False),
    ("/bin/.*", "/bin/.hidden", True),
    ("/bin/.*", "/bin/xhidden", False),
    # `-`, `+`, `(`, `$`, `^`, `\`, `|`, `{`: literal characters
    ("/bin/a-b", "/bin/a-b", True),
    ("/bin/a+", "/bin/a+", True),
    ("/bin/a+", "/bin/aa", False),
    ("/bin/a+", "/bin/a", False),
    ("/bin/(a)", "/bin/(a)", True),
    ("/bin/(a)", "/bin/a", False),
    ("/bin/a$", "/bin/a$", True),
    ("/bin/a$", "/bin/a", False),
    ("/bin/^a", "/bin/^a", True),
    ("/bin/^a", "/bin/a", False),
    ("/bin/a\\b", "/bin/a\\b", True),
    ("/bin/a\\b", "/bin/a\b", False),
    ("/bin/a\\*", "/bin/a\\xyz", True),  # `\` is no escape in a glob here: `*` still means any run
    ("/bin/a\\*", "/bin/a*", False),
    ("/bin/a|b", "/bin/a|b", True),
    ("/bin/a|b", "/bin/a", False),
    ("/bin/a{2}", "/bin/a{2}", True),
    ("/bin/a{2}", "/bin/aa", False),
    # spaces and non-ASCII
    ("/opt/my tool/run", "/opt/my tool/run", True),
    ("/opt/my tool/run", "/opt/mytool/run", False),
    ("/opt/* tool", "/opt/my tool", True),
    ("/opt/café/*", "/opt/café/x", True),
    ("/opt/café/*", "/opt/cafe/x", False),
    ("/opt/日本/?", "/opt/日本/語", True),
    # trailing slash and empty components are literal structure, matched as such
    ("/usr/bin/", "/usr/bin/", True),
    ("/usr/bin/", "/usr/bin", False),
    ("/usr//bin", "/usr//bin", True),
    ("/usr//bin", "/usr/bin", False),
    ("/usr/*/bin", "/usr//bin", True),
])
def test_matches(pattern, path, expected):
    assert _path_matches(path, pattern) is expected
    assert reference(path, pattern) is expected  # the table itself agrees with the shell


# -- property: the regex is the per-component shell glob ----------------------------------------

ALPHABET = "/.*?a-"
PATH_ALPHABET = "/.a-b"


def _random_cases(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        pattern = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7)))
        # Paths drawn both at random and from the pattern itself (its wildcards filled in), so that
        # matches are as common as mismatches.
        if rng.random() < 0.5:
            path = "".join(rng.choice(PATH_ALPHABET + "*?") for _ in range(rng.randint(0, 7)))
        else:
            path = "".join(
                "".join(rng.choice(PATH_ALPHABET) for _ in range(rng.randint(0, 3))) if c == "*"
                else rng.choice(PATH_ALPHABET) if c == "?" else c for c in pattern)
        yield pattern, path


@pytest.mark.parametrize("seed", range(8))
def test_property_regex_equals_per_component_fnmatch(seed):
    matched = mismatched = 0
    for pattern, path in _random_cases(seed, 2500):
        expected = reference(path, pattern)
        got = re.fullmatch(glob_regex(pattern)[1:-1], path) is not None
        assert got is expected, (pattern, path)
        assert _path_matches(path, pattern) is expected, (pattern, path)
        matched += expected
        mismatched += not expected
    # The generator must exercise both sides, or the property says little.
    assert matched > 200 and mismatched > 200


# -- the regex is one both engines read alike -----------------------------------------------------

# One token of what glob_regex may emit: the anchors, the two wildcards, a backslash before an ASCII
# character that is neither a letter nor a digit (a literal in Python's re and in PostgreSQL's ARE,
# where a backslash before an alphanumeric is an escape such as \d, \m, \y or \Z), an ASCII letter or
# digit, or any non-ASCII character (special in neither engine).
_TOKEN = re.compile(r"\[\^/\]\*|\[\^/\]|\\[\x00-\x2f\x3a-\x40\x5b-\x60\x7b-\x7f]|[A-Za-z0-9]|[^\x00-\x7f]")


def assert_portable(regex: str) -> None:
    assert regex.startswith("^") and regex.endswith("$"), regex
    body = regex[1:-1]
    position = 0
    while position < len(body):
        token = _TOKEN.match(body, position)
        assert token is not None, f"{regex!r}: {body[position:]!r} is not a portable token"
        position = token.end()
    re.compile(regex)  # and Python accepts it


def _all_pattern_sources():
    yield from ["/usr/bin/env", "/usr/bin/*", "/opt/tool-?/run", "/a b", "/é/日本", "/a\\b", "/a$b^c(d)+e.f"]
    # every printable ASCII character and a few non-ASCII ones, alone and beside the wildcards
    for code in list(range(0x20, 0x7f)) + [0x7f, 0xe9, 0x65e5, 0x1f600, 0x00a0]:
        char = chr(code)
        if char in "[]":
            continue  # refused by config
        yield f"/x{char}y"
        yield f"/*{char}?"
    for pattern, _ in _random_cases(99, 2000):
        yield pattern


def test_every_generated_regex_is_portable():
    for pattern in _all_pattern_sources():
        assert_portable(glob_regex(pattern))


def test_portability_check_rejects_what_the_engines_read_differently():
    """The checker itself: each of these would mean something else in one engine or the other."""
    for bad in (r"^\d$", r"^\y$", r"^a.b$", r"^a*$", r"^(a)$", r"^a$b$", r"^[a]$", r"^\Z$", "^a\\$"):
        with pytest.raises(AssertionError):
            assert_portable(bad)


def test_path_matches_is_a_full_match_not_a_search():
    assert not _path_matches("/x/usr/bin/env", "/usr/bin/env")
    assert not _path_matches("/usr/bin/env/x", "/usr/bin/env")
