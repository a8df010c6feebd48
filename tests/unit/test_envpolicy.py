"""supervisor.envpolicy: which environment names a run may set, and why the others are refused."""

from __future__ import annotations

import re

import pytest

from supervisor import envpolicy
from supervisor.envpolicy import DENIED, NAME_PATTERN_RE, allowed_regexes, denied_regexes, refusal

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
        assert refusal(name, ()) == (f"environment name {name} is refused: {why} "
                                     "(a host that trusts it lists it in [runs] allowed_environment)")


@pytest.mark.parametrize(("pattern", "why"), DENIED)
def test_allowed_environment_opens_exactly_what_it_names(pattern: str, why: str) -> None:
    for name in examples(pattern):
        assert refusal(name, (name,)) is None
        others = [other for p, _ in DENIED for other in examples(p) if other != name]
        # Naming one opens that one only: every other refused name stays refused.
        assert all(refusal(other, (name,)) is not None for other in others), name


@pytest.mark.parametrize(("pattern", "why"), DENIED)
def test_allowing_the_pattern_itself_opens_all_it_covers(pattern: str, why: str) -> None:
    assert all(refusal(name, (pattern,)) is None for name in examples(pattern))


def test_globs_in_allowed_environment() -> None:
    assert refusal("LD_LIBRARY_PATH", ("LD_*",)) is None
    assert refusal("LD_PRELOAD", ("LD_LIBRARY_*",)) is not None
    assert refusal("LD_LIBRARY_PATH", ("LD_LIBRARY_*",)) is None
    assert refusal("PYTHONPATH", ("PYTHON????",)) is None
    assert refusal("PYTHONHOME", ("PYTHON????",)) is None
    assert refusal("PYTHONSTARTUP", ("PYTHON????",)) is not None
    assert refusal("BASH_ENV", ("*",)) is None  # a host that trusts every name may say so


def test_names_are_case_sensitive() -> None:
    """The environment is: ld_preload is not what the loader reads, and allowing `path` does not
    open PATH."""
    for name in ("ld_preload", "Ld_Preload", "path", "Path", "bash_env", "pythonpath", "systemd_x"):
        assert refusal(name, ()) is None, name
    assert refusal("PATH", ("path",)) is not None
    assert refusal("LD_PRELOAD", ("ld_*",)) is not None


@pytest.mark.parametrize("name", [
    "MY_LD_PRELOAD", "XLD_PRELOAD", "OLD_PATH", "APP_PATH", "PATHS", "PATH_INFO", "MYPYTHONPATH",
    "NOT_BASH_ENV", "ENVIRONMENT", "ENV_FILE", "MY_ENV", "IFS_X", "XIFS", "TZ", "HOME", "LANG", "LC_ALL",
    "NODE_ENV", "JAVA_HOME", "SECRET", "PS1", "PS4X", "A_SYSTEMD_B", "XLISTEN_FDS", "NOTIFY_SOCKETS",
    "RUBYOPTS", "PERL", "PERLLIBX", "_JAVA_OPTIONS_X",
])
def test_names_that_merely_contain_a_pattern_are_allowed(name: str) -> None:
    assert refusal(name, ()) is None


NAMES = [name for pattern, _ in DENIED for name in examples(pattern)] + [
    "MY_LD_PRELOAD", "path", "PATHS", "LD", "LDX", "PYTHO", "BASH_FUNC", "A", "_", "SYSTEMD", "LISTEN",
]


@pytest.mark.parametrize("name", NAMES)
def test_the_regexes_the_host_registers_agree_with_the_globs(name: str) -> None:
    """The claim in the database refuses by denied_regexes(); unitspec by the globs: one answer."""
    by_regex = any(re.search(rx, name) for rx in denied_regexes())
    by_glob = refusal(name, ()) is not None
    assert by_regex == by_glob


@pytest.mark.parametrize("allowed", [("LD_PRELOAD",), ("LD_*",), ("PYTHON????",), ("*",), ("PATH", "BASH_ENV")])
def test_allowed_regexes_agree_with_the_globs(allowed: tuple[str, ...]) -> None:
    for name in NAMES:
        by_regex = any(re.search(rx, name) for rx in denied_regexes()) and not any(
            re.search(rx, name) for rx in allowed_regexes(allowed))
        assert by_regex == (refusal(name, allowed) is not None), (name, allowed)


def test_regexes_are_anchored() -> None:
    for rx in denied_regexes() + allowed_regexes(("LD_PRELOAD",)):
        assert rx.startswith("^") and rx.endswith("$")
    assert envpolicy.allowed_regexes(()) == ()
