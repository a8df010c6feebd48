"""The package level: build the .deb once (packaging/build-deb, as a user would), then check it with
lintian, systemd-analyze and a clean-room install (test_cleanroom.py). The VM tier (tests/vm) installs
the same build.

Once across sessions, not once per session: the package tests (the PyPI pass of `make test`) and the
VM tier (a pass of its own) run at once, and each would otherwise spend a minute or two of the
2-core machine on the same dpkg-buildpackage. The build goes to build/deb under an flock, with the
hash of the sources it was built from (what build-deb copies: the files git tracks, as the work tree
has them) and of the .deb itself; a session whose sources hash the same takes that .deb, any other
builds it again. Each session then works on a copy of its own, so that a later build (`make deb`,
another session after an edit) cannot swap the file under it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import _unavailable
from tests.harness.commands import run_in_session
from tests.harness.host import REPO

SHARED = REPO / "build" / "deb"
# Not build-deb's own lock (SHARED/.lock, taken while it moves its results in): this one is held
# across the whole build, and the same file would deadlock build-deb against its caller.
SESSION_LOCK = ".session-lock"
BUILT_FROM = ".built-from.json"
# A build takes one to two minutes of the 2-core machine; one that runs past this is stuck.
BUILD_TIMEOUT = 1200


def source_hash(repo: Path = REPO) -> str:
    """A hash of what packaging/build-deb builds from: each file git tracks that exists, by path,
    mode and content (the work tree's, uncommitted edits included), and the build script itself."""
    result = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached"], capture_output=True,
                            check=False, timeout=60)
    if result.returncode != 0:
        # Not a git checkout (build-deb then copies the whole tree): nothing tells two trees apart,
        # so this session builds its own.
        return "unshared-" + os.urandom(16).hex()
    listed = result.stdout.decode().split("\0")
    digest = hashlib.sha256()
    for name in sorted(filter(None, listed)):
        path = repo / name
        if not path.is_symlink() and not path.exists():
            continue  # deleted in the work tree: build-deb leaves it out too
        content = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
        executable = not path.is_symlink() and os.access(path, os.X_OK)
        digest.update(f"{name}\0{int(executable)}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reusable(shared: Path, sources: str) -> Path | None:
    """The .deb in `shared` when it was built from `sources` and is still the file that build wrote."""
    try:
        record = json.loads((shared / BUILT_FROM).read_text())
        path = shared / record["deb"]
        if record["sources"] == sources and file_hash(path) == record["sha256"]:
            return path
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def build_shared(shared: Path, sources: str, build: list[str], env: dict[str, str], dest: Path,
                 timeout: float = BUILD_TIMEOUT) -> tuple[Path, bool]:
    """A copy in `dest` of the .deb built from `sources`, built by `build` unless `shared` already has
    it; and whether this call built it. Under an flock of `shared`, so that sessions at once build it
    once, and copied before the lock is released, so that no other build replaces it half-read. A
    build past `timeout` seconds fails the session, its whole process tree killed (run_in_session:
    dpkg-buildpackage and the tests it runs, not only build-deb)."""
    shared.mkdir(parents=True, exist_ok=True)
    with open(shared / SESSION_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = reusable(shared, sources)
        if found is not None:
            return Path(shutil.copy2(found, dest)), False
        (shared / BUILT_FROM).unlink(missing_ok=True)
        try:
            result = run_in_session(build, timeout, {**env, "OUT": str(shared)})
        except subprocess.TimeoutExpired:
            pytest.fail(f"packaging/build-deb did not finish in {timeout:g}s; it was killed with what it started",
                        pytrace=False)
        if result.returncode != 0:
            pytest.fail(f"packaging/build-deb exited {result.returncode}:\n{result.stderr[-5000:]}", pytrace=False)
        path = Path(result.stdout.strip().splitlines()[-1])
        assert path.is_file() and path.name.endswith("_all.deb"), result.stdout
        (shared / BUILT_FROM).write_text(json.dumps({"sources": sources, "deb": path.name,
                                                     "sha256": file_hash(path)}))
        return Path(shutil.copy2(path, dest)), True


@pytest.fixture(scope="session")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0 and not shutil.which("dpkg-buildpackage"):
        _unavailable("building the .deb needs dpkg-dev and debhelper (packaging/build-deb installs them as root)")
    started = time.monotonic()
    own, built = build_shared(SHARED, source_hash(), [str(REPO / "packaging" / "build-deb")], dict(os.environ),
                              tmp_path_factory.mktemp("deb"))
    print(f"{'built' if built else 'took the shared build of'} {own.name} in {time.monotonic() - started:.1f}s")
    return own
