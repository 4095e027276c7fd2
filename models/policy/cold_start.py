"""Cold start: a new memory's output row from its k nearest live memories' rows.

A memory added to a running policy gets a row of the output layer. A fresh (neutral)
row serves it like similarity search alone (mask ≈ 1, :func:`models.policy.network.neutral_out`)
until REINFORCE has seen it selected often enough. Memories that sit close in embedding
space tend to play the same part for the same queries, so the new row starts instead as
the similarity-weighted mean of the rows (and biases) of its ``k`` nearest live memories,
by cosine similarity of the memory embeddings; only neighbours with a positive
similarity count. With none (an empty bank, or nothing similar) the row is neutral.

``causalmem bench coldstart`` measures what it buys: the learner steps a new helpful
memory needs to enter the served top-k (docs/benchmarks.md).

>>> import torch
>>> w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
>>> b = torch.tensor([1.0, 3.0, 9.0])
>>> emb = np.array([[1.0, 0.0], [0.6, 0.8], [-1.0, 0.0]], np.float32)
>>> rows, bias = knn_rows(w, b, emb, np.array([0, 1, 2]), np.array([[0.8, 0.6]], np.float32), k=2)
>>> [round(float(x), 3) for x in rows[0]], round(float(bias[0]), 3)  # weights 0.8 and 0.96
([0.455, 0.545], 2.091)
"""

from __future__ import annotations

import numpy as np
import torch

from models.policy.network import neutral_rows


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    out: np.ndarray = x / np.where(norms > 0, norms, 1.0)
    return out


def knn_rows(
    weight: torch.Tensor,
    bias: torch.Tensor,
    slot_embeddings: np.ndarray,
    slots: np.ndarray,
    new_embeddings: np.ndarray,
    k: int = 5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial output rows for new memories from their nearest live memories' rows.

    Parameters
    ----------
    weight, bias
        The policy's output layer, ``[S, H]`` and ``[S]`` (not modified).
    slot_embeddings
        ``[n, D]`` float32: the memory embeddings of the live slots whose embedding is known.
    slots
        ``[n]`` int64: the slot of each row of ``slot_embeddings``.
    new_embeddings
        ``[m, D]``: the new memories' embeddings.
    k
        Neighbours per new memory.

    Returns
    -------
    ``([m, H], [m])`` on ``weight``'s device and dtype: for each new memory, the
    similarity-weighted mean of its ``k`` nearest live memories' rows and biases
    (weights: the positive cosine similarities); a neutral row when none is similar.
    """
    if k < 1:
        raise ValueError(f"k={k}: need at least one neighbour")
    new = _unit(np.atleast_2d(new_embeddings))
    m, hidden = new.shape[0], int(weight.shape[1])
    out_w, out_b = neutral_rows(m, hidden)
    out_w, out_b = out_w.to(weight.device, weight.dtype), out_b.to(bias.device, bias.dtype)
    slots = np.asarray(slots, dtype=np.int64).ravel()
    if m == 0 or slots.size == 0:
        return out_w, out_b
    bank = _unit(np.asarray(slot_embeddings, dtype=np.float32).reshape(slots.size, -1))
    if bank.shape[1] != new.shape[1]:
        raise ValueError(f"embedding sizes differ: live {bank.shape[1]}, new {new.shape[1]}")
    sims = new @ bank.T  # [m, n]
    kk = min(k, slots.size)
    top = np.argpartition(-sims, kk - 1, axis=1)[:, :kk]  # [m, kk], unordered
    w_top = np.clip(np.take_along_axis(sims, top, axis=1), 0.0, None).astype(np.float64)
    norm = w_top.sum(axis=1)
    has = norm > 0
    if not has.any():
        return out_w, out_b
    mix = torch.as_tensor(w_top[has] / norm[has, None], dtype=weight.dtype, device=weight.device)  # [m', kk]
    idx = torch.as_tensor(slots[top[has]], dtype=torch.long, device=weight.device)  # [m', kk]
    with torch.no_grad():
        rows = torch.einsum("mk,mkh->mh", mix, weight.detach()[idx])
        biases = (mix * bias.detach()[idx]).sum(dim=1)
    where = torch.as_tensor(np.flatnonzero(has), dtype=torch.long, device=weight.device)
    out_w[where] = rows
    out_b[where] = biases
    return out_w, out_b


class SlotEmbeddings:
    """The live memories' unit embeddings by slot, in one matrix.

    A new memory's nearest live memories are then one matrix–vector product over the bank
    (≈ 0.4 GFLOP at 10^6 memories of D = 384), instead of gathering every embedding anew
    for each added memory. Rows grow by doubling up to ``capacity`` (the policy's slots).

    >>> bank = SlotEmbeddings(capacity=8)
    >>> bank.set(5, np.array([1.0, 0.0], np.float32)); bank.set(2, np.array([0.0, 3.0], np.float32))
    >>> slots, rows = bank.nearest(np.array([0.6, 0.8], np.float32), k=1)
    >>> slots.tolist(), rows.tolist()
    ([2], [[0.0, 1.0]])
    >>> bank.drop(2); bank.nearest(np.array([0.6, 0.8], np.float32), k=3, exclude=5)[0].tolist()
    []
    >>> len(bank), 5 in bank
    (1, True)
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows = np.zeros((0, 0), np.float32)
        self._known = np.zeros(0, bool)

    def __len__(self) -> int:
        return int(self._known.sum())

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < self._known.size and bool(self._known[slot])

    def set(self, slot: int, embedding: np.ndarray) -> None:
        """Record (or replace) ``slot``'s embedding."""
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} outside [0, {self.capacity})")
        e = _unit(np.asarray(embedding, np.float32).ravel())
        if self._rows.shape[1] not in (0, e.size):
            raise ValueError(f"embedding sizes differ: bank {self._rows.shape[1]}, new {e.size}")
        if slot >= self._known.size or self._rows.shape[1] == 0:
            size = min(self.capacity, max(slot + 1, 2 * self._known.size, 64))
            rows = np.zeros((size, e.size), np.float32)
            known = np.zeros(size, bool)
            if self._rows.size:
                rows[: self._rows.shape[0]] = self._rows
                known[: self._known.size] = self._known
            self._rows, self._known = rows, known
        self._rows[slot] = e
        self._known[slot] = True

    def drop(self, slot: int) -> None:
        """Forget ``slot``'s embedding (a removed memory)."""
        if 0 <= slot < self._known.size:
            self._known[slot] = False

    def clear(self) -> None:
        self._rows = np.zeros((0, 0), np.float32)
        self._known = np.zeros(0, bool)

    def nearest(self, embedding: np.ndarray, k: int, exclude: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` known slots most similar to ``embedding`` (cosine), and their unit rows.

        Order is unspecified; fewer than ``k`` when fewer are known.
        """
        known = self._known.copy()
        if exclude is not None and 0 <= exclude < known.size:
            known[exclude] = False
        slots = np.flatnonzero(known)
        if slots.size == 0 or k < 1:
            return slots, np.zeros((0, self._rows.shape[1]), np.float32)
        sims = self._rows @ _unit(np.asarray(embedding, np.float32).ravel())
        sims[~known] = -np.inf
        kk = min(k, slots.size)
        top = np.argpartition(-sims, kk - 1)[:kk]
        return top.astype(np.int64), self._rows[top]
