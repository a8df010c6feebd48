"""The peers' own virtualenv, .venv-bench-peers: pgqueuer and its drivers for bench/peers.py.

Never unitvisor's .venv or .venv-debian, nor pyproject.toml or debian/control: the peers are
baselines of the benchmark, no dependency of unitvisor. bench.run makes sure of it before it boots
anything (so that `python -m bench.run --tiny` in the smoke test works on a fresh checkout), and
`make bench-peers-venv` does the same by hand. It is made again when bench/peers-requirements.txt
is newer than it; it lives in the checkout, which the test bed binds at the same path, so its
scripts' absolute paths work inside (the test bed is this machine's own OS: the same /usr/bin/python3).

    .venv/bin/python -m bench.peers_env      # create or update it; prints its python
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-bench-peers"
PYTHON = VENV / "bin" / "python"
REQUIREMENTS = REPO / "bench" / "peers-requirements.txt"
STAMP = VENV / ".installed"
# The interpreter of the test bed's OS, which is this machine's: the venv must run inside too.
BASE_PYTHON = "/usr/bin/python3"


def ensure() -> Path:
    """The venv's python, the venv created or brought up to date first (pip from PyPI)."""
    if STAMP.exists() and STAMP.stat().st_mtime >= REQUIREMENTS.stat().st_mtime:
        return PYTHON
    shutil.rmtree(VENV, ignore_errors=True)  # a half-made or outdated one: start over
    try:
        subprocess.run([BASE_PYTHON, "-m", "venv", str(VENV)], check=True, capture_output=True, text=True)
        subprocess.run([str(PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r",
                        str(REQUIREMENTS)], check=True, capture_output=True, text=True, timeout=600)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"cannot make the peers' virtualenv {VENV}: {(e.stderr or '').strip()[-1500:]}") from e
    STAMP.touch()
    return PYTHON


def versions() -> dict[str, str]:
    """The peers' own package versions, as installed in their venv."""
    out = subprocess.run([str(PYTHON), "-c", "import importlib.metadata as m, json; print(json.dumps("
                          "{p: m.version(p) for p in ('pgqueuer', 'asyncpg', 'pystemd')}))"],
                         capture_output=True, text=True, check=True).stdout
    return {f"peers_{name}": version for name, version in json.loads(out).items()}


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
