"""The documentation matches the code it describes."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pipeline.cli as cli
from pipeline.config import KafkaSecurity, Settings

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_lists_every_setting() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M))
    expected = {f.name for f in fields(Settings) if f.name != "security"}
    expected |= {"kafka_" + f.name for f in fields(KafkaSecurity)}
    assert expected - documented == set(), "settings missing from docs/configuration.md"
    assert documented - expected == set(), "docs/configuration.md documents settings that do not exist"


def test_readme_starts_with_the_two_commands_and_lists_only_real_verbs() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block
    listed = set(re.findall(r"^\| `causalmem ([a-z-]+)", readme, flags=re.M))
    assert listed, "the README lists the verbs"
    assert listed <= set(cli.VERBS), f"README lists verbs that do not exist: {listed - set(cli.VERBS)}"


def test_every_doc_link_points_to_a_file() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
