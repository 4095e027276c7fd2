"""The documentation matches the code it describes."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pipeline.cli as cli
from pipeline.config import KafkaSecurity, Settings
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


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
    verbs = set(cli.VERBS) | set(cli.plugin_verbs())  # demo and bench come with the lab
    assert listed <= verbs, f"README lists verbs that do not exist: {listed - verbs}"


def test_every_doc_link_points_to_a_file() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every ``causalmem …`` command line in the README and docs: code-block lines, and inline
    code with arguments (a bare ``causalmem rollback`` names a verb; it is not a command line).
    Not the changelog's: it records commands as they were run, some with options since retired."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if page.name == "changelog.md":
            continue
        text = page.read_text()
        lines = re.findall(r"^causalmem (.+)$", text, flags=re.M)
        lines += [c for c in re.findall(r"`causalmem ([^`]+)`", text) if " " in c.strip()]
        for line in lines:
            line = line.split("#")[0].strip()
            words = line.split()
            # a table cell's `a\|b\|c` lists alternatives; FILE, V, N are placeholders
            for alt in words[1].split("\\|") if len(words) > 1 else [None]:
                argv = [words[0], *([alt] if alt else []), *words[2:]]
                out.append((page.name, [re.sub(r"^[A-Z]+$", "1", w) for w in argv]))
    return out


def test_every_documented_command_line_parses() -> None:
    commands = _documented_commands()
    assert any(argv[:2] == ["bench", "soak"] for _, argv in commands)
    for page, argv in commands:
        try:
            cli.build_parser(argv).parse_args(argv)
        except SystemExit as exc:  # --help exits 0; a rejected line exits 2
            if exc.code != 0:
                raise AssertionError(f"{page}: `causalmem {' '.join(argv)}` is rejected by the CLI parser") from exc


def test_architecture_opens_with_the_layout_and_it_matches_the_code() -> None:
    """Every package and module of topics/, models/ and pipeline/ appears in the layout tree."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert text.split("\n## ")[1].startswith("Layout"), "docs/architecture.md opens with the layout"
    tree = text.split("```")[1]
    words = set(re.findall(r"[a-z_]+(?:\.py|/)", tree)) | set(re.findall(r"\b[a-z_]+\b", tree))
    missing = []
    for top in ("topics", "models", "pipeline"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT / top)
            if rel.name in ("__init__.py", "__main__.py"):
                continue
            if top == "pipeline" and len(rel.parts) > 1:  # subpackages: the package's line lists its modules
                if f"{rel.parts[0]}/" not in words:
                    missing.append(f"{top}/{rel.parts[0]}/")
                if len(rel.parts) == 2 and rel.stem not in words and rel.parts[0] not in ("cli", "lab"):
                    missing.append(str(Path(top) / rel))
                continue
            if rel.name not in words:
                missing.append(str(Path(top) / rel))
    assert not missing, f"docs/architecture.md's layout does not mention: {sorted(set(missing))}"


def test_benchmarks_page_has_a_section_per_bench_with_its_command() -> None:
    """docs/benchmarks.md is the reference: each ``causalmem bench`` subcommand has its own
    section, headed by its command, that shows a command line running it."""
    from causalmem_lab.cli.bench import BENCH_HELP as HELP

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    sections = dict(re.findall(r"^## [^\n]*`causalmem bench ([a-z]+)`\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    assert set(sections) == set(HELP), "one section per bench in docs/benchmarks.md"
    for name, body in sections.items():
        assert re.search(rf"^causalmem bench {name}\b", body, flags=re.M), f"the {name} section shows no command"


def test_benchmark_pages_describe_changes_not_issue_numbers() -> None:
    for name in ("benchmarks.md", "changelog.md"):
        text = (ROOT / "docs" / name).read_text()
        assert not re.search(r"\bissues? \d+", text, flags=re.I), f"docs/{name} names an issue number"


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_the_benchmark_pages_name_existing_headings() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    targets = {ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "changelog.md"}
    anchors = {}
    for page in targets:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        anchors[page] = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for page in pages:
        for target, fragment in re.findall(r"\]\(([^)#:]*)#([^)]+)\)", page.read_text()):
            path = (page.parent / target).resolve() if target else page
            if path in anchors:
                assert fragment in anchors[path], f"{page.name} links to missing #{fragment} in {path.name}"
