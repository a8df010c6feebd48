"""A throwaway Prometheus server: Debian's `prometheus` binary run by the test itself, with its own
configuration and storage in a temp dir and a free port on 127.0.0.1, never the system's
prometheus.service. It scrapes targets on this machine's loopback (a test bed shares the machine's
network, so a daemon in one is reachable at 127.0.0.1), and answers through its HTTP API.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.harness.postgres import free_port

PREFIX = "unitvisor-prom-"
_PR_SET_PDEATHSIG = 1


def available() -> str | None:
    """None when a Prometheus can be run here, else the reason why not."""
    for tool in ("prometheus", "promtool"):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install --no-install-recommends prometheus)"
    return None


def require() -> None:
    """Skip the calling test where Prometheus's tools are missing; under CI (CI=true) fail instead, as
    tests/conftest.py does for every level: a skipped check is a check that did not run."""
    reason = available()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"required in CI but unavailable: {reason}", pytrace=False)
        pytest.skip(reason)


def _die_with_the_test() -> None:
    # A test session killed with SIGKILL cannot stop its Prometheus: the kernel does, by this signal.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Prometheus:
    def __init__(self, targets: list[str], job: str = "unitvisor", rule_files: list[Path] | None = None,
                 interval: str = "1s") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir="/tmp"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.dir / "prometheus.log"
        rules = "".join(f"  - {json.dumps(str(p))}\n" for p in rule_files or [])
        (self.dir / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {interval}\n  scrape_timeout: {interval}\n"
            f"  evaluation_interval: {interval}\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + f"scrape_configs:\n  - job_name: {json.dumps(job)}\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_the_test)
        log.close()
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus was not ready after 60s: {self.log()}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>: its `data`, or an AssertionError with Prometheus's own error."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query's vector as {labels without __name__: value}."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return {tuple(sorted((k, v) for k, v in r["metric"].items() if k != "__name__")): float(r["value"][1])
                for r in data["result"]}

    def value(self, expr: str) -> float | None:
        """The one value of a query whose answer is a single series, None when it has none yet."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} has {len(result)} series: {result}"
        return next(iter(result.values()), None)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
