"""The write gate's math (models/memory/write_gate.py), its judge (pipeline/writes/service.py) and cold start."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.memory.write_gate import RewardEstimator, WriteGate, memory_id_for, route
from models.policy.cold_start import knn_rows
from models.policy.network import NEUTRAL_BIAS, PolicyNetwork
from pipeline.config import Settings
from pipeline.writes.service import Judge
from topics.fields import Limits
from topics.lifecycle import MemoryRecord, decode_memory_record
from topics.writes import MemoryWrite, RejectedWrite

BASE_TS = 1_767_225_600.0


# --------------------------------------------------------------------------- the gate


@pytest.mark.parametrize(
    ("reward", "expected", "admitted", "kind", "rpe"),
    [
        (1.0, 0.5, True, "success", 0.5),
        (0.0, 0.5, True, "pitfall", -0.5),
        (0.75, 0.5, False, None, 0.25),  # |RPE| = θ is not enough: strictly greater
        (0.5, 0.5, False, None, 0.0),
    ],
)
def test_the_gate_admits_only_surprises_and_names_their_kind(
    reward: float, expected: float, admitted: bool, kind: str | None, rpe: float
) -> None:
    d = WriteGate(theta=0.25).judge(reward, (expected, "cluster"))
    assert (d.admitted, d.kind, d.expected_reward) == (admitted, kind, expected)
    assert d.rpe == pytest.approx(rpe)


def test_theta_must_be_a_finite_non_negative_number() -> None:
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            WriteGate(theta=bad)
    with pytest.raises(ValueError):
        Settings(writes_theta=-1.0).writes()


def test_the_gate_judges_on_its_own_estimate_not_on_the_producers_claim() -> None:
    est = RewardEstimator(prior=0.0, fading=0.5, radius=0.9, min_count=2)
    topic = np.array([1.0, 0.0, 0.0])
    for r in (0.5, 0.5):
        est.update(topic, r)
    own = est.expected(topic)
    assert own == (0.5, "cluster")
    gate = WriteGate(theta=0.3)
    # A producer's number is not an expectation the gate decides by.
    with pytest.raises(ValueError, match="producer"):
        gate.judge(0.5, (-5.0, "producer"))
    # The reward the gate expected for this topic, whatever the producer claims it expected: no surprise.
    for claimed in (-5.0, 5.0):
        d = gate.judge(0.5, own, claimed_expected_reward=claimed)
        assert (d.admitted, d.rpe, d.expected_reward, d.estimate) == (False, 0.0, 0.5, "cluster")
        assert (d.claimed_expected_reward, d.claim_disagrees) == (claimed, True)
    # A genuine surprise is admitted, even when the producer claims it expected it.
    up = gate.judge(1.5, own, claimed_expected_reward=1.5)
    assert (up.admitted, up.kind, up.rpe, up.claim_disagrees) == (True, "success", 1.0, True)
    down = gate.judge(-0.5, own, claimed_expected_reward=-0.5)
    assert (down.admitted, down.kind, down.rpe) == (True, "pitfall", -1.0)
    # A claim within θ of the gate's expectation agrees; no claim, nothing to compare.
    assert gate.judge(0.5, own, claimed_expected_reward=0.6).claim_disagrees is False
    bare = gate.judge(0.5, own)
    assert (bare.claimed_expected_reward, bare.claim_disagrees) == (None, False)


def test_the_estimator_keeps_one_running_mean_per_query_topic() -> None:
    est = RewardEstimator(prior=0.25, fading=0.5, radius=0.9, min_count=2)
    a, a2, b = np.array([1.0, 0.0, 0.0]), np.array([0.99, 0.1, 0.0]), np.array([0.0, 0.0, 1.0])
    assert est.expected(a) == (0.25, "prior")
    for r in (1.0, 0.0, 1.0):  # means: 1, 0.5, 0.75 (1/n, then the fading rate 0.5)
        est.update(a, r)
    est.update(a2, 1.0)  # cosine 0.995 to a's centroid: the same topic → 0.875
    assert est.n_clusters == 1
    assert est.expected(a) == (pytest.approx(0.875), "cluster")
    est.update(b, -1.0)  # a second topic, one reward: still answered by the global mean
    assert est.n_clusters == 2
    assert est.expected(b)[1] == "global"
    est.update(b, -1.0)
    assert est.expected(b) == (-1.0, "cluster")
    assert est.expected(None)[1] == "global" and est.expected(np.zeros(3))[1] == "global"


def test_the_estimator_stops_creating_topics_at_its_bound() -> None:
    est = RewardEstimator(radius=0.99, max_clusters=3, min_count=1)
    for i in range(10):
        v = np.zeros(10)
        v[i] = 1.0
        est.update(v, float(i))
    assert est.n_clusters == 3


def test_memory_ids_are_deterministic_and_distinct() -> None:
    assert memory_id_for("w1") == memory_id_for("w1") != memory_id_for("w2")
    assert len(memory_id_for("x" * 256)) <= 256


def test_route_puts_successes_first_and_pitfalls_last_by_surprise() -> None:
    memories = [("plain", None, None, 0.9), ("warn", "pitfall", -0.9, 0.95), ("ok", "success", 0.4, 0.5)]
    memories.append(("great", "success", 1.5, 0.45))

    def order(m: tuple[str, str | None, float | None, float]) -> tuple[int, float]:
        group, bonus = route(m[1], m[2], beta=0.1)
        return group, -(m[3] + bonus)

    assert [m[0] for m in sorted(memories, key=order)] == ["great", "ok", "plain", "warn"]
    assert route("memory", 2.0) == (1, pytest.approx(0.2)) and route("success", float("nan")) == (0, 0.0)


# --------------------------------------------------------------------------- the judge


def test_the_judge_writes_admissions_as_lifecycle_adds_and_keeps_rejections() -> None:
    judge = Judge(WriteGate(0.3), RewardEstimator(prior=0.0, fading=0.5, min_count=1))
    emb = np.array([0.6, 0.8, 0.0, 0.0], np.float32)
    good = judge.judge(MemoryWrite("w1", BASE_TS, "use v2", "q1", 0, reward=1.0, embedding=emb))
    assert isinstance(good.output, MemoryRecord) and good.label == "admitted_success"
    rec = decode_memory_record(good.output.to_bytes(), Limits(embedding_dim=4), key=good.output.key)
    assert (rec.op, rec.kind, rec.delta, rec.source) == ("add", "success", 1.0, "write-gate")
    assert rec.memory_id == memory_id_for("w1") and rec.text == "use v2" and rec.ts == BASE_TS
    assert rec.embedding is not None and rec.embedding.tolist() == pytest.approx(emb.tolist())
    # The same topic expects 1.0 now: 0.9 is no surprise, 0.0 is a pitfall.
    meh = judge.judge(MemoryWrite("w2", BASE_TS + 1, "v2 again", "q2", 0, reward=0.9, embedding=emb), now=5.0)
    assert isinstance(meh.output, RejectedWrite) and meh.label == "rejected"
    assert (meh.output.estimate, meh.output.theta, meh.output.ts) == ("cluster", 0.3, 5.0)
    assert meh.output.rpe == pytest.approx(-0.1) and meh.output.write.write_id == "w2"
    bad = judge.judge(MemoryWrite("w3", BASE_TS + 2, "v1", "q3", 0, reward=0.0, embedding=emb))
    assert bad.label == "admitted_pitfall" and isinstance(bad.output, MemoryRecord)
    assert bad.output.delta == pytest.approx(-0.95)


@pytest.mark.parametrize(
    ("reward", "claimed", "label", "rpe"),
    [
        (0.5, -5.0, "rejected", 0.0),  # the topic's usual reward, claimed a surprise: not admitted
        (0.5, 5.0, "rejected", 0.0),
        (1.5, 1.5, "admitted_success", 1.0),  # a surprise, claimed expected: admitted all the same
        (-0.5, -0.5, "admitted_pitfall", -1.0),
    ],
)
def test_the_judge_decides_by_its_own_estimate_whatever_the_producer_claims(
    reward: float, claimed: float, label: str, rpe: float
) -> None:
    est = RewardEstimator(prior=0.0, fading=0.5, radius=0.9, min_count=2)
    topic = np.array([0.0, 1.0, 0.0, 0.0], np.float32)
    for r in (0.5, 0.5):
        est.update(topic, r)
    judge = Judge(WriteGate(0.3), est)
    w = MemoryWrite("w1", BASE_TS, "x", "q1", 0, reward=reward, expected_reward=claimed, query_embedding=topic)
    j = judge.judge(w, now=5.0)
    assert j.label == label
    assert j.decision.rpe == pytest.approx(rpe)
    assert (j.decision.expected_reward, j.decision.estimate) == (0.5, "cluster")
    assert (j.decision.claimed_expected_reward, j.decision.claim_disagrees) == (claimed, True)
    if isinstance(j.output, RejectedWrite):  # kept for review with the gate's numbers and the claim as received
        assert (j.output.expected_reward, j.output.estimate, j.output.rpe) == (0.5, "cluster", 0.0)
        assert j.output.write.expected_reward == claimed
    else:
        assert j.output.delta == pytest.approx(rpe)


# --------------------------------------------------------------------------- cold start


def test_knn_rows_are_the_similarity_weighted_mean_of_the_nearest_rows() -> None:
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [4.0, 4.0], [9.0, 9.0]])
    bias = torch.tensor([1.0, 2.0, 3.0, 4.0])
    emb = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]], np.float32)  # slot 3: orthogonal to the new one
    slots = np.array([0, 1, 2, 3])
    new = np.array([[1.0, 0.0, 0.0]], np.float32)
    rows, b = knn_rows(weight, bias, emb, slots, new, k=2)
    # nearest: slot 0 (cos 1) and slot 2 (cos 1/√2)
    s = 1.0 + 2**-0.5
    assert rows[0].tolist() == pytest.approx([(1.0 + 4.0 * 2**-0.5) / s, (4.0 * 2**-0.5) / s], rel=1e-5)
    assert float(b[0]) == pytest.approx((1.0 + 3.0 * 2**-0.5) / s, rel=1e-5)
    # k=1: exactly the nearest row; the live slots may be any subset, in any order
    rows, b = knn_rows(weight, bias, emb[[3, 1]], np.array([3, 1]), np.array([[0.1, 1.0, 0.0]], np.float32), k=1)
    assert rows[0].tolist() == [0.0, 1.0] and float(b[0]) == 2.0


def test_knn_rows_fall_back_to_neutral_rows_without_a_similar_memory() -> None:
    net = PolicyNetwork(embedding_dim=3, slots=4, hidden=8)
    with torch.no_grad():
        net.out.bias.fill_(5.0)
    opposite = np.array([[-1.0, 0.0, 0.0]], np.float32)
    for emb, slots in ((np.array([[1.0, 0.0, 0.0]], np.float32), np.array([0])), (np.zeros((0, 3)), np.zeros(0))):
        rows, b = knn_rows(net.out.weight, net.out.bias, emb, slots, opposite, k=3)
        assert rows.shape == (1, 8) and float(b[0]) == pytest.approx(NEUTRAL_BIAS)
        assert float(rows.abs().max()) < 0.01  # small, as neutral_out makes them
    # several new memories at once: one neutral, one from its neighbour
    both = np.array([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], np.float32)
    rows, b = knn_rows(net.out.weight, net.out.bias, np.array([[1.0, 0.0, 0.0]], np.float32), np.array([2]), both)
    assert float(b[0]) == pytest.approx(NEUTRAL_BIAS) and float(b[1]) == 5.0
    assert torch.equal(rows[1], net.out.weight[2].detach())
    assert not rows.requires_grad
