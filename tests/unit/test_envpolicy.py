"""supervisor.envpolicy: which environment names a run may set (an allowlist), and why the others are
refused; a name on the denylist opens only by its exact name."""

from __future__ import annotations

import re

import pytest

from supervisor import envpolicy
from supervisor.envpolicy import (
    DEFAULT_ALLOWED,
    DENIED,
    NAME_PATTERN_RE,
    allowed_names,
    allowed_pattern_regexes,
    denied_regexes,
    pattern_problem,
    refusal,
)

# For each pattern, names it must refuse: the name itself, or for a prefix the bare prefix and a
# few real ones.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "LD_*": ("LD_", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "LD_BIND_NOW"),
    "BASH_FUNC_*": ("BASH_FUNC_", "BASH_FUNC_ls%%", "BASH_FUNC_x"),
    "PYTHON*": ("PYTHON", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONWARNINGS", "PYTHONHOME"),
    "PERL5*": ("PERL5", "PERL5OPT", "PERL5LIB", "PERL5DB"),
    "SYSTEMD_*": ("SYSTEMD_X", "SYSTEMD_LOG_LEVEL", "SYSTEMD_PAGER"),
    "LISTEN_*": ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"),
}


def examples(pattern: str) -> tuple[str, ...]:
    return EXAMPLES.get(pattern, (pattern,))


def test_every_prefix_pattern_has_examples() -> None:
    prefixes = {pattern for pattern, _ in DENIED if "*" in pattern}
    assert prefixes == set(EXAMPLES)


def test_patterns_are_names_or_prefixes_and_unique() -> None:
    patterns = [pattern for pattern, _ in DENIED]
    assert len(patterns) == len(set(patterns))
    for pattern, why in DENIED:
        assert NAME_PATTERN_RE.match(pattern), pattern
        assert "*" not in pattern[:-1], f"{pattern}: only a trailing * (a prefix)"
        assert why and not why.endswith("."), f"{pattern}: reason {why!r}"  # it goes mid-sentence


@pytest.mark.parametrize(("pattern", "why"), DENIED)
def test_every_denied_pattern_is_refused_with_its_reason(pattern: str, why: str) -> None:
    for name in examples(pattern):
        for allowed in ((), ("*",), DEFAULT_ALLOWED):
            assert refusal(name, allowed) == (
                f"environment name {name} is refused: {why} (a host that trusts it lists the exact name in "
                "[runs] allowed_environment; a pattern never opens it)")


@pytest.mark.parametrize(("pattern", "why"), DENIED)
def test_allowed_environment_opens_exactly_what_it_names(pattern: str, why: str) -> None:
    for name in examples(pattern):
        assert refusal(name, (name,)) is None
        others = [other for p, _ in DENIED for other in examples(p) if other != name]
        # Naming one opens that one only: every other refused name stays refused.
        assert all(refusal(other, (name,)) is not None for other in others), name


@pytest.mark.parametrize(("pattern", "why"), DENIED)
def test_a_pattern_never_opens_a_denied_name(pattern: str, why: str) -> None:
    """Issue 21: `APP_*`, `*` or `L*` must not open LD_PRELOAD by accident, nor the denylist's own
    prefix every name under it."""
    for name in examples(pattern):
        for allowed in ((pattern,), ("*",), (name[0] + "*",), (name[:-1] + "?",)):
            if allowed[0] != name:
                assert refusal(name, allowed) is not None, (name, allowed)


# What the issue found passing 0.5's denylist.
ISSUE_NAMES = ("TAR_OPTIONS", "GIT_CONFIG_COUNT", "GIT_CONFIG_KEY_0", "GIT_CONFIG_VALUE_0", "RSYNC_RSH",
               "LUA_INIT", "MAKEFLAGS", "LESSOPEN", "DOTNET_STARTUP_HOOKS", "OPENSSL_CONF", "HOME", "SECRET")


@pytest.mark.parametrize("name", ISSUE_NAMES)
def test_a_name_the_allowlist_does_not_name_is_refused(name: str) -> None:
    assert refusal(name, DEFAULT_ALLOWED) == (
        f"environment name {name} is not in this host's [runs] allowed_environment")
    assert refusal(name, ()) is not None
    assert refusal(name, (name,)) is None
    assert refusal(name, (name[:2] + "*",)) is None  # not on the denylist: a pattern may open it


def test_the_default_allows_the_locale_and_the_time_zone_only() -> None:
    assert DEFAULT_ALLOWED == ("LANG", "LANGUAGE", "LC_*", "TZ")
    for name in ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ"):
        assert refusal(name, DEFAULT_ALLOWED) is None, name
    for name in ("TZDIR", "LOCPATH", "LANGX", "PATH", "LD_PRELOAD", "NLSPATH"):
        assert refusal(name, DEFAULT_ALLOWED) is not None, name


def test_globs_in_allowed_environment() -> None:
    assert refusal("APP_MODE", ("APP_*",)) is None
    assert refusal("APPX", ("APP_*",)) is not None
    assert refusal("APP_A", ("APP_?",)) is None
    assert refusal("APP_AB", ("APP_?",)) is not None
    assert refusal("ANYTHING", ("*",)) is None  # a host that trusts every name but the denylist may say so
    assert refusal("BASH_ENV", ("*",)) is not None


def test_names_are_case_sensitive() -> None:
    """The environment is: allowing `path` does not open PATH, nor `app_*` APP_X."""
    assert refusal("PATH", ("path",)) is not None
    assert refusal("APP_X", ("app_*",)) is not None
    assert refusal("ld_preload", ("ld_preload",)) is None


@pytest.mark.parametrize("pattern", ["LD_*", "PYTHON*", "PYTHON????", "PERL5*", "SYSTEMD_*", "LISTEN_*",
                                     "BASH_FUNC_*", "LD_LIBRARY_*", "PYTHONP?TH"])
def test_a_pattern_that_can_open_only_denied_names_is_a_problem(pattern: str) -> None:
    problem = pattern_problem(pattern)
    assert problem and problem.startswith(f"{pattern!r} matches only names of ") and "exact name" in problem


@pytest.mark.parametrize("pattern", ["*", "L*", "APP_*", "LC_*", "LD", "PYTHONPATH", "P*", "PYTHO?", "PY*"])
def test_a_pattern_that_can_open_something_or_a_name_is_no_problem(pattern: str) -> None:
    assert pattern_problem(pattern) is None


@pytest.mark.parametrize("name", [
    "MY_LD_PRELOAD", "XLD_PRELOAD", "OLD_PATH", "APP_PATH", "PATHS", "PATH_INFO", "MYPYTHONPATH",
    "NOT_BASH_ENV", "ENVIRONMENT", "ENV_FILE", "MY_ENV", "IFS_X", "XIFS", "TZ", "HOME", "LANG", "LC_ALL",
    "NODE_ENV", "JAVA_HOME", "SECRET", "PS1", "PS4X", "A_SYSTEMD_B", "XLISTEN_FDS", "NOTIFY_SOCKETS",
    "RUBYOPTS", "PERL", "PERLLIBX", "_JAVA_OPTIONS_X",
])
def test_names_that_merely_contain_a_denied_pattern_open_by_a_pattern(name: str) -> None:
    assert refusal(name, ("*",)) is None


NAMES = [name for pattern, _ in DENIED for name in examples(pattern)] + [
    "MY_LD_PRELOAD", "path", "PATHS", "LD", "LDX", "PYTHO", "BASH_FUNC", "A", "_", "SYSTEMD", "LISTEN",
    "LANG", "LC_ALL", "APP_X", "TAR_OPTIONS",
]


@pytest.mark.parametrize("name", NAMES)
def test_the_regexes_the_host_registers_agree_with_the_globs(name: str) -> None:
    """The claim in the database refuses by what the host registers (sql/015's rule, written here in
    Python's re); unitspec by the globs: one answer for every allowlist."""
    for allowed in ((), ("*",), DEFAULT_ALLOWED, ("LD_PRELOAD", "APP_*"), ("L*", "PATH")):
        by_regex = not (name in allowed_names(allowed) or (
            any(re.search(rx, name) for rx in allowed_pattern_regexes(allowed))
            and not any(re.search(rx, name) for rx in denied_regexes())))
        assert by_regex == (refusal(name, allowed) is not None), (name, allowed)


def test_regexes_are_anchored_and_names_are_split_from_patterns() -> None:
    for rx in denied_regexes() + allowed_pattern_regexes(("APP_*",)):
        assert rx.startswith("^") and rx.endswith("$")
    assert allowed_names(("LANG", "LC_*", "TZ", "A?")) == ("LANG", "TZ")
    assert allowed_pattern_regexes(("LANG", "LC_*")) == (r"^LC\_[^/]*$",)
    assert envpolicy.allowed_pattern_regexes(()) == ()
