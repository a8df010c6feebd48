"""bench.pyspy_top: the daemon's loop in a raw py-spy profile, split into waits and CPU."""

from __future__ import annotations

from bench.pyspy_top import main, report, summarize

LOOP = ("<module> (/venv/bin/unitvisor:6);Daemon.run (/repo/supervisor/daemon.py:156);"
        "Daemon._iteration (/repo/supervisor/daemon.py:340)")
CALL = LOOP + ";Systemd._call (/repo/supervisor/systemd.py:233)"
PROFILE = [
    # the loop waiting for PID 1's reply, inside pystemd's C code
    f"{CALL};call_method (dbuslib.pyx);sd_bus_call (libsystemd.so.0);ppoll (libc.so.6) 30",
    # the loop decoding that reply: on the CPU, under the same Python frame
    f"{CALL};call_method (dbuslib.pyx);process_reply (dbuslib.pyx) 10",
    # waiting for the GIL after a call
    f"{CALL};pthread_cond_timedwait (libc.so.6);0x7f00 (libc.so.6) 5",
    # psycopg on the CPU, two levels of Python frames
    LOOP + ";wait_poll (/venv/lib/python3.11/site-packages/psycopg/waiting.py:542);"
    "PGconn.get_value (/venv/lib/python3.11/site-packages/psycopg/pq/pq_ctypes.py:917) 8",
    # another thread's waits and work: not the loop's
    "Thread._bootstrap (/usr/lib/python3.11/threading.py:995);Guard._run (/repo/supervisor/guard.py:104);"
    "pthread_cond_timedwait (libc.so.6) 100",
    "Thread._bootstrap (/usr/lib/python3.11/threading.py:995);TailReader._work (/repo/supervisor/journal.py:251) 7",
    "",
    "not a profile line",
]


def test_only_the_loops_samples_count():
    summary = summarize(PROFILE)
    assert summary.samples == 53
    assert summary.on_cpu == 18


def test_waits_are_told_from_work_by_the_native_frames():
    summary = summarize(PROFILE)
    assert summary.waits == {"Systemd._call (supervisor/systemd.py)": 30, "the GIL": 5}
    assert summary.self_cpu == {"Systemd._call (supervisor/systemd.py)": 10,
                                "PGconn.get_value (psycopg/pq/pq_ctypes.py)": 8}
    assert summary.total_cpu["Daemon._iteration (supervisor/daemon.py)"] == 18
    assert summary.total_cpu["wait_poll (psycopg/waiting.py)"] == 8


def test_report_gives_shares_of_the_on_cpu_samples():
    text = report(summarize(PROFILE))
    assert "on the CPU 34.0%, waiting 66.0%" in text
    assert "56.6%  in Systemd._call (supervisor/systemd.py)" in text
    assert " 55.6%  55.6%  Systemd._call (supervisor/systemd.py)" in text
    assert " 44.4%  44.4%  PGconn.get_value (psycopg/pq/pq_ctypes.py)" in text


def test_report_of_a_profile_without_the_loop():
    assert report(summarize(PROFILE[4:])) == "no samples of the daemon's loop (Daemon.run) in this profile\n"


def test_main_reads_a_file(tmp_path, capsys):
    path = tmp_path / "profile.txt"
    path.write_text("\n".join(PROFILE) + "\n")
    assert main([str(path)]) == 0
    assert "the loop's thread: 53 samples" in capsys.readouterr().out
    assert main([]) == 2
