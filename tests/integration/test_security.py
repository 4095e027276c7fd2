"""Security: SASL/TLS reaches every Kafka client, secrets stay out of logs, labels carry a labeler.

(a) With SASL_SSL settings (SCRAM-SHA-256, a CA generated here), the clients made by
``pipeline.kafka`` carry the protocol, mechanism, credentials and a verifying TLS context;
the faust worker gets matching ``broker_credentials``; and every component builds its
clients through ``pipeline.kafka`` (statically: no aiokafka client is constructed
anywhere else; dynamically: each component's start passes its settings' security through
``pipeline.kafka.security_kwargs``).
(b) The password given in ``CAUSALMEM_KAFKA_SASL_PASSWORD`` never shows in the output of
``init-topics``, ``status``, a running ``worker`` and ``learner`` (debug logs), or their
``/metrics``; nor in ``repr``/``str`` of the settings.
(c) Every label carries a labeler identity: the queue refuses an empty one and stamps it on
the labels it publishes.
"""

from __future__ import annotations

import ast
import asyncio
import datetime as dt
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import faust
import orjson
import pytest
from causalmem_lab.procs import Child
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import KafkaSecurity, Settings
from pipeline.labeling.queue import LabelQueue
from pipeline.learner.loop import Learner
from pipeline.metrics import Metrics
from pipeline.modeltopic import scan_model_topic
from pipeline.promtext import metric
from pipeline.worker.app import Worker
from pipeline.worker.join import JoinStage
from tests.conftest import settings_env
from tests.helpers import retrieval_event
from tests.paths import REPO_ROOT
from topics.convert import make_sample
from topics.fields import Limits, Rejected, encode
from topics.labels import decode_human_label

ROOT = REPO_ROOT
CA_NAME = "causalmem-test-ca"
SECRET = "sup3r-s3cret-value"


# --------------------------------------------------------------------------- a CA for the TLS settings


def _ca_with_cryptography(path: Path) -> bool:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        return False
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return True


def _ca_with_openssl(path: Path) -> bool:
    openssl = shutil.which("openssl")
    if openssl is None:
        return False
    cmd = [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    cmd += ["-keyout", str(path.with_suffix(".key")), "-out", str(path), "-days", "1", "-subj", f"/CN={CA_NAME}"]
    cmd += ["-addext", "basicConstraints=critical,CA:TRUE"]
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def ca_file(tmp_path: Path) -> Path:
    """A self-signed CA (the ``cryptography`` package, else the openssl CLI, else skip)."""
    path = tmp_path / "ca.pem"
    if not (_ca_with_cryptography(path) or _ca_with_openssl(path)):
        pytest.skip("neither the cryptography package nor the openssl CLI can make a CA here")
    return path


def sasl_ssl(ca_file: Path, **overrides: Any) -> Settings:
    return Settings.from_env(
        {},
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_username="u",
        kafka_sasl_password="s3cret",
        kafka_sasl_mechanism="SCRAM-SHA-256",
        kafka_ssl_cafile=str(ca_file),
        **overrides,
    )


def _check_tls(ctx: Any) -> None:
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    subjects = [dict(x[0] for x in cert["subject"]) for cert in ctx.get_ca_certs()]
    assert {"commonName": CA_NAME} in subjects, subjects


# --------------------------------------------------------------------------- (a) configuration plumbing


async def test_pipeline_kafka_clients_carry_sasl_ssl_settings(ca_file: Path) -> None:
    s = sasl_ssl(ca_file)
    assert s.security == KafkaSecurity(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-256",
        sasl_username="u",
        sasl_password="s3cret",
        ssl_cafile=str(ca_file),
    )
    producer = kafka.producer("127.0.0.1:9", s)
    consumer = kafka.consumer("127.0.0.1:9", s, "some-topic", group_id="g")
    admin = kafka.admin("127.0.0.1:9", s)
    for name, client in (("producer", producer.client), ("consumer", consumer._client), ("admin", admin._client)):
        assert client._security_protocol == "SASL_SSL", name
        assert client._sasl_mechanism == "SCRAM-SHA-256", name
        assert (client._sasl_plain_username, client._sasl_plain_password) == ("u", "s3cret"), name
        _check_tls(client._ssl_context)
    # Per-call overrides (used all over the package) keep the security settings.
    assert kafka.consumer("127.0.0.1:9", s, group_id=None, auto_offset_reset="earliest")._client._sasl_mechanism == (
        "SCRAM-SHA-256"
    )
    await producer.stop()
    await consumer.stop()
    await admin.close()


def test_worker_faust_app_gets_matching_broker_credentials(ca_file: Path) -> None:
    s = sasl_ssl(ca_file, partitions=4, embedding_dim=8, slots=32, hidden=16)
    worker = Worker(s.worker(), "127.0.0.1:9", Metrics())
    creds = worker.app.conf.broker_credentials
    assert isinstance(creds, faust.SASLCredentials), type(creds)
    assert (creds.username, creds.password) == ("u", "s3cret")
    assert creds.mechanism.value == "SCRAM-SHA-256"
    assert creds.protocol.value == "SASL_SSL"
    _check_tls(creds.ssl_context)
    # What faust's aiokafka driver passes to the clients it makes from these credentials.
    auth = credentials_to_aiokafka_auth(creds)
    assert auth["security_protocol"] == "SASL_SSL" and auth["sasl_mechanism"] == "SCRAM-SHA-256"
    assert (auth["sasl_plain_username"], auth["sasl_plain_password"]) == ("u", "s3cret")
    # The worker's join stage makes its clients from the same settings.
    assert worker.join.config.connection.security is s.security


KAFKA_CLIENT_CLASSES = {
    "AIOKafkaProducer",
    "AIOKafkaConsumer",
    "AIOKafkaAdminClient",
    "AIOKafkaClient",
    "KafkaProducer",
    "KafkaConsumer",
    "KafkaAdminClient",
}
OTHER_KAFKA_LIBRARIES = {"kafka", "confluent_kafka", "pykafka"}


def test_static_every_kafka_client_is_made_in_pipeline_kafka() -> None:
    """No aiokafka client is constructed outside pipeline/kafka.py; every faust.App gets credentials."""
    offenders: list[str] = []
    files = [p for d in ("topics", "models", "pipeline") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 20
    made_in_kafka_py = 0
    for path in files:
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        aliases = set(KAFKA_CLIENT_CLASSES)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] in OTHER_KAFKA_LIBRARIES:
                    offenders.append(f"{rel}:{node.lineno}: imports {node.module}")
                for a in node.names:
                    if a.name in KAFKA_CLIENT_CLASSES and a.asname:
                        aliases.add(a.asname)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in OTHER_KAFKA_LIBRARIES:
                        offenders.append(f"{rel}:{node.lineno}: imports {a.name}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in aliases:
                if rel == "pipeline/kafka.py":
                    made_in_kafka_py += 1
                else:
                    offenders.append(f"{rel}:{node.lineno}: constructs {name}")
            is_faust_app = (
                name == "App" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "faust"
            )
            if is_faust_app and "broker_credentials" not in {k.arg for k in node.keywords}:
                offenders.append(f"{rel}:{node.lineno}: faust.App without broker_credentials")
    assert offenders == [], "\n".join(offenders)
    assert made_in_kafka_py == 4  # producer, consumer, admin, and the client that asks for a producer id
    source = (ROOT / "pipeline" / "kafka.py").read_text()
    assert source.count("**security_kwargs(settings.security)") == 3
    assert source.count("**security_kwargs(sec)") == 1  # the producer id probe's


@pytest.mark.broker
async def test_every_component_builds_its_clients_through_pipeline_kafka(
    topics_ready: Settings, ca_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each component's start hands its settings' SASL_SSL security to pipeline.kafka.security_kwargs.

    The recorder answers with PLAINTEXT so that the components really start on the test broker.
    """
    s = topics_ready.replace(security=sasl_ssl(ca_file).security)
    calls: list[KafkaSecurity] = []

    def record(sec: KafkaSecurity) -> dict[str, Any]:
        calls.append(sec)
        return {"security_protocol": "PLAINTEXT"}

    monkeypatch.setattr(kafka, "security_kwargs", record)

    async def started(name: str, start: Any, stop: Any, at_least: int) -> None:
        calls.clear()
        await start()
        # Let the clients' background tasks start: aiokafka's group-less consumer raises
        # CancelledError from stop() when stopped in the same loop tick as its start.
        await asyncio.sleep(0.2)
        try:
            assert len(calls) >= at_least, (name, len(calls))
            assert all(c is s.security for c in calls), name
        finally:
            await stop()

    pub = EventPublisher(s.bootstrap, s)
    await started("publisher", pub.start, pub.stop, 1)
    sub = PolicySubscriber(s.bootstrap, s.policy, s)
    await started("subscriber", sub.start, sub.stop, 1)
    join = JoinStage(s.join(), s.bootstrap, Metrics())
    await started("join", join.start, join.stop, 2)
    learner = Learner(s.learner(), s.bootstrap, Metrics())
    await started("learner", learner.start, lambda: learner.stop(publish=False), 3)
    queue = LabelQueue(s.bootstrap, s, "")  # on SASL the identity is the principal
    assert queue.labeler == s.security.sasl_username
    await started("labeler", queue.start, queue.stop, 3)  # its own labels, the queue, the producer
    calls.clear()
    await kafka.create_topics(s.bootstrap, s)
    await scan_model_topic(s.bootstrap, s)
    assert len(calls) >= 2 and all(c is s.security for c in calls)


# --------------------------------------------------------------------------- (b) no secrets in logs


@pytest.mark.broker
def test_no_secret_in_cli_output_process_logs_or_metrics(topics_ready: Settings, tmp_path: Path) -> None:
    s = topics_ready
    env = {
        **settings_env(s),
        "CAUSALMEM_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",  # so that the processes still connect
        "CAUSALMEM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "CAUSALMEM_KAFKA_SASL_USERNAME": "svc-user",
        "CAUSALMEM_KAFKA_SASL_PASSWORD": SECRET,
    }
    full_env = {**os.environ, **env}
    # Sanity: the password does reach the processes' settings (so a leak would be caught below).
    probe = "from pipeline.config import Settings; print(Settings.from_env().security.sasl_password)"
    r = subprocess.run([sys.executable, "-c", probe], env=full_env, capture_output=True, timeout=60, cwd=ROOT)
    assert r.stdout.decode().strip() == SECRET
    outputs: dict[str, str] = {}
    for verb in ("init-topics", "status"):
        r = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", verb, "--bootstrap", s.bootstrap, "--log-level", "debug"],
            env=full_env,
            capture_output=True,
            timeout=120,
            cwd=ROOT,
        )
        outputs[verb] = (r.stdout + r.stderr).decode("utf-8", "replace")
        assert r.returncode == 0, outputs[verb][-3000:]
    assert "policy-checkpoints" in outputs["init-topics"]

    worker = Child("worker", s.bootstrap, env, ["--log-level", "debug"], log_path=tmp_path / "worker.log")
    learner = Child("learner", s.bootstrap, env, ["--log-level", "debug"], log_path=tmp_path / "learner.log")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            w, lm = worker.metrics(), learner.metrics()
            if metric(w, "causalmem_partitions_owned", stage="join") > 0 and metric(lm, "causalmem_checkpoint_version"):
                break
            assert worker.alive() and learner.alive(), worker.log_tail() + learner.log_tail()
            time.sleep(0.5)
        else:
            raise AssertionError("worker/learner did not come up\n" + worker.log_tail() + learner.log_tail())
        time.sleep(2.0)
        for name, child in (("worker /metrics", worker), ("learner /metrics", learner)):
            with urllib.request.urlopen(child.url, timeout=5) as resp:
                outputs[name] = resp.read().decode()
    finally:
        for child in (worker, learner):
            child.stop()
    outputs["worker log"] = (tmp_path / "worker.log").read_text(errors="replace")
    outputs["learner log"] = (tmp_path / "learner.log").read_text(errors="replace")
    assert "DEBUG" in outputs["worker log"] + outputs["learner log"] or len(outputs["learner log"]) > 200
    leaks = [name for name, text in outputs.items() if SECRET in text]
    assert leaks == [], f"the SASL password appears in {leaks}"


def test_redacted_security_hides_the_password() -> None:
    s = Settings.from_env({"CAUSALMEM_KAFKA_SASL_PASSWORD": SECRET, "CAUSALMEM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"})
    assert s.security.sasl_password == SECRET
    assert SECRET not in str(s.security.redacted())
    creds = kafka.faust_credentials(s.security.__class__(security_protocol="SASL_PLAINTEXT", sasl_password=SECRET))
    assert SECRET not in repr(creds) and SECRET not in str(creds)


@pytest.mark.parametrize("render", [repr, str], ids=["repr", "str"])
@pytest.mark.parametrize("what", ["settings", "security"])
def test_settings_repr_and_str_do_not_contain_the_password(render: Any, what: str) -> None:
    s = Settings.from_env({"CAUSALMEM_KAFKA_SASL_PASSWORD": SECRET, "CAUSALMEM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"})
    obj = s if what == "settings" else s.security
    assert SECRET not in render(obj)


# --------------------------------------------------------------------------- (c) labels carry a labeler


@pytest.mark.parametrize("labeler", ["", None])
def test_label_queue_refuses_an_empty_labeler(labeler: Any) -> None:
    with pytest.raises(ValueError, match="labeler"):
        LabelQueue("127.0.0.1:9", Settings(), labeler)


def test_a_label_without_a_labeler_is_rejected_on_the_wire() -> None:
    body = {"schema": "human_label/v1", "event_id": "e", "query_id": "q", "ts": 1.0, "kind": "rating", "rating": 3}
    for labeler, reason in ((None, "missing_field"), ("", "out_of_range"), (7, "wrong_type")):
        raw = orjson.dumps(body if labeler is None else {**body, "labeler": labeler})
        with pytest.raises(Rejected) as exc:
            decode_human_label(raw, Limits(), key=b"q")
        assert exc.value.reason == reason


@pytest.mark.broker
async def test_published_labels_carry_the_labeler_identity(topics_ready: Settings) -> None:
    s = topics_ready
    labeler = "alice \u202e(reviewer 7)"
    producer = kafka.producer(s.bootstrap, s)
    await producer.start()
    samples = []
    try:
        for i in range(2):
            ev = retrieval_event(s, f"q-al-{i}", event_id=f"ev-al-{i}")
            sample = make_sample(ev, -0.6, "error", ev.ts)
            samples.append(sample)
            await producer.send(s.topics().active_learning.name, encode(sample.to_dict()), key=sample.query_id.encode())
        await producer.flush()
    finally:
        await producer.stop()

    async with LabelQueue(s.bootstrap, s, labeler) as queue:
        got = []
        for _ in range(2):
            item = await queue.next(timeout=30)
            assert item is not None
            got.append(item)
        by_id = {item.sample.sample_id: item for item in got}
        assert set(by_id) == {x.sample_id for x in samples}
        first, second = (by_id[x.sample_id] for x in samples)
        answered = await queue.answer(first, [first.sample.candidates[0]], rating=4)
        skipped = await queue.skip(second, "none of these helps")
        assert answered.labeler == skipped.labeler == labeler

    msgs = await kafka.read_all(s.bootstrap, s, s.topics().human_labels.name)
    labels = [decode_human_label(m.value, s.limits(), m.key) for m in msgs]  # keyed by query id
    assert len(labels) == 2
    assert {lab.labeler for lab in labels} == {labeler}
    assert {lab.sample_id for lab in labels} == {x.sample_id for x in samples}
    assert all(lab.kind == "memory_choice" for lab in labels)
    answer = next(lab for lab in labels if lab.correct_memories)
    assert answer.rating == 4 and answer.correct_memories == [first.sample.candidates[0]]
    skip = next(lab for lab in labels if not lab.correct_memories)
    assert skip.skip_reason == "none of these helps"
