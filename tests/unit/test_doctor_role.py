"""doctor's line on the kind of database role it is connected as."""

from supervisor import store
from supervisor.doctor import role_check, role_settings_check


def test_an_admin_may_act_as_any_host() -> None:
    check = role_check(store.Identity("admin", None), "web-1")
    assert check.status == "ok" and check.message.startswith("admin")


def test_a_host_role_bound_to_this_host_is_ok() -> None:
    assert role_check(store.Identity("host", "web-1"), "web-1").status == "ok"


def test_a_host_role_bound_to_another_host_id_is_an_error() -> None:
    check = role_check(store.Identity("host", "web-2"), "web-1")
    assert check.status == "fail"
    assert "bound to web-2, but this host's id is web-1" in check.message


def test_a_submitter_or_unbound_role_cannot_run_the_daemon() -> None:
    for kind in ("submitter", "unbound"):
        check = role_check(store.Identity(kind, None), "web-1")
        assert check.status == "fail" and check.message.startswith(kind)
        assert "unitvisor hosts add" in check.message


def test_session_defaults_on_the_role_are_a_warning_naming_them() -> None:
    assert role_settings_check([]).status == "ok"
    check = role_settings_check(["default_transaction_read_only=on", "search_path=x"])
    assert check.status == "warn"
    assert "default_transaction_read_only=on, search_path=x" in check.message and "RESET ALL" in check.message
