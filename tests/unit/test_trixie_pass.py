"""`make test-trixie` runs what `make test-pass-debian` runs, with Debian 13's packages instead of 12's
(Makefile; tests/harness/trixie.py): the same selection, and nothing in it that only works with this
machine's Python. Static checks of the two places that broke it: they cost milliseconds, where running
the pass costs many minutes."""

from __future__ import annotations

import re

from tests.harness.host import REPO


def _recipe(makefile: str, target: str) -> str:
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert match, f"no recipe for {target}"
    return match.group(1)


def test_both_debian_passes_select_with_the_one_selection() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^DEBIAN_SELECTION :=", makefile, re.M)
    for target in ("test-pass-debian", "test-trixie"):
        recipe = _recipe(makefile, target)
        assert "$(DEBIAN_SELECTION)" in recipe, (target, recipe)
        # Anything else that selects would make the two differ again (`python -m pytest` is no marker).
        assert not re.search(r"""(^|\s)(-m\s+["']|-k\s|--deselect\s|--ignore\s)""", recipe), (target, recipe)


def test_no_integration_test_runs_the_checkouts_own_executable() -> None:
    # .venv/bin/unitvisor starts .venv's python, this machine's 3.11, which cannot import trixie's
    # packages: in the trixie chroot every such test failed. unitvisor_command() gives trixie's
    # `python3 -m supervisor` there (tests/integration/conftest.py).
    offenders = [path.name for path in sorted((REPO / "tests" / "integration").glob("test_*.py"))
                 if re.search(r"\bUNITVISOR\b(?!_)", path.read_text())]
    assert offenders == []
