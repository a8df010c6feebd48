"""A run's environment on a real host: delivered through a root-only file that no other user can
read (never over D-Bus), exactly as written, gone once the outcome is recorded, and never left behind
by a daemon killed after writing it; names the host refuses (BASH_ENV) and root runs are never
claimed unless the host's config names them."""

from __future__ import annotations

import hashlib
import secrets
import shlex
import uuid

import psycopg

from supervisor import store
from tests.harness.host import GATES, Host, daemon_active, wait_for

ENV_DIR = "/run/unitvisor/environment"


def hostile(token: str) -> str:
    """Every character the env-file encoding must carry through: quotes, backslashes (also last),
    `$`, backticks, spaces (leading and trailing), a tab, `#`, `;`, `=`, unicode."""
    return (f" {token} \"dq\" 'sq' \\back\\slash $HOME ${{HOME}} $(id) `id` # not a comment; a=b=c"
            "\ttab gr\u00fc\u00df \U0001f511 \\\" \\$ end\\ ")


def submit(host: Host, argv: list[str], environment: dict[str, str], **values: object) -> str:
    """Straight into the database, as a control plane does: a secret given to `unitvisor submit
    --env` would be on that command's command line, which every user of the host sees."""
    with psycopg.connect(host.dsn, autocommit=True) as conn:
        return str(store.submit_run(conn, argv=argv, environment=environment, **values))


def sha256(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def checking_gated(host: Host, gate: str, expected: dict[str, str]) -> list[str]:
    """A gated command that first checks each variable against the SHA-256 of its expected value
    (exit 3 on a mismatch, before waiting): the command line holds digests, never a value."""
    checks = " && ".join(
        f'[ "$(printf %s "${name}" | sha256sum)" = {shlex.quote(sha256(value) + "  -")} ]'
        for name, value in expected.items())
    script = host.gated(gate)[2]
    return ["/bin/sh", "-c", f"{checks} || exit 3; {script}"]


def as_nobody(host: Host, *cmd: str) -> str:
    """What an unprivileged local user sees: stdout and stderr of the command, run as nobody."""
    result = host.tb.run("runuser", "-u", "nobody", "--", *cmd, check=False, timeout=60)
    return result.stdout + result.stderr


# The names these tests set: a host opens only what [runs] allowed_environment names (envpolicy.py).
ALLOW = 'allowed_environment = ["SECRET", "HOSTILE", "EMPTY", "A", "OTHER_SECRET", "MINE"]'


def env_files(host: Host) -> list[str]:
    return host.tb.run("sh", "-c", f"ls -A {ENV_DIR} 2>/dev/null || true").stdout.split()


def test_the_environment_reaches_the_run_exactly_and_no_other_user(host: Host) -> None:
    host.configure(runs_extra=ALLOW)
    host.start()
    token = secrets.token_hex(16)
    environment = {"SECRET": token, "HOSTILE": hostile(token), "EMPTY": ""}
    run_id = submit(host, checking_gated(host, "secret", environment), environment)
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: host.show(run_id)["state"] == "running", what="the run to run")

    # root sees where the values are, and that the unit carries none of them
    props = host.unit_props(unit, "Environment", "EnvironmentFiles", "MainPID")
    assert props["Environment"] == ""
    assert props["EnvironmentFiles"].startswith(f"{ENV_DIR}/{unit}.env ")
    assert host.tb.run("stat", "-c", "%a %U", ENV_DIR, f"{ENV_DIR}/{unit}.env").stdout.split() == [
        "700", "root", "600", "root"]
    assert host.tb.run("stat", "-c", "%a", "/run/unitvisor").stdout.strip() == "700"
    pid = props["MainPID"]
    assert pid != "0"

    # an unprivileged user finds no trace of either value, by any of these ways
    [path] = host.tb.run("busctl", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                         "org.freedesktop.systemd1.Manager", "GetUnit", "s", unit).stdout.split()[1:]
    seen = {
        "systemctl show": as_nobody(host, "systemctl", "show", unit),
        "systemctl show -p Environment": as_nobody(host, "systemctl", "show", "-p", "Environment", unit),
        "systemctl status": as_nobody(host, "systemctl", "status", "--no-pager", "-n", "100", unit),
        "systemctl cat": as_nobody(host, "systemctl", "cat", unit),
        "busctl introspect": as_nobody(host, "busctl", "introspect", "--no-pager", "org.freedesktop.systemd1",
                                       path.strip('"')),
        "environ of the run": as_nobody(host, "cat", f"/proc/{pid}/environ"),
        "environ of every visible process": as_nobody(host, "sh", "-c", "cat /proc/[0-9]*/environ 2>/dev/null"),
        "the runtime directory": as_nobody(host, "ls", "-la", "/run/unitvisor", ENV_DIR),
        "the file": as_nobody(host, "cat", f"{ENV_DIR}/{unit}.env"),
        "everything under /run": as_nobody(host, "grep", "-r", "-a", "-D", "skip", "-F", token, "/run"),
    }
    # The ways work for nobody (else finding nothing in them would prove nothing)...
    assert f"EnvironmentFiles={ENV_DIR}/{unit}.env" in seen["systemctl show"]
    assert ".EnvironmentFiles" in seen["busctl introspect"] and ".Environment " in seen["busctl introspect"]
    assert "Description=unitvisor run" in seen["systemctl cat"]
    # ...and none shows the secret.
    for where, text in seen.items():
        assert token not in text, f"the secret is visible to nobody through {where}"
    assert "Permission denied" in seen["the file"] and "Permission denied" in seen["environ of the run"]

    host.open_gate("secret")
    data = host.wait_run(run_id)
    [attempt] = data["attempts"]
    # exit 3 would mean that a value reached the run other than exactly as written
    assert (data["state"], attempt["exit_status"]) == ("succeeded", "exit:0"), attempt
    assert env_files(host) == []


def test_a_daemon_killed_after_writing_the_file_leaves_none_behind(host: Host) -> None:
    host.configure(runs_extra=ALLOW)
    host.start()
    done = submit(host, ["/bin/true"], {"A": "1"})
    assert host.wait_run(done)["state"] == "succeeded"
    host.stop()
    host.install_units({"UNITVISOR_FAULT": "after-environment-file"})
    host.tb.run("systemctl", "start", "--no-block", "unitvisor.service")
    environment = {"SECRET": secrets.token_hex(16)}
    run_id = submit(host, checking_gated(host, "killed", environment), environment)
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: daemon_active(host) in ("failed", "inactive"), timeout=60, what="the daemon to die")
    assert env_files(host) == [f"{unit}.env"]  # written, and the unit never started
    assert host.loaded_run_units() == []

    # Leftovers no open attempt owns: a file of a run that ended, a half-written one, a stray.
    leftovers = [f"unitvisor-run-{done}-1.service.env", f".unitvisor-run-{uuid.uuid4()}-1.service.env."
                 "0123456789abcdef.tmp", "stray"]
    for name in leftovers:
        host.tb.run("sh", "-c", f"umask 077; echo 'SECRET=\"old\"' > {ENV_DIR}/{name}")
    host.tb.run("systemctl", "reset-failed", "unitvisor.service", check=False)
    host.start()  # no fault now: the start-up reconcile pass starts the attempt and sweeps
    wait_for(lambda: host.show(run_id)["state"] == "running", what="the attempt to be started after the crash")
    wait_for(lambda: env_files(host) == [f"{unit}.env"], timeout=60, what="the leftovers to be swept")
    host.open_gate("killed")
    data = host.wait_run(run_id)
    assert (data["state"], [a["exit_status"] for a in data["attempts"]]) == ("succeeded", ["exit:0"])
    assert env_files(host) == []


def test_a_run_that_sets_bash_env_waits_and_runs_only_where_allowed(host: Host) -> None:
    """BASH_ENV names a file that bash runs before the script: here one that exits 7, so an allowed
    /usr/bin/bash -c 'exit 0' would do something else than it says."""
    host.start()
    host.gated("bash-env")  # makes the directory, readable by runs
    script = f"{GATES}/bash-env.sh"
    # Through the container's own shell: /run there is a tmpfs the overlay's files do not reach.
    host.tb.run("sh", "-c", f"umask 022; cat > {script}", input="exit 7\n")
    run_id = submit(host, ["/usr/bin/bash", "-c", "exit 0"], {"BASH_ENV": script})
    data = wait_for(lambda: (d := host.show(run_id))["wait_reason"] and d, timeout=60, what="the reason it waits")
    assert data["wait_reason"] == "no live host accepts it: environment name BASH_ENV is not allowed (testhost-1)"
    assert data["attempts"] == [] and data["state"] == "queued"
    assert host.loaded_run_units() == []

    host.stop()
    host.configure(runs_extra='allowed_environment = ["BASH_ENV"]')
    host.start()
    data = host.wait_run(run_id)
    [attempt] = data["attempts"]
    assert (attempt["outcome"], attempt["exit_status"]) == ("exit-code", "exit:7")  # BASH_ENV ran


def test_a_root_run_is_claimed_only_where_allowed_users_names_root(host: Host) -> None:
    host.configure(runs_extra='user = "nobody"\nallowed_users = ["daemon"]')
    host.start()
    run_id = submit(host, ["/bin/sh", "-c", '[ "$(id -u)" = 0 ]'], {}, run_user="root")
    data = wait_for(lambda: (d := host.show(run_id))["wait_reason"] and d, timeout=60, what="the reason it waits")
    assert data["wait_reason"] == "no live host accepts it: user root is not allowed (testhost-1)"
    assert data["attempts"] == [] and host.loaded_run_units() == []

    host.stop()
    host.configure(runs_extra='allowed_users = ["root"]')
    host.start()
    data = host.wait_run(run_id)
    assert (data["state"], data["attempts"][0]["exit_status"]) == ("succeeded", "exit:0")
    doctor = host.cli("--config", "/etc/unitvisor/unitvisor.toml", "doctor", check=False)
    assert doctor.returncode == 0, doctor.stdout
    assert any(line.startswith("warn") and "root runs" in line for line in doctor.stdout.splitlines())


def test_a_root_run_reads_its_own_environment_and_no_other_runs(host: Host) -> None:
    """A run as root owns the environment files (capabilities do not matter for the owner), so the
    daemon's runtime directory is inaccessible in every run's namespace; its own values still arrive,
    because PID 1 reads the file before it sets the namespace up."""
    host.configure(runs_extra='allowed_users = ["root"]\n' + ALLOW)
    host.start()
    secret = secrets.token_hex(16)
    other = submit(host, checking_gated(host, "other-run", {"OTHER_SECRET": secret}), {"OTHER_SECRET": secret})
    wait_for(lambda: host.show(other)["state"] == "running", what="the other run to run")
    assert env_files(host), "the other run's environment file is there to be read"
    mine = secrets.token_hex(16)
    probe = ["/bin/sh", "-c",
             f'[ "$MINE" = {mine} ] || exit 3; cat /run/unitvisor/environment/* && exit 4; '
             'ls /run/unitvisor && exit 5; [ "$(id -u)" = 0 ] || exit 6; exit 0']
    run_id = submit(host, probe, {"MINE": mine}, run_user="root")
    data = host.wait_run(run_id)
    assert (data["state"], data["attempts"][0]["exit_status"]) == ("succeeded", "exit:0"), data
    host.open_gate("other-run")
    assert host.wait_run(other)["state"] == "succeeded"


def test_a_run_that_cannot_become_root_is_kept_out_by_the_directorys_mode(host: Host) -> None:
    """A host with the sandbox's namespaces off and a fixed user: the unit gets no mount namespace
    (no InaccessiblePaths=, which would be its only cause), and the run, a user under NoNewPrivileges,
    still reads its own environment and no other run's: /run/unitvisor is root's, mode 0700."""
    host.configure(runs_extra='user = "nobody"\nprivate_tmp = false\nprotect_system = "no"\nprotect_home = "no"\n'
                              'protect_kernel = false\nprotect_control_groups = false\nprivate_devices = false\n'
                              'protect_proc = "default"\n' + ALLOW)
    host.start()
    secret = secrets.token_hex(16)
    other = submit(host, checking_gated(host, "other-run", {"OTHER_SECRET": secret}), {"OTHER_SECRET": secret})
    wait_for(lambda: host.show(other)["state"] == "running", what="the other run to run")
    assert env_files(host), "the other run's environment file is there to be read"
    other_unit = f"unitvisor-run-{other}-1.service"
    assert host.unit_props(other_unit, "ActiveState", "InaccessiblePaths") == {
        "ActiveState": "active", "InaccessiblePaths": ""}
    mine = secrets.token_hex(16)
    # exit 4/5: the directory was readable; 7: the run is in a mount namespace of its own (its
    # /proc/self/ns/mnt differs from PID 1's, which the run may not read: compared by inode here).
    probe = ["/bin/sh", "-c",
             f'[ "$MINE" = {mine} ] || exit 3; cat /run/unitvisor/environment/* && exit 4; '
             'ls /run/unitvisor && exit 5; [ "$(id -un)" = nobody ] || exit 6; '
             'stat -L -c %i /proc/self/ns/mnt']
    run_id = submit(host, probe, {"MINE": mine})
    data = host.wait_run(run_id)
    assert (data["state"], data["attempts"][0]["exit_status"]) == ("succeeded", "exit:0"), data
    pid1_ns = host.tb.run("stat", "-L", "-c", "%i", "/proc/1/ns/mnt").stdout.strip()
    logs = host.cli("logs", run_id, check=False).stdout
    assert pid1_ns in logs.split(), f"the run's mount namespace is not PID 1's ({pid1_ns}): {logs!r}"
    host.open_gate("other-run")
    assert host.wait_run(other)["state"] == "succeeded"


def run_output(host: Host, run_id: str) -> list[str]:
    return host.tb.run("journalctl", f"UNITVISOR_RUN={run_id}", "--no-pager", "-o", "cat", check=False).stdout.split()


def test_a_name_the_allowlist_does_not_name_waits_through_submit_env(host: Host) -> None:
    """Issue 21: TAR_OPTIONS (not on 0.5's denylist) made an allowed backup script run the submitter's
    command. With the default allowlist the host claims a run that sets the locale and the time zone,
    never one that sets TAR_OPTIONS, until [runs] allowed_environment names it."""
    host.start()
    value = "--checkpoint=1 --checkpoint-action=exec=/x"
    tar = host.submit("--env", "LANG=C.UTF-8", "--env", f"TAR_OPTIONS={value}",
                      "--", "/bin/sh", "-c", 'echo "tar=${#TAR_OPTIONS}"')
    locale = host.submit("--env", "LANG=C.UTF-8", "--env", "LC_ALL=C", "--env", "TZ=UTC",
                         "--", "/bin/sh", "-c", 'echo "locale=$LANG,$LC_ALL,$TZ"')
    assert host.wait_run(locale)["state"] == "succeeded"
    assert wait_for(lambda: "locale=C.UTF-8,C,UTC" in run_output(host, locale), what="the run's output")
    data = wait_for(lambda: (d := host.show(tar))["wait_reason"] and d, timeout=60, what="the reason it waits")
    assert data["wait_reason"] == "no live host accepts it: environment name TAR_OPTIONS is not allowed (testhost-1)"
    assert data["attempts"] == [] and data["state"] == "queued"

    host.stop()
    host.configure(runs_extra='allowed_environment = ["LANG", "TAR_OPTIONS"]')
    host.start()
    assert host.wait_run(tar)["state"] == "succeeded"
    assert wait_for(lambda: f"tar={len(value)}" in run_output(host, tar), what="the run's output")


def test_the_largest_environment_entry_submit_accepts_reaches_the_run(host: Host) -> None:
    """The bound (sql/015: NAME=value at most 131071 bytes, the kernel's MAX_ARG_STRLEN with its NUL)
    is one that exec and systemd's EnvironmentFile= take: a 1 MB value used to be accepted and then
    failed at exec (203/EXEC). Every character of this one needs an escape in the env file ($)."""
    host.configure(runs_extra='allowed_environment = ["BIG"]')
    host.start()
    value = "$" * (131071 - len("BIG="))
    run_id = host.submit("--env", f"BIG={value}", "--", "/bin/sh", "-c",
                         'echo "big=${#BIG}"; [ "$BIG" = "$(printf "%${#BIG}s" | tr " " "\\$")" ] && echo same')
    data = host.wait_run(run_id)
    lines = wait_for(lambda: (out := run_output(host, run_id)) and "same" in out and out,
                     what="the run's output")
    assert data["state"] == "succeeded", (data, lines)
    assert f"big={len(value)}" in lines
