"""supervisor.config: the [fleet] section, the rules that tie its timeouts to the others (docs/fleet.md,
"Timeouts, and what each must be relative to the others"), and allowlist patterns the database can use."""

from __future__ import annotations

import dataclasses

import pytest

from supervisor import config
from supervisor.config import (
    CUT_OFF_MARGIN,
    ConfigError,
    DaemonSettings,
    FleetSettings,
    Settings,
    SystemdSettings,
    cut_off_after,
    parse,
)


def fleet(text: str, source: str = "u.toml") -> Settings:
    return parse(text, source)


# -- [fleet] keys -------------------------------------------------------------------------------

def test_fleet_defaults():
    assert Settings().fleet == FleetSettings(host_dead_after=60.0, stop_runs_when_cut_off=False)
    assert parse("").fleet == FleetSettings(host_dead_after=60.0, stop_runs_when_cut_off=False)
    assert parse("[fleet]\n").fleet == FleetSettings()


@pytest.mark.parametrize(("value", "expected"), [
    ('"90s"', 90.0), ('"2m"', 120.0), ('"1h"', 3600.0), ("45", 45.0), ("30.5", 30.5), ('"30"', 30.0),
])
def test_host_dead_after_is_a_duration(value, expected):
    assert parse(f"[fleet]\nhost_dead_after = {value}\n").fleet.host_dead_after == expected


@pytest.mark.parametrize(("value", "detail"), [
    ('"90x"', "invalid duration '90x': use a number with s, m, h or d, like 90s or 10m"),
    ('"0s"', "invalid duration '0s': must be more than zero"),
    ("-60", "invalid duration -60: must be more than zero"),
    ("true", "invalid duration True: use a number with s, m, h or d, like 90s or 10m"),
])
def test_host_dead_after_bad_duration_names_the_key(value, detail):
    with pytest.raises(ConfigError) as info:
        fleet(f"[fleet]\nhost_dead_after = {value}\n")
    assert str(info.value) == f"u.toml: [fleet] host_dead_after: {detail}"


@pytest.mark.parametrize("value", ["true", "false"])
def test_stop_runs_when_cut_off_parses(value):
    assert parse(f"[fleet]\nstop_runs_when_cut_off = {value}\n").fleet.stop_runs_when_cut_off is (value == "true")


@pytest.mark.parametrize("value", ['"yes"', "1", '"true"'])
def test_stop_runs_when_cut_off_must_be_a_boolean(value):
    with pytest.raises(ConfigError) as info:
        fleet(f"[fleet]\nstop_runs_when_cut_off = {value}\n")
    assert str(info.value) == "u.toml: [fleet] stop_runs_when_cut_off: expected true or false"


def test_unknown_fleet_key_is_an_error_naming_the_known_ones():
    with pytest.raises(ConfigError) as info:
        fleet("[fleet]\nhost_dead_afer = \"90s\"\n")
    assert str(info.value) == ("u.toml: [fleet] host_dead_afer: unknown key "
                               "(known: host_dead_after, max_dead_per_pass, stop_runs_when_cut_off)")


def test_max_dead_per_pass_defaults_to_five_and_takes_a_whole_number():
    assert fleet("").fleet.max_dead_per_pass == 5
    assert fleet("[fleet]\nmax_dead_per_pass = 20\n").fleet.max_dead_per_pass == 20
    with pytest.raises(ConfigError, match=r"\[fleet\] max_dead_per_pass: expected a whole number of at least 1"):
        fleet("[fleet]\nmax_dead_per_pass = 0\n")


def test_fleet_must_be_a_table():
    with pytest.raises(ConfigError) as info:
        fleet('fleet = "on"\n')
    assert str(info.value) == "u.toml: [fleet]: expected a table"


# -- host_dead_after: at least 3 poll intervals -------------------------------------------------

def test_host_dead_after_below_three_poll_intervals_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as info:
        fleet('[daemon]\npoll_interval = "10s"\n[fleet]\nhost_dead_after = "29s"\n')
    message = str(info.value)
    assert message == ("u.toml: [fleet] host_dead_after: 29s is less than 3 poll intervals "
                       "(3 x [daemon] poll_interval = 30s): a host would be declared dead after two missed heartbeats")
    assert "[fleet] host_dead_after" in message and "[daemon] poll_interval" in message


def test_host_dead_after_of_exactly_three_poll_intervals_is_accepted():
    settings = parse('[daemon]\npoll_interval = "10s"\n[fleet]\nhost_dead_after = "30s"\n')
    assert settings.fleet.host_dead_after == 30.0


def test_explicit_host_dead_after_is_checked_against_a_long_poll_interval_not_stretched():
    """An explicit value is the author's: it is refused, never silently raised to 3 poll intervals."""
    with pytest.raises(ConfigError, match=r"^u\.toml: \[fleet\] host_dead_after: 60s is less than 3 poll intervals "
                                          r"\(3 x \[daemon\] poll_interval = 90s\)"):
        fleet('[daemon]\npoll_interval = "30s"\n[fleet]\nhost_dead_after = "60s"\n')


def test_the_check_applies_to_settings_built_in_code_too():
    settings = dataclasses.replace(Settings(), daemon=DaemonSettings(poll_interval=30.0))
    with pytest.raises(ConfigError, match=r"host_dead_after: 60s is less than 3 poll intervals"):
        config._validate(settings)


# -- the derived default ------------------------------------------------------------------------

@pytest.mark.parametrize(("poll", "expected"), [
    ('"30s"', 90.0), ("30", 90.0), ('"1m"', 180.0), ('"25s"', 75.0),
    ('"20s"', 60.0), ('"10s"', 60.0), ('"1s"', 60.0),
])
def test_without_host_dead_after_the_default_stretches_to_three_poll_intervals(poll, expected):
    assert parse(f"[daemon]\npoll_interval = {poll}\n").fleet.host_dead_after == expected


def test_derived_default_also_with_a_fleet_table_that_does_not_set_it():
    settings = parse('[daemon]\npoll_interval = "30s"\n[fleet]\nstop_runs_when_cut_off = false\n')
    assert settings.fleet.host_dead_after == 90.0


@pytest.mark.parametrize("value", ['"90s"', '"120s"', '"10m"'])
def test_explicit_host_dead_after_is_kept(value):
    settings = parse(f'[daemon]\npoll_interval = "30s"\n[fleet]\nhost_dead_after = {value}\n')
    assert settings.fleet.host_dead_after == config.parse_duration(value.strip('"'))


def test_explicit_host_dead_after_is_kept_with_a_short_poll():
    assert parse('[daemon]\npoll_interval = "5s"\n[fleet]\nhost_dead_after = "15s"\n').fleet.host_dead_after == 15.0


# -- stop_runs_when_cut_off: cut_off_after = host_dead_after - stop_grace - 2 s -------------------

def test_cut_off_margin_is_two_seconds():
    assert CUT_OFF_MARGIN == 2.0


@pytest.mark.parametrize(("dead_after", "grace", "expected"), [
    (60.0, 10.0, 48.0), (90.0, 10.0, 78.0), (60.0, 30.0, 28.0), (32.0, 10.0, 20.0),
])
def test_cut_off_after(dead_after, grace, expected):
    settings = dataclasses.replace(Settings(), fleet=FleetSettings(host_dead_after=dead_after),
                                   systemd=SystemdSettings(stop_grace=grace))
    assert cut_off_after(settings) == expected


def test_cut_off_after_with_defaults_is_48_seconds():
    assert cut_off_after(Settings()) == 48.0


def test_stop_runs_when_cut_off_with_defaults_is_accepted():
    assert parse("[fleet]\nstop_runs_when_cut_off = true\n").fleet.stop_runs_when_cut_off is True


def test_stop_runs_when_cut_off_at_exactly_two_poll_intervals_is_accepted():
    settings = parse('[daemon]\npoll_interval = "10s"\n[systemd]\nstop_grace = "10s"\n'
                     '[fleet]\nhost_dead_after = "32s"\nstop_runs_when_cut_off = true\n')
    assert cut_off_after(settings) == 20.0


def test_stop_runs_when_cut_off_below_two_poll_intervals_is_refused():
    with pytest.raises(ConfigError) as info:
        fleet('[daemon]\npoll_interval = "10s"\n[systemd]\nstop_grace = "10s"\n'
              '[fleet]\nhost_dead_after = "31s"\nstop_runs_when_cut_off = true\n')
    assert str(info.value) == (
        "u.toml: [fleet] stop_runs_when_cut_off: runs would be stopped after 19s without a heartbeat "
        "(host_dead_after - stop_grace - 2s), less than 2 poll intervals (20s); raise host_dead_after or lower "
        "stop_grace or poll_interval")


def test_a_long_stop_grace_is_refused_only_with_stop_runs_when_cut_off():
    text = '[systemd]\nstop_grace = "50s"\n[fleet]\nhost_dead_after = "60s"\n'
    assert parse(text).systemd.stop_grace == 50.0  # cut_off_after would be 8s, but the switch is off
    with pytest.raises(ConfigError, match=r"^u\.toml: \[fleet\] stop_runs_when_cut_off: runs would be stopped "
                                          r"after 8s without a heartbeat"):
        fleet(text + "stop_runs_when_cut_off = true\n")


def test_a_stop_grace_longer_than_host_dead_after_is_refused_with_stop_runs_when_cut_off():
    with pytest.raises(ConfigError, match=r"stopped after -42s without a heartbeat"):
        fleet('[systemd]\nstop_grace = "100s"\n[fleet]\nstop_runs_when_cut_off = true\n')


def test_stop_runs_when_cut_off_is_checked_against_the_derived_default():
    # poll 30s: host_dead_after becomes 90s; cut_off_after 90 - 10 - 2 = 78 >= 60: accepted ...
    settings = parse('[daemon]\npoll_interval = "30s"\n[fleet]\nstop_runs_when_cut_off = true\n')
    assert (settings.fleet.host_dead_after, cut_off_after(settings)) == (90.0, 78.0)
    # ... and with stop_grace 30s: 90 - 30 - 2 = 58 < 60: refused
    with pytest.raises(ConfigError, match=r"stopped after 58s without a heartbeat .* less than 2 poll intervals "
                                          r"\(60s\)"):
        fleet('[daemon]\npoll_interval = "30s"\n[systemd]\nstop_grace = "30s"\n'
              '[fleet]\nstop_runs_when_cut_off = true\n')


# -- allowed_executables: no character classes --------------------------------------------------

@pytest.mark.parametrize("pattern", ["/usr/bin/[ab]", "/usr/bin/a[", "/usr/bin/a]", "/opt/[!x]/run", "/[]"])
def test_allowed_executables_with_brackets_are_refused(pattern):
    with pytest.raises(ConfigError) as info:
        fleet(f'[runs]\nallowed_executables = ["/bin/true", "{pattern}"]\n')
    assert str(info.value) == (f"u.toml: [runs] allowed_executables: {pattern!r}: character classes ([...]) are "
                               "not supported; use * (any characters within one path component) or ?")


@pytest.mark.parametrize("pattern", ["/usr/bin/*", "/opt/tool-?/run", "/opt/a b/c.d", "/opt/(x)/$y^+"])
def test_allowed_executables_without_brackets_are_accepted(pattern):
    assert parse(f'[runs]\nallowed_executables = ["{pattern}"]\n').runs.allowed_executables == (pattern,)
