"""No unpickling of network data (docs/contract.md: checkpoints are safetensors, never pickles).

No module on a path that reads Kafka data unpickles anything: checked statically over the
package sources (comments and docstrings aside), and dynamically by running a learner
restore and a subscriber load with pickle and ``torch.load`` disabled.
"""

from __future__ import annotations

import ast
import io
import pickle
import re
import tokenize
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import kafka
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.learner.loop import Learner
from pipeline.metrics import Metrics
from tests.helpers import experience, running, until
from tests.paths import REPO_ROOT
from topics.fields import encode

ROOT = REPO_ROOT


# --------------------------------------------------------------------------- no pickle on network paths

UNSAFE_PATTERNS = {
    "pickle.load": re.compile(
        r"\b_?c?pickle\.(?:loads?|Unpickler)\b|\bfrom\s+_?c?pickle\s+import\s+[^\n]*\b(?:loads?|Unpickler)\b"
    ),
    "torch.load": re.compile(r"\btorch\.load\b|\btorch\.serialization\.load\b|\bfrom\s+torch\s+import\s+load\b"),
    "cloudpickle": re.compile(r"\bcloudpickle\b"),
    "dill": re.compile(r"\bimport\s+dill\b|\bfrom\s+dill\b|\bdill\.loads?\b"),
    "joblib.load": re.compile(r"\bjoblib\.load\b|\bfrom\s+joblib\s+import\b"),
    "numpy.load(allow_pickle)": re.compile(r"\b(?:np|numpy)\.load\((?:[^()]|\([^()]*\))*allow_pickle\s*=\s*True", re.S),
    "yaml.load without SafeLoader": re.compile(
        r"\byaml\.(?:unsafe_load|full_load|load_all)\b|\byaml\.load\((?:(?!\)).)*?\)", re.S
    ),
    "pandas.read_pickle": re.compile(r"\bread_pickle\b"),
    "marshal/shelve": re.compile(r"\bmarshal\.loads?\b|\bimport\s+shelve\b"),
}


def _package_sources() -> list[Path]:
    files = [p for d in ("topics", "models", "pipeline") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 20, files
    return files


def _code_only(source: str) -> str:
    """The source with comments and docstrings blanked (prose may mention pickle)."""
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    comment_at = {
        tok.start[0]: tok.start[1]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    out = []
    for n, line in enumerate(source.splitlines(keepends=True), start=1):
        if n in doc_lines:
            line = "\n"
        elif n in comment_at:
            line = line[: comment_at[n]] + "\n"
        out.append(line)
    return "".join(out)


def test_static_no_unpickling_anywhere_in_the_package() -> None:
    hits = []
    for path in _package_sources():
        code = _code_only(path.read_text())
        for name, pattern in UNSAFE_PATTERNS.items():
            for m in pattern.finditer(code):
                text = m.group(0)
                if name == "yaml.load without SafeLoader" and "SafeLoader" in text:
                    continue
                line = code[: m.start()].count("\n") + 1
                hits.append(f"{path.relative_to(ROOT)}:{line}: {name}: {text[:80]!r}")
    assert hits == [], "\n".join(hits)


def test_static_scanner_catches_what_it_looks_for() -> None:
    """The patterns above are not vacuous."""
    samples = {
        "pickle.load": "x = pickle.loads(raw)",
        "torch.load": "m = torch.load(buf, weights_only=False)",
        "cloudpickle": "import cloudpickle",
        "dill": "import dill",
        "joblib.load": "joblib.load(path)",
        "numpy.load(allow_pickle)": "a = np.load(f, allow_pickle=True)",
        "yaml.load without SafeLoader": "cfg = yaml.load(text)",
        "pandas.read_pickle": "pd.read_pickle(p)",
        "marshal/shelve": "marshal.loads(b)",
    }
    for name, sample in samples.items():
        assert UNSAFE_PATTERNS[name].search(sample), name
    assert (
        "SafeLoader"
        in UNSAFE_PATTERNS["yaml.load without SafeLoader"].search("yaml.load(t, Loader=yaml.SafeLoader)")[0]
    )
    assert not UNSAFE_PATTERNS["numpy.load(allow_pickle)"].search("np.load(f)")
    assert "pickle" not in _code_only('"""No pickle here."""\n# nor pickle.loads here\nx = 1\n')


@pytest.fixture
def pickle_forbidden(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Unpickling raises (and is recorded, in case a caller swallows the error)."""
    calls: list[str] = []

    def forbid(name: str) -> Any:
        def guard(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called on a network path")

        return guard

    class GuardedUnpickler(pickle.Unpickler):  # a class: libraries subclass pickle.Unpickler at import
        def load(self) -> Any:
            return forbid("pickle.Unpickler.load")()

    monkeypatch.setattr(pickle, "loads", forbid("pickle.loads"))
    monkeypatch.setattr(pickle, "load", forbid("pickle.load"))
    monkeypatch.setattr(pickle, "Unpickler", GuardedUnpickler)
    monkeypatch.setattr(torch, "load", forbid("torch.load"))
    monkeypatch.setattr(torch.serialization, "load", forbid("torch.serialization.load"))
    return calls


@pytest.mark.broker
async def test_dynamic_learner_restore_and_subscriber_load_without_pickle(
    topics_ready: Settings, pickle_forbidden: list[str]
) -> None:
    s = topics_ready
    for unpickle in (pickle.loads, lambda raw: pickle.Unpickler(io.BytesIO(raw)).load(), torch.load):
        with pytest.raises(AssertionError):
            unpickle(pickle.dumps(1))  # the guards are in place
    pickle_forbidden.clear()

    async with running(Learner(s.learner(), s.bootstrap, Metrics())) as first:
        await until(lambda: first.active.is_set() and first.version >= 1, 30, "the initial checkpoint")
        assert first.restored_from == "fresh"
        producer = kafka.producer(s.bootstrap, s)
        await producer.start()
        for i in range(24):
            await producer.send(s.topics().experiences.name, encode(experience(s, i).to_dict()), partition=0)
        await producer.flush()
        await producer.stop()
        await until(lambda: first.trainer.experiences == 24 and not first.dirty, 30, "a trained checkpoint")
    trained = first.trainer.tensors()
    final_version = first.version
    assert final_version >= 2

    async with running(Learner(s.learner(), s.bootstrap, Metrics())) as second:
        await until(lambda: second.active.is_set(), 30, "the second learner restored")
        assert second.restored_from == f"topic v{final_version}"
        for name, tensor in second.trainer.tensors().items():
            assert torch.equal(tensor, trained[name]), name

    async with PolicySubscriber(s.bootstrap, s.policy, s) as sub:
        loaded = await sub.wait_for_policy(final_version, timeout=30)
        for name, tensor in loaded.net.tensors().items():
            assert torch.equal(tensor, trained[name]), name
        assert sub.rejections == []
    assert pickle_forbidden == [], pickle_forbidden
