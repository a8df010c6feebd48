"""Dependencies between runs on a test bed host (schema 035): a small fan-out and fan-in runs in order
under a real daemon, and a failed run skips the run after it, which never reaches systemd."""

from __future__ import annotations

from datetime import datetime

from tests.harness.host import Host, wait_for


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_a_fan_out_and_fan_in_run_in_order_and_a_failure_skips_what_needs_it(host: Host) -> None:
    host.start()
    # extract (held open by its gate) -> load-a, load-b (fan-out) -> report (fan-in).
    extract = host.submit("--", *host.gated("extract"))
    load_a = host.submit("--after", extract, "--", "/bin/true")
    load_b = host.submit("--after", extract, "--", "/bin/true")
    report = host.submit("--after", load_a, "--after", load_b, "--", "/bin/true")
    wait_for(lambda: host.show(extract)["state"] == "running", timeout=30, what="the extract to be running")
    for waiting in (load_a, load_b):
        data = host.show(waiting)
        assert (data["state"], data["attempts"]) == ("queued", [])
        assert data["wait_reason"].startswith(f"waits for run {extract} (running)")
    assert host.show(report)["wait_reason"].startswith(f"waits for run {load_a} (queued) and 1 more")

    host.open_gate("extract")
    done = host.wait_run(report, timeout=60)
    assert done["state"] == "succeeded", done
    ended = {run: host.show(run)["attempts"] for run in (extract, load_a, load_b)}
    assert all(len(attempts) == 1 and attempts[0]["outcome"] == "success" for attempts in ended.values()), ended
    # Each started only once what it runs after had ended, by the database's clock.
    for later, earlier in ((load_a, extract), (load_b, extract), (report, load_a), (report, load_b)):
        started = (done if later == report else host.show(later))["attempts"][0]["started_at"]
        assert _at(started) >= _at(ended[earlier][0]["ended_at"]), (later, earlier)

    # A failed run: the run after it ends skipped, naming it, and no unit of it is ever started.
    failing = host.submit("--", "/bin/false")
    after = host.submit("--after", failing, "--", "/bin/true")
    skipped = host.wait_run(after, timeout=60)
    assert (skipped["state"], skipped["attempts"]) == ("skipped", []), skipped
    assert skipped["after"] == [{"id": failing, "state": "failed", "met": False}]
    assert any(e["reason"] == f"run {failing}, which it runs after, ended failed; it needed it to succeed"
               for e in skipped["events"])
    assert not [u for u in host.loaded_run_units() if after in u]
    result = host.cli("wait", after, "--timeout", "10s", check=False)
    assert result.returncode == 1
