"""Which environment names a run may set. Pure: no I/O.

An allowlist, not a denylist: a run may set a name only where the host's `[runs] allowed_environment`
names it (names, or globs such as `APP_*`), and the default opens only the locale and the time zone
(DEFAULT_ALLOWED). A denylist cannot be complete: a name that changes what an allowed program runs is
whatever that program reads (TAR_OPTIONS made an allowed backup script run the submitter's command;
GIT_CONFIG_*, RSYNC_RSH, LUA_INIT, MAKEFLAGS, LESSOPEN, DOTNET_STARTUP_HOOKS, OPENSSL_CONF passed
0.5's list), and no list of every program's variables exists.

DENIED stays, as the names known to load code (the dynamic loader's, the shells', the interpreters'),
each with its reason: such a name is opened only by its exact name in allowed_environment, never by a
pattern, so that `APP_*`, `*` or `L*` never opens LD_PRELOAD by accident. The anchors are glibc's own
list of variables it ignores for setuid programs (elf/dl-unsecvars.h), sudo's env_reset, and what each
interpreter documents it reads at start.

This is the one place the rule lives: the unit spec refuses by it (unitspec.py), and each host
registers its allowlist (exact names, pattern regexes) and DENIED's regexes (fleet.host_profile),
which the claim in the database matches (unitvisor.refused_environment_name, sql/migrations/015), so a host
never claims a run it would refuse.
"""

from __future__ import annotations

import re

from supervisor.globs import glob_regex, matches

# (pattern, why): a pattern is a name, or a prefix ending in `*`.
DENIED: tuple[tuple[str, str], ...] = (
    ("LD_*", "the dynamic loader loads and runs code from it (LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT)"),
    ("GCONV_PATH", "glibc loads character-set modules from it"),
    ("GETCONF_DIR", "glibc runs getconf helpers from it"),
    ("GLIBC_TUNABLES", "it changes glibc's allocator and loader, and has been an exploit vector"),
    ("HOSTALIASES", "glibc's resolver reads a file of its choosing"),
    ("LOCALDOMAIN", "it changes how glibc resolves host names"),
    ("RES_OPTIONS", "it changes how glibc resolves host names"),
    ("RESOLV_HOST_CONF", "glibc's resolver reads a file of its choosing"),
    ("LOCPATH", "glibc loads locale data from it"),
    ("NLSPATH", "glibc loads message catalogs from it"),
    ("NIS_PATH", "it changes where glibc looks up users and hosts"),
    ("MALLOC_TRACE", "glibc writes a file of its choosing"),
    ("TZDIR", "glibc loads time zone files from it"),
    ("PATH", "it chooses which programs an allowed script runs"),
    ("BASH_ENV", "bash runs the file it names before a script"),
    ("ENV", "sh runs the file it names"),
    ("BASH_FUNC_*", "bash imports shell functions from it"),
    ("SHELLOPTS", "it turns on shell options, such as xtrace with PS4"),
    ("BASHOPTS", "it turns on shell options"),
    ("PS4", "with xtrace the shell expands it, running any command substitution in it"),
    ("IFS", "it changes how a shell splits words"),
    ("CDPATH", "it changes which directory a script's cd enters"),
    ("PYTHON*", "Python reads start-up code, module paths and warning filters that import modules from it"),
    ("PERL5*", "Perl reads options and module paths from it (PERL5OPT, PERL5LIB, PERL5DB)"),
    ("PERLLIB", "Perl loads modules from it"),
    ("PERLIO", "Perl loads I/O layers from it"),
    ("RUBYOPT", "Ruby reads options, such as -r to load a library, from it"),
    ("RUBYLIB", "Ruby loads libraries from it"),
    ("NODE_OPTIONS", "Node.js reads options, such as --require, from it"),
    ("NODE_PATH", "Node.js loads modules from it"),
    ("JAVA_TOOL_OPTIONS", "the JVM reads options, such as -javaagent, from it"),
    ("_JAVA_OPTIONS", "the JVM reads options from it"),
    ("JDK_JAVA_OPTIONS", "the java launcher reads options from it"),
    ("SYSTEMD_*", "systemd's tools and libraries change their behaviour by it"),
    ("NOTIFY_SOCKET", "it would let the run speak for a service to systemd"),
    ("LISTEN_*", "it would make the run take file descriptors for sockets it was not given"),
)

# What a host allows when its config does not say: the locale and the time zone, which every program
# may read and none runs code from. A host that sets allowed_environment replaces this list (list these
# again to keep them).
DEFAULT_ALLOWED: tuple[str, ...] = ("LANG", "LANGUAGE", "LC_*", "TZ")

# A name or a name glob, as `[runs] allowed_environment` accepts it.
NAME_PATTERN_RE = re.compile(r"^[A-Za-z_*?][A-Za-z0-9_*?]{0,127}\Z")


def is_pattern(entry: str) -> bool:
    return "*" in entry or "?" in entry


def _denied(name: str) -> str | None:
    for pattern, why in DENIED:
        if matches(name, pattern):
            return why
    return None


def refusal(name: str, allowed: tuple[str, ...]) -> str | None:
    """Why a run may not set `name` on a host whose allowed_environment is `allowed`; None when it may.
    Case-sensitive, as the environment is."""
    if name in allowed:
        return None
    why = _denied(name)
    if why:
        return (f"environment name {name} is refused: {why} "
                "(a host that trusts it lists the exact name in [runs] allowed_environment; a pattern never "
                "opens it)")
    if any(matches(name, pattern) for pattern in allowed if is_pattern(pattern)):
        return None
    return f"environment name {name} is not in this host's [runs] allowed_environment"


def pattern_problem(pattern: str) -> str | None:
    """Why a pattern in allowed_environment can open nothing (every name it matches is on DENIED, which
    only exact names open), so that a 0.5 config's `PYTHON*` is an error that says so rather than a
    silent no-op; None for a pattern that can open something, or a plain name."""
    if not is_pattern(pattern):
        return None
    literal = pattern[:min(i for i in (pattern.find("*"), pattern.find("?")) if i >= 0)]
    for denied, _ in DENIED:
        if denied.endswith("*") and literal.startswith(denied[:-1]):
            return (f"{pattern!r} matches only names of {denied}, which a pattern never opens: list each name "
                    f"you trust by its exact name (supervisor/envpolicy.py says why {denied} is refused)")
    return None


def denied_regexes() -> tuple[str, ...]:
    """DENIED as anchored regular expressions that mean the same in Python and in PostgreSQL."""
    return tuple(glob_regex(pattern) for pattern, _ in DENIED)


def allowed_names(allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The entries of allowed_environment that are plain names: each opens exactly itself, DENIED too."""
    return tuple(entry for entry in allowed if not is_pattern(entry))


def allowed_pattern_regexes(allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The entries that are patterns, as anchored regular expressions: each opens what it matches that
    DENIED does not."""
    return tuple(glob_regex(entry) for entry in allowed if is_pattern(entry))
