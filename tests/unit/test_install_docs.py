"""packaging/install-docs: the docs as the package installs them in /usr/share/doc/unitvisor, where
every link must lead to a file the package ships (and an anchor to a heading of it). The .deb's own
contents are held to the same in tests/package/test_deb_contents.py.

(Failed before: the package shipped README.md and cli.md only, and README's links to docs/fleet.md,
docs/sql-api.md, docs/metrics.md, packaging/unitvisor.toml, supervisor/... led nowhere on a host.)
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.harness.host import REPO

DOC_DIR = "/usr/share/doc/unitvisor"
LINK = re.compile(r"\[([^\]]+)\]\(([^()\s]+)\)")
# What debian/unitvisor.install and debian/rules put where, for the links that leave the doc dir:
# installed path prefix -> path prefix in the checkout.
SHIPPED = {"/etc/unitvisor/unitvisor.toml": "packaging/unitvisor.toml",
           "/usr/share/unitvisor/supervisor/": "supervisor/", "/usr/share/unitvisor/sql/": "sql/",
           "/usr/lib/systemd/system/": "units/"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", markdown)  # headings only outside code blocks
    return {slug(m.group(1)) for m in re.finditer(r"(?m)^#+ (.+)$", text)}


def broken_links(root: Path, exists) -> list[str]:
    """Every link of every installed .md under root (the doc dir) that leads nowhere. `exists(path)`
    answers for an absolute path outside the doc dir."""
    broken = []
    for doc in sorted(root.rglob("*.md")):
        for label, target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            if not path:
                file = doc
            elif path.startswith("/"):
                if path.startswith(DOC_DIR + "/"):
                    file = root / path[len(DOC_DIR) + 1:]
                else:
                    if not exists(path):
                        broken.append(f"{doc.name}: [{label}]({target}): not shipped")
                    continue
            else:
                file = (doc.parent / path).resolve()
            if not file.exists():
                broken.append(f"{doc.name}: [{label}]({target}): no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                broken.append(f"{doc.name}: [{label}]({target}): no such heading")
    return broken


def shipped_from_checkout(path: str) -> bool:
    for installed, source in SHIPPED.items():
        if path == installed or (installed.endswith("/") and path.startswith(installed)):
            return (REPO / (source + path[len(installed):])).exists()
    return False


def test_every_installed_link_leads_to_a_shipped_file(tmp_path: Path) -> None:
    subprocess.run([str(REPO / "packaging" / "install-docs"), str(tmp_path)], check=True, timeout=60)
    names = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert {"README.md", "cli.md", "sql-api.md", "fleet.md", "metrics.md", "benchmarks.md", "alerts.yml",
            "examples/sql_api.sql"} <= names
    assert broken_links(tmp_path, shipped_from_checkout) == []
    readme = (tmp_path / "README.md").read_text()
    assert "](fleet.md" in readme and "](docs/" not in readme
    assert "[packaging/unitvisor.toml](/etc/unitvisor/unitvisor.toml)" in readme
    # A file the package does not ship is named, not linked.
    assert "bench/inside.py (in unitvisor's source tree)" in readme


def test_the_check_finds_a_link_that_leads_nowhere(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("[a](docs/fleet.md) [b](#nowhere) [c](/usr/share/unitvisor/x.py)\n")
    assert len(broken_links(tmp_path, shipped_from_checkout)) == 3
