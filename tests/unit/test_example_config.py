"""The shipped example config documents every key with its real default."""

import dataclasses
import re
from pathlib import Path

from supervisor import config

EXAMPLE = Path(__file__).resolve().parents[2] / "packaging" / "unitvisor.toml"


def uncommented() -> str:
    return re.sub(r"(?m)^# ([a-z_]+ = .*)$", r"\1", EXAMPLE.read_text())


def test_example_with_every_key_uncommented_is_the_defaults():
    settings = config.parse(uncommented(), "example")
    assert dataclasses.replace(settings, source="defaults") == config.Settings()


def test_example_names_every_key():
    text = uncommented()
    for section in dataclasses.fields(config.Settings):
        if section.name == "source":
            continue
        assert f"[{section.name}]" in text
        for key in dataclasses.fields(section.default_factory()):
            assert re.search(rf"(?m)^{key.name} = ", text), f"[{section.name}] {key.name} is not documented"


def test_example_as_shipped_parses():
    assert config.parse(EXAMPLE.read_text(), "example") == dataclasses.replace(config.Settings(), source="example")
