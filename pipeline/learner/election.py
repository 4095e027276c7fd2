"""Which learner trains: a consumer group on the one-partition ``control`` topic.

Every learner of a policy joins the group ``{prefix}causalmem-learner-{policy}``; Kafka
assigns the single partition to one member, and that member is the active learner. When
it dies (or stops polling) the group rebalances and a standby is elected and restores
from the model topic (docs/architecture.md).

The group consumer only elects: it is paused on what it is assigned and never returns
records (the learner reads its inputs with a separate, manually assigned consumer). It
must still be polled (:meth:`Election.poll`) for its membership to stay alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import ConsumerRebalanceListener

from pipeline import kafka
from pipeline.config import Connection
from pipeline.service import Service

log = logging.getLogger(__name__)


def group_id(conn: Connection) -> str:
    return f"{conn.topics.prefix}causalmem-learner-{conn.policy}"


class Election(Service):
    """Membership of the learner group; :attr:`elected` while this learner owns control."""

    def __init__(self, bootstrap: str, conn: Connection, on_lost: Callable[[], None]) -> None:
        super().__init__()
        self.bootstrap = bootstrap
        self.conn = conn
        self.topic = conn.topics.control.name
        self.on_lost = on_lost  # called when the partition is taken away
        self.elected = False
        self.consumer: Any = None

    async def _start(self) -> None:
        self.consumer = kafka.consumer(self.bootstrap, self.conn, group_id=group_id(self.conn))
        self.consumer.subscribe([self.topic], listener=_Listener(self))
        await self.consumer.start()

    async def _stop(self) -> None:
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            # A consumer stopped while still starting raises CancelledError: stop anyway.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await consumer.stop()

    async def poll(self) -> None:
        """Keep the membership alive (rebalances run their callbacks from here)."""
        with contextlib.suppress(Exception):
            await self.consumer.getmany(timeout_ms=0)

    def lost(self) -> None:
        self.elected = False
        self.on_lost()

    def assigned(self, partitions: Any) -> None:
        if self.consumer is None:  # stopped while the group was still assigning
            return
        if partitions:
            # Restoring happens in the learner's run loop, not inside the rebalance callback.
            self.consumer.pause(*partitions)
        if any(tp.topic == self.topic for tp in partitions):
            self.elected = True


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    def __init__(self, election: Election) -> None:
        self.election = election

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:
            self.election.lost()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.election.assigned(assigned)
