"""``causalmem ui`` through Starlette's TestClient: login, CSRF, labeling, agreement, memories, health.

The labeling pool runs against stand-ins for its Kafka clients (what it sends and commits is
recorded); the topic views are fed decoded values directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest

from tests.helpers import form_field
from tests.queue_fakes import RecordingProducer, SampleConsumer

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from aiokafka import TopicPartition
from starlette.testclient import TestClient

from pipeline.config import Settings
from pipeline.labeling.agreement import fleiss_kappa
from pipeline.labeling.queue import memory_choice_label
from pipeline.ui.app import create_app
from pipeline.ui.auth import Labeler, hash_password
from pipeline.ui.feeds import LabelBook
from pipeline.ui.health import Trends
from pipeline.ui.memories import MemoryEffects, MemoryView
from pipeline.ui.pool import SamplePool
from topics.events import Features, RetrievalEvent
from topics.fields import Limits, encode
from topics.internal import Experience
from topics.labels import ActiveLearningSample, HumanLabel, decode_human_label

BASE_TS = 1_767_225_600.0
S = Settings(embedding_dim=8, slots=64, partitions=2)
TP = TopicPartition(S.topics().active_learning.name, 0)
LABELERS = {
    "ann": Labeler("ann", token="ann-token-0123"),
    "bob": Labeler("bob", password_hash=hash_password("bob-pw", iterations=1000)),
}


def sample(sid: str) -> ActiveLearningSample:
    return ActiveLearningSample(
        sample_id=sid,
        query_id=f"q-{sid}",
        step=1,
        ts=BASE_TS,
        reason="error",
        utility=-0.7,
        policy_version=3,
        features=Features(np.zeros(8, dtype=np.float32), 0.5, 1.0),
        candidates=[4, 9, 17],
        selected=[4],
        top_slots=[{"slot": 4, "prob": 0.5}, {"slot": 9, "prob": 0.3}, {"slot": 17, "prob": 0.2}],
        query_text="Which port does the broker listen on?",
        memory_texts={4: "The cafeteria opens at 8.", 9: "The broker listens on 9092.", 17: "Ports are numbers."},
    )


class Producer(RecordingProducer):
    """Records sends; ``labels`` decodes what went to ``human-labels``."""

    def labels(self) -> list[HumanLabel]:
        return [decode_human_label(v, Limits(slots=64)) for t, v in self.sent if t == S.topics().human_labels.name]


class Pool(SamplePool):
    """The real pool on stand-in clients, with a clock the test moves."""

    def __init__(self, samples: list[ActiveLearningSample], overlap: int = 1, undo_s: float = 0.0) -> None:
        self.now = 0.0
        super().__init__(
            "127.0.0.1:1", S.connection(), overlap=overlap, lease_s=60.0, undo_s=undo_s, clock=lambda: self.now
        )
        self.fake_consumer, self.fake_producer = SampleConsumer(samples, TP), Producer()

    async def _read_own_answers(self) -> None:
        return None

    async def _open_clients(self) -> None:
        self._consumer, self._producer = self.fake_consumer, self.fake_producer


class Feeds:
    def __init__(self) -> None:
        self.refreshed = asyncio.Event()  # the app's first read of the topics: done (what /readyz asks)
        self.refreshed.set()
        self.memories = MemoryView(recent_per_memory=5)
        self.trends = Trends(bucket_s=60.0)
        self.book = LabelBook()
        self.manifests: dict[int, dict[str, Any]] = {}
        self.snapshot: dict[str, Any] | None = None


def client_for(tmp_path: Path, pool: Pool, feeds: Feeds | None = None) -> TestClient:
    config = S.replace(state_dir=str(tmp_path)).ui()
    app = create_app(config, "127.0.0.1:1", labelers=LABELERS, pool=pool, feeds=feeds or Feeds())
    return TestClient(app, base_url="http://127.0.0.1")


def second_browser(c: TestClient) -> TestClient:
    """Another browser (its own cookies) on the same running app."""
    return TestClient(c.app, base_url="http://127.0.0.1")


def login_csrf(c: TestClient) -> str:
    """The login form's CSRF token: a login starts from the login page, as in a browser."""
    return form_field(c.get("/login").text, "csrf")


def try_login(c: TestClient, name: str, secret: str, **kw: Any) -> Any:
    data = {"csrf": login_csrf(c), "name": name, "secret": secret, "next": "/queue"}
    return c.post("/login", data=data, **kw)


def login(c: TestClient, name: str = "ann", secret: str = "ann-token-0123") -> None:
    r = try_login(c, name, secret, follow_redirects=False)
    assert r.status_code == 303, r.text


# --------------------------------------------------------------------------- login and CSRF


def test_every_page_needs_a_login_and_every_write_a_labeler(tmp_path: Path) -> None:
    pool = Pool([sample("s1")])
    with client_for(tmp_path, pool) as c:
        for path in ("/queue", "/memories", "/health", "/agreement"):
            r = c.get(path, follow_redirects=False)
            assert r.status_code == 303 and r.headers["location"].startswith("/login")
        r = c.post("/queue/answer", data={"sample_id": "s1", "lease": "x", "correct": "9"})
        assert r.status_code == 403 and "logged-in labeler" in r.text
        r = try_login(c, "ann", "wrong")
        assert r.status_code == 401 and "wrong password" in r.text
        login(c, "bob", "bob-pw")  # a password hash works too
        assert c.get("/queue").status_code == 200
    assert pool.fake_producer.sent == []


def test_a_form_without_the_sessions_csrf_token_writes_nothing(tmp_path: Path) -> None:
    pool = Pool([sample("s1")])
    with client_for(tmp_path, pool) as c:
        login(c)
        page = c.get("/queue").text
        form = {"sample_id": "s1", "lease": form_field(page, "lease"), "correct": "9", "action": "answer"}
        r = c.post("/queue/answer", data={**form, "csrf": "forged"})
        assert r.status_code == 403 and "CSRF" in r.text
        r = c.post("/queue/answer", data=form)
        assert r.status_code == 403
    assert pool.fake_producer.sent == [] and pool.fake_consumer.commits == []


def hash_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Record each PBKDF2 (its iterations, and whether it ran on the event loop's thread)."""
    from pipeline.ui import auth

    calls: list[tuple[int, bool]] = []
    real = auth._pbkdf2

    def spy(password: str, salt: bytes, iterations: int) -> bytes:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        calls.append((iterations, on_loop))
        return real(password, salt, iterations) if iterations <= 1000 else b"\0" * 32  # the dummy never matches

    monkeypatch.setattr(auth, "_pbkdf2", spy)
    return calls


def test_each_login_hashes_once_in_a_worker_thread_whoever_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: PBKDF2 ran on the event loop (8 guessers slowed every page to 1.1 s) and an unknown
    name was answered without hashing (0.02 s against 0.20 s: names could be told apart)."""
    from pipeline.ui.auth import PBKDF2_ITERATIONS

    calls = hash_spy(monkeypatch)
    with client_for(tmp_path, Pool([])) as c:
        for name, secret, status in (("bob", "bob-pw", 303), ("nobody", "guess", 401), ("ann", "wrong", 401)):
            before = len(calls)
            assert try_login(second_browser(c), name, secret, follow_redirects=False).status_code == status
            assert len(calls) == before + 1, name  # one hash per attempt, known name or not
        assert [it for it, _ in calls] == [1000, PBKDF2_ITERATIONS, PBKDF2_ITERATIONS]  # unknown: a full-cost dummy
        assert not any(on_loop for _, on_loop in calls)  # in a worker thread, never on the event loop


def test_guesses_are_throttled_per_address_and_per_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: 54 guesses in a row, none refused. Guesses from one address hold that address's
    attempts at the name, not the name's from everywhere (tests/integration/test_ui_trust_boundaries.py)."""
    calls = hash_spy(monkeypatch)
    with client_for(tmp_path, Pool([])) as c:
        throttle = c.app.state.ui.throttle  # type: ignore[attr-defined]
        now = [0.0]
        throttle.clock = lambda: now[0]
        for _ in range(5):
            assert try_login(c, "ann", "wrong").status_code == 401
        hashed = len(calls)
        r = try_login(c, "ann", "ann-token-0123")  # the 6th attempt on ann: refused, even with her token
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and "Too many login attempts" in r.text
        assert len(calls) == hashed  # a refused attempt checks nothing
        other = TestClient(c.app, base_url="http://127.0.0.1", client=("10.0.0.9", 5000))
        login(other, "ann", "ann-token-0123")  # ann from elsewhere is not held by those guesses
        login(c, "bob", "bob-pw")  # another name from the same address goes through
        now[0] += 60.0  # one guess back per minute
        login(c, "ann", "ann-token-0123")
        # per address: one client trying many names
        spray = TestClient(c.app, base_url="http://127.0.0.1", client=("10.0.0.7", 5000))
        statuses = [try_login(spray, f"user{i}", "guess").status_code for i in range(21)]
        assert statuses == [401] * 20 + [429]


def test_sasl_logins_are_throttled_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the SASL-mode app was an unthrottled password oracle against the broker."""
    from pipeline import kafka
    from pipeline.config import KafkaSecurity

    attempts: list[str | None] = []

    async def start_producer(bootstrap: str, conn: Any, **kw: Any) -> Producer:
        attempts.append(conn.security.sasl_password)
        raise RuntimeError("SASL authentication failed")

    monkeypatch.setattr(kafka, "start_producer", start_producer)
    sasl = S.replace(state_dir=str(tmp_path), security=KafkaSecurity("SASL_PLAINTEXT", "SCRAM-SHA-512", "ui", "pw"))
    app = create_app(sasl.ui(), "127.0.0.1:1", pool=Pool([]), feeds=Feeds())
    with TestClient(app, base_url="http://127.0.0.1") as c:
        assert [try_login(c, "ann", f"guess{i}").status_code for i in range(6)] == [401] * 5 + [429]
        assert len(attempts) == 5  # the broker was asked five times, not six


def test_a_session_cookie_stops_working_after_logout(tmp_path: Path) -> None:
    """Before: the signed cookie was the whole session, so a copy of it outlived the logout."""
    with client_for(tmp_path, Pool([])) as c:
        login(c)
        cookie = c.cookies["causalmem_ui"]
        copy = second_browser(c)
        copy.cookies.set("causalmem_ui", cookie)
        assert copy.get("/memories").status_code == 200
        c.post("/logout", data={"csrf": form_field(c.get("/memories").text, "csrf")})
        assert copy.get("/memories", follow_redirects=False).status_code == 303  # to the login page
        r = copy.post("/queue/leave", data={"csrf": "x", "sample_id": "s1"})
        assert r.status_code == 403


def test_the_login_form_needs_its_csrf_token_and_a_non_ascii_token_is_refused(tmp_path: Path) -> None:
    """Before: a page on another site could log the browser in (no token on the login form),
    and a non-ASCII CSRF token answered 500."""
    pool = Pool([sample("s1")])
    with client_for(tmp_path, pool) as c:
        # a cross-site form: the browser sends no cookie of ours (SameSite=Strict), so no token matches
        r = c.post("/login", data={"name": "ann", "secret": "ann-token-0123", "next": "/queue"})
        assert r.status_code == 403 and "out of date" in r.text
        assert c.get("/queue", follow_redirects=False).status_code == 303  # not logged in
        r = c.post("/login", data={"csrf": "é" * 8, "name": "ann", "secret": "ann-token-0123"})
        assert r.status_code == 403
        login(c)
        page = c.get("/queue").text
        form = {"sample_id": "s1", "lease": form_field(page, "lease"), "correct": "9", "csrf": "jeton-é"}
        assert c.post("/queue/answer", data=form).status_code == 403
        form = {**form, "csrf": form_field(page, "csrf"), "lease": "bail-é"}
        assert c.post("/queue/answer", data=form).status_code == 409  # a stale lease, not a crash
    assert pool.fake_producer.sent == []


@pytest.mark.parametrize(
    ("options", "secure"),
    [
        ({}, False),
        ({"host": "0.0.0.0"}, True),
        ({"secure_cookie": True}, True),
        ({"host": "::", "secure_cookie": False}, False),
    ],
)
def test_the_session_cookie_is_secure_unless_on_loopback_or_told(
    tmp_path: Path, options: dict[str, Any], secure: bool
) -> None:
    """Before: https_only was hard-coded False, so behind TLS the cookie still went over plain HTTP."""
    app = create_app(S.replace(state_dir=str(tmp_path)).ui(**options), "127.0.0.1:1", LABELERS, Pool([]), Feeds())
    with TestClient(app, base_url="https://127.0.0.1") as c:
        r = c.get("/login")
        assert ("secure" in r.headers["set-cookie"].lower()) is secure


# --------------------------------------------------------------------------- labeling


def test_an_answer_is_the_label_causalmem_label_sends(tmp_path: Path) -> None:
    pool = Pool([sample("s1"), sample("s2")])
    with client_for(tmp_path, pool) as c:
        login(c)
        page = c.get("/queue").text
        assert "Which port does the broker listen on?" in page and "The broker listens on 9092." in page
        assert "0.30" in page  # the policy's probability of slot 9
        r = c.post(
            "/queue/answer",
            data={
                "csrf": form_field(page, "csrf"),
                "sample_id": form_field(page, "sample_id"),
                "lease": form_field(page, "lease"),
                "correct": "9",
                "harmful": "4",
                "rating": "4",
                "action": "answer",
            },
            follow_redirects=False,
        )
        assert r.status_code == 303 and r.headers["location"] == "/queue?sent=answer"
        (label,) = pool.fake_producer.labels()
        expected = memory_choice_label(sample("s1"), "ann", [9], rating=4, harmful_memories=[4])
        assert label.to_dict() == expected.to_dict()
        assert pool.fake_consumer.commits == [1]  # committed once acknowledged
        assert "s2"[:2] in c.get("/queue").text  # the next sample comes up


def test_unknown_sample_stale_lease_and_double_submit_write_nothing(tmp_path: Path) -> None:
    pool = Pool([sample("s1"), sample("s2")])
    with client_for(tmp_path, pool) as c:
        login(c)
        page = c.get("/queue").text
        csrf, lease = form_field(page, "csrf"), form_field(page, "lease")

        def post(**kw: str) -> Any:
            data = {"csrf": csrf, "sample_id": "s1", "lease": lease, "correct": "9", "action": "answer", **kw}
            return c.post("/queue/answer", data=data)

        r = post(sample_id="nope")
        assert r.status_code == 409 and "Unknown sample" in r.text
        r = post(lease="not-the-lease")
        assert r.status_code == 409 and "lease" in r.text
        r = post(correct="63")
        assert r.status_code == 409 and "not among this sample" in r.text
        assert pool.fake_producer.sent == []
        assert post().status_code == 200  # followed to the next sample
        r = post()
        assert r.status_code == 409 and "already answered" in r.text
        assert len(pool.fake_producer.labels()) == 1
        # s2 is leased now; past its lease the answer is refused
        page = c.get("/queue").text
        assert form_field(page, "sample_id") == "s2"
        pool.now += 61.0
        r = post(sample_id="s2", lease=form_field(page, "lease"))
        assert r.status_code == 409 and "expired" in r.text
    assert len(pool.fake_producer.labels()) == 1


def test_leaving_releases_the_lease_for_another_labeler(tmp_path: Path) -> None:
    pool = Pool([sample("s1")])
    with client_for(tmp_path, pool) as ann:
        bob = second_browser(ann)
        login(ann)
        login(bob, "bob", "bob-pw")
        page = ann.get("/queue").text
        assert form_field(page, "sample_id") == "s1"
        assert "queue is empty for you" in bob.get("/queue").text
        r = ann.post("/queue/leave", data={"csrf": form_field(page, "csrf"), "sample_id": "s1", "beacon": "1"})
        assert r.status_code == 204
        assert form_field(bob.get("/queue").text, "sample_id") == "s1"


def test_overlap_shows_a_sample_to_n_labelers_and_commits_after_the_last(tmp_path: Path) -> None:
    pool = Pool([sample("s1")], overlap=2)
    with client_for(tmp_path, pool) as ann:
        bob = second_browser(ann)
        login(ann)
        login(bob, "bob", "bob-pw")
        for c, slot in ((ann, "9"), (bob, "17")):
            page = c.get("/queue").text
            assert form_field(page, "sample_id") == "s1"
            data = {
                "csrf": form_field(page, "csrf"),
                "sample_id": "s1",
                "lease": form_field(page, "lease"),
                "correct": slot,
            }
            c.post("/queue/answer", data=data)
            if c is ann:
                assert pool.fake_consumer.commits == []  # one answer of two: still held
        assert pool.fake_consumer.commits == [1]
        assert sorted(x.labeler for x in pool.fake_producer.labels()) == ["ann", "bob"]


# --------------------------------------------------------------------------- agreement


def test_fleiss_kappa_matches_the_published_example() -> None:
    """Fleiss (1971) as tabulated on Wikipedia: 10 items, 14 raters, 5 categories, κ = 0.210."""
    table = [
        [0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0], [2, 2, 8, 1, 1],
        [7, 7, 0, 0, 0], [3, 2, 6, 3, 0], [2, 5, 3, 2, 2], [6, 5, 2, 1, 0], [0, 2, 2, 3, 7],
    ]  # fmt: skip
    items = [[cat for cat, n in enumerate(row) for _ in range(n)] for row in table]
    assert round(fleiss_kappa(items), 3) == 0.210


def test_agreement_page_lists_disagreements_and_a_review_settles_one(tmp_path: Path) -> None:
    pool, feeds = Pool([]), Feeds()
    feeds.book.add_sample(sample("s1"))
    feeds.book.add_label(memory_choice_label(sample("s1"), "ann", [9]))
    feeds.book.add_label(memory_choice_label(sample("s1"), "bob", [9, 17]))
    with client_for(tmp_path, pool, feeds) as c:
        login(c)
        page = c.get("/agreement").text
        assert "/review/s1" in page and "ann: 9" in page and "bob: 9, 17" in page
        # ann answered s1 herself: she cannot settle it
        pool.answered["ann"] = {"s1"}
        review = c.get("/review/s1").text
        r = c.post("/review/s1", data={"csrf": form_field(review, "csrf"), "correct": "9"})
        assert r.status_code == 409 and pool.fake_producer.sent == []
        pool.answered["ann"] = set()
        r = c.post("/review/s1", data={"csrf": form_field(review, "csrf"), "correct": "9"}, follow_redirects=False)
        assert r.status_code == 303
        (label,) = pool.fake_producer.labels()
        assert (label.sample_id, label.labeler, label.correct_memories) == ("s1", "ann", [9])
        assert c.get("/review/unknown").status_code == 404


# --------------------------------------------------------------------------- memories and health


def event(
    q: str, step: int, selected: list[int], dropped: list[int], ts: float, fallback: bool = False
) -> RetrievalEvent:
    cands = sorted(set(selected) | {30, 31})
    return RetrievalEvent(
        event_id=f"{q}-{step}", query_id=q, step=step, ts=ts,
        features=Features(np.zeros(8, dtype=np.float32), 0.0, 0.0),
        candidates=cands, scores=np.zeros(len(cands)), selected=selected, temperature=1.0, logprob=-1.0,
        fallback=fallback, dropped=dropped, query_text=f"question {q}",
        memory_texts={s: f"memory text {s}" for s in [*selected, *dropped]},
    )  # fmt: skip


def fed() -> Feeds:
    feeds = Feeds()
    rng = np.random.default_rng(0)
    for i in range(40):
        ev = event(f"q{i}", 0, [5, 6], [7] if i % 2 else [], BASE_TS + 30 * i, fallback=i % 10 == 0)
        feeds.memories.observe_event(ev)
        feeds.trends.observe_event(ev)
        effects = {5: float(rng.normal(-0.5, 0.1)), 6: float(rng.normal(0.4, 0.1))} if i % 4 else None
        exp = Experience(id=ev.event_id, kind="feedback", event=ev, utility=-0.1, slot_effects=effects)
        feeds.memories.observe_experience(exp)
        feeds.trends.observe_experience(exp)
    return feeds


def test_memory_effects_are_welford_with_a_normal_interval() -> None:
    xs = np.random.default_rng(1).normal(0.2, 1.0, 500)
    effects = MemoryEffects(slots=8)
    assert effects.get(3) is None
    for x in xs:
        effects.update(3, float(x))
    e = effects.get(3)
    assert e is not None
    half = 1.959963984540054 * xs.std(ddof=1) / np.sqrt(len(xs))
    assert e.n == 500 and e.mean == pytest.approx(xs.mean()) and e.high - e.mean == pytest.approx(half)


def test_memories_table_sorts_probably_harmful_first_and_marks_do_not_use(tmp_path: Path) -> None:
    pool, feeds = Pool([]), fed()
    view = feeds.memories
    assert [r["slot"] for r in view.rows(sort="harmful")][:1] == [5]
    m5 = view.detail(5)
    assert m5 is not None and m5["reads"] == 40 and m5["drops"] == 0 and m5["high"] < 0
    assert view.detail(7)["drops"] == 20  # type: ignore[index]
    # per-memory credit where the feedback carried it, else the step's utility for each read memory
    assert m5["n"] == 40 and view.per_memory_credit == 30
    with client_for(tmp_path, pool, feeds) as c:
        login(c)
        table = c.get("/memories?sort=harmful").text
        assert table.index('href="/memories/5"') < table.index('href="/memories/6"') and "<svg" in table
        assert "memory text 6" in c.get("/memories?q=text+6").text
        assert 'href="/memories/5"' not in c.get("/memories?q=text+6").text
        page = c.get("/memories/5").text
        assert "question q39" in page and "-0.100" in page  # a recent query with its utility
        r = c.post("/memories/5/do-not-use", data={"csrf": form_field(page, "csrf")}, follow_redirects=False)
        assert r.status_code == 303
        (label,) = pool.fake_producer.labels()
        assert (label.kind, label.harmful_memories, label.correct_memories, label.query_id, label.sample_id) == (
            "memory_choice",
            [5],
            [],
            "q39",
            "do-not-use:5",
        )
        assert c.get("/memories/999").status_code == 404


def test_memory_pages_leave_out_events_that_name_memories_by_id(tmp_path: Path) -> None:
    """Slot numbers of a by-id event are labels (contract 1.3): counting them would mix memories,
    and "do not use" on such a number would suppress another memory."""
    feeds = fed()
    view = feeds.memories
    before = view.detail(5)
    ev = dataclasses.replace(event("qid", 0, [5], [], BASE_TS + 5000), candidate_ids=["doc-a", "doc-b", "doc-c"])
    view.observe_event(ev)
    view.observe_experience(Experience(id=ev.event_id, kind="feedback", event=ev, utility=3.0))
    assert view.detail(5) == before and view.by_id == 1
    with client_for(tmp_path, Pool([]), feeds) as c:
        login(c)
        assert "1 retrievals named their memories by id" in c.get("/memories").text


def test_health_page_shows_the_band_its_advice_and_the_trends(tmp_path: Path) -> None:
    feeds = fed()
    feeds.snapshot = {
        "ts": BASE_TS,
        "health": {"score": 62.5, "band": "warning"},
        "checkpoints": {"serving": {"version": 7, "reason": "label", "created_ts": BASE_TS}, "candidate": None},
    }
    feeds.manifests = {
        7: {"version": 7, "reason": "label", "created_ts": BASE_TS, "candidate": True, "served": True},
        8: {"version": 8, "reason": "update", "created_ts": BASE_TS + 1, "candidate": True, "served": False},
    }
    with client_for(tmp_path, Pool([]), feeds) as c:
        login(c)
        data = c.get("/health/data").json()
        assert data["health"]["band"] == "warning" and "do not use" in data["health"]["advice"]
        points = data["trends"]
        assert len(points) == 20 and points[0]["u_system"] == pytest.approx(-0.1)
        assert points[0]["intervention_rate"] == pytest.approx(1 / 9)  # two events: 4 + 4 kept, 1 dropped
        assert [g["outcome"] for g in data["gate"]] == ["waiting", "promoted (serving)"]
        page = c.get("/health").text
        assert "62.5" in page and "warning" in page and page.count("<svg") == 3 and 'data-live="/health/live"' in page
        feeds.snapshot = None  # no worker endpoint: the score is computed from the topics
        data = c.get("/health/data").json()
        assert data["score_source"].startswith("topics") and data["health"]["band"] in ("warning", "critical")


def test_health_page_shows_the_principals_and_the_one_flagged(tmp_path: Path) -> None:
    """Contract 1.15 asks for a flagged principal in the UI too: the health page lists the
    principals a learner's ``/metrics`` label (here the learner's own metric objects, exposed as
    the learner serves them), the flagged one first and marked."""
    from prometheus_client import generate_latest

    from pipeline.metrics import Metrics
    from pipeline.promtext import parse
    from pipeline.ui.health import principals_of

    learner = Metrics(role="learner")
    for name, share, weight, flagged in (("svc-a", 0.55, 0.36, 0), ("bot-9", 0.12, 1.0, 1), ("svc-b", 0.33, 1.0, 0)):
        learner.principal_share.labels(name).set(share)
        learner.principal_weight.labels(name).set(weight)
        learner.principal_flagged.labels(name).set(flagged)
    values = parse(generate_latest(learner.registry).decode())
    feeds = fed()
    feeds.snapshot = {
        "ts": BASE_TS,
        "gate_estimates": {"estimates": {}, "decisions": {}, "principals": principals_of(values)},
    }
    with client_for(tmp_path, Pool([]), feeds) as c:
        login(c)
        rows = c.get("/health/data").json()["gate_estimates"]["principals"]
        assert [(r["principal"], r["flagged"]) for r in rows] == [("bot-9", True), ("svc-a", False), ("svc-b", False)]
        page = c.get("/health").text
        table = page[page.index('id="principals"') :]
        assert table.index("bot-9") < table.index("svc-a") < table.index("svc-b")
        assert '<tr class="error"><td>bot-9</td><td>12.0%' in table and table.count("FLAGGED") == 1
        feeds.snapshot = {"ts": BASE_TS}  # no --learner: says where the table would come from
        assert 'id="principals"' not in c.get("/health").text and "--learner URL" in c.get("/health").text


def test_health_page_shows_shadow_mode_and_its_estimate(tmp_path: Path) -> None:
    """The UI shows shadow mode's mode and estimate (``causalmem ui --shadow``)."""
    feeds = fed()
    line = "policy 'default': shadow mode, gain +0.120 [+0.030, +0.210] over 400 exploration steps"
    feeds.snapshot = {"ts": BASE_TS, "shadow": {"mode": "shadow", "line": line}}
    with client_for(tmp_path, Pool([]), feeds) as c:
        login(c)
        assert c.get("/health/data").json()["shadow"]["mode"] == "shadow"
        assert line.replace("'", "&#39;") in c.get("/health").text
        feeds.snapshot = {"ts": BASE_TS}  # without --shadow: no section
        assert 'id="shadow"' not in c.get("/health").text


def test_the_cli_verb_needs_a_labelers_file(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli import main

    assert main(["ui", "--bootstrap", "127.0.0.1:1"]) == 1
    assert "--labelers" in capsys.readouterr().err


def test_json_of_a_label_is_unchanged_for_old_readers() -> None:
    """harmful_memories is optional: a label without it encodes as before (contract 1.2)."""
    label = memory_choice_label(sample("s1"), "ann", [9])
    assert "harmful_memories" not in orjson.loads(encode(label.to_dict()))


def test_the_topic_reader_takes_any_embedding_length_and_follows_the_gate(tmp_path: Path) -> None:
    """The app is configured with 384 dimensions; the deployment's events have 8: all are read.
    Candidate and serving manifests on the model topic become the gate's history."""
    from pipeline.ui.feeds import Feeds as TopicFeeds
    from topics.internal import experience_bytes
    from topics.manifest import Manifest

    feeds = TopicFeeds("127.0.0.1:1", Settings(state_dir=str(tmp_path)).ui())
    ev = event("q1", 0, [5], [7], BASE_TS)
    feeds._apply("events", SimpleNamespace(value=encode(ev.to_dict()), key=b"q1"))
    feeds._apply("experiences", SimpleNamespace(value=experience_bytes(ev, 0.3, {5: 0.2}), key=None))
    row = feeds.memories.detail(5)
    assert row is not None and row["reads"] == 1 and row["mean"] == pytest.approx(0.2)
    assert feeds.trends.series()[0]["u_system"] == pytest.approx(0.3)

    def manifest(version: int) -> bytes:
        arch = {"input_dim": 10, "hidden": 16, "slots": 64, "embedding_dim": 8}
        m = Manifest("default", version, BASE_TS + version, "periodic", arch, 0.5, 0.0, "0" * 64, 1, 1, {}, {})
        return encode(m.to_dict())

    for key, version in ((b"default/candidate", 2), (b"default", 2), (b"default/candidate", 3)):
        feeds._apply("model", SimpleNamespace(value=manifest(version), key=key))
    assert feeds.manifests[2]["candidate"] and feeds.manifests[2]["served"]
    assert feeds.manifests[3]["candidate"] and not feeds.manifests[3]["served"]


def test_an_answer_is_held_for_undo_then_sent_and_the_app_stopping_sends_it(tmp_path: Path) -> None:
    pool = Pool([sample("s1"), sample("s2")], undo_s=10.0)
    with client_for(tmp_path, pool) as c:
        login(c)
        page = c.get("/queue").text

        def answer(page: str, slot: str) -> str:
            data = {
                "csrf": form_field(page, "csrf"),
                "sample_id": form_field(page, "sample_id"),
                "lease": form_field(page, "lease"),
            }
            return c.post("/queue/answer", data={**data, "correct": slot}).text

        page = answer(page, "9")
        assert "goes out in 10 s" in page and form_field(page, "sample_id") == "s2"
        assert pool.fake_producer.sent == []  # held: nothing sent yet
        page = c.post("/queue/undo", data={"csrf": form_field(page, "csrf")}).text
        assert "Taken back" in page and form_field(page, "sample_id") == "s1"  # the sample is theirs again
        assert pool.fake_producer.sent == [] and pool.fake_consumer.commits == []
        page = answer(page, "17")
        pool.now += 11.0
        c.portal.call(pool.flush)  # what the app's flusher does every second
        (label,) = pool.fake_producer.labels()
        assert (label.sample_id, label.correct_memories) == ("s1", [17]) and pool.fake_consumer.commits == [1]
        r = c.post("/queue/undo", data={"csrf": form_field(page, "csrf")})
        assert r.status_code == 409 and "sent already" in r.text
        answer(c.get("/queue").text, "9")  # s2: held when the app stops
        assert len(pool.fake_producer.labels()) == 1
    assert [x.sample_id for x in pool.fake_producer.labels()] == ["s1", "s2"]


def test_hash_password_prints_a_hash_the_labelers_file_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    from pipeline.cli import main
    from pipeline.ui.auth import load_labelers

    monkeypatch.setattr("sys.stdin", io.StringIO("correct horse\n"))
    assert main(["ui", "--hash-password"]) == 0
    hashed = capsys.readouterr().out.strip()
    (tmp_path / "l.toml").write_text(f'[labelers.ann]\npassword_hash = "{hashed}"\n')
    ann = load_labelers(tmp_path / "l.toml")["ann"]
    assert ann.accepts("correct horse") and not ann.accepts("correct horse ")
    (tmp_path / "bad.toml").write_text('[labelers.ann]\ntoken = "short"\n')
    with pytest.raises(ValueError, match="at least 12 characters"):
        load_labelers(tmp_path / "bad.toml")


def test_sasl_logins_are_checked_by_the_broker_and_labels_use_the_labelers_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No labelers file on a SASL connection: a labeler logs in with their own Kafka user;
    the broker (here a stand-in that knows ann's password) decides, and ann's label goes
    through a producer made with her credentials, not the app's."""
    from pipeline import kafka
    from pipeline.config import KafkaSecurity

    made: list[tuple[str | None, str | None, Producer]] = []

    class SaslProducer(Producer):
        def __init__(self, user: str | None, password: str | None) -> None:
            super().__init__()
            self.user, self.password, self.stopped = user, password, False

        async def start(self) -> None:
            if (self.user, self.password) != ("ann", "ann-kafka-pw"):
                raise RuntimeError("SASL authentication failed")

        async def stop(self) -> None:
            self.stopped = True

    def producer(bootstrap: str, conn: Any, **kw: Any) -> SaslProducer:
        p = SaslProducer(conn.security.sasl_username, conn.security.sasl_password)
        made.append((p.user, p.password, p))
        return p

    monkeypatch.setattr(kafka, "producer", producer)
    sasl = S.replace(
        state_dir=str(tmp_path),
        # idempotence off: the stand-in broker is not asked for a producer id first
        security=KafkaSecurity("SASL_PLAINTEXT", "SCRAM-SHA-512", "causalmem-ui", "app-pw", idempotence="off"),
    )
    pool = Pool([sample("s1")])
    app = create_app(sasl.ui(), "127.0.0.1:1", pool=pool, feeds=Feeds())
    with TestClient(app, base_url="http://127.0.0.1") as c:
        r = try_login(c, "ann", "wrong")
        assert r.status_code == 401 and made[-1][2].stopped  # refused by the broker; nothing kept
        assert c.get("/queue", follow_redirects=False).status_code == 303  # still logged out
        login(c, "ann", "ann-kafka-pw")
        ann_producer = made[-1][2]
        page = c.get("/queue").text
        data = {"csrf": form_field(page, "csrf"), "sample_id": "s1", "lease": form_field(page, "lease"), "correct": "9"}
        c.post("/queue/answer", data=data)
        assert pool.fake_producer.sent == []  # not through the app's own connection
        (label,) = [decode_human_label(v, Limits(slots=64)) for _, v in ann_producer.sent]
        assert label.labeler == "ann" and label.correct_memories == [9]
        c.post("/logout", data={"csrf": form_field(c.get("/memories").text, "csrf")})
        assert ann_producer.stopped and "ann" not in pool.producers
    with pytest.raises(ValueError, match="labelers"):
        create_app(S.replace(state_dir=str(tmp_path)).ui(), "127.0.0.1:1", pool=Pool([]), feeds=Feeds())


async def test_shadow_estimate_is_judged_again_at_most_every_shadow_every_s(tmp_path: Path) -> None:
    """It re-reads and re-judges a window of steps: at every 5 s refresh it was most of the UI's work."""
    from dataclasses import replace

    from pipeline.ui.feeds import Feeds as TopicFeeds

    config = replace(Settings(state_dir=str(tmp_path)).ui(), shadow_window=100, shadow_every_s=3600.0)
    feeds = TopicFeeds("127.0.0.1:1", config)
    calls: list[int] = []

    async def shadow() -> dict[str, object]:
        calls.append(1)
        return {"mode": "shadow", "line": f"estimate {len(calls)}"}

    async def nothing() -> set[str]:
        return set()

    async def snapshot() -> dict[str, object]:
        return {"ts": BASE_TS}

    async def estimates() -> list[object]:
        return []

    feeds._shadow, feeds._existing, feeds._gate_estimates = shadow, nothing, estimates  # type: ignore[method-assign]
    feeds.status.snapshot = snapshot  # type: ignore[method-assign]
    for _ in range(3):
        await feeds.refresh()
    assert len(calls) == 1 and feeds.snapshot is not None and feeds.snapshot["shadow"]["line"] == "estimate 1"
    feeds._shadow_last = (feeds._shadow_last[0] - 3601.0, None)  # type: ignore[index]  # an hour on
    await feeds.refresh()
    assert len(calls) == 2 and feeds.snapshot["shadow"]["line"] == "estimate 2"


def test_health_probes_answer_without_a_login_and_ready_once_the_topics_are_read(tmp_path: Path) -> None:
    """``/healthz`` and ``/readyz`` for the deployment's probes (deploy/k8s/ui-deployment.yaml):
    no session needed; not ready until the app's first read of the topics."""
    feeds = Feeds()
    refreshed = feeds.refreshed
    refreshed.clear()
    with client_for(tmp_path, Pool([]), feeds) as c:
        assert c.get("/healthz").status_code == 200
        waiting = c.get("/readyz")
        assert waiting.status_code == 503 and "not been read yet" in waiting.text
        refreshed.set()
        assert c.get("/readyz").status_code == 200
        assert c.get("/queue", follow_redirects=False).status_code == 303  # the pages still need a login
