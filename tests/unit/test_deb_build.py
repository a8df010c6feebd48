"""The .deb's build shared by the passes of `make test` (tests/package/conftest.py): built once for
the same sources, again for other sources or when the shared file is no longer the one built, and
once when two sessions want it at the same moment. A script stands in for packaging/build-deb: it
counts its builds and writes a .deb whose content names the build."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.package.conftest import build_shared, source_hash

FAKE_BUILD = """#!/bin/sh
set -e
echo x >>"$COUNT"
sleep "${DELAY:-0}"
n=$(wc -l <"$COUNT")
mkdir -p "$OUT"
echo "build $n" >"$OUT/unitvisor_1.0_all.deb"
echo "$OUT/unitvisor_1.0_all.deb"
"""


# A build that hangs in a child of its own, as build-deb does in dpkg-buildpackage: the child's pid is
# written where the test reads it.
HANGING_BUILD = """#!/bin/sh
sleep 300 &
echo $! >"$CHILD"
wait
"""


def fake(tmp_path: Path, delay: float = 0) -> tuple[list[str], dict[str, str], Path]:
    script = tmp_path / "build-deb"
    script.write_text(FAKE_BUILD)
    script.chmod(0o755)
    count = tmp_path / "count"
    count.touch()
    return [str(script)], {"PATH": "/usr/bin:/bin", "COUNT": str(count), "DELAY": str(delay)}, count


def builds(count: Path) -> int:
    return len(count.read_text().splitlines())


def dest(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def test_the_same_sources_are_built_once(tmp_path: Path) -> None:
    build, env, count = fake(tmp_path)
    shared = tmp_path / "shared"
    first, built_first = build_shared(shared, "a", build, env, dest(tmp_path, "s1"))
    second, built_second = build_shared(shared, "a", build, env, dest(tmp_path, "s2"))
    assert (built_first, built_second, builds(count)) == (True, False, 1)
    assert first.read_text() == second.read_text() == "build 1\n"
    assert first.parent != second.parent  # each session's own copy


def test_other_sources_are_built_again(tmp_path: Path) -> None:
    build, env, count = fake(tmp_path)
    shared = tmp_path / "shared"
    build_shared(shared, "a", build, env, dest(tmp_path, "s1"))
    again, built = build_shared(shared, "b", build, env, dest(tmp_path, "s2"))
    assert built and builds(count) == 2 and again.read_text() == "build 2\n"


def test_a_deb_replaced_since_is_built_again(tmp_path: Path) -> None:
    # `make deb` after an edit writes build/deb without the record: the record's hash no longer
    # matches the file, even if the sources are back to what they were.
    build, env, count = fake(tmp_path)
    shared = tmp_path / "shared"
    first, _ = build_shared(shared, "a", build, env, dest(tmp_path, "s1"))
    (shared / first.name).write_text("another build\n")
    again, built = build_shared(shared, "a", build, env, dest(tmp_path, "s2"))
    assert built and builds(count) == 2 and again.read_text() == "build 2\n"


def test_two_sessions_at_once_build_once(tmp_path: Path) -> None:
    build, env, count = fake(tmp_path, delay=0.5)
    shared = tmp_path / "shared"
    results: list[tuple[Path, bool]] = []
    sessions = [threading.Thread(target=lambda name=name: results.append(
        build_shared(shared, "a", build, env, dest(tmp_path, name)))) for name in ("s1", "s2")]
    for session in sessions:
        session.start()
    for session in sessions:
        session.join(timeout=30)
    assert builds(count) == 1
    assert sorted(built for _, built in results) == [False, True]
    assert {path.read_text() for path, _ in results} == {"build 1\n"}


def alive(pid: int) -> bool:
    """Whether the process runs: a zombie waiting for its parent to reap it does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_build_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    script = tmp_path / "build-deb"
    script.write_text(HANGING_BUILD)
    script.chmod(0o755)
    child_file = tmp_path / "child"
    env = {"PATH": "/usr/bin:/bin", "CHILD": str(child_file)}
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"did not finish in 1s; it was killed with what it started"):
        build_shared(tmp_path / "shared", "a", [str(script)], env, dest(tmp_path, "s1"), timeout=1)
    assert time.monotonic() - started < 30  # not left waiting for the child's pipe
    child = int(child_file.read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "build-deb's child outlived the build's timeout"


# Marked package: it needs git, which the trixie chroot's pass (tests/unit, without package tests) has
# not; the PyPI pass runs it with the package tests, whose build it is about.
@pytest.mark.package
def test_the_source_hash_follows_the_work_tree(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a").write_text("one\n")
    (tmp_path / "untracked").write_text("x\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "a"], check=True)
    before = source_hash(tmp_path)
    (tmp_path / "untracked").write_text("y\n")  # build-deb leaves untracked files out: no change
    assert source_hash(tmp_path) == before
    (tmp_path / "a").write_text("two\n")  # an uncommitted edit is built: a change
    edited = source_hash(tmp_path)
    assert edited != before
    (tmp_path / "a").chmod(0o755)  # so is a mode
    assert source_hash(tmp_path) not in (before, edited)
