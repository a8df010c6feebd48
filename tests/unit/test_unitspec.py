"""supervisor.unitspec: the unit name (the idempotency key) and the transient unit's properties."""

from __future__ import annotations

import dataclasses
import fnmatch
import uuid

import pytest

from supervisor import config, envpolicy, taskspeak
from supervisor.config import DatabaseSettings, RunSettings, Settings, SystemdSettings
from supervisor.model import Attempt, Run
from supervisor.unitspec import (
    UNIT_GLOB,
    UNIT_NAME_FORMAT,
    Refused,
    _check_executable,
    build,
    environment,
    parse_unit_name,
    unit_name,
)
from tests.unit.test_sandbox import SANDBOX_DEFAULTS

RUN_ID = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")
NAME_1 = "unitvisor-run-12345678-9abc-4def-8123-456789abcdef-1.service"


def settings(**runs):
    """Settings with [runs] overridden; /usr/bin/* and /bin/sh allowed unless told otherwise, and every
    environment name but the denylist's (`*`): the tests of the allowlist's default say so."""
    runs.setdefault("allowed_executables", ("/bin/sh", "/usr/bin/*"))
    runs.setdefault("allowed_environment", ("*",))
    return dataclasses.replace(Settings(), runs=RunSettings(**runs))


def make(argv=("/bin/sh", "-c", "true"), attempt=1, **fields):
    run = Run(id=RUN_ID, argv=list(argv), **fields)
    return run, Attempt(run_id=RUN_ID, attempt=attempt, host_id="h1", unit_name=unit_name(RUN_ID, attempt))


def props_for(argv=("/bin/sh", "-c", "true"), attempt=1, cfg=None, **fields):
    run, att = make(argv, attempt, **fields)
    return build(run, att, cfg or settings())


def text(value):
    return value.decode() if isinstance(value, bytes) else value


# -- unit_name --------------------------------------------------------------------------------------

def test_unit_name_format():
    assert unit_name(RUN_ID, 1) == NAME_1
    assert unit_name(RUN_ID, 27) == "unitvisor-run-12345678-9abc-4def-8123-456789abcdef-27.service"
    assert UNIT_NAME_FORMAT == "unitvisor-run-%s-%s.service"


def test_unit_name_is_deterministic():
    other = uuid.UUID(str(RUN_ID))
    assert unit_name(RUN_ID, 3) == unit_name(other, 3) == unit_name(RUN_ID, 3)


def test_unit_name_differs_per_run_and_attempt():
    other = uuid.UUID("00000000-0000-4000-8000-000000000000")
    names = {unit_name(RUN_ID, 1), unit_name(RUN_ID, 2), unit_name(other, 1), unit_name(other, 2)}
    assert len(names) == 4


def test_unit_name_is_lowercase_even_for_an_uppercase_uuid_literal():
    assert unit_name(uuid.UUID("12345678-9ABC-4DEF-8123-456789ABCDEF"), 1) == NAME_1


def test_unit_name_matches_the_glob_the_reconciler_lists():
    assert UNIT_GLOB == "unitvisor-run-*.service"
    assert fnmatch.fnmatchcase(unit_name(RUN_ID, 5), UNIT_GLOB)


@pytest.mark.parametrize("run_id", [str(RUN_ID), RUN_ID.hex, RUN_ID.int, None, "../../etc/passwd", b"x"])
def test_unit_name_rejects_non_uuid(run_id):
    with pytest.raises(ValueError, match="no unit name for run"):
        unit_name(run_id, 1)


@pytest.mark.parametrize("attempt", [0, -1, "1", 1.0, None])
def test_unit_name_rejects_bad_attempt(attempt):
    with pytest.raises(ValueError, match="no unit name for run"):
        unit_name(RUN_ID, attempt)


def test_unit_name_rejects_bool_attempt():
    with pytest.raises(ValueError):
        unit_name(RUN_ID, True)


# -- parse_unit_name --------------------------------------------------------------------------------

@pytest.mark.parametrize("attempt", [1, 2, 9, 10, 1000, 999_999_999])
def test_parse_unit_name_round_trip(attempt):
    parsed = parse_unit_name(unit_name(RUN_ID, attempt))
    assert parsed == (RUN_ID, attempt)
    assert isinstance(parsed[0], uuid.UUID)
    assert isinstance(parsed[1], int)


def test_parse_unit_name_random_round_trips():
    for _ in range(50):
        run_id = uuid.uuid4()
        assert parse_unit_name(unit_name(run_id, 7)) == (run_id, 7)


U = str(RUN_ID)


@pytest.mark.parametrize("name", [
    "",
    "unitvisor-run-",
    "unitvisor.service",
    f"unitvisor-run-{U}.service",                       # no attempt
    f"unitvisor-run-{U}-0.service",                     # attempt 0
    f"unitvisor-run-{U}-01.service",                    # leading zero
    f"unitvisor-run-{U}--1.service",
    f"unitvisor-run-{U}-1234567890.service",            # more digits than the pattern allows
    f"unitvisor-run-{U.upper()}-1.service",             # uppercase
    f"UNITVISOR-RUN-{U}-1.service",
    f"unitvisor-run-{U}-1.SERVICE",
    f"unitvisor-run-{RUN_ID.hex}-1.service",            # no hyphens in the UUID
    f"unitvisor-run-{{{U}}}-1.service",                 # braces
    f"unitvisor-run-{U}-1.scope",
    f"unitvisor-run-{U}-1.service.d",                   # extra suffixes
    f"unitvisor-run-{U}-1.service.service",
    f"unitvisor-run-{U}-1.service/../../x",
    f"unitvisor-run-{U}-1.service.wants/x.service",
    f"unitvisor-run-{U}-1-2.service",
    f"x-unitvisor-run-{U}-1.service",                   # prefix before ours
    f"/run/systemd/transient/unitvisor-run-{U}-1.service",
    "unitvisor-run-../../../etc/passwd-1.service",      # path traversal
    f"unitvisor-run-{U[:-2]}/.-1.service",
    f"../unitvisor-run-{U}-1.service",
    f"unitvisor-run-{U}-1@.service",                    # template instance syntax
    f"unitvisor-run@{U}-1.service",
    f"unitvisor-run-{U}-1@x.service",
    f"unitvisor-run-{U}-1\n.service",                   # newline inside
    f"unitvisor-run-{U}\n-1.service",
    f"\nunitvisor-run-{U}-1.service",
    f"unitvisor-run-{U}-1.service\x00",
    f"unitvisor-run-{U}-1.service ",
    f" unitvisor-run-{U}-1.service",
    f"unitvisor-run-{U}-1 .service",
    f"unitvisor-run-{U}-\u0661.service",                # a non-ASCII digit
    f"unitvisor-run-{U[:8]}-{U[9:13]}-{U[14:18]}-{U[19:23]}-{U[24:]}0-1.service",  # 13 hex digits at the end
    "unitvisor-run-g2345678-9abc-4def-8123-456789abcdef-1.service",  # not hex
])
def test_parse_unit_name_rejects_hostile_names(name):
    assert parse_unit_name(name) is None


def test_parse_unit_name_rejects_trailing_newline():
    assert parse_unit_name(NAME_1 + "\n") is None


# -- build: identity and mechanics ------------------------------------------------------------------

def test_build_core_properties():
    props = props_for(attempt=2)
    assert props[b"Description"] == f"unitvisor run {RUN_ID} attempt 2".encode()
    assert props[b"Slice"] == b"unitvisor.slice"
    assert props[b"Type"] == b"exec"
    # An ended unit is kept loaded by the daemon's reference (AddRef), not as active/exited.
    assert props[b"RemainAfterExit"] is False
    assert props[b"AddRef"] is True
    assert props[b"KillMode"] == b"control-group"
    assert props[b"SendSIGKILL"] is True
    assert props[b"TimeoutStopUSec"] == 10_000_000
    assert props[b"LogExtraFields"] == [f"UNITVISOR_RUN={RUN_ID}".encode(), b"UNITVISOR_ATTEMPT=2"]


def test_build_exact_key_set_without_options():
    props = props_for()
    assert set(props) == {
        b"Description", b"Slice", b"Type", b"RemainAfterExit", b"AddRef", b"ExecStartEx", b"LogExtraFields",
        b"KillMode", b"TimeoutStopUSec", b"SendSIGKILL", b"NoNewPrivileges", b"PrivateTmp", b"ProtectSystem",
        b"ProtectHome", b"DynamicUser", b"CPUAccounting", b"MemoryAccounting", b"IOAccounting",
        b"TasksAccounting", b"ExecStopPostEx",
    } | set(SANDBOX_DEFAULTS)


def test_build_asks_systemd_for_the_accounting_an_outcome_records():
    props = props_for()
    assert (props[b"CPUAccounting"], props[b"MemoryAccounting"], props[b"IOAccounting"]) == (True, True, True)


def test_build_exec_start_ex_passes_argv_with_no_env_expand():
    props = props_for(["/bin/sh", "-c", "echo hi"])
    assert props[b"ExecStartEx"] == [(b"/bin/sh", [b"/bin/sh", b"-c", b"echo hi"], [b"no-env-expand"])]


HOSTILE_ARGS = [
    "$HOME", "${HOME}", "$$", "%n", "%i %u %%", "with space", "  leading and trailing  ", "'single'", '"double"',
    "line1\nline2", "tab\there", "back\\slash", ";rm -rf /", "`id`", "$(id)", "*", "~", "", "-", "--", "ünïcødé ✓",
    "a=b", "\r",
]


def test_build_argv_is_passed_byte_identical():
    argv = ["/usr/bin/printf", *HOSTILE_ARGS]
    path, args, flags = props_for(argv)[b"ExecStartEx"][0]
    assert path == b"/usr/bin/printf"
    assert args == [a.encode("utf-8") for a in argv]
    assert [a.decode("utf-8") for a in args] == argv
    assert len(args) == len(argv)
    assert flags == [b"no-env-expand"]


def test_build_argv_zero_is_the_executable_and_is_repeated_in_args():
    path, args, _ = props_for(["/usr/bin/env"])[b"ExecStartEx"][0]
    assert path == b"/usr/bin/env"
    assert args == [b"/usr/bin/env"]


def test_build_does_not_mutate_the_runs_argv():
    run, att = make(["/bin/sh", "-c", "x"])
    build(run, att, settings())
    assert run.argv == ["/bin/sh", "-c", "x"]


def test_build_is_deterministic():
    run, att = make(["/bin/sh", "-c", "x"], memory_max=1 << 30, environment={"A": "1"})
    assert build(run, att, settings()) == build(run, att, settings())


def test_build_refuses_mismatched_attempt_unit_name():
    run, att = make()
    wrong = dataclasses.replace(att, unit_name=unit_name(RUN_ID, 2))
    with pytest.raises(Refused) as info:
        build(run, wrong, settings())
    assert str(info.value) == f"attempt row names unit {wrong.unit_name!r}, expected {NAME_1}"


def test_build_refuses_attempt_of_another_run():
    run, _ = make()
    other = uuid.UUID("00000000-0000-4000-8000-000000000000")
    att = Attempt(run_id=other, attempt=1, host_id="h1", unit_name=unit_name(other, 1))
    with pytest.raises(Refused, match="attempt row names unit"):
        build(run, att, settings())


def test_build_refuses_hand_edited_unit_name():
    run, att = make()
    with pytest.raises(Refused):
        build(run, dataclasses.replace(att, unit_name="sshd.service"), settings())


# -- build: limits ----------------------------------------------------------------------------------

def test_build_limits():
    props = props_for(memory_max=512 << 20, cpu_quota_percent=50, tasks_max=100, io_weight=200, runtime_max_sec=90)
    assert props[b"MemoryMax"] == 536_870_912
    assert props[b"MemorySwapMax"] == 0  # memory_max bounds swap too
    assert props[b"CPUQuotaPerSecUSec"] == 500_000
    assert props[b"TasksMax"] == 100
    assert props[b"IOWeight"] == 200
    assert props[b"RuntimeMaxUSec"] == 90_000_000


@pytest.mark.parametrize(("percent", "usec"), [(1, 10_000), (50, 500_000), (100, 1_000_000), (150, 1_500_000),
                                               (200, 2_000_000), (100000, 1_000_000_000)])
def test_build_cpu_quota_is_percent_times_10000(percent, usec):
    assert props_for(cpu_quota_percent=percent)[b"CPUQuotaPerSecUSec"] == usec


@pytest.mark.parametrize(("seconds", "usec"), [(1, 1_000_000), (3600, 3_600_000_000),
                                               (315_360_000, 315_360_000_000_000)])
def test_build_runtime_max_is_seconds_times_a_million(seconds, usec):
    assert props_for(runtime_max_sec=seconds)[b"RuntimeMaxUSec"] == usec


def test_build_limits_are_integers():
    props = props_for(memory_max=1 << 20, cpu_quota_percent=33, tasks_max=1, io_weight=1, runtime_max_sec=1)
    for key in (b"MemoryMax", b"CPUQuotaPerSecUSec", b"TasksMax", b"IOWeight", b"RuntimeMaxUSec",
                b"TimeoutStopUSec"):
        assert type(props[key]) is int, key
    assert props[b"CPUQuotaPerSecUSec"] == 330_000


def test_build_without_limits_sets_none():
    props = props_for()
    for key in (b"MemoryMax", b"MemorySwapMax", b"MemoryHigh", b"CPUQuotaPerSecUSec", b"TasksMax", b"IOWeight",
                b"RuntimeMaxUSec"):
        assert key not in props


def test_build_memory_high_is_memory_high_alone():
    """MemoryHigh= throttles; it brings no MemorySwapMax= of its own (that comes with memory_max)."""
    props = props_for(memory_high=384 << 20)
    assert props[b"MemoryHigh"] == 402_653_184 and type(props[b"MemoryHigh"]) is int
    assert b"MemoryMax" not in props and b"MemorySwapMax" not in props
    both = props_for(memory_high=384 << 20, memory_max=512 << 20)
    assert (both[b"MemoryHigh"], both[b"MemoryMax"], both[b"MemorySwapMax"]) == (384 << 20, 512 << 20, 0)


def test_build_every_unit_copies_its_tasks_peak_at_its_end():
    """The same fixed command in every unit, root's and a DynamicUser's alike: no run's data in it."""
    first, second = props_for(), props_for(argv=("/usr/bin/true",), attempt=2, run_user="root",
                                           cfg=settings(allowed_users=("root",)))
    assert first[b"ExecStopPostEx"] == second[b"ExecStopPostEx"] == [taskspeak.STOP_POST_COMMAND]
    assert first[b"TasksAccounting"] is True
    assert b"ExecStopPostEx" not in build(*make(), settings(), copy_tasks_peak=False)


def test_build_single_limit_sets_only_that_one():
    props = props_for(tasks_max=7)
    assert props[b"TasksMax"] == 7
    for key in (b"MemoryMax", b"CPUQuotaPerSecUSec", b"IOWeight", b"RuntimeMaxUSec"):
        assert key not in props


# -- build: user ------------------------------------------------------------------------------------

def test_build_dynamic_user_by_default():
    props = props_for()
    assert props[b"DynamicUser"] is True
    assert b"User" not in props


def test_build_configured_user():
    props = props_for(cfg=settings(user="runner"))
    assert text(props[b"User"]) == "runner"
    assert b"DynamicUser" not in props


def test_build_run_user_in_allowed_users():
    props = props_for(run_user="alice", cfg=settings(allowed_users=("bob", "alice")))
    assert text(props[b"User"]) == "alice"
    assert b"DynamicUser" not in props


def test_build_run_user_equal_to_configured_user_needs_no_allowlist_entry():
    props = props_for(run_user="runner", cfg=settings(user="runner"))
    assert text(props[b"User"]) == "runner"


def test_build_run_user_overrides_configured_user_when_allowed():
    props = props_for(run_user="alice", cfg=settings(user="runner", allowed_users=("alice",)))
    assert text(props[b"User"]) == "alice"


@pytest.mark.parametrize("cfg", [settings(), settings(user="runner"), settings(allowed_users=("bob",))])
def test_build_refuses_run_user_not_allowed(cfg):
    with pytest.raises(Refused) as info:
        props_for(run_user="root", cfg=cfg)
    assert str(info.value) == "user root is not in this host's allowed_users"


def test_build_empty_run_user_means_host_default():
    assert props_for(run_user="")[b"DynamicUser"] is True
    assert text(props_for(run_user="", cfg=settings(user="runner"))[b"User"]) == "runner"


# -- build: executable allowlist --------------------------------------------------------------------

def test_build_allowlist_exact_match():
    cfg = settings(allowed_executables=("/bin/true",))
    assert props_for(["/bin/true"], cfg=cfg)[b"ExecStartEx"][0][0] == b"/bin/true"
    with pytest.raises(Refused) as info:
        props_for(["/bin/false"], cfg=cfg)
    assert str(info.value) == "executable /bin/false is not in this host's allowed_executables"


def test_build_allowlist_exact_match_is_not_a_prefix_match():
    cfg = settings(allowed_executables=("/bin/true",))
    for path in ("/bin/true2", "/bin/tru", "/bin/true/x"):
        with pytest.raises(Refused, match="not in this host's allowed_executables"):
            props_for([path], cfg=cfg)


def test_build_allowlist_is_case_sensitive():
    with pytest.raises(Refused, match="not in this host's allowed_executables"):
        props_for(["/BIN/SH"], cfg=settings(allowed_executables=("/bin/sh",)))


def test_build_allowlist_glob():
    cfg = settings(allowed_executables=("/usr/bin/*",))
    assert props_for(["/usr/bin/python3", "-V"], cfg=cfg)[b"ExecStartEx"][0][0] == b"/usr/bin/python3"
    for path in ("/usr/sbin/python3", "/usr/bin", "/usr/local/bin/x", "/bin/sh"):
        with pytest.raises(Refused, match="not in this host's allowed_executables"):
            props_for([path], cfg=cfg)


def test_build_allowlist_any_pattern_matches():
    cfg = settings(allowed_executables=("/bin/true", "/opt/*/bin/tool"))
    assert props_for(["/opt/a/bin/tool"], cfg=cfg)[b"ExecStartEx"][0][0] == b"/opt/a/bin/tool"
    assert props_for(["/bin/true"], cfg=cfg)[b"ExecStartEx"][0][0] == b"/bin/true"


def test_build_empty_allowlist_refuses_everything():
    with pytest.raises(Refused) as info:
        props_for(["/bin/sh"], cfg=settings(allowed_executables=()))
    assert str(info.value) == "this host allows no executables ([runs] allowed_executables is empty)"


@pytest.mark.parametrize("path", [
    "/usr/bin/../../tmp/x", "/usr/bin/../bin/sh", "/usr/bin/./python3", "/usr/bin//python3", "//usr/bin/python3",
    "///usr/bin/python3", "/usr/bin/python3/", "/usr/bin/.", "/usr/bin/..",
])
def test_build_refuses_non_normalised_paths_even_when_a_glob_would_match(path):
    cfg = settings(allowed_executables=("/usr/bin/*", "/*", "*"))
    with pytest.raises(Refused) as info:
        props_for([path], cfg=cfg)
    assert str(info.value) == f"executable {path!r} is not a normalised absolute path"


@pytest.mark.parametrize("path", ["sh", "bin/sh", "./sh", "../usr/bin/sh", "", "~/x", " /bin/sh"])
def test_build_refuses_relative_executables(path):
    with pytest.raises(Refused, match="is not a normalised absolute path"):
        props_for([path], cfg=settings(allowed_executables=("*",)))


def test_build_checks_path_before_allowlist():
    with pytest.raises(Refused, match="is not a normalised absolute path"):
        props_for(["/usr/bin/../x"], cfg=settings(allowed_executables=()))


@pytest.mark.parametrize("argv", [["/bin/sh\0"], ["/bin/sh", "a\0b"], ["/bin/sh", "-c", "\0"]])
def test_build_refuses_nul_in_argv(argv):
    with pytest.raises(Refused) as info:
        props_for(argv)
    assert str(info.value) == "argv contains a NUL byte"


@pytest.mark.parametrize("argv", [[], ["/bin/sh", 1], ["/bin/sh", None], [b"/bin/sh"], ["/bin/sh", b"x"]])
def test_build_refuses_empty_or_non_string_argv(argv):
    with pytest.raises(Refused) as info:
        props_for(argv)
    assert str(info.value) == "argv is empty or not a list of strings"


# -- build: environment -----------------------------------------------------------------------------

def env_of(cfg=None, **fields):
    run, _ = make(**fields)
    return environment(run, (cfg or settings()).runs)


def test_environment_is_verbatim():
    env = {"A_1": "$HOME %n", "_x": "", "EQ": "a=b=c", "Q": "'\"\\", "T": "tab\there", "G": "grüß"}
    assert env_of(environment=env) == env


@pytest.mark.parametrize("env", [{}, {"A": "1"}, {"SECRET": "s3cr3t", "B": "x"}])
def test_build_never_puts_the_environment_in_a_property(env):
    """Any local user reads a unit's properties over D-Bus: the values go through a root-only file
    (runenv.py), which the reconciler adds as EnvironmentFiles=."""
    props = props_for(environment=env)
    assert b"Environment" not in props and b"EnvironmentFiles" not in props
    assert not any(b"s3cr3t" in repr(value).encode() for value in props.values())


@pytest.mark.parametrize(("pattern", "why"), envpolicy.DENIED)
def test_build_refuses_every_name_the_policy_refuses(pattern, why):
    name = pattern.replace("*", "X")
    with pytest.raises(Refused) as info:
        props_for(environment={"OK": "1", name: "v"})
    assert str(info.value) == envpolicy.refusal(name, ())
    assert why in str(info.value)


@pytest.mark.parametrize(("pattern", "why"), envpolicy.DENIED)
def test_build_accepts_a_refused_name_the_host_allows(pattern, why):
    name = pattern.replace("*", "X")
    cfg = settings(allowed_environment=(name,))
    assert b"ExecStartEx" in props_for(environment={name: "v"}, cfg=cfg)
    assert env_of(cfg, environment={name: "v"}) == {name: "v"}


def test_build_allows_names_that_only_contain_a_refused_one():
    env = {"MY_LD_PRELOAD": "x", "APP_PATH": "/srv", "XPYTHONPATH": "y", "NOT_BASH_ENV": "z", "path": "lower"}
    assert env_of(environment=env) == env


@pytest.mark.parametrize("name", ["1ABC", "A-B", "A B", "A=B", "", "A.B", "Ä", "A\nB", "A" * 129, 5, None])
def test_build_refuses_invalid_environment_names(name):
    with pytest.raises(Refused) as info:
        props_for(environment={name: "v"})
    assert str(info.value) == f"environment name {name!r} is not valid"


def test_build_accepts_longest_environment_name():
    name = "A" * 128
    assert env_of(environment={name: "v"}) == {name: "v"}


def test_build_refuses_environment_name_with_trailing_newline():
    with pytest.raises(Refused):
        props_for(environment={"FOO\n": "v"})


@pytest.mark.parametrize("value", ["a\nb", "\n", "trailing\n", "a\0b", 5, None, ["x"], True])
def test_build_refuses_invalid_environment_values(value):
    with pytest.raises(Refused) as info:
        props_for(environment={"NAME": value})
    assert str(info.value) == "environment value of NAME must be a string without NUL or newline"


@pytest.mark.parametrize("env", [["A=1"], "A=1", None, [("A", "1")]])
def test_build_refuses_environment_that_is_not_a_dict(env):
    with pytest.raises(Refused) as info:
        props_for(environment=env)
    assert str(info.value) == "environment is not an object of NAME: value"


# -- build: working directory -----------------------------------------------------------------------

def test_build_working_directory():
    assert props_for(working_directory="/srv/data dir")[b"WorkingDirectory"] == b"/srv/data dir"


def test_build_no_working_directory():
    assert b"WorkingDirectory" not in props_for(working_directory=None)


@pytest.mark.parametrize("wd", ["relative", "", "./x", "~", "/srv/\0x"])
def test_build_refuses_bad_working_directory(wd):
    with pytest.raises(Refused) as info:
        props_for(working_directory=wd)
    assert str(info.value) == f"working directory {wd!r} is not an absolute path"


# -- build: settings --------------------------------------------------------------------------------

def test_build_sandbox_defaults():
    props = props_for()
    assert props[b"NoNewPrivileges"] is True
    assert props[b"PrivateTmp"] is True
    assert props[b"ProtectSystem"] == b"strict"
    assert props[b"ProtectHome"] == b"yes"


def test_build_sandbox_from_settings():
    cfg = settings(no_new_privileges=False, private_tmp=False, protect_system="full", protect_home="read-only")
    props = props_for(cfg=cfg)
    assert props[b"NoNewPrivileges"] is False
    assert props[b"PrivateTmp"] is False
    assert props[b"ProtectSystem"] == b"full"
    assert props[b"ProtectHome"] == b"read-only"


def test_build_slice_and_stop_grace_from_settings():
    cfg = dataclasses.replace(settings(), systemd=SystemdSettings(slice="batch.slice", stop_grace=2.5))
    props = props_for(cfg=cfg)
    assert props[b"Slice"] == b"batch.slice"
    assert props[b"TimeoutStopUSec"] == 2_500_000


def test_build_with_settings_from_a_config_file():
    cfg = config.parse("""
[systemd]
slice = "jobs.slice"
stop_grace = "1m"

[runs]
allowed_executables = ["/opt/app/bin/*"]
user = "appuser"
allowed_users = ["deploy"]
protect_system = "no"
protect_home = "tmpfs"
private_tmp = false
""")
    props = props_for(["/opt/app/bin/job", "--flag"], cfg=cfg)
    assert props[b"Slice"] == b"jobs.slice"
    assert props[b"TimeoutStopUSec"] == 60_000_000
    assert text(props[b"User"]) == "appuser"
    assert props[b"ProtectSystem"] == b"no"
    assert props[b"ProtectHome"] == b"tmpfs"
    assert props[b"PrivateTmp"] is False
    assert props[b"NoNewPrivileges"] is True
    assert text(props_for(["/opt/app/bin/job"], run_user="deploy", cfg=cfg)[b"User"]) == "deploy"
    with pytest.raises(Refused, match="not in this host's allowed_executables"):
        props_for(["/bin/sh"], cfg=cfg)


def test_allowlist_glob_matches_one_path_component_like_a_shell():
    _check_executable(["/usr/bin/env"], ("/usr/bin/*",))
    with pytest.raises(Refused, match="not in this host's allowed_executables"):
        _check_executable(["/usr/bin/sub/x"], ("/usr/bin/*",))
    _check_executable(["/opt/tool-2/bin/run"], ("/opt/tool-*/bin/run",))


KEPT_OUT = [b"-/run/systemd/private", b"-/var/run/systemd/private", b"-/run/systemd/io.systemd.Manager",
            b"-/var/run/systemd/io.systemd.Manager", b"-/run/systemd/ask-password",
            b"-/var/run/systemd/ask-password", b"-/run/dbus/system_bus_socket",
            b"-/var/run/dbus/system_bus_socket", b"-/run/unitvisor", b"-/var/run/unitvisor"] + [
            b"-" + prefix + path
            for path in (b"/run/systemd/io.systemd.sysext", b"/run/systemd/io.systemd.Credentials",
                         b"/run/systemd/io.systemd.PCRExtend", b"/run/systemd/io.systemd.BootControl",
                         b"/run/systemd/io.systemd.Hostname", b"/run/systemd/io.systemd.ManagedOOM",
                         b"/run/systemd/machine/io.systemd.Machine", b"/run/udev/control")
            for prefix in (b"", b"/var")] + [b"-/etc/unitvisor"]


@pytest.mark.parametrize(("runs", "run_user"), [
    ({"allowed_users": ("root",)}, "root"),
    ({"user": "root", "allowed_users": ("root",)}, None),
    ({"no_new_privileges": False}, None),
    ({"user": "deploy", "no_new_privileges": False}, None),
])
def test_a_run_that_may_become_root_is_kept_out_of_the_daemons_runtime_directory(runs, run_user):
    """Every run's environment file is there, and root owns them: a run as root, or one whose
    set-user-id programs work (NoNewPrivileges off), could read them all."""
    props = props_for(cfg=settings(**runs), run_user=run_user)
    assert props[b"InaccessiblePaths"] == KEPT_OUT


@pytest.mark.parametrize(("runs", "run_user"), [
    ({"allowed_users": ("root",)}, "root"),
    ({"no_new_privileges": False}, None),
])
def test_a_run_that_may_become_root_cannot_reach_pid_1_the_bus_the_dsn_or_a_writable_run(runs, run_user):
    """Issue 21: a root run asked PID 1 over /run/systemd/private or the system bus for a transient unit
    (root, every capability, no sandbox), read /etc/unitvisor/dsn, and wrote a drop-in under a /run
    that ProtectSystem=strict had not kept read-only."""
    props = props_for(cfg=settings(**runs), run_user=run_user)
    hidden = {path.removeprefix(b"-") for path in props[b"InaccessiblePaths"]}
    assert {b"/run/systemd/private", b"/run/dbus/system_bus_socket", b"/var/run/dbus/system_bus_socket",
            b"/etc/unitvisor", b"/run/unitvisor"} <= hidden
    assert props[b"ReadOnlyPaths"] == [b"-/run", b"-/var/run"]


def test_a_dsn_file_elsewhere_is_kept_from_a_root_run_too():
    cfg = dataclasses.replace(settings(allowed_users=("root",)),
                              database=DatabaseSettings(dsn_file="/srv/secrets/unitvisor.dsn"))
    props = props_for(cfg=cfg, run_user="root")
    assert props[b"InaccessiblePaths"] == KEPT_OUT + [b"-/srv/secrets/unitvisor.dsn"]


@pytest.mark.parametrize(("runs", "run_user"), [
    ({}, None),
    ({"user": "deploy"}, None),
    ({"allowed_users": ("deploy", "root")}, "deploy"),
    ({"user": "deploy", "private_tmp": False, "protect_system": "no", "protect_home": "no"}, None),
])
def test_a_run_that_cannot_become_root_gets_no_mount_namespace_for_it(runs, run_user):
    """The directory's mode (0700, root's) keeps it out; the path alone would give the unit a mount
    namespace, which halves systemd's start rate where the sandbox's namespaces are off."""
    props = props_for(cfg=settings(**runs), run_user=run_user)
    assert b"InaccessiblePaths" not in props and b"ReadOnlyPaths" not in props


def test_a_host_with_the_default_allowlist_refuses_a_name_it_does_not_name():
    """Issue 21: TAR_OPTIONS made an allowed backup script run the submitter's command; the denylist
    let it through. The default opens the locale and the time zone only."""
    cfg = dataclasses.replace(Settings(), runs=RunSettings(allowed_executables=("/bin/sh",)))
    with pytest.raises(Refused, match=r"^environment name TAR_OPTIONS is not in this host's \[runs\] "
                                      r"allowed_environment$"):
        props_for(environment={"LANG": "C.UTF-8", "TAR_OPTIONS": "--checkpoint-action=exec=x"}, cfg=cfg)
    assert env_of(cfg, environment={"LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC"}) == {
        "LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC"}
