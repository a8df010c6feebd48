"""The size of every text argument of unitvisor.submit_run is bounded (issue 21: a 1 MB environment value
was accepted and then failed at exec with 203/EXEC; a 100,000-character host_pin was accepted). Each
bound: the largest accepted value goes in, one byte (or character, or element) more is refused with
SQLSTATE 22023 and a message that names the argument, its size and the limit, and nothing is written.
The bounds and why each is what it is: sql/015_run_privilege.sql (check_run_sizes)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from supervisor import store
from tests.integration.conftest import CliResult, assert_nothing_written, table_counts
from tests.integration.test_submit import call_submit

STRING_MAX = 131071  # the kernel's MAX_ARG_STRLEN, 131072 bytes with the NUL
TOTAL_MAX = 524288  # argv, and the environment, each: bytes + NUL + an 8-byte pointer per string
SECRET = "s3cr3t-value-never-in-a-message"


def refused(conn: psycopg.Connection, message: str, **values: Any) -> None:
    before = table_counts(conn)
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        call_submit(conn, **values)
    assert info.value.diag.sqlstate == "22023"
    assert info.value.diag.message_primary == message
    assert SECRET not in str(info.value)
    assert table_counts(conn) == before


def accepted(conn: psycopg.Connection, **values: Any) -> uuid.UUID:
    run_id = call_submit(conn, **values)
    assert store.get_run(conn, run_id) is not None
    return run_id


def filler(size: int, prefix: str = SECRET) -> str:
    """A string of exactly `size` bytes (ASCII) starting with SECRET, so that a message echoing a value
    would show it."""
    return (prefix + "x" * size)[:size]


# -- argv ---------------------------------------------------------------------------------------

def test_an_argv_element_up_to_max_arg_strlen(conn: psycopg.Connection) -> None:
    accepted(conn, argv=["/bin/echo", filler(STRING_MAX)])
    refused(conn, "argv: element 2 is 131072 bytes, over the limit of 131071 (the kernel's MAX_ARG_STRLEN, 128 KiB "
                  "with its NUL)", argv=["/bin/echo", filler(STRING_MAX + 1)])


def test_an_argv_element_is_counted_in_bytes_not_characters(conn: psycopg.Connection) -> None:
    # 65536 characters of two bytes each: 131072 bytes, which execve refuses.
    refused(conn, "argv: element 2 is 131072 bytes, over the limit of 131071 (the kernel's MAX_ARG_STRLEN, 128 KiB "
                  "with its NUL)", argv=["/bin/echo", "é" * 65536])


def test_argv_as_a_whole(conn: psycopg.Connection) -> None:
    # "/bin/echo" costs 9 + 1 + 8; four big elements fill the rest to exactly 524288.
    first = len("/bin/echo") + 1 + 8
    rest = TOTAL_MAX - first - 4 * 9
    sizes = [rest // 4] * 3 + [rest - 3 * (rest // 4)]
    argv = ["/bin/echo", *(filler(n) for n in sizes)]
    assert sum(len(a) + 9 for a in argv) == TOTAL_MAX
    accepted(conn, argv=argv)
    refused(conn, "argv: 524289 bytes in all, over the limit of 524288 (each element's bytes, its NUL and an "
                  "8-byte pointer, as execve counts them)", argv=[*argv[:-1], argv[-1] + "x"])


def test_many_tiny_argv_elements_count_their_pointers(conn: psycopg.Connection) -> None:
    # 30000 one-byte elements are 300000 bytes of strings and NULs with their pointers: under the limit.
    # 60000 are 600000: over it, although their characters alone are 60000.
    accepted(conn, argv=["/bin/echo", *(["x"] * 30000)])
    refused(conn, "argv: 600018 bytes in all, over the limit of 524288 (each element's bytes, its NUL and an "
                  "8-byte pointer, as execve counts them)", argv=["/bin/echo", *(["x"] * 60000)])


# -- environment --------------------------------------------------------------------------------

def test_an_environment_entry_up_to_max_arg_strlen(conn: psycopg.Connection) -> None:
    # NAME=value is one string for execve: 4 + 1 + value bytes.
    accepted(conn, environment={"BIG1": filler(STRING_MAX - 5)})
    refused(conn, "environment: BIG1=value is 131072 bytes, over the limit of 131071 (the kernel's MAX_ARG_STRLEN, "
                  "128 KiB with its NUL)", environment={"BIG1": filler(STRING_MAX - 4)})


def test_the_issues_one_megabyte_value_is_refused(conn: psycopg.Connection) -> None:
    refused(conn, "environment: HUGE=value is 1048581 bytes, over the limit of 131071 (the kernel's "
                  "MAX_ARG_STRLEN, 128 KiB with its NUL)", environment={"OK": "1", "HUGE": filler(1 << 20)})


def test_the_environment_as_a_whole(conn: psycopg.Connection) -> None:
    # Four entries of 4-byte names: each costs 4 + 1 + value + 1 + 8.
    per = TOTAL_MAX // 4 - 14
    env = {f"VAR{i}": filler(per) for i in range(4)}
    assert sum(len(k) + 1 + len(v) + 1 + 8 for k, v in env.items()) == TOTAL_MAX
    accepted(conn, environment=env)
    refused(conn, "environment: 524289 bytes in all, over the limit of 524288 (each NAME=value's bytes, its NUL "
                  "and an 8-byte pointer, as execve counts them)", environment={**env, "VAR3": env["VAR3"] + "x"})


def test_at_most_256_environment_names(conn: psycopg.Connection) -> None:
    accepted(conn, environment={f"V{i}": "x" for i in range(256)})
    refused(conn, "environment: 257 names, over the limit of 256", environment={f"V{i}": "x" for i in range(257)})


# -- the other text arguments -------------------------------------------------------------------

def test_working_directory_up_to_path_max(conn: psycopg.Connection) -> None:
    accepted(conn, working_directory="/" + "a" * 4094)
    refused(conn, "working_directory: 4096 bytes, over the limit of 4095 (PATH_MAX, 4096 with its NUL)",
            working_directory="/" + "a" * 4095)


def test_host_pin_up_to_255_characters_and_the_issues_100000(conn: psycopg.Connection) -> None:
    accepted(conn, host_pin="h" * 255)
    refused(conn, "host_pin: 256 characters, over the limit of 255 (a host id is at most 255)", host_pin="h" * 256)
    refused(conn, "host_pin: 100000 characters, over the limit of 255 (a host id is at most 255)",
            host_pin=filler(100000))


def test_retry_on_up_to_64_elements(conn: psycopg.Connection) -> None:
    # 8 outcomes, and since schema 27 exit statuses and signals
    accepted(conn, retry_on=["lost"] * 64)
    refused(conn, "retry_on: 65 elements, over the limit of 64", retry_on=["lost"] * 65)


@pytest.mark.parametrize(("values", "constraint"), [
    ({"run_user": "a" * 33}, "runs_run_user_valid"),
    ({"idempotency_key": "k" * 256}, "runs_idempotency_key_valid"),
    ({"concurrency_key": "k" * 256}, "runs_concurrency_key_valid"),
    ({"labels": {"team": "v" * 256}}, "runs_labels_valid"),
])
def test_the_arguments_bounded_by_their_form_stay_so(conn: psycopg.Connection, values: dict,
                                                      constraint: str) -> None:
    """Bounded where their form is checked (23514), once, not again by check_run_sizes."""
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        call_submit(conn, **values)
    assert info.value.diag.constraint_name == constraint
    assert_nothing_written(conn)


def test_store_submit_reports_a_size_in_one_line(conn: psycopg.Connection) -> None:
    with pytest.raises(store.DatabaseError) as info:
        store.submit_run(conn, argv=["/bin/true"], host_pin="h" * 300)
    assert str(info.value) == ("the database refused the run: host_pin: 300 characters, over the limit of 255 "
                               "(a host id is at most 255)")


def test_the_cli_reports_a_size_as_one_line_and_exit_1(dsn: str, cli: Callable[..., CliResult]) -> None:
    result = cli("submit", "--host", "h" * 300, "--", "/bin/true", dsn=dsn)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr_lines == ["unitvisor: the database refused the run: host_pin: 300 characters, over the "
                                   "limit of 255 (a host id is at most 255)"]
    # Over the environment's total: five values of 120000 bytes (each one fits MAX_ARG_STRLEN, as the
    # CLI's own command line must).
    envs = [arg for i in range(5) for arg in ("--env", f"V{i}={filler(120000)}")]
    result = cli("submit", *envs, "--", "/bin/true", dsn=dsn)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr_lines == ["unitvisor: the database refused the run: environment: 600060 bytes in all, over "
                                   "the limit of 524288 (each NAME=value's bytes, its NUL and an 8-byte pointer, "
                                   "as execve counts them)"]
