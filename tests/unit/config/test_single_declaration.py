"""Each setting is declared once (pipeline/config.py) and every component's configuration derives from it:
a component built directly equals the one ``Settings()`` builds, no default is written as a literal in two
declarations, and each setting has its own environment variable and doc."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.policy.trainer_config import TrainerConfig
from models.serving.params import DROP_ABSENT, EXPLORE_TEMPERATURE_ABSENT, ServingParams
from pipeline.client.retriever import CausalRetriever
from pipeline.client.serving import UNSERVED, follow
from pipeline.config import (
    ActiveLearningConfig,
    AdapterConfig,
    Connection,
    DriftConfig,
    EvaluatorConfig,
    GateConfig,
    JoinConfig,
    KafkaSecurity,
    LearnerConfig,
    ScorerConfig,
    Settings,
    ShadowConfig,
    UiConfig,
    WorkerConfig,
    WritesConfig,
    describe,
    env_name,
)
from topics.fields import Limits
from topics.names import Topics

# Every configuration Settings builds, by its builder.
BUILDERS: dict[str, Callable[[Settings], Any]] = {
    "connection": Settings.connection,
    "adapter": Settings.adapter,
    "shadow": Settings.shadow,
    "join": Settings.join,
    "drift": Settings.drift,
    "worker": Settings.worker,
    "evaluator": Settings.evaluator,
    "writes": Settings.writes,
    "trainer": Settings.trainer,
    "serving": Settings.serving,
    "gate_config": Settings.gate_config,
    "learner": Settings.learner,
    "ui": Settings.ui,
}


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # Settings.state_path() creates ~/.causalmem


def test_a_component_built_directly_equals_the_one_settings_builds() -> None:
    s = Settings()
    c = Connection(topics=Topics.build(), limits=Limits())
    assert c == s.connection() == Connection.of(None)
    trainer = TrainerConfig(embedding_dim=s.embedding_dim, slots=s.slots, device=s.torch_device())
    direct = {
        "adapter": AdapterConfig(),
        "shadow": ShadowConfig(),
        "join": JoinConfig(connection=c),
        "drift": DriftConfig(),
        "worker": WorkerConfig(connection=c, join=JoinConfig(connection=c)),
        "evaluator": EvaluatorConfig(connection=c),
        "writes": WritesConfig(connection=c, lifecycle_topic=c.topics.memory_lifecycle.name),
        "trainer": trainer,
        "serving": ServingParams(),
        "gate_config": GateConfig(),
        "learner": LearnerConfig(connection=c, trainer=trainer),
        "ui": UiConfig(connection=c, state_dir=s.state_path()),
    }
    for name, built in direct.items():
        assert built == BUILDERS[name](s), f"{name}: built directly differs from Settings().{name}()"
    assert s.join().active_learning == ActiveLearningConfig() and s.evaluator().scorer == ScorerConfig()
    # The canary: a learner configured directly (tests, the lab) runs the same canary as `causalmem learner`.
    assert LearnerConfig(connection=c, trainer=trainer).serving.canary_rate == s.serve_canary_rate > 0


def test_clients_serve_by_the_settings_defaults_before_a_manifest_says_otherwise() -> None:
    served = Settings().serving()
    r = CausalRetriever(np.eye(4, dtype=np.float32), fallback=lambda *a: [], seed=0)
    # Before a manifest, the contract's values (§6: the dynamic drop, exploration at T = 0.25), the rest
    # the settings'.
    expected = (served.temperature, served.explore_rate, EXPLORE_TEMPERATURE_ABSENT, DROP_ABSENT)
    assert (r.temperature, r.explore_rate, r.explore_temperature, r.drop, r.drop_ratio) == (*expected, 0.01)
    v = follow(None, {})  # the adapters' values before a manifest
    assert (v.temperature, v.explore_rate, v.explore_temperature, v.drop) == expected
    # A manifest without serving (before contract 1.2) means these values and no canary.
    assert r.canary_rate == UNSERVED.canary_rate == 0.0
    assert (
        dataclasses.replace(served, drop=DROP_ABSENT, canary_rate=0.0, explore_temperature=EXPLORE_TEMPERATURE_ABSENT)
        == UNSERVED
    )
    # What the learner writes explores narrower than a manifest without the key means.
    assert served.explore_temperature < EXPLORE_TEMPERATURE_ABSENT
    assert served.drop == "none"  # what the learner writes in its manifests: no drop (docs/promotion.md)


# -- no default written twice -------------------------------------------------------------


def _flatten(value: Any, path: str = "") -> Iterator[tuple[str, type, str, Any]]:
    """(path, owning dataclass, field name, value) of every leaf of a configuration."""
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            yield from _flatten(v, f"{path}{f.name}.")
        else:
            yield f"{path}{f.name}", type(value), f.name, v


def _built(s: Settings) -> dict[tuple[str, str], tuple[type, str, Any]]:
    return {
        (name, p): (owner, fname, v) for name, build in BUILDERS.items() for p, owner, fname, v in _flatten(build(s))
    }


def _other(name: str, default: Any) -> Any:
    """A valid value of a setting other than its default."""
    alternatives = {
        "baseline": "cluster",
        "reset_scope": "last_layer",
        "serve_drop": "dynamic",
        "worker_store": "memory",
        "device": "meta",
        "evaluator_device": "cpu",
        "min_insync_replicas": None,  # must stay at most replication_factor (1)
        "checkpoint_signing_key_file": None,  # a file that exists (Settings.signing_key reads it)
    }
    if name in alternatives:
        return alternatives[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2 if default else 0.5
    if isinstance(default, str):
        return default + "x"
    return None


@cache
def _default_expr(owner: type, name: str) -> ast.expr | None:
    """The source expression of ``owner.name``'s default: the first argument of ``setting(...)``, or
    ``field(default=...)``'s; None when it has none or it is made by a factory."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            value = node.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                if value.func.id == "setting":
                    return value.args[0]
                if value.func.id == "field":
                    return next((k.value for k in value.keywords if k.arg == "default"), None)
            return value
    return None


def _is_literal(expr: ast.expr | None) -> bool:
    """A number, string or bool written out (None is no value: it is never a duplicate)."""
    if isinstance(expr, ast.Constant):
        return expr.value is not None
    if isinstance(expr, ast.UnaryOp):
        return _is_literal(expr.operand)
    if isinstance(expr, ast.BinOp):
        return _is_literal(expr.left) and _is_literal(expr.right)
    return False


def _derived_pairs() -> list[tuple[str, type, str]]:
    """(setting, component class, field) for each component field that a setting sets."""
    base = _built(Settings())
    pairs = []
    for f in dataclasses.fields(Settings):
        if f.name == "security" or f.default is None:
            continue
        other = _other(f.name, f.default)
        if other is None:
            continue
        changed = _built(Settings(**{f.name: other}))
        for key, (owner, fname, v) in changed.items():
            if (key not in base or base[key][2] != v) and owner is not Topics:
                pairs.append((f.name, owner, fname))
    return pairs


# Settings' device "auto" is resolved (Settings.torch_device) into the trainer's concrete device, which
# on its own (tests, benchmarks) is the CPU: two meanings, not one default written twice.
RESOLVED = {("device", TrainerConfig, "device")}


@pytest.mark.slow  # several seconds: make test runs it, make check does not
def test_each_component_default_that_a_setting_sets_is_that_declaration_not_a_second_literal() -> None:
    pairs = [p for p in _derived_pairs() if p not in RESOLVED]
    assert ("gate_epsilon", GateConfig, "epsilon") in pairs and (
        "serve_temperature",
        ServingParams,
        "temperature",
    ) in pairs
    assert ("embedding_dim", Limits, "embedding_dim") in pairs and ("lr", TrainerConfig, "lr") in pairs
    twice = sorted(
        {
            f"{setting} and {owner.__name__}.{fname}"
            for setting, owner, fname in pairs
            if _is_literal(_default_expr(Settings, setting)) and _is_literal(_default_expr(owner, fname))
        }
    )
    assert twice == [], f"defaults written as literals in two declarations: {twice}"


def test_each_setting_has_one_environment_variable_and_a_doc_and_is_read_from_it() -> None:
    settings = describe(Settings)
    security = describe(KafkaSecurity)
    assert set(settings) == {f.name for f in dataclasses.fields(Settings)} - {"security"}
    assert set(security) == {f.name for f in dataclasses.fields(KafkaSecurity)}
    names = [env for env, _, _ in (*settings.values(), *security.values())]
    assert len(names) == len(set(names)), "two settings share an environment variable"
    assert all(doc.strip() for _, _, doc in (*settings.values(), *security.values()))
    for f in dataclasses.fields(Settings):
        other = _other(f.name, f.default) if f.name != "metrics_port" else 9100
        if f.name == "security" or other is None:
            continue
        assert getattr(Settings.from_env({env_name(Settings, f): str(other)}), f.name) == other, f.name
    s = Settings.from_env({env_name(KafkaSecurity, f): "v" for f in dataclasses.fields(KafkaSecurity)})
    assert dataclasses.astuple(s.security) == ("v",) * len(dataclasses.fields(KafkaSecurity))
