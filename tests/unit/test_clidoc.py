from pathlib import Path

from supervisor.clidoc import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_cli_reference_is_current():
    assert DOC.read_text() == render(), "docs/cli.md is stale: run `python -m supervisor.clidoc > docs/cli.md`"


def test_every_command_has_an_example():
    text = render()
    for section in text.split("## unitvisor ")[1:]:
        name = section.split("\n", 1)[0]
        if name in ("version", "daemon", "fence", "migrate"):  # services and one-shot upkeep
            continue
        assert "Example:" in section, f"unitvisor {name} --help shows no example"
