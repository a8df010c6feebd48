import pytest

from supervisor import store, unitspec
from supervisor.outcomes import Outcome
from tests.integration.conftest import register

# Each test runs twice: as the superuser, and with every host call of the store made as a login role
# bound to its host id (tests/integration/conftest.py, as_bound_roles).
pytestmark = pytest.mark.usefixtures("as_bound_roles")


def test_unclaimed_attempts_are_those_of_runs_in_flight_without_a_row(conn):
    queued = store.submit_run(conn, argv=["/bin/true"])
    claimed_run = store.submit_run(conn, argv=["/bin/true"])
    fence = register(conn, "h1", max_runs=10)
    [(_, first)] = store.claim(conn, fence, 1, unitspec.UNIT_NAME_FORMAT)
    assert first.run_id == queued  # oldest first
    store.record_outcome(conn, fence, first, Outcome("success", "exit:0", "exited 0"), "succeeded")
    found = store.unclaimed_attempts(conn, [(queued, 1), (queued, 2), (claimed_run, 1), (claimed_run, 2)])
    # queued's run has ended: none of its names wait for a claim; claimed_run is queued: both do.
    assert found == {(claimed_run, 1), (claimed_run, 2)}
    assert store.unclaimed_attempts(conn, []) == set()
