"""Optional dependencies: the client needs none of the extras; a missing extra is named in one line."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pipeline.extras import MissingExtra, require


def _run_without(blocked: set[str], code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where importing any of ``blocked`` fails as if not installed."""
    prelude = textwrap.dedent(
        f"""
        import sys

        class _Blocked:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {sorted(blocked)!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, _Blocked())
        """
    )
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # several seconds: make test runs it, make check does not
def test_the_services_need_no_extra_and_the_client_not_even_faust() -> None:
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        from pipeline.client import CausalRetriever, EventPublisher, PolicySubscriber, SyncEventPublisher

        memory = np.eye(4, dtype=np.float32)
        r = CausalRetriever(memory, texts=["alpha", "beta", "gamma", "delta"], k=2, n_candidates=4)
        res = r.retrieve(memory[1], "q1", 0, 0.0, 0.0, query_text="beta")
        assert len(res.slots) == 2 and res.event.query_id == "q1", res
        assert "faust" not in sys.modules
        import pipeline.worker.app, pipeline.learner.loop
        print("ok")
        """
    )
    done = _run_without({"matplotlib", "rich", "yaml"}, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_lab_verb_missing_a_lab_dependency_is_one_line_naming_it() -> None:
    code = "import sys; from pipeline.cli import main; sys.exit(main(['demo', '--bootstrap', '127.0.0.1:1']))"
    done = _run_without({"rich"}, code)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "causalmem demo: this needs rich, which the lab requires: from the source checkout, pip install -e ./lab"
    )


def test_a_lab_verb_without_the_lab_says_where_it_comes_from() -> None:
    code = "import sys, pipeline.cli as cli; cli.plugin_verbs = lambda: {}; sys.exit(cli.main(['bench', 'throughput']))"
    done = _run_without(set(), code)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "causalmem: 'bench' comes with the lab, which is not installed: from the source checkout, pip install -e ./lab"
    )


def test_require() -> None:
    assert require("json", "cli").loads("[1]") == [1]
    with pytest.raises(MissingExtra, match=r"needs surely_absent_module, from the 'cli' extra"):
        require("surely_absent_module.sub", "cli")
    assert issubclass(MissingExtra, RuntimeError)  # the CLI prints it as one line and exits 1


@pytest.mark.parametrize("verb", ["status", "label", "evaluate"])
def test_an_operator_verb_without_rich_names_the_cli_extra(verb: str) -> None:
    code = f"import sys; from pipeline.cli import main; sys.exit(main([{verb!r}, '--help']))"
    done = _run_without({"rich"}, code)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        f"causalmem {verb}: this needs rich, from the 'cli' extra: pip install 'causal-memory-pipeline[cli]'"
    )
