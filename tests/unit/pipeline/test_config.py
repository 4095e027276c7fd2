"""Configuration from CAUSALMEM_* variables (pipeline/config.py) and the Kafka security
settings handed to aiokafka and faust (pipeline/kafka.py)."""

from __future__ import annotations

import ssl

import faust
import pytest

from pipeline.config import KafkaSecurity, Settings
from pipeline.kafka import faust_credentials, security_kwargs


def test_defaults_without_environment() -> None:
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.partitions, s.embedding_dim, s.slots, s.hidden) == (8, 384, 1024, 512)
    assert s.bootstrap is None and s.gate is True and s.metrics_port is None
    assert s.security == KafkaSecurity()


def test_parses_int_float_bool_str() -> None:
    s = Settings.from_env(
        {
            "CAUSALMEM_SLOTS": "64",
            "CAUSALMEM_EMBEDDING_DIM": "16",
            "CAUSALMEM_METRICS_PORT": "9100",  # int | None
            "CAUSALMEM_LR": "2.5e-4",
            "CAUSALMEM_DRIFT_DROP": "0.2",
            "CAUSALMEM_GATE": "true",
            "CAUSALMEM_DRIFT_RESET": "0",
            "CAUSALMEM_BOOTSTRAP": "kafka-1:9092,kafka-2:9092",
            "CAUSALMEM_TOPIC_PREFIX": "prod.",
            "CAUSALMEM_BASELINE": "cluster",
        }
    )
    assert s.slots == 64 and isinstance(s.slots, int)
    assert s.embedding_dim == 16
    assert s.metrics_port == 9100 and isinstance(s.metrics_port, int)
    assert s.lr == 2.5e-4 and isinstance(s.lr, float)
    assert s.drift_drop == 0.2
    assert s.gate is True and s.drift_reset is False
    assert s.bootstrap == "kafka-1:9092,kafka-2:9092"
    assert s.topic_prefix == "prod."
    assert s.baseline == "cluster"
    assert s.limits().embedding_dim == 16 and s.limits().slots == 64


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
    ],
)
def test_bool_spellings(raw: str, expected: bool) -> None:
    assert Settings.from_env({"CAUSALMEM_GATE": raw}).gate is expected


def test_float_field_accepts_integer_text() -> None:
    s = Settings.from_env({"CAUSALMEM_CHECKPOINT_INTERVAL_S": "30"})
    assert s.checkpoint_interval_s == 30.0 and isinstance(s.checkpoint_interval_s, float)


def test_empty_variable_means_default() -> None:
    assert Settings.from_env({"CAUSALMEM_SLOTS": "", "CAUSALMEM_TOPIC_PREFIX": ""}).slots == 1024


@pytest.mark.parametrize(
    ("name", "raw", "kind"),
    [("SLOTS", "many", "int"), ("SLOTS", "1.5", "int"), ("LR", "fast", "float"), ("METRICS_PORT", "http", "int")],
)
def test_invalid_value_message(name: str, raw: str, kind: str) -> None:
    with pytest.raises(ValueError) as info:
        Settings.from_env({f"CAUSALMEM_{name}": raw})
    msg = str(info.value)
    assert f"CAUSALMEM_{name}" in msg and repr(raw) in msg and kind in msg


def test_overrides_win_over_environment() -> None:
    env = {"CAUSALMEM_SLOTS": "64", "CAUSALMEM_LR": "0.1", "CAUSALMEM_KAFKA_SASL_USERNAME": "env-user"}
    s = Settings.from_env(env, slots=128, lr=None, kafka_sasl_username="flag-user")
    assert s.slots == 128
    assert s.lr == 0.1  # None means "not given": the environment stays
    assert s.security.sasl_username == "flag-user"


def test_unknown_override_rejected() -> None:
    with pytest.raises(TypeError, match="unknown setting"):
        Settings.from_env({}, no_such_setting=1)


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAUSALMEM_PARTITIONS", "3")
    monkeypatch.setenv("CAUSALMEM_KAFKA_SECURITY_PROTOCOL", "SSL")
    s = Settings.from_env()
    assert s.partitions == 3 and s.security.security_protocol == "SSL"


def test_kafka_security_from_environment_and_redaction() -> None:
    env = {
        "CAUSALMEM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "CAUSALMEM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "CAUSALMEM_KAFKA_SASL_USERNAME": "svc",
        "CAUSALMEM_KAFKA_SASL_PASSWORD": "hunter2",
        "CAUSALMEM_KAFKA_SSL_CAFILE": "/etc/ca.pem",
    }
    sec = Settings.from_env(env).security
    assert sec == KafkaSecurity(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc",
        sasl_password="hunter2",
        ssl_cafile="/etc/ca.pem",
    )
    red = sec.redacted()
    assert red["sasl_password"] == "***"
    assert "hunter2" not in str(red)
    assert red["sasl_username"] == "svc" and red["ssl_cafile"] == "/etc/ca.pem"
    assert sec.sasl_password == "hunter2"  # redacting does not change the settings
    assert KafkaSecurity().redacted()["sasl_password"] is None


def test_security_kwargs_plaintext() -> None:
    assert security_kwargs(KafkaSecurity()) == {"security_protocol": "PLAINTEXT"}


def test_security_kwargs_sasl_ssl() -> None:
    sec = KafkaSecurity(
        security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256", sasl_username="u", sasl_password="p"
    )
    kw = security_kwargs(sec)
    assert kw["security_protocol"] == "SASL_SSL"
    assert kw["sasl_mechanism"] == "SCRAM-SHA-256"
    assert kw["sasl_plain_username"] == "u" and kw["sasl_plain_password"] == "p"
    assert isinstance(kw["ssl_context"], ssl.SSLContext)
    assert kw["ssl_context"].verify_mode == ssl.CERT_REQUIRED


def test_security_kwargs_sasl_plaintext_defaults_to_plain() -> None:
    kw = security_kwargs(KafkaSecurity(security_protocol="SASL_PLAINTEXT", sasl_username="u", sasl_password="p"))
    assert kw["sasl_mechanism"] == "PLAIN"
    assert "ssl_context" not in kw


def test_security_kwargs_ssl_only() -> None:
    kw = security_kwargs(KafkaSecurity(security_protocol="SSL"))
    assert set(kw) == {"security_protocol", "ssl_context"}
    assert isinstance(kw["ssl_context"], ssl.SSLContext)


def test_faust_credentials() -> None:
    assert faust_credentials(KafkaSecurity()) is None
    sasl = faust_credentials(
        KafkaSecurity(
            security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="u", sasl_password="p"
        )
    )
    assert isinstance(sasl, faust.SASLCredentials)
    assert (sasl.username, sasl.password) == ("u", "p")
    assert str(sasl.mechanism.value) == "SCRAM-SHA-512"
    assert isinstance(sasl.ssl_context, ssl.SSLContext)
    assert str(sasl.protocol.value) == "SASL_SSL"
    plain = faust_credentials(KafkaSecurity(security_protocol="SASL_PLAINTEXT", sasl_username="u", sasl_password="p"))
    assert isinstance(plain, faust.SASLCredentials)
    assert plain.ssl_context is None and str(plain.mechanism.value) == "PLAIN"
    assert str(plain.protocol.value) == "SASL_PLAINTEXT"
    tls = faust_credentials(KafkaSecurity(security_protocol="SSL"))
    assert isinstance(tls, faust.SSLCredentials)
    assert isinstance(tls.context, ssl.SSLContext)


def test_settings_replace_and_topics() -> None:
    s = Settings.from_env({"CAUSALMEM_TOPIC_PREFIX": "x.", "CAUSALMEM_PARTITIONS": "4"})
    t = s.topics()
    assert t.retrieval_events.name == "x.retrieval-events" and t.retrieval_events.partitions == 4
    assert t.llm_feedback.partitions == t.human_labels.partitions == 4  # co-partitioned inputs
    assert t.policy_checkpoints.name == "x.policy-checkpoints" and t.policy_checkpoints.partitions == 1
    r = s.replace(slots=7)
    assert r.slots == 7 and s.slots == 1024 and r.topic_prefix == "x."


def test_replication_settings_reach_every_topic_and_bad_ones_are_refused() -> None:
    s = Settings.from_env({"CAUSALMEM_REPLICATION_FACTOR": "3", "CAUSALMEM_MIN_INSYNC_REPLICAS": "2"})
    for spec in s.topics().all():
        assert spec.replication == 3 and spec.configs["min.insync.replicas"] == "2", spec.name
    assert s.topics().policy_checkpoints.configs["cleanup.policy"] == "compact"  # the topic's own configs stay
    assert s.worker().connection.topics.outcomes.replication == 3  # the worker's changelogs follow it
    default = Settings().topics()
    assert all(spec.replication == 1 and "min.insync.replicas" not in spec.configs for spec in default.all())
    for rf, isr in ((1, 2), (0, 1), (3, 0)):
        with pytest.raises(ValueError, match="min_insync_replicas"):
            Settings(replication_factor=rf, min_insync_replicas=isr).topics()
