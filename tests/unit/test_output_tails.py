"""Output tails read in batches (issue 14): one journalctl for every attempt that is due, split per
attempt, each tail exactly what that attempt's own read gives, and the TailReader thread that forms
the batches. journalctl is a fake at its boundary (subprocess.run): an in-memory journal that prints
-o cat and -o json as systemd 252 does (both checked in a test bed: a MESSAGE that is not UTF-8 or
holds a control character other than a tab comes as an array of byte values, one of 4096 bytes or
more as null, a field a record has twice as an array of its values, and --lines counts records
without a MESSAGE, which -o cat skips)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid

import pytest

from supervisor.journal import LONG, Journal, TailReader, field_values, split_output

Record = tuple[str, int, bytes | None]  # run id, attempt, MESSAGE (None: the record has none)


def json_value(data: bytes) -> str | list[int] | None:
    if len(b"MESSAGE=" + data) >= 4096:  # left out without --all
        return None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return list(data)
    return text if all(c == "\t" or c >= " " and c != "\x7f" for c in text) else list(data)


def json_line(run_id: str, attempt: int, message: bytes | None) -> bytes:
    record: dict[str, object] = {"__CURSOR": "s=1;i=2", "__REALTIME_TIMESTAMP": "1796089524395860",
                                 "UNITVISOR_RUN": run_id, "UNITVISOR_ATTEMPT": str(attempt), "_BOOT_ID": "b"}
    if message is not None:
        record["MESSAGE"] = json_value(message)
    return json.dumps(record, ensure_ascii=False).encode() + b"\n"


class FakeJournalctl:
    """journalctl over an in-memory journal (records in the journal's order): -o cat or -o json,
    --lines, and matches as journalctl combines them: the values of one field ORed, the fields ANDed,
    groups of those ORed with "+"."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self.calls: list[list[str]] = []

    def __call__(self, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        self.calls.append(cmd)
        groups: list[dict[str, set[str]]] = [{}]
        for arg in cmd[1:]:
            if arg == "+":
                groups.append({})
            elif not arg.startswith("-") and "=" in arg:
                field, value = arg.split("=", 1)
                groups[-1].setdefault(field, set()).add(value)
        lines = next(int(arg.split("=")[1]) for arg in cmd if arg.startswith("--lines="))

        def matches(run_id: str, attempt: int) -> bool:
            fields = {"UNITVISOR_RUN": run_id, "UNITVISOR_ATTEMPT": str(attempt)}
            return any(all(fields[field] in values for field, values in group.items()) for group in groups)

        shown = [(run_id, attempt, message) for run_id, attempt, message in self.records if matches(run_id, attempt)]
        shown = shown[-lines:]
        if cmd[cmd.index("-o") + 1] == "cat":
            out = b"".join(message + b"\n" for _, _, message in shown if message is not None)
        else:
            out = b"".join(json_line(*record) for record in shown)
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr=b"")

    def modes(self) -> list[str]:
        return [cmd[cmd.index("-o") + 1] for cmd in self.calls]


def lines_of(run_id: str, attempt: int, count: int, prefix: str = "") -> list[Record]:
    return [(run_id, attempt, f"{prefix}{run_id}/{attempt} line {i}".encode()) for i in range(1, count + 1)]


def each_alone(records: list[Record], attempts, max_lines: int, max_bytes: int, mocker) -> list[str | None]:
    """What today's read of each attempt alone (journalctl -o cat --lines) keeps."""
    mocker.patch.object(subprocess, "run", FakeJournalctl(records))
    return [Journal().output_tail(run_id, attempt, max_lines, max_bytes) for run_id, attempt in attempts]


def batched(records: list[Record], attempts, max_lines: int, max_bytes: int, mocker):
    fake = FakeJournalctl(records)
    mocker.patch.object(subprocess, "run", fake)
    return Journal().output_tails(attempts, max_lines, max_bytes), fake


# -- Journal.output_tails: one journalctl, the same tails ----------------------------------------

def test_one_journalctl_reads_every_attempts_tail(mocker):
    records = lines_of("r1", 1, 3) + lines_of("r2", 1, 9) + lines_of("r1", 2, 2)
    tails, fake = batched(records, [("r1", 1), ("r2", 1), ("r1", 2), ("r3", 1)], 5, 4096, mocker)
    assert tails == ["r1/1 line 1\nr1/1 line 2\nr1/1 line 3", "\n".join(f"r2/1 line {i}" for i in range(5, 10)),
                     "r1/2 line 1\nr1/2 line 2", ""]  # r3 printed nothing: kept as nothing
    (cmd,) = fake.calls
    # The runs' matches only, each once: journalctl ORs them; the records are split by attempt here.
    assert cmd == ["journalctl", "--no-pager", "-q", "-o", "json", "--lines=20",
                   "--output-fields=MESSAGE,UNITVISOR_RUN,UNITVISOR_ATTEMPT",
                   "UNITVISOR_RUN=r1", "UNITVISOR_RUN=r2", "UNITVISOR_RUN=r3"]


ODD = [
    ("r1", 1, b"plain"), ("r1", 1, b"tab\there"), ("r1", 1, b"esc\x1b[31mred"), ("r1", 1, b"bad\xffbyte"),
    ("r1", 1, b"cr\rin"), ("r1", 1, None), ("r1", 1, "sep\u2028arator ✓ é".encode()),
    ("r1", 1, b"half \xe2\x9c"), ("r1", 1, b"multi\nline\nsyslog"), ("r1", 1, b""), ("r1", 1, b"x" * 5000),
    ("r2", 1, b"\xc3\xa9t\xc3\xa9"), ("r2", 1, b"\x00nul"),
]


@pytest.mark.parametrize(("records", "max_lines", "max_bytes"), [
    (lines_of("r1", 1, 3) + lines_of("r2", 1, 30) + lines_of("r1", 2, 2), 5, 4096),
    (ODD, 20, 65536),  # not UTF-8, control characters, no MESSAGE, several lines a record, 5000 bytes
    (ODD, 4, 30),  # the byte cut lands inside a character, inside a line
    (ODD[:6], 3, 4096),
    ([rec for i in range(1, 11) for rec in lines_of("r1", 1, 1, f"{i} ") + lines_of("r2", 1, 1, f"{i} ")], 4, 4096),
    (lines_of("r1", 1, 3) + lines_of("r2", 1, 1000), 5, 4096),  # r2 crowds r1 out
    (lines_of("r2", 1, 1000) + lines_of("r1", 1, 3), 5, 4096),  # r2's lines came first: no crowding
    ([], 5, 4096),
])
def test_a_batch_keeps_exactly_what_each_attempt_read_alone_keeps(records, max_lines, max_bytes, mocker):
    attempts = [("r1", 1), ("r2", 1), ("r1", 2), ("r3", 1)]
    tails, _ = batched(records, attempts, max_lines, max_bytes, mocker)
    assert tails == each_alone(records, attempts, max_lines, max_bytes, mocker)


def test_non_utf8_is_replaced_as_the_single_read_replaces_it(mocker):
    tails, _ = batched([("r1", 1, b"bad\xffbyte"), ("r1", 1, b"half \xe2\x9c"), ("r2", 1, b"esc\x1b[0m")],
                       [("r1", 1), ("r2", 1)], 20, 4096, mocker)
    assert tails == ["bad\ufffdbyte\nhalf \ufffd", "esc\x1b[0m"]


def test_an_attempt_crowded_out_by_a_chatty_one_is_read_alone(mocker):
    # r1 and r3 printed their few lines, then r2 a million (here 1000): the batch's last 15 records
    # are all r2's, so it cannot tell r1's and r3's tails; r4 printed nothing, which the batch cannot
    # tell either. r2's own 5 last lines are in the batch.
    records = lines_of("r1", 1, 3) + lines_of("r3", 1, 7) + lines_of("r2", 1, 1000)
    attempts = [("r1", 1), ("r2", 1), ("r3", 1)]
    tails, fake = batched(records, attempts, 5, 4096, mocker)
    assert tails == each_alone(records, attempts, 5, 4096, mocker)
    assert fake.modes() == ["json", "cat", "cat"]
    assert [cmd[-2:] for cmd in fake.calls[1:]] == [["UNITVISOR_RUN=r1", "UNITVISOR_ATTEMPT=1"],
                                                     ["UNITVISOR_RUN=r3", "UNITVISOR_ATTEMPT=1"]]


def test_another_attempt_of_the_same_run_counts_against_the_bound(mocker):
    """Attempt 2 of r1 (not asked for: its tail is not due yet) printed 1000 lines after attempt 1."""
    records = lines_of("r1", 1, 3) + lines_of("r2", 1, 2) + lines_of("r1", 2, 1000)
    tails, fake = batched(records, [("r1", 1), ("r2", 1)], 5, 4096, mocker)
    assert tails == ["r1/1 line 1\nr1/1 line 2\nr1/1 line 3", "r2/1 line 1\nr2/1 line 2"]
    assert fake.modes() == ["json", "cat", "cat"]


def test_an_attempt_with_a_line_too_long_for_the_batch_is_read_alone(mocker):
    """journalctl -o json (without --all) leaves out a MESSAGE of 4096 bytes or more: among an
    attempt's last lines, its read alone has it; before them, it does not matter."""
    records = [("r1", 1, b"y" * 5000), *lines_of("r1", 1, 5), ("r2", 1, b"short"), ("r2", 1, b"z" * 4088),
               ("r2", 1, b"last")]
    tails, fake = batched(records, [("r1", 1), ("r2", 1)], 5, 65536, mocker)
    assert tails == ["\n".join(f"r1/1 line {i}" for i in range(1, 6)), "short\n" + "z" * 4088 + "\nlast"]
    assert fake.modes() == ["json", "cat"]
    assert fake.calls[1][-2:] == ["UNITVISOR_RUN=r2", "UNITVISOR_ATTEMPT=1"]


def test_a_batch_below_its_bound_proves_the_short_tails(mocker):
    """Fewer records than the bound: every record of every attempt is there, the short ones too."""
    tails, fake = batched(lines_of("r1", 1, 2) + lines_of("r2", 1, 8), [("r1", 1), ("r2", 1), ("r3", 1)], 5, 4096,
                          mocker)
    assert tails == ["r1/1 line 1\nr1/1 line 2", "\n".join(f"r2/1 line {i}" for i in range(4, 9)), ""]
    assert fake.modes() == ["json"]


@pytest.mark.parametrize("failure", [
    subprocess.CompletedProcess([], 1, stdout=b"", stderr=b"No journal files were found."),
    OSError(2, "No such file or directory"),
    subprocess.TimeoutExpired("journalctl", 10),
])
def test_a_failed_batch_keeps_no_tail_and_reads_no_more(mocker, failure):
    kwargs = {"side_effect": failure} if isinstance(failure, BaseException) else {"return_value": failure}
    run = mocker.patch.object(subprocess, "run", **kwargs)
    assert Journal().output_tails([("r1", 1), ("r2", 1)], 20, 4096) == [None, None]
    assert run.call_count == 1


@pytest.mark.parametrize("stdout", [
    b'{"MESSAGE": "cut sh', b"[1, 2]\n", b'{"UNITVISOR_RUN": "r1", "UNITVISOR_ATTEMPT": "1", "MESSAGE": [300]}\n',
    b'{"UNITVISOR_RUN": "r1", "UNITVISOR_ATTEMPT": "1", "MESSAGE": "\\ud800"}\n', b"\xff\n",
])
def test_output_that_is_not_records_has_each_attempt_read_alone(mocker, stdout):
    cat = subprocess.CompletedProcess([], 0, stdout=b"alone\n", stderr=b"")
    run = mocker.patch.object(subprocess, "run", side_effect=[subprocess.CompletedProcess([], 0, stdout=stdout),
                                                             cat, cat])
    assert Journal().output_tails([("r1", 1), ("r2", 1)], 20, 4096) == ["alone", "alone"]
    assert run.call_count == 3


def test_an_attempt_twice_is_matched_once_and_kept_twice(mocker):
    tails, fake = batched(lines_of("r1", 1, 2) + lines_of("r2", 1, 1), [("r1", 1), ("r2", 1), ("r1", 1)], 5, 4096,
                          mocker)
    assert tails == ["r1/1 line 1\nr1/1 line 2", "r2/1 line 1", "r1/1 line 1\nr1/1 line 2"]
    assert "--lines=10" in fake.calls[0] and fake.calls[0].count("UNITVISOR_RUN=r1") == 1


def test_one_attempt_is_read_as_before(mocker):
    tails, fake = batched(lines_of("r1", 1, 2), [("r1", 1)], 5, 4096, mocker)
    assert (tails, fake.modes()) == (["r1/1 line 1\nr1/1 line 2"], ["cat"])


@pytest.mark.parametrize(("lines", "size"), [(0, 4096), (20, 0)])
def test_a_batch_that_keeps_none_reads_nothing(mocker, lines, size):
    run = mocker.patch.object(subprocess, "run")
    assert Journal().output_tails([("r1", 1), ("r2", 1)], lines, size) == [None, None]
    run.assert_not_called()


# -- splitting journalctl's JSON -----------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    ("text ✓", ["text ✓".encode()]),
    ([98, 97, 100, 255], [b"bad\xff"]),
    ([], [b""]),
    (["first", "second"], [b"first", b"second"]),  # the field twice in one record
    (["text", [27, 91]], [b"text", b"\x1b["]),
    (None, []),  # too long for JSON without --all
    (7, []),
])
def test_field_values(value, expected):
    assert field_values(value) == expected


def test_split_output_by_each_attempts_fields():
    stdout = b"".join([
        json_line("r1", 1, b"one"),
        json_line("r9", 1, b"another run's: counted, kept by none"),
        b'{"UNITVISOR_RUN":"r1","UNITVISOR_ATTEMPT":["7","1"],"MESSAGE":["first","second"]}\n',
        json_line("r1", 2, None),
        json_line("r1", 2, "a\u2028b".encode()),
        b'{"UNITVISOR_RUN":["r1","r1"],"UNITVISOR_ATTEMPT":"7","MESSAGE":"twice the same values: once"}\n',
        b'{"UNITVISOR_RUN":"r1","UNITVISOR_ATTEMPT":"1","MESSAGE":null}\n',
        b'{"UNITVISOR_RUN":"r1","UNITVISOR_ATTEMPT":"2","MESSAGE":[null,"short"]}\n',
    ])
    assert split_output(stdout, [("r1", 1), ("r1", 2), ("r1", 7)]) == (
        [[b"one", b"first", LONG], [None, "a\u2028b".encode(), LONG], [b"first", b"twice the same values: once"]], 8)
    assert split_output(b"", [("r1", 1)]) == ([[]], 0)


@pytest.mark.parametrize("stdout", [b"not json\n", b"[]\n", b'{"MESSAGE": [256]}\n', b'"text"\n'])
def test_split_output_refuses_what_is_not_records(stdout):
    with pytest.raises(ValueError):
        split_output(stdout, [("r1", 1)])


# -- TailReader: every attempt due, in one read ----------------------------------------------------

class GatedJournal:
    """Records each batch and when it was read; the first read waits for `gate`, so that the test
    can queue attempts while the thread is busy."""

    def __init__(self) -> None:
        self.batches: list[tuple[float, list[tuple[str, int]]]] = []
        self.gate = threading.Event()

    def output_tails(self, attempts, max_lines, max_bytes):
        self.batches.append((time.monotonic(), list(attempts)))
        if len(self.batches) == 1:
            assert self.gate.wait(10)
        return [f"{run_id[-1]}/{attempt}" for run_id, attempt in attempts]


def wait_reads(journal: GatedJournal, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(journal.batches) < count:
        assert time.monotonic() < deadline, journal.batches
        time.sleep(0.005)


def ids(batch):
    return [int(run_id[-1]) for run_id, _ in batch[1]]


def test_the_reader_takes_every_attempt_due_in_one_batch_of_at_most_its_size():
    journal, woken = GatedJournal(), []
    reader = TailReader(journal, 320, 4096, delay=0.0, spacing=0.0, wake=lambda: woken.append(1))
    assert reader.batch_size == 2  # BATCH_RECORDS // 320
    reader.add(uuid.UUID(int=1), 1)
    wait_reads(journal, 1)  # busy with the first
    for i in range(2, 7):
        reader.add(uuid.UUID(int=i), 1)
    journal.gate.set()
    reader.close(timeout=10)
    assert [ids(b) for b in journal.batches] == [[1], [2, 3], [4, 5], [6]]
    assert reader.take() == [(uuid.UUID(int=i), 1, f"{i}/1") for i in range(1, 7)]
    assert len(woken) == 4


def test_the_reader_reads_none_before_its_time_and_spaces_its_reads():
    journal = GatedJournal()
    journal.gate.set()
    reader = TailReader(journal, 20, 4096, delay=0.3, spacing=0.6)
    assert reader.batch_size == TailReader.MAX_BATCH
    added = {}
    for i in (1, 2, 3):
        added[i] = time.monotonic()
        reader.add(uuid.UUID(int=i), 1)
        time.sleep(0.15)  # 2 comes due 0.15 s after 1 is read, 3 after that, both within the spacing
    reader.close(timeout=10)
    assert [i for batch in journal.batches for i in ids(batch)] == [1, 2, 3]
    for batch in journal.batches:
        assert all(batch[0] >= added[i] + 0.3 for i in ids(batch))  # none before its time
    # 1 is read alone when due; 2 and 3 come due within the spacing and are read together after it.
    assert [ids(b) for b in journal.batches] == [[1], [2, 3]]
    assert journal.batches[1][0] - journal.batches[0][0] >= 0.6


def test_a_full_batch_is_followed_at_once():
    journal = GatedJournal()
    reader = TailReader(journal, 320, 4096, delay=0.0, spacing=1.0)
    reader.add(uuid.UUID(int=1), 1)
    wait_reads(journal, 1)
    for i in range(2, 6):
        reader.add(uuid.UUID(int=i), 1)
    journal.gate.set()
    reader.close(timeout=10)
    # [2, 3] after the spacing, then [4, 5] at once: the last read was full, so more may be waiting.
    assert [ids(b) for b in journal.batches] == [[1], [2, 3], [4, 5]]
    assert journal.batches[1][0] - journal.batches[0][0] >= 1.0 > 0.5 > journal.batches[2][0] - journal.batches[1][0]


@pytest.mark.parametrize(("max_lines", "size"), [(1, 32), (20, 32), (21, 30), (100, 6), (640, 1), (1000, 1)])
def test_a_batch_holds_at_most_its_records(max_lines, size):
    """At most BATCH_RECORDS records a read (its memory and time), and MAX_BATCH attempts."""
    assert TailReader(GatedJournal(), max_lines, 4096).batch_size == size
    assert (TailReader.MAX_BATCH, TailReader.BATCH_RECORDS) == (32, 640)
