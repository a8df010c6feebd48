"""The run sandbox: [runs] keys -> the unit's D-Bus properties (unitspec._sandbox), and the keys'
validation. The encodings were checked against a live systemd 252 (`systemctl show` of the unit)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from supervisor import config
from supervisor.config import ConfigError, RunSettings, Settings
from supervisor.model import Attempt, Run
from supervisor.unitspec import build, unit_name

RUN_ID = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")

# Every property the sandbox sets with the defaults, and its exact value as sent over D-Bus.
SANDBOX_DEFAULTS: dict[bytes, object] = {
    b"CapabilityBoundingSet": 0,
    b"ProtectProc": b"invisible",
    b"ProcSubset": b"all",
    b"ProtectKernelTunables": True,
    b"ProtectKernelModules": True,
    b"ProtectKernelLogs": True,
    b"ProtectControlGroups": True,
    b"ProtectClock": True,
    b"ProtectHostname": True,
    b"RestrictNamespaces": 0,
    b"RestrictSUIDSGID": True,
    b"RestrictRealtime": True,
    b"LockPersonality": True,
    b"SystemCallArchitectures": [b"native"],
    b"SystemCallFilter": (True, [b"@system-service"]),
    b"SystemCallErrorNumber": 1,
    b"RestrictAddressFamilies": (True, [b"AF_UNIX", b"AF_INET", b"AF_INET6"]),
    b"PrivateDevices": True,
    b"PrivateUsers": False,
    b"MemoryDenyWriteExecute": False,
    b"PrivateNetwork": False,
    b"UMask": 0o077,
}


def props(run_private_network: bool = False, run_user: str | None = None, **runs: object) -> dict[bytes, object]:
    runs.setdefault("allowed_executables", ("/bin/true",))
    settings = dataclasses.replace(Settings(), runs=RunSettings(**runs))  # type: ignore[arg-type]
    run = Run(id=RUN_ID, argv=["/bin/true"], private_network=run_private_network, run_user=run_user)
    return build(run, Attempt(run_id=RUN_ID, attempt=1, host_id="h1", unit_name=unit_name(RUN_ID, 1)), settings)


def sandbox(**kwargs: object) -> dict[bytes, object]:
    every = props(**kwargs)  # type: ignore[arg-type]
    return {key: every[key] for key in every if key in SANDBOX_DEFAULTS}


def test_defaults_are_exactly_the_hardened_set():
    assert sandbox() == SANDBOX_DEFAULTS
    for key, value in SANDBOX_DEFAULTS.items():
        assert type(props()[key]) is type(value), key


def test_the_options_before_the_sandbox_stay():
    p = props()
    assert (p[b"NoNewPrivileges"], p[b"PrivateTmp"], p[b"ProtectSystem"], p[b"ProtectHome"], p[b"DynamicUser"]) == (
        True, True, b"strict", b"yes", True)


def test_a_root_run_still_gets_the_empty_bounding_set():
    p = props(run_user="root", allowed_users=("root",))
    assert p[b"User"] == b"root"
    assert p[b"CapabilityBoundingSet"] == 0


@pytest.mark.parametrize(("names", "mask"), [
    (("CAP_CHOWN",), 1),
    (("CAP_NET_BIND_SERVICE",), 1 << 10),
    (("CAP_NET_RAW", "CAP_CHECKPOINT_RESTORE"), (1 << 13) | (1 << 40)),
    (("CAP_SYS_ADMIN", "CAP_SYS_ADMIN"), 1 << 21),
])
def test_capabilities_kept_are_a_bitmask_of_their_numbers(names, mask):
    assert props(capability_bounding_set=names)[b"CapabilityBoundingSet"] == mask


def test_all_capabilities_leaves_the_property_out():
    assert b"CapabilityBoundingSet" not in props(capability_bounding_set=("all",))


@pytest.mark.parametrize(("key", "value", "changed"), [
    ("protect_proc", "default", {b"ProtectProc": b"default"}),
    ("protect_proc", "noaccess", {b"ProtectProc": b"noaccess"}),
    ("proc_subset", "pid", {b"ProcSubset": b"pid"}),
    ("protect_kernel", False, {b"ProtectKernelTunables": False, b"ProtectKernelModules": False,
                               b"ProtectKernelLogs": False}),
    ("protect_control_groups", False, {b"ProtectControlGroups": False}),
    ("protect_clock", False, {b"ProtectClock": False}),
    ("protect_hostname", False, {b"ProtectHostname": False}),
    ("restrict_suid_sgid", False, {b"RestrictSUIDSGID": False}),
    ("restrict_realtime", False, {b"RestrictRealtime": False}),
    ("lock_personality", False, {b"LockPersonality": False}),
    ("private_devices", False, {b"PrivateDevices": False}),
    ("private_users", True, {b"PrivateUsers": True}),
    ("memory_deny_write_execute", True, {b"MemoryDenyWriteExecute": True}),
    ("private_network", True, {b"PrivateNetwork": True}),
    ("umask", "0022", {b"UMask": 0o022}),
    ("umask", "027", {b"UMask": 0o027}),
    ("system_call_architectures", ("native", "x86"), {b"SystemCallArchitectures": [b"native", b"x86"]}),
    ("system_call_filter", ("@system-service", "@mount"),
     {b"SystemCallFilter": (True, [b"@system-service", b"@mount"])}),
    ("system_call_error", "EACCES", {b"SystemCallErrorNumber": 13}),
    ("restrict_address_families", ("AF_UNIX",), {b"RestrictAddressFamilies": (True, [b"AF_UNIX"])}),
])
def test_each_key_changes_only_its_own_properties(key, value, changed):
    assert sandbox(**{key: value}) == {**SANDBOX_DEFAULTS, **changed}


@pytest.mark.parametrize(("key", "value", "gone"), [
    ("restrict_namespaces", False, {b"RestrictNamespaces"}),
    ("system_call_architectures", (), {b"SystemCallArchitectures"}),
    ("system_call_filter", (), {b"SystemCallFilter", b"SystemCallErrorNumber"}),
    ("system_call_error", "kill", {b"SystemCallErrorNumber"}),
    ("restrict_address_families", (), {b"RestrictAddressFamilies"}),
    ("capability_bounding_set", ("all",), {b"CapabilityBoundingSet"}),
])
def test_a_key_turned_off_leaves_systemds_default(key, value, gone):
    expected = {k: v for k, v in SANDBOX_DEFAULTS.items() if k not in gone}
    assert sandbox(**{key: value}) == expected


def test_a_run_asking_for_no_network_gets_none():
    assert props(run_private_network=True)[b"PrivateNetwork"] is True


def test_a_host_without_network_overrides_a_run_that_did_not_ask():
    assert props(run_private_network=False, private_network=True)[b"PrivateNetwork"] is True


def test_every_sandbox_property_has_a_signature_pystemd_can_marshal():
    from pystemd.systemd1 import unit_signatures

    import supervisor.systemd  # noqa: F401  (registers the extra signatures)

    every = props(capability_bounding_set=("CAP_KILL",), run_private_network=True)
    unit_signatures.signature_array(every)  # a KeyError or a marshalling error would raise


# -- the config keys ------------------------------------------------------------------------------

def parse_runs(text: str) -> RunSettings:
    return config.parse(f"[runs]\n{text}\n").runs


def test_old_defaults_config_parses_and_turns_everything_off():
    runs = parse_runs("""
capability_bounding_set = ["all"]
protect_proc = "default"
protect_kernel = false
restrict_namespaces = false
system_call_architectures = []
system_call_filter = []
restrict_address_families = []
umask = "0022"
""")
    assert runs.capability_bounding_set == ("all",)
    assert runs.system_call_filter == ()


@pytest.mark.parametrize(("line", "message"), [
    ('capability_bounding_set = ["CAP_NOPE"]', "[runs] capability_bounding_set: 'CAP_NOPE' is not a capability"),
    ('capability_bounding_set = ["all", "CAP_KILL"]', "[runs] capability_bounding_set: 'all' is not a capability"),
    ('capability_bounding_set = ["cap_kill"]', "[runs] capability_bounding_set: 'cap_kill'"),
    ('capability_bounding_set = "CAP_KILL"', "[runs] capability_bounding_set: expected a list of strings"),
    ('protect_proc = "yes"', "[runs] protect_proc: expected one of default, invisible, noaccess, ptraceable"),
    ('proc_subset = "none"', "[runs] proc_subset: expected one of all, pid"),
    ("protect_kernel = 1", "[runs] protect_kernel: expected true or false"),
    ('private_network = "yes"', "[runs] private_network: expected true or false"),
    ('system_call_filter = ["~@mount"]', "[runs] system_call_filter: '~@mount' is not a system call or @group"),
    ('system_call_filter = ["@system-service @mount"]', "[runs] system_call_filter: '@system-service @mount'"),
    ('system_call_architectures = ["x86 64"]', "[runs] system_call_architectures: 'x86 64'"),
    ('system_call_error = "NOPE"', "[runs] system_call_error: 'NOPE' is not an errno name"),
    ('system_call_error = "eperm"', "[runs] system_call_error: 'eperm'"),
    ('system_call_error = 1', "[runs] system_call_error: expected a string"),
    ('restrict_address_families = ["INET"]', "[runs] restrict_address_families: 'INET' is not an address family"),
    ('umask = "0888"', "[runs] umask: '0888' is not an octal mode"),
    ('umask = "77"', "[runs] umask: '77' is not an octal mode"),
    ("umask = 77", "[runs] umask: expected a string"),
])
def test_bad_values_are_refused_naming_the_key(line, message):
    with pytest.raises(ConfigError) as info:
        parse_runs(line)
    assert message in str(info.value)


def test_the_benchmarks_unsandboxed_config_gives_the_units_of_before_the_sandbox():
    """bench.run's "sandbox off" passes must measure the old units: every sandbox property either
    left out or set to systemd's own default (verified live: `systemctl show` of such a unit)."""
    from bench.inside import BENCH_CONFIG, UNSANDBOXED_RUNS

    runs = config.parse(BENCH_CONFIG + UNSANDBOXED_RUNS).runs
    off = sandbox(**{f.name: getattr(runs, f.name) for f in dataclasses.fields(runs)})
    assert off == {
        b"ProtectProc": b"default", b"ProcSubset": b"all", b"ProtectKernelTunables": False,
        b"ProtectKernelModules": False, b"ProtectKernelLogs": False, b"ProtectControlGroups": False,
        b"ProtectClock": False, b"ProtectHostname": False, b"RestrictSUIDSGID": False, b"RestrictRealtime": False,
        b"LockPersonality": False, b"PrivateDevices": False, b"PrivateUsers": False,
        b"MemoryDenyWriteExecute": False, b"PrivateNetwork": False, b"UMask": 0o022,
    }


def test_the_benchmarks_unsandboxed_units_have_no_mount_namespace_and_a_fixed_user():
    """Its units stand beside the peers' bare ones: nothing that makes PID 1 set up a mount namespace
    or allocate a dynamic user, the two costs that dominate a start (docs/benchmarks.md)."""
    from bench.inside import unit_props

    props = unit_props("unsandboxed", ["/bin/true"])
    assert (props[b"User"], props[b"NoNewPrivileges"]) == (b"nobody", True)
    assert (props[b"PrivateTmp"], props[b"ProtectSystem"], props[b"ProtectHome"]) == (False, b"no", b"no")
    assert not {b"DynamicUser", b"InaccessiblePaths", b"BindPaths", b"ReadOnlyPaths"} & set(props)
