"""Which environment names a run may set. Pure: no I/O.

The executable allowlist says which programs a run may start; a name in this list would let the
submitter change what such a program does once started (load a library, run a file, turn on a
debugger), so an allowed /opt/jobs/report.sh could run anything. They are refused by default, each
for the reason given, and `[runs] allowed_environment` opens those a host trusts. The anchors are
glibc's own list of variables it ignores for setuid programs (elf/dl-unsecvars.h), sudo's env_reset,
and what each interpreter documents it reads at start.

This is the one place the list lives: the unit spec refuses by it (unitspec.py), and each host
registers it as regular expressions (fleet.host_profile) that the claim in the database matches
(unitvisor.host_refusal), so a host never claims a run it would refuse.
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

# A name or a name glob, as `[runs] allowed_environment` accepts it.
NAME_PATTERN_RE = re.compile(r"^[A-Za-z_*?][A-Za-z0-9_*?]{0,127}\Z")


def refusal(name: str, allowed: tuple[str, ...]) -> str | None:
    """Why a run may not set `name` on a host that trusts `allowed`; None when it may."""
    if any(matches(name, pattern) for pattern in allowed):
        return None
    for pattern, why in DENIED:
        if matches(name, pattern):
            return (f"environment name {name} is refused: {why} "
                    "(a host that trusts it lists it in [runs] allowed_environment)")
    return None


def denied_regexes() -> tuple[str, ...]:
    """DENIED as anchored regular expressions that mean the same in Python and in PostgreSQL."""
    return tuple(glob_regex(pattern) for pattern, _ in DENIED)


def allowed_regexes(allowed: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(glob_regex(pattern) for pattern in allowed)
