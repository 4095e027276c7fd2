"""The layout's rules (docs/architecture.md): imports only go down, no import circles, the lab outside."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import warnings
import zipfile
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
SERVICES_AND_ABOVE = ("pipeline.learner", "pipeline.worker", "pipeline.cli", "causalmem_lab")
OPERATOR = ("pipeline.labeling", "pipeline.status", "pipeline.policy_evaluation")


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
        "pipeline/policy_evaluation",
    ):
        assert _offenders(folder, ("pipeline.cli", "causalmem_lab")) == []


def test_nothing_outside_the_cli_imports_it() -> None:
    outside = [p for p in _modules("pipeline") if "cli" not in p.relative_to(ROOT / "pipeline").parts]
    offenders = [
        f"{p.relative_to(ROOT)}"
        for p in outside
        if any(m == "pipeline.cli" or m.startswith("pipeline.cli.") for m in _imports(p))
    ]
    assert offenders == []


# Past this many lines, ask whether a file still holds one concept (a warning, not a limit).
LONG_FILE = 800
PRODUCT = ("topics", "models", "pipeline")


def test_long_files_are_reported_not_refused() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n}"
        for folder in (*PRODUCT, "lab/causalmem_lab")
        for p in _modules(folder)
        if (n := len(p.read_text().splitlines())) > LONG_FILE
    ]
    if long:
        warnings.warn(f"over {LONG_FILE} lines, does each still hold one concept? {long}", stacklevel=1)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "lab") if path.is_relative_to(ROOT / "lab") else path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module → the project modules it imports (anywhere in the file, TYPE_CHECKING included)."""
    files = [p for folder in (*PRODUCT, "lab/causalmem_lab") for p in _modules(folder)]
    names = {_module_name(p) for p in files}
    graph: dict[str, set[str]] = {}
    for p in files:
        targets = set()
        for m in _imports(p):
            # `from a.b import c` may name module a.b.c or a name in a.b: take the longest module.
            while m and m not in names:
                m = m.rpartition(".")[0]
            if m:
                targets.add(m)
        me = _module_name(p)
        # a package's __init__ re-exporting its own modules is not a circle
        graph[me] = {m for m in targets if m != me and not (p.name == "__init__.py" and m.startswith(me + "."))}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    assert _circles(_import_graph()) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_product_never_imports_the_lab() -> None:
    for folder in PRODUCT:
        assert _offenders(folder, ("causalmem_lab",)) == []


@pytest.mark.slow  # several seconds: make test runs it, make check does not
def test_importing_the_product_and_its_services_loads_no_lab_module() -> None:
    code = (
        "import sys, pipeline, pipeline.client, pipeline.learner.loop, pipeline.worker.app, pipeline.cli;"
        "pipeline.cli.build_parser(['status']);"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'causalmem_lab'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_wheels_package_list_leaves_the_lab_out() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert all(not pattern.startswith(("lab", "causalmem_lab")) for pattern in include)
    assert not (ROOT / "pipeline" / "lab").exists()


@pytest.mark.slow
def test_the_built_wheel_holds_no_lab_code(tmp_path: Path) -> None:
    # A copy of the checkout's sources, lab included, so that the build leaves nothing in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in (*PRODUCT, "lab"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*pip_wheel, "-w", str(tmp_path), str(src)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("causal_memory_pipeline-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("pipeline/client/") for n in names)
    assert [n for n in names if n.split("/")[0] in ("lab", "causalmem_lab") or "/lab/" in n] == []
