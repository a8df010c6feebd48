"""supervisor.systemd with pystemd's DBus mocked: how D-Bus errors become SystemdError/SystemdUnavailable/
UnitRefused, what each call sends and how its answer is read, and the watcher's drain.

The exceptions are pystemd's own, built by pystemd's own factory `DBusError(errno, err_name, err_message)`,
the one dbuslib calls on every failure (`raise DBusError(r, error.name, error.message)` after sd_bus_call,
`DBusError(r, None, "Failed to process bus")` after sd_bus_process, ...). That matters: the factory picks
a subclass by the error's name (or, without a known name, by errno) and a subclass keeps no err_name; only
the plain DBusBaseError keeps it. pystemd 0.11.0 (bookworm) and 0.15 behave the same. The errno/name/message
triples below are the ones sd-bus and PID 1 really produce (checked against a private dbus-daemon).
"""

from __future__ import annotations

import dataclasses
import errno
from unittest import mock

import pytest
from pystemd.dbusexc import DBusBaseError, DBusError, DBusNoSuchUnitError

from supervisor import systemd as sd
from supervisor.systemd import (
    Systemd,
    SystemdError,
    SystemdUnavailable,
    UnitBrief,
    UnitRefused,
    UnitState,
    Watcher,
    _map_error,
)

UNIT = "unitvisor-run-00000000-0000-4000-8000-000000000001-1.service"
UNIT_PATH = b"/org/freedesktop/systemd1/unit/" + UNIT.replace("-", "_2d").replace(".", "_2e").encode()


def no_such_unit(name: str = UNIT) -> DBusBaseError:
    return DBusError(-errno.ENOENT, b"org.freedesktop.systemd1.NoSuchUnit", f"Unit {name} not loaded.".encode())


def unit_exists(name: str = UNIT) -> DBusBaseError:
    return DBusError(-errno.EEXIST, b"org.freedesktop.systemd1.UnitExists", f"Unit {name} already exists.".encode())


def disconnected() -> DBusBaseError:  # sd_bus_call's answer when the peer hung up
    return DBusError(-errno.ECONNRESET, b"org.freedesktop.DBus.Error.Disconnected", b"Connection reset by peer")


def process_failed(code: int) -> DBusBaseError:  # sd_bus_process failing
    return DBusError(-code, None, "Failed to process bus")


@pytest.fixture
def DBus(mocker):
    """The DBus class as supervisor.systemd sees it; every instance is the same mock bus."""
    return mocker.patch.object(sd, "DBus")


@pytest.fixture
def bus(DBus):
    return DBus.return_value


def answer(body):
    return mock.Mock(body=body)


# -- the exceptions as pystemd builds them -----------------------------------------------------------

def test_pystemd_builds_its_exceptions_as_these_tests_assume():
    assert type(no_such_unit()) is DBusNoSuchUnitError and no_such_unit().err_name == ""
    assert type(unit_exists()) is DBusBaseError and unit_exists().err_name == b"org.freedesktop.systemd1.UnitExists"
    assert disconnected().err_name == "" and disconnected().errno == -errno.ECONNRESET
    assert process_failed(errno.ENOTCONN).err_name == ""


# -- _map_error -------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [
    process_failed(errno.ENOTCONN),
    process_failed(errno.ECONNRESET),
    process_failed(errno.EPIPE),
    process_failed(errno.ESHUTDOWN),
    disconnected(),
    DBusError(-errno.ETIMEDOUT, b"org.freedesktop.DBus.Error.Timeout", b"Connection timed out"),
    DBusError(-errno.ENOENT, None, "Could not open a bus to DBus"),  # no socket: no dbus-daemon
    DBusError(-errno.ECONNREFUSED, None, "Could not open a bus to DBus"),
    DBusError(errno.ECONNRESET, None, "positive errno"),  # the sign does not matter
], ids=lambda e: f"{type(e).__name__}{e.errno}")
def test_a_connection_errno_without_an_answer_is_unavailable(exc):
    mapped = _map_error(exc, "reading x")
    assert type(mapped) is SystemdUnavailable
    assert str(mapped).startswith("reading x: systemd is not reachable over D-Bus (")


def test_no_such_unit_is_an_answer_not_a_broken_connection():
    mapped = _map_error(no_such_unit(), "looking up x")
    assert type(mapped) is SystemdError
    assert str(mapped) == f"looking up x: Unit {UNIT} not loaded."


@pytest.mark.parametrize(("exc", "text"), [
    (unit_exists(), f"Unit {UNIT} already exists."),
    (DBusError(-errno.EINVAL, b"org.freedesktop.DBus.Error.InvalidArgs", b"Invalid CPU quota value 0"),
     "Invalid CPU quota value 0"),
    (DBusError(-errno.EACCES, b"org.freedesktop.DBus.Error.AccessDenied", b"Access denied"), "Access denied"),
    (DBusError(-errno.EDEADLOCK, b"org.freedesktop.systemd1.TransactionIsDestructive",
               b"Transaction for x.service/stop is destructive (y.service has 'start' job queued)."),
     "Transaction for x.service/stop is destructive (y.service has 'start' job queued)."),
    (DBusError(-errno.ECANCELED, b"org.freedesktop.systemd1.ShuttingDown",
               b"Refusing activation, D-Bus is shutting down."), "Refusing activation, D-Bus is shutting down."),
], ids=lambda v: getattr(v, "err_name", None) or type(v).__name__ if not isinstance(v, str) else "")
def test_pid1s_named_errors_are_refusals_in_systemds_words(exc, text):
    mapped = _map_error(exc, "starting x")
    assert type(mapped) is SystemdError
    assert str(mapped) == f"starting x: {text}"


def test_an_error_without_a_message_falls_back_to_pystemds_text():
    mapped = _map_error(DBusError(-errno.EIO, None, None), "doing x")
    assert type(mapped) is SystemdError
    assert str(mapped).startswith("doing x: [err -5]")


@pytest.mark.parametrize(("code", "name", "message"), [
    (errno.ENOTCONN, b"System.Error.ENOTCONN", b"Transport endpoint is not connected"),
    (errno.EPIPE, b"System.Error.EPIPE", b"Broken pipe"),
])
def test_sd_bus_synthesized_system_error_names_are_a_lost_connection(code, name, message):
    assert isinstance(_map_error(DBusError(-code, name, message), "reading x"), SystemdUnavailable)


# -- connecting ---------------------------------------------------------------------------------------

def test_connect_opens_the_system_bus(DBus, bus):
    s = Systemd()
    assert not s.connected
    s.connect()
    DBus.assert_called_once_with()
    bus.open.assert_called_once_with()
    assert s.connected


def test_a_bus_that_cannot_be_opened_is_unavailable(bus):
    bus.open.side_effect = DBusError(-errno.ENOENT, None, "Could not open a bus to DBus")
    s = Systemd()
    with pytest.raises(SystemdUnavailable, match="^connecting to the system bus: systemd is not reachable"):
        s.connect()
    assert not s.connected


def test_connect_closes_the_previous_connection(DBus):
    old, new = mock.Mock(name="old"), mock.Mock(name="new")
    DBus.side_effect = [old, new]
    s = Systemd()
    s.connect()
    s.connect()
    old.close.assert_called_once_with()
    assert s._bus is new


def test_close_ignores_a_bus_error_and_forgets_the_bus(bus):
    s = Systemd()
    s.connect()
    bus.close.side_effect = process_failed(errno.ENOTCONN)
    s.close()
    assert not s.connected
    s.close()  # twice is harmless
    bus.close.assert_called_once_with()


def test_the_first_call_connects_on_demand(DBus, bus):
    bus.call_method.return_value = answer([])
    Systemd().list_units("unitvisor-run-*.service")
    bus.open.assert_called_once_with()


# -- start_transient ------------------------------------------------------------------------------------

PROPS = {b"Description": b"unitvisor run r attempt 1", b"RemainAfterExit": True}


def test_start_transient_sends_name_mode_properties_and_no_aux_units(bus):
    bus.call_method.return_value = answer(b"/org/freedesktop/systemd1/job/42")
    assert Systemd().start_transient(UNIT, PROPS) is True
    (dest, path, iface, method, args), _ = bus.call_method.call_args
    assert (dest, path, iface, method) == (sd.DEST, sd.MANAGER_PATH, sd.MANAGER_IFACE, b"StartTransientUnit")
    assert args[:2] == [(ord("s"), UNIT.encode()), (ord("s"), b"fail")]
    assert args[2] == (ord("a"), b"(sv)")
    assert (ord("s"), b"Description") in args and (ord("b"), True) in args
    assert args[-2:] == [(ord("a"), b"(sa(sv))"), (-1, None)]


def test_a_unit_that_exists_is_adopted_not_an_error(bus):
    bus.call_method.side_effect = unit_exists()
    s = Systemd()
    assert s.start_transient(UNIT, PROPS) is False
    assert s.connected


def test_unit_exists_is_recognised_by_errno_alone():
    assert sd._is_unit_exists(DBusError(-errno.EEXIST, None, b"File exists"))
    assert sd._is_unit_exists(DBusError(-errno.EIO, b"org.freedesktop.systemd1.UnitExists", b"x"))
    assert not sd._is_unit_exists(no_such_unit())


def test_a_refusal_is_unit_refused_with_systemds_message_and_keeps_the_connection(bus):
    cause = DBusError(-errno.EINVAL, b"org.freedesktop.DBus.Error.InvalidArgs",
                      b"Invalid user name or UID: no such user")
    bus.call_method.side_effect = cause
    s = Systemd()
    with pytest.raises(UnitRefused) as info:
        s.start_transient(UNIT, PROPS)
    assert str(info.value) == f"starting {UNIT}: Invalid user name or UID: no such user"
    assert info.value.__cause__ is cause
    assert s.connected
    bus.close.assert_not_called()


def test_a_broken_bus_while_starting_is_unavailable_and_closes_the_connection(bus):
    bus.call_method.side_effect = disconnected()
    s = Systemd()
    with pytest.raises(SystemdUnavailable) as info:
        s.start_transient(UNIT, PROPS)
    assert not isinstance(info.value, UnitRefused)
    assert not s.connected
    bus.close.assert_called_once_with()


def test_the_next_call_after_a_broken_bus_reconnects(DBus):
    broken, fresh = mock.Mock(name="broken"), mock.Mock(name="fresh")
    broken.call_method.side_effect = disconnected()
    fresh.call_method.return_value = answer(b"/job/1")
    DBus.side_effect = [broken, fresh]
    s = Systemd()
    with pytest.raises(SystemdUnavailable):
        s.start_transient(UNIT, PROPS)
    assert s.start_transient(UNIT, PROPS) is True
    fresh.open.assert_called_once_with()


# -- state --------------------------------------------------------------------------------------------------

INVOCATION = bytes.fromhex("5a3c1f0e9b8d4c7a8e6f2b1d0c9a8b7e")


def props(overrides=None):
    values = {b"ActiveState": b"failed", b"SubState": b"failed", b"Result": b"exit-code",
              b"ExecMainCode": 1, b"ExecMainStatus": 3, b"InvocationID": list(INVOCATION), b"Job": (0, b"/")}
    values.update(overrides or {})
    return values


def unknown_property() -> DBusBaseError:
    """systemd 252's answer to a Get of MemoryPeak, as pystemd raised it in the test bed (errno EBADR)."""
    return DBusError(-errno.EBADR, b"org.freedesktop.DBus.Error.UnknownProperty",
                     b"Unknown interface org.freedesktop.systemd1.Service or property MemoryPeak.")


# The interface of each property, as systemd 252's D-Bus API has it (`busctl introspect` of a service).
SERVICE_PROPERTIES = {b"Result", b"ExecMainCode", b"ExecMainStatus", b"ExecMainStartTimestamp",
                      b"ExecMainExitTimestamp", b"CPUUsageNSec", b"MemoryPeak", b"IOReadBytes", b"IOWriteBytes"}


def pid1(values, path=UNIT_PATH):
    """A fake PID 1 for state(): GetUnit answers `path`; Get answers a property from `values` on its own
    interface only, UnknownProperty for one it lacks (as sd-bus does); anything else fails the test."""
    def call_method(dest, obj, iface, method, args):
        if method == b"GetUnit":
            return answer(path)
        assert (obj, iface, method) == (path, sd.PROPS_IFACE, b"Get"), (obj, iface, method)
        (_, want_iface), (_, prop) = args
        expected = sd.SERVICE_IFACE if prop in SERVICE_PROPERTIES else sd.UNIT_IFACE
        if want_iface != expected or prop not in values:
            raise unknown_property()
        return answer(values[prop])
    return call_method


def test_state_of_a_unit_that_is_not_loaded_is_none(bus):
    bus.call_method.side_effect = no_such_unit()
    s = Systemd()
    assert s.state(UNIT) is None
    assert s.connected  # an answer, not a broken connection


def test_state_reads_getunit_then_one_get_a_property_the_units_state_first(bus):
    bus.call_method.side_effect = pid1(props())
    assert Systemd().state(UNIT) == UnitState(UNIT, "failed", "failed", "exit-code", 1, 3,
                                               "5a3c1f0e9b8d4c7a8e6f2b1d0c9a8b7e", False)
    get_unit, *gets = bus.call_method.call_args_list
    assert get_unit.args[:4] == (sd.DEST, sd.MANAGER_PATH, sd.MANAGER_IFACE, b"GetUnit")
    assert get_unit.args[4] == [(ord("s"), UNIT.encode())]
    read = [c.args[4][1][1] for c in gets]
    # Job, ActiveState and SubState (all has_ended decides on) before anything of the invocation
    assert read[:3] == [b"Job", b"ActiveState", b"SubState"]
    # exactly the properties UnitState is made of, each once: no GetAll of ~400
    assert sorted(read) == sorted([b"Job", b"ActiveState", b"SubState", b"InvocationID", b"ActiveEnterTimestamp",
                                   b"Result", b"ExecMainCode", b"ExecMainStatus", b"ExecMainStartTimestamp",
                                   b"ExecMainExitTimestamp", b"CPUUsageNSec", b"MemoryPeak", b"IOReadBytes",
                                   b"IOWriteBytes"])
    assert {c.args[3] for c in gets} == {b"Get"}


def test_state_reads_times_and_accounting(bus):
    bus.call_method.side_effect = pid1(props({
        b"ExecMainStartTimestamp": 1_700_000_000_000_001, b"ExecMainExitTimestamp": 1_700_000_001_000_002,
        b"ActiveEnterTimestamp": 1_700_000_000_000_500, b"CPUUsageNSec": 12_000_000, b"MemoryPeak": 2**64 - 1,
        b"IOReadBytes": 4096, b"IOWriteBytes": 0}))
    state = Systemd().state(UNIT)
    assert (state.exec_main_start_usec, state.exec_main_exit_usec, state.active_enter_usec) == (
        1_700_000_000_000_001, 1_700_000_001_000_002, 1_700_000_000_000_500)
    assert state.accounting == sd.Accounting(cpu_usage_nsec=12_000_000, memory_peak_bytes=None,
                                             io_read_bytes=4096, io_write_bytes=0)


def test_a_property_this_systemd_lacks_is_none_not_an_error(bus):
    # systemd 252 has no MemoryPeak (256 on): Get answers UnknownProperty, which is no lost connection
    values = props({b"CPUUsageNSec": 5, b"IOReadBytes": 6, b"IOWriteBytes": 7})
    bus.call_method.side_effect = pid1(values)
    s = Systemd()
    state = s.state(UNIT)
    assert state.accounting == sd.Accounting(cpu_usage_nsec=5, memory_peak_bytes=None, io_read_bytes=6,
                                             io_write_bytes=7)
    assert state.result == "exit-code"
    assert s.connected


def test_a_property_this_systemd_lacks_is_not_asked_for_again_until_a_new_connection(bus):
    values = props({b"CPUUsageNSec": 5, b"IOReadBytes": 6, b"IOWriteBytes": 7})
    bus.call_method.side_effect = pid1(values)
    s = Systemd()

    def peak_gets() -> int:
        return sum(1 for c in bus.call_method.call_args_list
                   if c.args[3] == b"Get" and c.args[4][1][1] == b"MemoryPeak")

    s.state(UNIT)
    s.state(UNIT)
    assert peak_gets() == 1
    s.connect()  # PID 1 may have been upgraded meanwhile (daemon-reexec)
    s.state(UNIT)
    assert peak_gets() == 2


def test_unknown_property_is_an_answer_not_a_broken_connection():
    assert type(unknown_property()).__name__ == "DBusUnknownPropertyError"  # pystemd's own subclass
    assert type(_map_error(unknown_property(), "reading")) is SystemdError


def test_state_with_a_queued_job_and_the_invocation_id_as_bytes(bus):
    bus.call_method.side_effect = pid1(props({
        b"ActiveState": b"deactivating", b"SubState": b"stop-sigterm", b"Result": b"success", b"ExecMainCode": 0,
        b"ExecMainStatus": 0, b"InvocationID": INVOCATION, b"Job": (17, b"/org/freedesktop/systemd1/job/17")}))
    state = Systemd().state(UNIT)
    assert state.job_pending is True
    assert state.invocation_id == INVOCATION.hex()
    assert state.has_ended is False


def test_state_of_a_unit_with_no_invocation_and_no_job(bus):
    values = props()
    del values[b"InvocationID"], values[b"Job"], values[b"Result"]
    bus.call_method.side_effect = pid1(values)
    state = Systemd().state(UNIT)
    assert state.invocation_id == "" and state.job_pending is False and state.result == ""


def test_a_unit_unloaded_while_its_state_is_read_is_an_error_as_before(bus):
    # GetAll on an object that is gone failed; one Get of several failing is no partial state either
    gone = DBusError(-errno.ENXIO, b"org.freedesktop.DBus.Error.UnknownObject",
                     f"Unknown object '{UNIT_PATH.decode()}'.".encode())
    bus.call_method.side_effect = [answer(UNIT_PATH), answer((0, b"/")), answer(b"inactive"), gone]
    s = Systemd()
    with pytest.raises(SystemdError, match=f"^reading {UNIT}: Unknown object"):
        s.state(UNIT)
    assert s.connected


def test_a_broken_bus_while_reading_state_is_unavailable(bus):
    bus.call_method.side_effect = [answer(UNIT_PATH), disconnected()]
    s = Systemd()
    with pytest.raises(SystemdUnavailable, match=f"^reading {UNIT}: "):
        s.state(UNIT)
    assert not s.connected


def test_another_error_while_looking_up_state_is_raised(bus):
    bus.call_method.side_effect = DBusError(-errno.EACCES, b"org.freedesktop.DBus.Error.AccessDenied", b"denied")
    with pytest.raises(SystemdError, match=f"^looking up {UNIT}: denied$") as info:
        Systemd().state(UNIT)
    assert type(info.value) is SystemdError


# -- stop / reset_failed / release ---------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "dbus_method", "args"), [
    ("stop", b"StopUnit", [(ord("s"), UNIT.encode()), (ord("s"), b"replace")]),
    ("reset_failed", b"ResetFailedUnit", [(ord("s"), UNIT.encode())]),
])
def test_unit_calls(bus, method, dbus_method, args):
    bus.call_method.return_value = answer(b"/org/freedesktop/systemd1/job/3")
    assert getattr(Systemd(), method)(UNIT) is True
    assert bus.call_method.call_args.args == (sd.DEST, sd.MANAGER_PATH, sd.MANAGER_IFACE, dbus_method, args)


@pytest.mark.parametrize("method", ["stop", "reset_failed"])
def test_a_unit_that_is_not_loaded_is_nothing_to_do(bus, method):
    bus.call_method.side_effect = no_such_unit()
    assert getattr(Systemd(), method)(UNIT) is False


@pytest.mark.parametrize("method", ["stop", "reset_failed"])
def test_a_refused_unit_call_says_which_call(bus, method):
    bus.call_method.side_effect = DBusError(-errno.EDEADLOCK, b"org.freedesktop.systemd1.TransactionIsDestructive",
                                            b"Transaction is destructive.")
    with pytest.raises(SystemdError, match="Transaction is destructive.$") as info:
        getattr(Systemd(), method)(UNIT)
    assert type(info.value) is SystemdError
    assert str(info.value).split(":")[0] in (f"StopUnit {UNIT}", f"ResetFailedUnit {UNIT}")


def test_release_stops_then_resets_even_a_unit_already_gone(bus):
    bus.call_method.side_effect = [no_such_unit(), no_such_unit()]
    Systemd().release(UNIT)
    assert [c.args[3] for c in bus.call_method.call_args_list] == [b"StopUnit", b"ResetFailedUnit"]


def methods(bus):
    return [c.args[3] for c in bus.call_method.call_args_list]


def held(bus, props=None):
    """A connection that created UNIT with AddRef (PID 1 holds a reference on it for the connection)."""
    bus.call_method.return_value = answer(b"/org/freedesktop/systemd1/job/42")
    s = Systemd()
    assert s.start_transient(UNIT, props if props is not None else {**PROPS, b"AddRef": True}) is True
    bus.call_method.reset_mock()
    return s


@pytest.mark.parametrize(("state", "calls"), [
    # a clean end (inactive/dead): dropping the reference is all, no job for PID 1
    ("inactive", [b"UnrefUnit"]),
    # PID 1 keeps a failed unit until reset-failed
    ("failed", [b"ResetFailedUnit", b"UnrefUnit"]),
    # a unit of 0.3.0 (RemainAfterExit=yes), active/exited: a stop job as 0.3.0 did
    ("active", [b"StopUnit", b"ResetFailedUnit", b"UnrefUnit"]),
    (None, [b"StopUnit", b"ResetFailedUnit", b"UnrefUnit"]),
])
def test_release_by_the_state_the_unit_ended_in(bus, state, calls):
    s = held(bus)
    s.release(UNIT, state)
    assert methods(bus) == calls
    assert bus.call_method.call_args.args[4] == [(ord("s"), UNIT.encode())]


def test_release_drops_a_reference_once_and_only_one_it_holds(bus):
    s = held(bus)
    s.release(UNIT, "inactive")
    s.release(UNIT, "inactive")
    assert methods(bus) == [b"UnrefUnit"]
    bus.call_method.reset_mock()
    s = held(bus, PROPS)  # created without AddRef: no reference to drop
    s.release(UNIT, "inactive")
    assert methods(bus) == []


def test_ref_takes_one_reference_per_connection_on_the_units_own_object(bus):
    bus.call_method.return_value = answer(UNIT_PATH)
    s = Systemd()
    assert s.ref(UNIT) is True
    assert s.ref(UNIT) is True  # PID 1 counts each Ref: a second one would need a second Unref
    # Not the manager's RefUnit, which refuses a unit left `bad-setting` by a daemon-reload (systemd 252)
    assert methods(bus) == [b"GetUnit", b"Ref"]
    assert bus.call_method.call_args.args == (sd.DEST, UNIT_PATH, sd.UNIT_IFACE, b"Ref", [])
    s.release(UNIT, "inactive")
    assert methods(bus) == [b"GetUnit", b"Ref", b"UnrefUnit"]


@pytest.mark.parametrize("answers", [
    [no_such_unit()],
    [answer(UNIT_PATH), DBusError(-errno.ENXIO, b"org.freedesktop.DBus.Error.UnknownObject",
                                  f"Unknown object '{UNIT_PATH.decode()}'.".encode())],
], ids=["not-loaded", "unloaded-between-the-calls"])
def test_ref_of_a_unit_already_collected_is_false(bus, answers):
    bus.call_method.side_effect = answers
    s = Systemd()
    assert s.ref(UNIT) is False
    bus.call_method.reset_mock(side_effect=True)
    s.release(UNIT, "inactive")
    assert methods(bus) == []  # nothing held, nothing dropped


def test_a_ref_that_pid1_refuses_is_an_error_not_a_gone_unit(bus):
    bus.call_method.side_effect = [answer(UNIT_PATH), DBusError(
        -errno.EACCES, b"org.freedesktop.DBus.Error.AccessDenied", b"Access denied")]
    with pytest.raises(SystemdError):
        Systemd().ref(UNIT)


def test_references_go_with_the_connection(bus):
    s = held(bus)
    s.close()
    bus.call_method.return_value = answer(None)
    s.release(UNIT, "inactive")  # PID 1 dropped it when the connection closed
    assert b"UnrefUnit" not in methods(bus)
    s = held(bus)
    s.connect()
    s.release(UNIT, "inactive")
    assert b"UnrefUnit" not in methods(bus)


def test_an_unref_that_pid1_refuses_is_nothing_to_do(bus):
    s = held(bus)
    bus.call_method.side_effect = DBusError(-errno.EIO, b"org.freedesktop.systemd1.NotReferenced",
                                            b"Unit has not been referenced yet.")
    s.release(UNIT, "inactive")  # no error: at worst a reference PID 1 drops with the connection
    assert methods(bus) == [b"UnrefUnit"]
    assert s.unref(UNIT) is False  # and it is not asked again


def test_an_unref_on_a_broken_connection_raises_unavailable(bus):
    s = held(bus)
    bus.call_method.side_effect = disconnected()
    with pytest.raises(SystemdUnavailable):
        s.release(UNIT, "inactive")


# -- list_units ---------------------------------------------------------------------------------------------

def row(name, active, sub, job_id=0):
    return (name.encode(), b"unitvisor run", b"loaded", active.encode(), sub.encode(), b"",
            b"/org/freedesktop/systemd1/unit/x", job_id, b"" if not job_id else b"stop",
            b"/" if not job_id else f"/org/freedesktop/systemd1/job/{job_id}".encode())


def test_list_units_parses_listunitsbypatterns_rows(bus):
    bus.call_method.return_value = answer([
        row("unitvisor-run-a-1.service", "active", "running"),
        row("unitvisor-run-b-1.service", "active", "exited"),
        row("unitvisor-run-c-1.service", "deactivating", "stop-sigterm", job_id=88),
    ])
    assert Systemd().list_units("unitvisor-run-*.service") == {
        "unitvisor-run-a-1.service": UnitBrief("active", "running", False),
        "unitvisor-run-b-1.service": UnitBrief("active", "exited", False),
        "unitvisor-run-c-1.service": UnitBrief("deactivating", "stop-sigterm", True),
    }
    method, args = bus.call_method.call_args.args[3:]
    assert method == b"ListUnitsByPatterns"
    assert args == [(ord("a"), b"s"), (-1, None), (ord("a"), b"s"), (ord("s"), b"unitvisor-run-*.service"),
                    (-1, None)]


def test_list_units_of_nothing(bus):
    bus.call_method.return_value = answer([])
    assert Systemd().list_units("unitvisor-run-*.service") == {}


# -- UnitState.has_ended and UnitBrief's properties -----------------------------------------------------

@pytest.mark.parametrize(("active", "sub", "job", "ended"), [
    ("failed", "failed", False, True),
    ("inactive", "dead", False, True),
    ("active", "exited", False, True),  # RemainAfterExit=yes after a clean exit
    ("active", "running", False, False),
    ("activating", "start", False, False),
    ("deactivating", "stop-sigterm", False, False),
    ("reloading", "reload", False, False),
    ("failed", "failed", True, False),  # a queued job: still moving
    ("active", "exited", True, False),
    ("inactive", "dead", True, False),
])
def test_has_ended(active, sub, job, ended):
    assert UnitState(UNIT, active, sub, "success", 1, 0, "", job).has_ended is ended


@pytest.mark.parametrize(("active", "sub", "job", "plainly", "process"), [
    ("active", "running", False, True, True),
    ("active", "running", True, False, True),
    ("active", "exited", False, False, False),
    ("activating", "start", False, False, True),
    ("activating", "auto-restart", False, False, True),
    ("deactivating", "stop-sigterm", False, False, True),
    ("deactivating", "stop-sigkill", True, False, True),
    ("reloading", "reload", False, False, True),
    ("failed", "failed", False, False, False),
    ("inactive", "dead", False, False, False),
    ("maintenance", "cleaning", False, False, False),
])
def test_unit_brief(active, sub, job, plainly, process):
    brief = UnitBrief(active, sub, job)
    assert brief.plainly_running is plainly
    assert brief.process_running is process


# -- Watcher --------------------------------------------------------------------------------------------------

def empty():
    return mock.Mock(**{"is_empty.return_value": True})


class Signal:
    """A received message as pystemd's DbusMessage behaves: the headers are readable at once
    (get_member, get_path), `headers` and `body` only once process_reply has decoded the message."""

    def __init__(self, member, path, body, interface):
        self._member, self._path, self._body, self._interface = member, path, body, interface
        self.headers, self.body = None, None
        self.decoded = 0

    def is_empty(self):
        return False

    def get_member(self):
        return self._member

    def get_path(self):
        return self._path

    def process_reply(self, with_headers):
        self.decoded += 1
        self.body = self._body
        if with_headers:
            self.headers = {"Type": 4, "Typename": "signal", "Member": self._member, "Path": self._path,
                            "Interface": self._interface, "Sender": b":1.0"}


def signal_msg(member, path=b"/org/freedesktop/systemd1", body=None, interface=b"org.freedesktop.systemd1.Manager"):
    return Signal(member, path, body, interface)


def escaped(name):
    """sd-bus's escaping of a unit name in its object path: _xx for all but letters and (not first) digits."""
    return "".join(c if c.isascii() and (c.isalpha() or (i and c.isdigit())) else f"_{ord(c):02x}"
                   for i, c in enumerate(name))


def props_changed(unit):
    path = b"/org/freedesktop/systemd1/unit/" + escaped(unit).encode()
    return signal_msg(b"PropertiesChanged", path, body=(b"org.freedesktop.systemd1.Unit", {}, []),
                      interface=b"org.freedesktop.DBus.Properties")


@pytest.fixture
def watcher(bus):
    bus.call_method.return_value = answer(None)
    w = Watcher("unitvisor-run-")
    w.connect()
    bus.call_method.reset_mock()
    return w


def test_watcher_connect_adds_three_matches_then_subscribes(bus):
    bus.call_method.return_value = answer(None)
    w = Watcher("unitvisor-run-")
    w.connect()
    calls = [c.args for c in bus.call_method.call_args_list]
    assert [c[3] for c in calls] == [b"AddMatch", b"AddMatch", b"AddMatch", b"Subscribe"]
    assert [c[4][0][1] for c in calls[:3]] == list(Watcher._RULES)
    assert calls[3][:4] == (sd.DEST, sd.MANAGER_PATH, sd.MANAGER_IFACE, b"Subscribe")
    bus.get_fd.return_value = 7
    assert w.fileno() == 7


def test_watcher_that_cannot_subscribe_closes_its_bus(bus):
    bus.call_method.side_effect = [answer(None), disconnected()]
    w = Watcher("unitvisor-run-")
    with pytest.raises(SystemdUnavailable, match="^subscribing to systemd's signals"):
        w.connect()
    bus.close.assert_called_once_with()
    assert not w.connected


def test_drain_before_connect_is_unavailable():
    with pytest.raises(SystemdUnavailable):
        Watcher("unitvisor-run-").drain()


def test_drain_decodes_paths_and_names_from_unitremoved_and_keeps_our_prefix(watcher, bus):
    bus.process.side_effect = [
        props_changed("unitvisor-run-a-1.service"),
        props_changed("unitvisor-run-a-1.service"),
        props_changed("ssh.service"),
        signal_msg(b"UnitRemoved", body=(b"unitvisor-run-b-2.service", b"/org/freedesktop/systemd1/unit/x")),
        signal_msg(b"UnitRemoved", body=(b"cron.service", b"/org/freedesktop/systemd1/unit/cron_2eservice")),
        signal_msg(b"JobRemoved", body=(5, b"/job/5", b"unitvisor-run-c-1.service", b"done")),
        empty(), empty(),
    ]
    assert watcher.drain() == ({"unitvisor-run-a-1.service", "unitvisor-run-b-2.service"}, False)
    assert bus.process.call_count == 8


def test_only_our_units_and_unitremoved_bodies_are_decoded(watcher, bus):
    ours, other = props_changed("unitvisor-run-a-1.service"), props_changed("ssh.service")
    removed = signal_msg(b"UnitRemoved", body=(b"unitvisor-run-b-2.service", b"/org/freedesktop/systemd1/unit/x"))
    reload = signal_msg(b"Reloading", body=(True,))
    bus.process.side_effect = [ours, other, removed, reload, empty(), empty()]
    assert watcher.drain() == ({"unitvisor-run-a-1.service", "unitvisor-run-b-2.service"}, True)
    assert (ours.decoded, other.decoded, removed.decoded, reload.decoded) == (1, 0, 1, 0)


# -- the state a unit's signals say (issue 27) --------------------------------------------------------

# A unit's two signals of one change, as systemd 252 sent them in the test bed for `sh -c 'exit 3'`
# (Type=exec): its Service interface's, then its Unit interface's, every property that emits changes.
ENDED_SERVICE = {b"Result": b"exit-code", b"ExecMainStartTimestamp": 1_796_296_738_190_240,
                 b"ExecMainExitTimestamp": 1_796_296_738_490_173, b"ExecMainCode": 1, b"ExecMainStatus": 3}
ENDED_UNIT = {b"ActiveState": b"failed", b"SubState": b"failed", b"ActiveEnterTimestamp": 1_796_296_738_190_650,
              b"Job": (0, b"/"), b"InvocationID": list(INVOCATION)}
RUNNING_SERVICE = {**ENDED_SERVICE, b"Result": b"success", b"ExecMainExitTimestamp": 0, b"ExecMainCode": 0,
                   b"ExecMainStatus": 0}
RUNNING_UNIT = {**ENDED_UNIT, b"ActiveState": b"active", b"SubState": b"running"}


def changed(unit, interface, values):
    msg = props_changed(unit)
    msg._body = (interface, values, [])
    return msg


def pair(unit, service, unit_values):
    return [changed(unit, sd.SERVICE_IFACE, service), changed(unit, sd.UNIT_IFACE, unit_values)]


def drained(watcher, bus, *messages):
    bus.process.side_effect = [*messages, empty(), empty()]
    return watcher.drain()


def test_a_units_two_signals_of_one_change_are_its_state(watcher, bus):
    assert drained(watcher, bus, *pair(UNIT, ENDED_SERVICE, ENDED_UNIT)) == ({UNIT}, False)
    assert watcher.signalled == {UNIT: UnitState(UNIT, "failed", "failed", "exit-code", 1, 3, INVOCATION.hex(), False,
                                            1_796_296_738_190_240, 1_796_296_738_490_173, 1_796_296_738_190_650)}


def test_the_last_change_of_a_drain_is_the_state(watcher, bus):
    drained(watcher, bus, *pair(UNIT, RUNNING_SERVICE, RUNNING_UNIT), *pair(UNIT, ENDED_SERVICE, ENDED_UNIT))
    assert watcher.signalled[UNIT].has_ended and watcher.signalled[UNIT].exec_main_status == 3


def test_another_units_signals_between_the_two_do_not_split_a_pair(watcher, bus):
    other = "unitvisor-run-00000000-0000-4000-8000-000000000002-1.service"
    service, unit = pair(UNIT, ENDED_SERVICE, ENDED_UNIT)
    drained(watcher, bus, service, *pair(other, RUNNING_SERVICE, RUNNING_UNIT), unit)
    assert watcher.signalled[UNIT].result == "exit-code" and not watcher.signalled[other].has_ended


@pytest.mark.parametrize("messages", [
    pytest.param(lambda: [changed(UNIT, sd.UNIT_IFACE, ENDED_UNIT)], id="a Unit signal alone"),
    pytest.param(lambda: [*pair(UNIT, RUNNING_SERVICE, RUNNING_UNIT), changed(UNIT, sd.UNIT_IFACE, ENDED_UNIT)],
                 id="its Service signal dropped: the earlier pair's Service values would say success"),
    pytest.param(lambda: [changed(UNIT, sd.SERVICE_IFACE, ENDED_SERVICE)], id="a Service signal alone"),
    pytest.param(lambda: pair(UNIT, {k: v for k, v in ENDED_SERVICE.items() if k != b"ExecMainStatus"}, ENDED_UNIT),
                 id="a property missing"),
    pytest.param(lambda: pair(UNIT, ENDED_SERVICE, {k: v for k, v in ENDED_UNIT.items() if k != b"Job"}),
                 id="the Job missing"),
])
def test_signals_that_do_not_say_all_of_the_state_leave_the_unit_to_be_read(watcher, bus, messages):
    assert drained(watcher, bus, *messages()) == ({UNIT}, False)
    assert watcher.signalled == {}


def test_a_service_signal_waits_for_its_unit_signal_in_the_next_drain(watcher, bus):
    service, unit = pair(UNIT, ENDED_SERVICE, ENDED_UNIT)
    drained(watcher, bus, service)
    assert watcher.signalled == {}
    drained(watcher, bus, unit)
    assert watcher.signalled[UNIT].exec_main_status == 3


def test_each_drain_says_only_what_it_read(watcher, bus):
    drained(watcher, bus, *pair(UNIT, ENDED_SERVICE, ENDED_UNIT))
    assert drained(watcher, bus) == (set(), False)
    assert watcher.signalled == {}


def test_a_reconnect_splits_a_pair(watcher, bus):
    service, unit = pair(UNIT, ENDED_SERVICE, ENDED_UNIT)
    drained(watcher, bus, service)
    bus.call_method.return_value = answer(None)
    watcher.connect()
    drained(watcher, bus, unit)
    assert watcher.signalled == {}


def removed(unit):
    return signal_msg(b"UnitRemoved", body=(unit.encode(), UNIT_PATH))


def test_an_ended_unit_removed_keeps_the_state_its_signals_said(watcher, bus):
    """A unit no daemon held is collected as it ends: its last signals are all that says how it ended."""
    drained(watcher, bus, *pair(UNIT, ENDED_SERVICE, ENDED_UNIT), removed(UNIT))
    assert watcher.signalled[UNIT].exec_main_status == 3


def test_a_running_unit_removed_is_not_running(watcher, bus):
    drained(watcher, bus, *pair(UNIT, RUNNING_SERVICE, RUNNING_UNIT), removed(UNIT))
    assert watcher.signalled == {}


def test_state_of_a_unit_its_signals_say_is_running_makes_no_call(bus):
    running = sd.unit_state(UNIT, {**RUNNING_SERVICE, **RUNNING_UNIT})
    assert Systemd().state(UNIT, signalled=running) is running
    bus.call_method.assert_not_called()


def test_state_of_a_unit_its_signals_say_ended_reads_its_accounting_alone(bus):
    bus.call_method.side_effect = pid1({b"CPUUsageNSec": 12_000_000, b"IOReadBytes": 4096, b"IOWriteBytes": 0})
    ended = sd.unit_state(UNIT, {**ENDED_SERVICE, **ENDED_UNIT})
    state = Systemd().state(UNIT, signalled=ended)
    assert state == dataclasses.replace(ended, accounting=sd.Accounting(cpu_usage_nsec=12_000_000, io_read_bytes=4096,
                                                                         io_write_bytes=0))
    # No GetUnit (the path is the name's), and of the Gets only the counters, which no signal carries.
    assert [c.args[3] for c in bus.call_method.call_args_list] == [b"Get"] * 4
    assert {c.args[4][1][1] for c in bus.call_method.call_args_list} == {
        b"CPUUsageNSec", b"MemoryPeak", b"IOReadBytes", b"IOWriteBytes"}


def test_a_unit_whose_name_only_resembles_the_prefix_is_not_ours(watcher, bus):
    # "unitvisor-runner-..." and "unitvisor_run-..." share a start with the prefix, escaped or not
    bus.process.side_effect = [props_changed("unitvisor-runner-1.service"), props_changed("unitvisor_run-x.service"),
                               props_changed("unitvisor-run.service"), props_changed("xunitvisor-run-a.service"),
                               empty(), empty()]
    assert watcher.drain() == (set(), False)


def test_the_prefixs_path_is_sd_bus_escaping_of_the_name():
    assert Watcher("unitvisor-run-")._path_prefix == b"/org/freedesktop/systemd1/unit/unitvisor_2drun_2d"
    assert Watcher("1a.")._path_prefix == b"/org/freedesktop/systemd1/unit/_31a_2e"  # a leading digit is escaped


def test_an_empty_prefix_takes_every_unit(bus):
    bus.call_method.return_value = answer(None)
    w = Watcher("")
    w.connect()
    bus.process.side_effect = [props_changed("ssh.service"), props_changed("0day.service"), empty(), empty()]
    assert w.drain() == ({"ssh.service", "0day.service"}, False)


def test_drain_reports_a_reload(watcher, bus):
    bus.process.side_effect = [signal_msg(b"Reloading", body=(True,)), signal_msg(b"Reloading", body=(False,)),
                               empty(), empty()]
    assert watcher.drain() == (set(), True)


def test_one_empty_message_is_not_the_end_of_the_queue(watcher, bus):
    bus.process.side_effect = [empty(), props_changed("unitvisor-run-a-1.service"), empty(),
                               props_changed("unitvisor-run-b-1.service"), empty(), empty(),
                               props_changed("unitvisor-run-never-1.service")]
    assert watcher.drain() == ({"unitvisor-run-a-1.service", "unitvisor-run-b-1.service"}, False)
    assert bus.process.call_count == 6


def test_drain_of_an_empty_queue_reads_twice(watcher, bus):
    bus.process.side_effect = [empty(), empty()]
    assert watcher.drain() == (set(), False)


def test_a_propertieschanged_on_the_unit_prefix_itself_is_no_unit(watcher, bus):
    bus.process.side_effect = [signal_msg(b"PropertiesChanged", path=sd.UNIT_PATH_PREFIX), empty(), empty()]
    assert watcher.drain() == (set(), False)


def test_a_bus_error_while_draining_closes_and_is_unavailable(watcher, bus):
    bus.process.side_effect = [props_changed("unitvisor-run-a-1.service"), process_failed(errno.ECONNRESET)]
    with pytest.raises(SystemdUnavailable, match="^reading systemd's signals: systemd is not reachable"):
        watcher.drain()
    assert not watcher.connected
    bus.close.assert_called_once_with()
    with pytest.raises(SystemdUnavailable):
        watcher.drain()


def holding(bus, count):
    """A connection that created `count` units with AddRef."""
    bus.call_method.return_value = answer(b"/org/freedesktop/systemd1/job/42")
    s = Systemd()
    for i in range(count):
        assert s.start_transient(f"unitvisor-run-{i}.service", {**PROPS, b"AddRef": True}) is True
    bus.call_method.reset_mock()
    return s


def test_past_the_bound_a_new_unit_is_kept_by_remainafterexit_not_by_a_reference(bus, mocker):
    """PID 1 pays bus match rules for every unit a client holds; past MAX_HELD_UNITS on one connection
    it lost its bus connection in the test bed. A new unit is then started as 0.3.0's were."""
    s = holding(bus, sd.MAX_HELD_UNITS - 1)
    marshalled = mocker.spy(sd.unit_signatures, "signature_array")

    def sent_properties(_bus):
        return marshalled.call_args.args[0]

    assert s.start_transient(UNIT, {**PROPS, b"AddRef": True}) is True
    assert sent_properties(bus)[b"AddRef"] is True  # the last one held
    over = "unitvisor-run-over.service"
    assert s.start_transient(over, {**PROPS, b"AddRef": True}) is True
    sent = sent_properties(bus)
    assert b"AddRef" not in sent and sent[b"RemainAfterExit"] is True
    bus.call_method.reset_mock()
    s.release(over, "active")  # active/exited when it ends: released with a stop job, no Unref
    assert methods(bus) == [b"StopUnit", b"ResetFailedUnit"]
    bus.call_method.reset_mock()
    s.release(UNIT, "inactive")  # one reference dropped: room for the next unit to be held again
    bus.call_method.return_value = answer(b"/org/freedesktop/systemd1/job/43")
    assert s.start_transient("unitvisor-run-next.service", {**PROPS, b"AddRef": True}) is True
    assert sent_properties(bus)[b"AddRef"] is True


def test_past_the_bound_ref_reads_a_loaded_unit_without_holding_it(bus):
    s = holding(bus, sd.MAX_HELD_UNITS)
    bus.call_method.return_value = answer(UNIT_PATH)
    assert s.ref(UNIT) is True  # loaded: the caller reads it; not held
    assert methods(bus) == [b"GetUnit"]
    bus.call_method.reset_mock()
    s.release(UNIT, "inactive")
    assert methods(bus) == []  # nothing held, nothing to drop
    bus.call_method.side_effect = [no_such_unit()]
    assert s.ref("unitvisor-run-gone.service") is False  # collected: still said, for the journal


def test_a_connection_that_holds_nothing_starts_units_that_keep_themselves(bus, mocker):
    """`unitvisor reconcile` by hand: its references would go when the command exits, collecting a
    unit that ended before the daemon held it."""
    marshalled = mocker.spy(sd.unit_signatures, "signature_array")
    bus.call_method.return_value = answer(UNIT_PATH)
    s = Systemd(max_held=0)
    assert s.start_transient(UNIT, {**PROPS, b"AddRef": True}) is True
    sent = marshalled.call_args.args[0]
    assert b"AddRef" not in sent and sent[b"RemainAfterExit"] is True
    bus.call_method.reset_mock()
    assert s.ref(UNIT) is True
    assert methods(bus) == [b"GetUnit"]  # read, never held


def test_an_ended_unit_whose_accounting_cannot_be_read_keeps_the_outcome_its_signals_said(bus):
    bus.call_method.side_effect = DBusError(-errno.ENXIO, b"org.freedesktop.DBus.Error.UnknownObject",
                                            f"Unknown object '{UNIT_PATH.decode()}'.".encode())
    ended = sd.unit_state(UNIT, {**ENDED_SERVICE, **ENDED_UNIT})
    assert Systemd().state(UNIT, signalled=ended) == ended  # accounting unknown: None throughout


def test_an_ended_unit_whose_accounting_is_read_on_a_lost_bus_is_unavailable(bus):
    bus.call_method.side_effect = disconnected()
    with pytest.raises(SystemdUnavailable):
        Systemd().state(UNIT, signalled=sd.unit_state(UNIT, {**ENDED_SERVICE, **ENDED_UNIT}))
