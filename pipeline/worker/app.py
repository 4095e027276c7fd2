"""The worker: one faust app running the join and the stream stages.

``causalmem worker`` runs one of these; run several on more machines to scale out (the
input topics' partitions are split between them). The parts:

- **join** (:mod:`pipeline.worker.join`): a batched aiokafka consumer inside the worker
  process (a faust service here);
- **outcomes** (:mod:`pipeline.worker.outcomes`): U_query and the active-learning
  candidates;
- **labels** (:mod:`pipeline.worker.labels`): verdicts, answers and ratings → samples,
  label experiences and rating pairs;
- **drift** (:mod:`pipeline.worker.drift`, one partition, so one owner): the correlation
  and the reset trigger;
- **upkeep** (:mod:`pipeline.worker.upkeep`): timers for health, lag and table pruning.

The active-learning rule they share is :mod:`pipeline.worker.active_learning`. Tables
(:mod:`pipeline.worker.tables`, values from :mod:`pipeline.worker.records`) live in
RocksDB under the state directory by default (``worker_store = rocksdb``): a restart reads
only the changelog written since; with ``memory`` they are rebuilt from their changelog
topics on every start or takeover. Entries older than ``label_window_s`` of event time, and
the oldest beyond the caps (entries and encoded bytes), are pruned. See
docs/architecture.md and docs/operations.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from typing import IO, Any

import faust
import mode

from pipeline.config import WorkerConfig
from pipeline.kafka import (
    PRODUCER_BATCH_BYTES,
    ClusterWatch,
    faust_credentials,
    idempotence_granted,
    read_all,
)
from pipeline.metrics import Metrics
from pipeline.service import restart_process
from pipeline.worker.delivery import WorkerApp
from pipeline.worker.drift import DriftStage
from pipeline.worker.join import JoinStage
from pipeline.worker.labels import LabelsStage
from pipeline.worker.outcomes import OutcomesStage, sent_sample_ids
from pipeline.worker.recovery import fetched_highwaters
from pipeline.worker.tables import STORE_URLS, Outputs, Tables, claim_slot, drop_unclean, match_epoch, raw_topic
from pipeline.worker.upkeep import HEALTH_INTERVAL_S, PRUNE_INTERVAL_S, Upkeep

log = logging.getLogger(__name__)


class JoinService(mode.Service):
    """Runs the join stage (and the cluster watch) inside the faust worker's lifecycle."""

    def __init__(self, stage: JoinStage, watch: ClusterWatch | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = stage
        self.watch = watch

    async def on_start(self) -> None:
        await self.stage.start()
        if self.watch is not None:
            await self.watch.start()

    async def on_stop(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        await self.stage.stop()

    @mode.Service.task
    async def _run(self) -> None:
        await self.stage.run()


class Worker:
    """Builds the faust app and its stages for one worker process."""

    def __init__(self, config: WorkerConfig, bootstrap: str, metrics: Metrics, web_port: int | None = None) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.metrics = metrics
        self.topics = config.connection.topics
        self.join = JoinStage(config.join, bootstrap, metrics)
        self._slot_lock: IO[str] | None = None
        self.app = self._app(web_port)
        self.tables = Tables.declare(self.app, config.partitions)
        self.outputs = Outputs.declare(self.app, self.topics)
        limits = config.connection.limits
        sent_before = functools.partial(sent_sample_ids, bootstrap, config.connection)
        self.outcomes = OutcomesStage(self.tables, self.outputs, metrics, limits, sent_before)
        self.labels = LabelsStage(self.tables, self.outputs, metrics, self.outcomes, self.topics, limits)
        self.drift = DriftStage(config.drift, self.tables, self.outputs, metrics, limits)
        t = self.topics
        self.upkeep = Upkeep(
            config,
            self.tables,
            self.join,
            metrics,
            self.app,
            stage_topics=frozenset({t.outcomes.name, t.human_labels.name, t.rating_pairs.name}),
        )
        self._register()

    def _app(self, web_port: int | None) -> faust.App:
        c = self.config
        # The producer waits for acknowledgements before faust commits (delivery.py); table
        # recovery reads each changelog to the end a fetch reports (recovery.py).
        return WorkerApp(
            c.app_id,
            fetch_highwaters=functools.partial(fetched_highwaters, self.bootstrap, c.connection),
            idempotence=functools.partial(idempotence_granted, self.bootstrap, c.connection),
            broker=[f"kafka://{b}" for b in self.bootstrap.split(",")],
            broker_credentials=faust_credentials(c.connection.security),
            store=STORE_URLS[c.store],
            # The RocksDB store's key → partition index: reads and deletes outside an event
            # (the prune) probe every partition's database for a key not in it.
            table_key_index_size=50_000,
            # faust's check that a table's persisted changelog offset is below the topic's
            # end: the epoch marker (table_dir) already empties tables built against another
            # cluster, and the embedded broker answers "latest offset" with the last batch's
            # base offset + 1, so the check would stop a worker whose data is fine.
            recovery_consistency_check=False,
            topic_partitions=c.partitions,
            # The embedded broker holds a JoinGroup for session_timeout / 2: a short session
            # keeps rebalances (a start, a takeover) to seconds.
            broker_session_timeout=6,
            broker_heartbeat_interval=1,
            web_enabled=web_port is not None,
            web_bind="127.0.0.1",
            web_port=web_port or 6066,
            producer_acks=-1,
            # Table changelog writes (and the stages' outputs) leave through faust's producer,
            # one buffered send at a time. With faust's 16 KiB batches, a batch of the outcomes
            # stage's writes filled after a few held samples (kilobytes each), and the next send
            # waited until the Kafka client had taken the full batch: the changelog trailed the
            # rest of the worker by up to 2 s (docs/benchmarks.md, "Throughput"). faust's linger (0)
            # stays: a verdict's held samples are sent and awaited one at a time (labels.py).
            producer_max_batch_size=PRODUCER_BATCH_BYTES,
            topic_replication_factor=c.connection.topics.outcomes.replication,  # changelogs too
            consumer_auto_offset_reset="earliest",
            processing_guarantee="at_least_once",
            autodiscover=False,
            table_cleanup_interval=30.0,
            worker_redirect_stdouts=False,
            # faust's files live in the state directory, not in the current one; the
            # tables' directory is chosen at start (table_dir).
            datadir=str(c.state_dir),
        )

    def _register(self) -> None:
        app, t = self.app, self.topics
        outcomes = raw_topic(app, t.outcomes.name, t.outcomes.partitions)
        labels = raw_topic(app, t.human_labels.name, t.human_labels.partitions)
        app.agent(outcomes, name="outcomes")(self.outcomes.agent)
        app.agent(labels, name="labels")(self.labels.agent)
        app.agent(self.outputs.rating_pairs, name="drift")(self.drift.agent)
        app.timer(interval=HEALTH_INTERVAL_S)(self.upkeep.health)
        app.timer(interval=PRUNE_INTERVAL_S)(self.upkeep.prune)

    def table_dir(self, marker: bytes | None) -> None:
        """Take a table directory of this app (RocksDB store), emptied if ``marker`` is another cluster's.

        Tables whose last run did not stop cleanly are dropped and rebuilt from their
        changelogs (:func:`pipeline.worker.tables.drop_unclean`). Called once, before the
        faust worker starts (it opens the databases there).
        """
        if self.config.store != "rocksdb" or self._slot_lock is not None:
            return
        slot, self._slot_lock = claim_slot(self.config.state_dir / "tables" / self.config.app_id)
        match_epoch(slot, marker)
        drop_unclean(slot)  # after a crash a database may be ahead of its changelog
        self.app.conf.tabledir = slot
        log.info("worker tables in %s", slot)

    def faust_worker(self, loglevel: str = "warning", restart_on_reset: bool = True) -> faust.Worker:
        """The faust worker running every stage; on a cluster reset it restarts this process."""
        if self.config.store == "rocksdb":
            self.table_dir(epoch_marker(self.bootstrap, self.config))
        watch = None
        if restart_on_reset:
            watch = ClusterWatch(
                self.bootstrap,
                self.config.connection,
                [t.name for t in self.topics.all()],
                on_reset=lambda missing: restart_process("worker: the Kafka cluster lost its topics"),
                metrics=self.metrics,
                marker_seen=True,  # the worker verb created the topics (and the marker) first
            )
        return faust.Worker(
            self.app,
            JoinService(self.join, watch),
            loglevel=loglevel,
            quiet=True,
            redirect_stdouts=False,
        )


def epoch_marker(bootstrap: str, config: WorkerConfig, timeout: float = 30.0) -> bytes | None:
    """The value of the cluster's epoch marker (None: unreadable); read before faust's loop exists."""

    async def read() -> bytes | None:
        records = await read_all(bootstrap, config.connection, config.connection.topics.epoch.name, partitions=[0])
        return bytes(records[0].value) if records else None

    pool = concurrent.futures.ThreadPoolExecutor(1)  # its own event loop, closed after
    try:
        return pool.submit(asyncio.run, read()).result(timeout=timeout)
    except Exception as exc:
        log.warning("epoch marker unreadable (%r): keeping the worker's local tables as they are", exc)
        return None
    finally:
        pool.shutdown(wait=False)
