"""doctor's line on the journal: persistent or not decides whether a success that ended while the
daemon was down survives a reboot (README, "Outcomes after a daemon restart or a host reboot")."""

from pathlib import Path

from supervisor.doctor import journal_check

ID = "0123456789abcdef0123456789abcdef"


def machine(tmp_path: Path, ident: str | None = ID) -> Path:
    path = tmp_path / "machine-id"
    if ident is not None:
        path.write_text(ident + "\n")
    return path


def test_a_journal_directory_for_this_machine_is_persistent(tmp_path: Path) -> None:
    (tmp_path / "journal" / ID).mkdir(parents=True)
    check = journal_check(tmp_path / "journal", machine(tmp_path))
    assert (check.status, check.message) == ("ok", f"persistent ({tmp_path / 'journal' / ID})")


def test_no_journal_directory_is_volatile_and_says_the_fix(tmp_path: Path) -> None:
    check = journal_check(tmp_path / "journal", machine(tmp_path))
    assert check.status == "warn"
    assert "recorded lost after a reboot" in check.message
    assert check.message.endswith("mkdir -p /var/log/journal && systemctl restart systemd-journald")


def test_a_directory_without_this_machines_journal_is_volatile(tmp_path: Path) -> None:
    """/var/log/journal exists but journald never moved there (not restarted since mkdir)."""
    (tmp_path / "journal" / "another-machine").mkdir(parents=True)
    assert journal_check(tmp_path / "journal", machine(tmp_path)).status == "warn"


def test_an_empty_machine_id_is_not_mistaken_for_the_directory_itself(tmp_path: Path) -> None:
    (tmp_path / "journal").mkdir()
    assert journal_check(tmp_path / "journal", machine(tmp_path, "")).status == "warn"


def test_an_unreadable_machine_id_is_a_warning_not_a_crash(tmp_path: Path) -> None:
    check = journal_check(tmp_path / "journal", machine(tmp_path, None))
    assert check.status == "warn" and "cannot tell" in check.message
