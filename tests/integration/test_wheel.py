"""The wheel, as `pip install` meets it: built from the files git tracks, installed into a fresh
virtualenv away from the checkout, its `unitvisor migrate` applies every migration to an empty
database. (Before 0.2.0 the wheel had no migrations, and migrate said "schema is current".)"""

from __future__ import annotations

import os
import subprocess
import venv
import zipfile
from pathlib import Path

import pytest

from supervisor import store
from tests.conftest import _unavailable
from tests.harness.host import REPO

pytestmark = pytest.mark.integration

SYSTEM_PYTHON = "/usr/bin/python3"
# Debian's python3-* packages, the ones the .deb runs with: the fresh virtualenv sees them through
# --system-site-packages, so that it needs no compiler (pystemd from PyPI builds from source).
DEPENDENCIES = ("psycopg", "pystemd", "sdnotify", "click")


def _tracked_copy(dest: Path) -> None:
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    names = [n for n in files.decode().split("\0") if n and (REPO / n).exists()]
    subprocess.run(["tar", "-C", str(REPO), "--null", "-T", "-", "-cf", str(dest / "src.tar")],
                   input="\0".join(names).encode(), check=True)
    (dest / "src").mkdir()
    subprocess.run(["tar", "-C", str(dest / "src"), "-xf", str(dest / "src.tar")], check=True)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import build, setuptools, wheel"], capture_output=True, check=False)
    if probe.returncode != 0:
        _unavailable("building the wheel needs python3-build, python3-setuptools and python3-wheel (make deps)")
    tmp = tmp_path_factory.mktemp("wheel")
    _tracked_copy(tmp)
    result = subprocess.run([SYSTEM_PYTHON, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp / "dist"),
                             str(tmp / "src")], capture_output=True, text=True, env=_clean_env(), timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = (tmp / "dist").glob("unitvisor-*.whl")
    return path


def test_the_wheel_carries_every_migration(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    expected = sorted(f"supervisor/sql/{p.relative_to(REPO / 'sql')}" for p in (REPO / "sql").rglob("*.sql"))
    assert "supervisor/sql/schema.sql" in expected and "supervisor/sql/migrations/001_schema.sql" in expected
    assert expected and sorted(n for n in names if n.endswith(".sql")) == expected
    assert not any(n.startswith("sql/") for n in names), "a top-level sql/ in site-packages would be anyone's"


def test_the_installed_wheel_migrates_an_empty_database(wheel: Path, empty_dsn: str, tmp_path: Path) -> None:
    probe = subprocess.run([SYSTEM_PYTHON, "-c", f"import {', '.join(DEPENDENCIES)}"], capture_output=True,
                           check=False)
    if probe.returncode != 0:
        _unavailable(f"Debian's python3-{', python3-'.join(DEPENDENCIES)} are not installed (make deps)")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    pip = subprocess.run([str(env_dir / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert pip.returncode == 0, pip.stderr
    # Away from the checkout, with nothing on PYTHONPATH: only the installed wheel can answer.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = elsewhere / "unitvisor.toml"
    config.write_text("")

    def unitvisor(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(env_dir / "bin" / "unitvisor"), "--config", str(config), "--dsn", empty_dsn,
                               *args], capture_output=True, text=True, cwd=elsewhere, env=_clean_env(), timeout=120,
                              check=False)

    probe = "from supervisor import store; print(store.MIGRATIONS_DIR)"
    where = subprocess.run([str(env_dir / "bin" / "python"), "-c", probe],
                           capture_output=True, text=True, cwd=elsewhere, env=_clean_env(), check=True).stdout.strip()
    assert Path(where).is_relative_to(env_dir), where
    versions = [p.stem for p in sorted((REPO / "sql" / "migrations").glob("*.sql"))]
    first = unitvisor("migrate")
    assert (first.returncode, first.stdout.strip()) == (0, f"applied: {', '.join(versions)}"), first.stderr
    again = unitvisor("migrate")
    assert (again.returncode, again.stdout.strip()) == (0, "schema is current; nothing to apply"), again.stderr
    with store.connect(empty_dsn) as conn:
        assert store.pending_migrations(conn) == []
