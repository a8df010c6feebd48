"""README's Install for a second host, over the network: PostgreSQL with TLS on (a certificate signed
by a throwaway CA made with openssl, as README shows), pg_hba.conf admitting TCP only as `hostssl ...
scram-sha-256`, and unitvisor connecting with `sslmode=verify-full sslrootcert=...` in its DSN: the
CLI with the operator's DSN, and a host's own DSN read from its DSN file as the daemon reads it.
A client that does not verify, or verifies against the wrong CA or the wrong name, gets one line
that says why.

(Failed before: the harness had no TLS cluster and README said nothing of listen_addresses,
pg_hba.conf or TLS; the first two tests are README's steps.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from supervisor import store
from tests.conftest import _unavailable
from tests.harness import postgres as postgres_mod
from tests.harness.postgres import Postgres
from tests.integration.test_cli_db import assert_one_line_error

PASSWORD = "operator-secret"
HOST_ID = "web-2"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> Path:
    """A throwaway CA: README's first openssl line."""
    directory.mkdir()
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=directory)
    return directory / "ca.crt"


def make_server_cert(ca_dir: Path, dns_name: str) -> tuple[Path, Path]:
    """The server's key and a certificate for dns_name signed by the CA: README's next two lines."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={dns_name}", cwd=ca_dir)
    # verify-full checks the name against subjectAltName (the CN only when there is none).
    (ca_dir / "san.ext").write_text(f"subjectAltName=DNS:{dns_name}\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-out", "server.crt", "-extfile", "san.ext", cwd=ca_dir)
    return ca_dir / "server.crt", ca_dir / "server.key"


@dataclass
class Tls:
    pg: Postgres
    ca: Path
    other_ca: Path

    def dsn(self, user: str, password: str, host: str = "localhost", ca: Path | None = None,
            sslmode: str = "verify-full") -> str:
        return (f"host={host} port={self.pg.port} dbname=unitvisor user={user} password={password} "
                f"sslmode={sslmode} sslrootcert={ca or self.ca}")


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tls]:
    if not subprocess.run(["sh", "-c", "command -v openssl"], capture_output=True, check=False).stdout:
        _unavailable("openssl is not installed (apt-get install openssl)")
    base = tmp_path_factory.mktemp("tls")
    ca = make_ca(base / "ca", "unitvisor test CA")
    cert, key = make_server_cert(base / "ca", "localhost")
    other_ca = make_ca(base / "other-ca", "some other CA")
    postgres_mod.cleanup_stale()
    try:
        pg = Postgres()
    except RuntimeError as exc:
        _unavailable(str(exc))
    try:
        pg.init()
        pg.require_tls(cert, key)
        pg.start()
        # README: createuser --pwprompt unitvisor; createdb --owner unitvisor unitvisor (as postgres)
        with psycopg.connect(pg.socket_dsn_for("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE ROLE unitvisor LOGIN PASSWORD '{PASSWORD}'")
            conn.execute("CREATE DATABASE unitvisor OWNER unitvisor")
        yield Tls(pg, ca, other_ca)
    finally:
        pg.stop()


@pytest.fixture(scope="module")
def web2_etc(tls: Tls, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """web-2's /etc/unitvisor (a directory of the test's own standing for it), with the CA's certificate
    copied in as README does: `install -m 0644 /tmp/unitvisor-ca.crt /etc/unitvisor/db-ca.crt`."""
    etc = tmp_path_factory.mktemp("web-2") / "etc" / "unitvisor"
    etc.mkdir(parents=True)
    subprocess.run(["install", "-m", "0644", str(tls.ca), str(etc / "db-ca.crt")], check=True, timeout=30)
    return etc


@pytest.fixture(scope="module")
def host_dsn(tls: Tls, web2_etc: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """README's steps on the database's machine, over its socket as the superuser: migrate, CONNECT
    for unitvisor's roles only, hosts add web-2 --db-host; then the printed DSN with README's
    sslmode and sslrootcert (web-2's /etc/unitvisor/db-ca.crt) appended, as it goes into web-2's
    /etc/unitvisor/dsn."""
    from tests.integration.conftest import unitvisor_command

    config = tmp_path_factory.mktemp("cfg") / "unitvisor.toml"
    config.write_text("")
    command, needs = unitvisor_command()

    def superuser(*args: str) -> str:
        result = subprocess.run([*command, "--config", str(config), "--dsn", tls.pg.socket_dsn_for("unitvisor"),
                                 *args], capture_output=True, text=True, timeout=120, check=False, cwd="/",
                                env={**os.environ, **needs})
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "applied" in superuser("migrate")
    with psycopg.connect(tls.pg.socket_dsn_for("unitvisor"), autocommit=True) as conn:
        conn.execute("REVOKE CONNECT ON DATABASE unitvisor FROM PUBLIC; GRANT CONNECT ON DATABASE unitvisor TO "
                     "unitvisor_admin, unitvisor_submitter, unitvisor_host")
    added = json.loads(superuser("hosts", "add", HOST_ID, "--db-host", "localhost", "--json"))
    return f"{added['dsn']} sslmode=verify-full sslrootcert={web2_etc / 'db-ca.crt'}"


def test_a_host_and_the_operator_connect_with_verify_full(tls: Tls, host_dsn: str, web2_etc: Path, cli,
                                                          tmp_path: Path) -> None:
    """The host's DSN from its DSN file (the daemon's path: [database] dsn_file, mode 0600), the
    operator's DSN over TLS for submit, both naming the CA's certificate where README puts it
    (/etc/unitvisor/db-ca.crt, mode 0644); both sessions are TLS, which the test reads back."""
    dsn_file = web2_etc / "dsn"
    dsn_file.write_text(host_dsn + "\n")
    dsn_file.chmod(0o600)  # README: (umask 077; editor /etc/unitvisor/dsn)
    assert {p.name: p.stat().st_mode & 0o777 for p in web2_etc.iterdir()} == {"db-ca.crt": 0o644, "dsn": 0o600}
    config = tmp_path / "unitvisor.toml"
    config.write_text(f'[database]\ndsn_file = "{dsn_file}"\n[host]\nid = "{HOST_ID}"\n')
    operator = tls.dsn("unitvisor", PASSWORD, ca=web2_etc / "db-ca.crt")
    submitted = cli("submit", "--host", HOST_ID, "--", "/bin/true", dsn=operator)
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    runs = cli("runs", "--json", config=config)
    assert runs.returncode == 0, runs.stderr
    assert [r["id"] for r in json.loads(runs.stdout)] == [run_id]
    doctor = cli("doctor", config=config)
    assert any(line.split()[:2] == ["ok", "database"] for line in doctor.stdout.splitlines()), doctor.stdout
    assert any(line.split()[:2] == ["ok", "role"] and f"bound to {HOST_ID}" in line
               for line in doctor.stdout.splitlines()), doctor.stdout
    for dsn in (host_dsn, operator):
        with store.connect(dsn) as conn:
            row = conn.execute("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
            assert row[0] is True and row[1].startswith("TLS"), row
            assert store.whoami(conn).kind == ("host" if dsn == host_dsn else "admin")


def test_a_connection_without_tls_is_refused_by_pg_hba(tls: Tls, cli) -> None:
    line = assert_one_line_error(cli("runs", dsn=tls.dsn("unitvisor", PASSWORD, sslmode="disable")), 1)
    assert "no pg_hba.conf entry" in line and "no encryption" in line, line


def test_the_wrong_ca_is_one_line_that_names_the_certificate(tls: Tls, cli) -> None:
    line = assert_one_line_error(cli("runs", dsn=tls.dsn("unitvisor", PASSWORD, ca=tls.other_ca)), 1)
    assert "cannot connect to the database at localhost:" in line and "certificate verify failed" in line, line


def test_a_name_the_certificate_does_not_carry_is_one_line(tls: Tls, cli) -> None:
    line = assert_one_line_error(cli("runs", dsn=tls.dsn("unitvisor", PASSWORD, host="127.0.0.1")), 1)
    # libpq 15: `server certificate for "localhost" (and 1 other name) does not match host name "127.0.0.1"`
    assert re.search(r'server certificate for "localhost".* does not match host name "127\.0\.0\.1"$', line), line
