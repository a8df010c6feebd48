"""supervisor.config: the TOML file -> validated Settings, and where the DSN comes from."""

from __future__ import annotations

import dataclasses
import os

import pytest

from supervisor import config
from supervisor.config import (
    ConfigError,
    DaemonSettings,
    DatabaseSettings,
    HostSettings,
    RunSettings,
    Settings,
    SystemdSettings,
    load,
    parse,
    resolve_dsn,
)


@pytest.fixture(autouse=True)
def _no_dsn_env(monkeypatch):
    monkeypatch.delenv("UNITVISOR_DSN", raising=False)


# -- defaults ---------------------------------------------------------------------------------------

def test_defaults():
    s = Settings()
    assert s.source == "defaults"
    assert s.database == DatabaseSettings(dsn="", dsn_file="/etc/unitvisor/dsn")
    assert s.host == HostSettings(id="", name="", max_runs=64, memory_budget=None)
    assert s.daemon == DaemonSettings(poll_interval=10.0, reconcile_interval=60.0, claim_batch=32,
                                      stop_orphans=True)
    assert s.systemd == SystemdSettings(slice="unitvisor.slice", stop_grace=10.0)
    assert s.runs == RunSettings(allowed_executables=(), user="", allowed_users=(), no_new_privileges=True,
                                 private_tmp=True, protect_system="strict", protect_home="yes")


def test_load_without_a_file_at_the_default_path_gives_defaults(monkeypatch, tmp_path):
    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "absent.toml")
    assert load(None) == Settings()
    assert load(None).source == "defaults"


def test_load_reads_the_default_path_when_it_exists(monkeypatch, tmp_path):
    path = tmp_path / "unitvisor.toml"
    path.write_text('[host]\nmax_runs = 3\n')
    monkeypatch.setattr(config, "DEFAULT_PATH", path)
    settings = load(None)
    assert settings.host.max_runs == 3
    assert settings.source == str(path)


def test_load_explicit_missing_file_is_an_error(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == f"{path}: no such file"


def test_load_unreadable_path_is_an_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        load(tmp_path)  # a directory
    assert str(info.value).startswith(f"{tmp_path}: cannot read: ")


def test_load_explicit_file(tmp_path):
    path = tmp_path / "u.toml"
    path.write_text('[systemd]\nslice = "batch.slice"\nstop_grace = "30s"\n')
    settings = load(path)
    assert settings.systemd == SystemdSettings(slice="batch.slice", stop_grace=30.0)
    assert settings.source == str(path)
    assert settings.host == HostSettings()


def test_empty_text_gives_defaults_with_source():
    settings = parse("", "x.toml")
    assert dataclasses.replace(settings, source="defaults") == Settings()
    assert settings.source == "x.toml"


def test_empty_sections_give_defaults():
    text = "[database]\n[host]\n[daemon]\n[systemd]\n[runs]\n"
    assert dataclasses.replace(parse(text), source="defaults") == Settings()


def test_full_file():
    text = """
[database]
dsn = "postgresql://u@db/unitvisor"
dsn_file = "/run/secrets/dsn"

[host]
id = "host-a"
name = "a.example"
max_runs = 8
memory_budget = "16G"

[daemon]
poll_interval = "2s"
reconcile_interval = "5m"
claim_batch = 4
stop_orphans = false

[systemd]
slice = "batch-jobs.slice"
stop_grace = 2.5

[runs]
allowed_executables = ["/usr/bin/python3", "/opt/tools/*"]
user = "runner"
allowed_users = ["alice", "_svc-1"]
no_new_privileges = false
private_tmp = false
protect_system = "full"
protect_home = "read-only"
"""
    s = parse(text, "full.toml")
    assert s.database == DatabaseSettings(dsn="postgresql://u@db/unitvisor", dsn_file="/run/secrets/dsn")
    assert s.host == HostSettings(id="host-a", name="a.example", max_runs=8, memory_budget=16 << 30)
    assert s.daemon == DaemonSettings(poll_interval=2.0, reconcile_interval=300.0, claim_batch=4,
                                      stop_orphans=False)
    assert s.systemd == SystemdSettings(slice="batch-jobs.slice", stop_grace=2.5)
    assert s.runs == RunSettings(allowed_executables=("/usr/bin/python3", "/opt/tools/*"), user="runner",
                                 allowed_users=("alice", "_svc-1"), no_new_privileges=False, private_tmp=False,
                                 protect_system="full", protect_home="read-only")
    assert s.host_id == "host-a"
    assert s.host_name == "a.example"


def test_list_values_become_tuples():
    s = parse('[runs]\nallowed_executables = ["/bin/true"]\n')
    assert s.runs.allowed_executables == ("/bin/true",)
    assert isinstance(s.runs.allowed_executables, tuple)


# -- structure errors -------------------------------------------------------------------------------

def test_unknown_section():
    with pytest.raises(ConfigError) as info:
        parse("[hosts]\nmax_runs = 3\n", "u.toml")
    assert str(info.value) == ("u.toml: unknown section [hosts] "
                               "(known: database, host, daemon, systemd, runs, fleet, metrics, retention, river)")


def test_unknown_top_level_key_is_an_unknown_section():
    with pytest.raises(ConfigError, match=r"^u\.toml: unknown section \[max_runs\]"):
        parse("max_runs = 3\n", "u.toml")


def test_section_that_is_not_a_table():
    with pytest.raises(ConfigError) as info:
        parse('host = "a"\n', "u.toml")
    assert str(info.value) == "u.toml: [host]: expected a table"


def test_unknown_key_names_section_key_and_known_keys():
    with pytest.raises(ConfigError) as info:
        parse("[host]\nmax_run = 3\n", "u.toml")
    assert str(info.value) == ("u.toml: [host] max_run: unknown key (known: id, labels, max_runs, memory_budget, name, "
                               "pressure_resources, pressure_slow_at, pressure_stop_at)")


def test_unknown_key_in_runs():
    with pytest.raises(ConfigError, match=r"^u\.toml: \[runs\] allowed_executable: unknown key \(known: "):
        parse('[runs]\nallowed_executable = ["/bin/true"]\n', "u.toml")


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[host\nmax_runs = 3\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value).startswith(f"{path}: not valid TOML: ")


def test_invalid_toml_from_parse_names_the_source():
    with pytest.raises(ConfigError, match=r"^/etc/x\.toml: not valid TOML: "):
        parse("max_runs = = 3", "/etc/x.toml")


def test_parse_default_source_name():
    with pytest.raises(ConfigError, match=r"^<string>: unknown section"):
        parse("[nope]\n")


# -- value types ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "message"), [
    ('[host]\nmax_runs = "8"\n', "[host] max_runs: expected a whole number of at least 1"),
    ("[host]\nmax_runs = 0\n", "[host] max_runs: expected a whole number of at least 1"),
    ("[host]\nmax_runs = -3\n", "[host] max_runs: expected a whole number of at least 1"),
    ("[host]\nmax_runs = 1.5\n", "[host] max_runs: expected a whole number of at least 1"),
    ("[host]\nmax_runs = true\n", "[host] max_runs: expected a whole number of at least 1"),
    ("[daemon]\nclaim_batch = 0\n", "[daemon] claim_batch: expected a whole number of at least 1"),
    ('[daemon]\nstop_orphans = "yes"\n', "[daemon] stop_orphans: expected true or false"),
    ("[daemon]\nstop_orphans = 1\n", "[daemon] stop_orphans: expected true or false"),
    ("[runs]\nprivate_tmp = 0\n", "[runs] private_tmp: expected true or false"),
    ("[runs]\nno_new_privileges = \"false\"\n", "[runs] no_new_privileges: expected true or false"),
    ('[runs]\nallowed_executables = "/bin/true"\n', "[runs] allowed_executables: expected a list of strings"),
    ("[runs]\nallowed_executables = [\"/bin/true\", 3]\n",
     "[runs] allowed_executables: expected a list of strings"),
    ('[runs]\nallowed_users = "alice"\n', "[runs] allowed_users: expected a list of strings"),
    ("[database]\ndsn = 5\n", "[database] dsn: expected a string"),
    ("[host]\nid = 42\n", "[host] id: expected a string"),
    ("[runs]\nuser = false\n", "[runs] user: expected a string"),
    ("[systemd]\nslice = [\"a.slice\"]\n", "[systemd] slice: expected a string"),
])
def test_bad_types(text, message):
    with pytest.raises(ConfigError) as info:
        parse(text, "u.toml")
    assert str(info.value) == f"u.toml: {message}"


# -- the output tail kept with an outcome ------------------------------------------------------------

@pytest.mark.parametrize(("lines", "size"), [(0, 4096), (20, 0), (1, 1), (1000, 65536), (0, 0)])
def test_output_tail_bounds_accepted(lines, size):
    runs = parse(f"[runs]\noutput_tail_lines = {lines}\noutput_tail_bytes = {size}\n", "u.toml").runs
    assert (runs.output_tail_lines, runs.output_tail_bytes) == (lines, size)


@pytest.mark.parametrize(("key", "value", "bounds"), [
    ("output_tail_lines", "-1", "0 to 1000"), ("output_tail_lines", "1001", "0 to 1000"),
    ("output_tail_lines", "1000000000", "0 to 1000"), ("output_tail_lines", '"20"', "0 to 1000"),
    ("output_tail_lines", "2.5", "0 to 1000"), ("output_tail_lines", "true", "0 to 1000"),
    ("output_tail_bytes", "-1", "0 to 65536"), ("output_tail_bytes", "65537", "0 to 65536"),
    ("output_tail_bytes", '"4K"', "0 to 65536"), ("output_tail_bytes", "false", "0 to 65536"),
])
def test_output_tail_absurd_values_refused(key, value, bounds):
    with pytest.raises(ConfigError) as info:
        parse(f"[runs]\n{key} = {value}\n", "u.toml")
    assert str(info.value) == f"u.toml: [runs] {key}: expected a whole number from {bounds}"


# -- sizes and durations ----------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    ('"512M"', 512 << 20),
    ('"2G"', 2 << 30),
    ("1073741824", 1 << 30),
    ('""', None),
    ("0", None),
])
def test_memory_budget(value, expected):
    assert parse(f"[host]\nmemory_budget = {value}\n").host.memory_budget == expected


@pytest.mark.parametrize(("value", "message"), [
    ('"12XB"', "[host] memory_budget: invalid size '12XB': use a whole number with K, M, G or T, like 512M or 2G"),
    ('"0"', "[host] memory_budget: invalid size '0': must be more than zero"),
    ("-1", "[host] memory_budget: invalid size -1: must be more than zero"),
    ("1.5", "[host] memory_budget: invalid size 1.5: use a whole number with K, M, G or T, like 512M or 2G"),
    ("true", "[host] memory_budget: invalid size True: use a whole number with K, M, G or T, like 512M or 2G"),
])
def test_bad_memory_budget(value, message):
    with pytest.raises(ConfigError) as info:
        parse(f"[host]\nmemory_budget = {value}\n", "u.toml")
    assert str(info.value) == f"u.toml: {message}"


def test_memory_budget_false_is_a_type_error():
    with pytest.raises(ConfigError):
        parse("[host]\nmemory_budget = false\n")


@pytest.mark.parametrize(("section", "key"), [
    ("daemon", "poll_interval"), ("daemon", "reconcile_interval"),
    ("systemd", "stop_grace"),
])
@pytest.mark.parametrize(("value", "expected"), [('"90s"', 90.0), ('"10m"', 600.0), ('"2h"', 7200.0),
                                                 ('"1d"', 86400.0), ("7", 7.0), ("0.5", 0.5), ('"3"', 3.0)])
def test_durations(section, key, value, expected):
    settings = parse(f"[{section}]\n{key} = {value}\n")
    assert getattr(getattr(settings, section), key) == expected


@pytest.mark.parametrize(("value", "detail"), [
    ('"10x"', "invalid duration '10x': use a number with s, m, h or d, like 90s or 10m"),
    ('"0s"', "invalid duration '0s': must be more than zero"),
    ("0", "invalid duration 0: must be more than zero"),
    ("-5", "invalid duration -5: must be more than zero"),
    ("true", "invalid duration True: use a number with s, m, h or d, like 90s or 10m"),
    ('"10M"', "invalid duration '10M': use a number with s, m, h or d, like 90s or 10m"),
])
def test_bad_durations(value, detail):
    with pytest.raises(ConfigError) as info:
        parse(f"[daemon]\npoll_interval = {value}\n", "u.toml")
    assert str(info.value) == f"u.toml: [daemon] poll_interval: {detail}"


@pytest.mark.parametrize("value", ["inf", "nan", "-nan"])
def test_non_finite_durations_are_refused(value):
    with pytest.raises(ConfigError):
        parse(f"[systemd]\nstop_grace = {value}\n")


# -- choices and names ------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["strict", "full", "yes", "no"])
def test_protect_system_choices(choice):
    assert parse(f'[runs]\nprotect_system = "{choice}"\n').runs.protect_system == choice


@pytest.mark.parametrize("choice", ["STRICT", "true", "", "read-only", "strict "])
def test_protect_system_refuses_other_values(choice):
    with pytest.raises(ConfigError) as info:
        parse(f'[runs]\nprotect_system = "{choice}"\n', "u.toml")
    assert str(info.value) == "u.toml: [runs] protect_system: expected one of full, no, strict, yes"


def test_protect_system_boolean_is_a_type_error():
    with pytest.raises(ConfigError, match=r"\[runs\] protect_system: expected a string$"):
        parse("[runs]\nprotect_system = true\n")


@pytest.mark.parametrize("choice", ["yes", "read-only", "tmpfs", "no"])
def test_protect_home_choices(choice):
    assert parse(f'[runs]\nprotect_home = "{choice}"\n').runs.protect_home == choice


def test_protect_home_refuses_other_values():
    with pytest.raises(ConfigError) as info:
        parse('[runs]\nprotect_home = "strict"\n', "u.toml")
    assert str(info.value) == "u.toml: [runs] protect_home: expected one of no, read-only, tmpfs, yes"


@pytest.mark.parametrize("name", ["unitvisor.slice", "batch-jobs.slice", "a_b.c.slice", "A9.slice",
                                  "system-unitvisor.slice"])
def test_valid_slice_names(name):
    assert parse(f'[systemd]\nslice = "{name}"\n').systemd.slice == name


@pytest.mark.parametrize("name", ["unitvisor", "unitvisor.service", "../x.slice", "a/b.slice", "a b.slice",
                                  ".slice", "", "x.slice.d", "x@1.slice", "x.slice;y"])
def test_invalid_slice_names(name):
    with pytest.raises(ConfigError) as info:
        parse(f'[systemd]\nslice = "{name}"\n', "u.toml")
    assert str(info.value) == "u.toml: [systemd] slice: expected a unit name ending in .slice"


def test_slice_name_with_trailing_newline_is_refused():
    with pytest.raises(ConfigError):
        parse('[systemd]\nslice = "x.slice\\n"\n')


@pytest.mark.parametrize("pattern", ["bin/true", "./bin/true", "true", "*", "~/bin/x", ""])
def test_relative_allowed_executables_refused(pattern):
    with pytest.raises(ConfigError) as info:
        parse(f'[runs]\nallowed_executables = ["/bin/true", "{pattern}"]\n', "u.toml")
    assert str(info.value) == f"u.toml: [runs] allowed_executables: {pattern!r} is not an absolute path"


@pytest.mark.parametrize("user", ["root", "alice", "_svc", "a", "svc-1", "a_b-c9", "a" * 32])
def test_valid_user_names(user):
    s = parse(f'[runs]\nuser = "{user}"\nallowed_users = ["{user}"]\n')
    assert s.runs.user == user
    assert s.runs.allowed_users == (user,)


@pytest.mark.parametrize("user", ["Alice", "1abc", "-abc", "a b", "a.b", "a@b", "a" * 33, "ä", "a/b", "a:b"])
def test_invalid_user(user):
    with pytest.raises(ConfigError) as info:
        parse(f'[runs]\nuser = "{user}"\n', "u.toml")
    assert str(info.value) == f"u.toml: [runs] user {user!r}: not a valid user name"


@pytest.mark.parametrize("user", ["Bob", "9", "x y"])
def test_invalid_allowed_user(user):
    with pytest.raises(ConfigError) as info:
        parse(f'[runs]\nallowed_users = ["alice", "{user}"]\n', "u.toml")
    assert str(info.value) == f"u.toml: [runs] user {user!r}: not a valid user name"


def test_user_name_with_trailing_newline_is_refused():
    with pytest.raises(ConfigError):
        parse('[runs]\nuser = "alice\\n"\n')


# -- resolve_dsn ------------------------------------------------------------------------------------

def _with_dsn(dsn="", dsn_file="/nonexistent/unitvisor-dsn"):
    return dataclasses.replace(Settings(), database=DatabaseSettings(dsn=dsn, dsn_file=dsn_file))


def test_resolve_dsn_override_wins_over_everything(monkeypatch, tmp_path):
    f = tmp_path / "dsn"
    f.write_text("from-file\n")
    monkeypatch.setenv("UNITVISOR_DSN", "from-env")
    assert resolve_dsn(_with_dsn("from-config", str(f)), "from-flag") == "from-flag"


def test_resolve_dsn_env_before_config_and_file(monkeypatch, tmp_path):
    f = tmp_path / "dsn"
    f.write_text("from-file\n")
    monkeypatch.setenv("UNITVISOR_DSN", "from-env")
    assert resolve_dsn(_with_dsn("from-config", str(f)), None) == "from-env"


def test_resolve_dsn_empty_override_and_env_are_skipped(monkeypatch):
    monkeypatch.setenv("UNITVISOR_DSN", "")
    assert resolve_dsn(_with_dsn("from-config"), "") == "from-config"


def test_resolve_dsn_config_before_file(tmp_path):
    f = tmp_path / "dsn"
    f.write_text("from-file\n")
    assert resolve_dsn(_with_dsn("from-config", str(f)), None) == "from-config"


def test_resolve_dsn_file_is_stripped(tmp_path):
    f = tmp_path / "dsn"
    f.write_text("  postgresql://u:secret@db/unitvisor \n\n")
    f.chmod(0o600)
    assert resolve_dsn(_with_dsn("", str(f)), None) == "postgresql://u:secret@db/unitvisor"


def test_resolve_dsn_none_configured(tmp_path):
    missing = tmp_path / "dsn"
    with pytest.raises(ConfigError) as info:
        resolve_dsn(_with_dsn("", str(missing)), None)
    assert str(info.value) == (
        "no database configured: set --dsn, --dsn-file, UNITVISOR_DSN, UNITVISOR_DSN_FILE, [database] dsn, "
        f"or write it to {missing}")


def test_resolve_dsn_empty_file_is_none_configured(tmp_path):
    f = tmp_path / "dsn"
    f.write_text(" \n")
    with pytest.raises(ConfigError, match=r"^no database configured: "):
        resolve_dsn(_with_dsn("", str(f)), None)


def test_resolve_dsn_unreadable_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_dsn(_with_dsn("", str(tmp_path)), None)  # a directory
    assert str(info.value).startswith(f"{tmp_path}: cannot read the database DSN: ")


def test_resolve_dsn_from_parsed_config(tmp_path):
    f = tmp_path / "dsn"
    f.write_text("dbname=x\n")
    f.chmod(0o600)
    settings = parse(f'[database]\ndsn_file = "{f}"\n')
    assert resolve_dsn(settings, None) == "dbname=x"


# -- credentials in files others may read ----------------------------------------------------------


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o620, 0o602, 0o700 | 0o070])
def test_a_dsn_file_that_group_or_others_may_access_is_refused(tmp_path, mode):
    f = tmp_path / "dsn"
    f.write_text("postgresql://u:secret@db/unitvisor\n")
    f.chmod(mode)
    with pytest.raises(ConfigError) as info:
        resolve_dsn(_with_dsn("", str(f)), None)
    message = str(info.value)
    assert message == (f"{f} holds the database DSN but its mode {mode:04o} lets group or others read it; "
                       f"chmod 600 {f}")
    assert "secret" not in message


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_dsn_file_is_used(tmp_path, mode):
    f = tmp_path / "dsn"
    f.write_text("dbname=x\n")
    f.chmod(mode)
    assert resolve_dsn(_with_dsn("", str(f)), None) == "dbname=x"


def test_a_dsn_file_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
    f = tmp_path / "dsn"
    f.write_text("dbname=x\n")
    f.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(f, 65534, 65534)  # nobody: as root, a real file of another owner
    else:
        monkeypatch.setattr(os, "geteuid", lambda: f.stat().st_uid + 1)  # as if someone else read ours
    owner = f.stat().st_uid
    with pytest.raises(ConfigError, match=f"holds the database DSN but belongs to uid {owner}, not root; chown root: "):
        resolve_dsn(_with_dsn("", str(f)), None)


def _config_file(tmp_path, dsn, mode):
    path = tmp_path / "unitvisor.toml"
    path.write_text(f'[database]\ndsn = "{dsn}"\n')
    path.chmod(mode)
    return load(path)


@pytest.mark.parametrize("dsn", ["postgresql://u:hunter2@db/unitvisor", "host=db user=u password=hunter2"])
def test_a_password_in_a_world_readable_config_is_refused(tmp_path, dsn):
    settings = _config_file(tmp_path, dsn, 0o644)
    with pytest.raises(ConfigError) as info:
        resolve_dsn(settings, None)
    assert "has a password in [database] dsn but its mode 0644" in str(info.value)
    assert "move the DSN to /etc/unitvisor/dsn" in str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(("dsn", "mode"), [
    ("postgresql://u@db/unitvisor", 0o644),           # no password: the config may say where the database is
    ("host=/var/run/postgresql dbname=unitvisor", 0o644),
    ("postgresql://u:hunter2@db/unitvisor", 0o600),   # a private config file may hold one
])
def test_a_dsn_in_the_config_is_used_when_nobody_else_can_read_its_password(tmp_path, dsn, mode):
    assert resolve_dsn(_config_file(tmp_path, dsn, mode), None) == dsn


def test_a_password_given_by_flag_or_environment_is_the_callers_business(tmp_path, monkeypatch):
    settings = _config_file(tmp_path, "dbname=x", 0o644)
    monkeypatch.setenv("UNITVISOR_DSN", "postgresql://u:pw@db/x")
    assert resolve_dsn(settings, None) == "postgresql://u:pw@db/x"
    assert resolve_dsn(settings, "postgresql://u:pw2@db/x") == "postgresql://u:pw2@db/x"


# -- [runs] allowed_environment: an allowlist ------------------------------------------------------

def test_allowed_environment_defaults_to_the_locale_and_the_time_zone():
    assert parse("").runs.allowed_environment == ("LANG", "LANGUAGE", "LC_*", "TZ")
    assert parse('[runs]\nallowed_environment = ["APP_*", "PYTHONPATH"]\n').runs.allowed_environment == (
        "APP_*", "PYTHONPATH")
    assert parse('[runs]\nallowed_environment = []\n').runs.allowed_environment == ()


@pytest.mark.parametrize(("entry", "message"), [
    ("PYTHON*", "'PYTHON*' matches only names of PYTHON*, which a pattern never opens: list each name you "
                "trust by its exact name"),
    ("LD_*", "'LD_*' matches only names of LD_*"),
    ("LD_LIBRARY_?ATH", "'LD_LIBRARY_?ATH' matches only names of LD_*"),
    ("1ABC", "'1ABC' is not an environment name or pattern"),
    ("APP-X", "'APP-X' is not an environment name or pattern"),
    ("APP_[AB]", "'APP_[AB]' is not an environment name or pattern"),
])
def test_allowed_environment_refuses_what_cannot_mean_what_it_says(entry, message):
    with pytest.raises(ConfigError) as info:
        parse(f'[runs]\nallowed_environment = ["{entry}"]\n', "u.toml")
    assert str(info.value).startswith(f"u.toml: [runs] allowed_environment: {message}")


def test_a_host_id_longer_than_a_host_pin_may_be_is_refused():
    assert parse(f'[host]\nid = "{"h" * 255}"\n').host.id == "h" * 255
    with pytest.raises(ConfigError, match=r"^u.toml: \[host\] id: 256 characters, over the limit of 255"):
        parse(f'[host]\nid = "{"h" * 256}"\n', "u.toml")


# -- a DSN file the operator names (issue 24): --dsn-file and $UNITVISOR_DSN_FILE --------------------


def _private(tmp_path, text="postgresql://admin:hunter2@db/unitvisor\n", mode=0o600, name="admin.dsn"):
    f = tmp_path / name
    f.write_text(text)
    f.chmod(mode)
    return f


def test_a_named_dsn_file_is_read(tmp_path, monkeypatch):
    monkeypatch.delenv("UNITVISOR_DSN", raising=False)
    f = _private(tmp_path)
    assert resolve_dsn(_with_dsn("from-config"), None, f) == "postgresql://admin:hunter2@db/unitvisor"
    monkeypatch.setenv("UNITVISOR_DSN_FILE", str(f))
    assert resolve_dsn(_with_dsn("from-config"), None) == "postgresql://admin:hunter2@db/unitvisor"


def test_the_order_flag_then_file_flag_then_environment_then_config(tmp_path, monkeypatch):
    flag_file, env_file = _private(tmp_path, "from-flag-file"), _private(tmp_path, "from-env-file", name="env.dsn")
    monkeypatch.setenv("UNITVISOR_DSN_FILE", str(env_file))
    settings = _with_dsn("from-config")
    assert resolve_dsn(settings, None, flag_file) == "from-flag-file"
    assert resolve_dsn(settings, None) == "from-env-file"
    monkeypatch.setenv("UNITVISOR_DSN", "from-env")  # a DSN beats a file at the same level
    assert resolve_dsn(settings, None) == "from-env"
    assert resolve_dsn(settings, None, flag_file) == "from-flag-file"  # the command line beats the environment
    assert resolve_dsn(settings, "from-flag") == "from-flag"


def test_dsn_and_dsn_file_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--dsn and --dsn-file both given"):
        resolve_dsn(_with_dsn(), "dbname=x", _private(tmp_path))


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_named_dsn_file_others_may_read_is_refused_like_an_ssh_key(tmp_path, mode):
    f = _private(tmp_path, mode=mode)
    with pytest.raises(ConfigError) as info:
        resolve_dsn(_with_dsn(), None, f)
    assert str(info.value) == (f"{f} holds the database DSN but its mode {mode:04o} lets group or others read it; "
                               f"chmod 600 {f}")
    assert "hunter2" not in str(info.value)


def test_a_named_dsn_file_without_a_password_is_refused_too(tmp_path):
    """Named for credentials: judged as holding them, as ssh judges a key file whatever it holds."""
    with pytest.raises(ConfigError, match="lets group or others read it"):
        resolve_dsn(_with_dsn(), None, _private(tmp_path, "host=/var/run/postgresql dbname=unitvisor", 0o644))


def test_a_named_dsn_file_that_is_missing_or_empty_says_so(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"nowhere\.dsn \(--dsn-file\): no such file$"):
        resolve_dsn(_with_dsn("from-config"), None, tmp_path / "nowhere.dsn")
    monkeypatch.setenv("UNITVISOR_DSN_FILE", str(tmp_path / "nowhere.dsn"))
    with pytest.raises(ConfigError, match=r"\(UNITVISOR_DSN_FILE\): no such file$"):
        resolve_dsn(_with_dsn("from-config"), None)
    with pytest.raises(ConfigError, match="is empty: write the DSN in it"):
        resolve_dsn(_with_dsn(), None, _private(tmp_path, " \n"))
