"""The layout's rules (docs/architecture.md): imports only go down."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES_AND_ABOVE = ("pipeline.learner", "pipeline.worker", "pipeline.cli", "pipeline.lab")
OPERATOR = ("pipeline.labeling", "pipeline.status", "pipeline.evaluation")


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)} imports {m}"
        for p in _modules(folder)
        for m in sorted(_imports(p))
        if any(m == f or m.startswith(f + ".") for f in forbidden)
    ]


def test_models_and_topics_import_nothing_from_pipeline() -> None:
    assert _offenders("models", ("pipeline",)) == []
    assert _offenders("topics", ("pipeline",)) == []


def test_the_client_imports_no_service_operator_tool_cli_or_lab() -> None:
    assert _offenders("pipeline/client", SERVICES_AND_ABOVE + OPERATOR) == []


def test_the_base_modules_import_no_package_above_them() -> None:
    base = [p for p in (ROOT / "pipeline").glob("*.py")]
    offenders = [
        f"{p.name} imports {m}"
        for p in base
        for m in sorted(_imports(p))
        if any(m == f or m.startswith(f + ".") for f in (*SERVICES_AND_ABOVE, *OPERATOR, "pipeline.client"))
    ]
    assert offenders == []


def test_services_and_operator_tools_import_neither_the_cli_nor_the_lab() -> None:
    for folder in (
        "pipeline/learner",
        "pipeline/worker",
        "pipeline/labeling",
        "pipeline/status",
        "pipeline/evaluation",
    ):
        assert _offenders(folder, ("pipeline.cli", "pipeline.lab")) == []


def test_nothing_outside_the_cli_imports_it() -> None:
    outside = [p for p in _modules("pipeline") if "cli" not in p.relative_to(ROOT / "pipeline").parts]
    offenders = [
        f"{p.relative_to(ROOT)}"
        for p in outside
        if any(m == "pipeline.cli" or m.startswith("pipeline.cli.") for m in _imports(p))
    ]
    assert offenders == []


def test_no_source_file_is_over_450_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n}"
        for folder in ("topics", "models", "pipeline")
        for p in _modules(folder)
        if (n := len(p.read_text().splitlines())) > 450
    ]
    assert long == []
