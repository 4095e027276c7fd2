"""The worker: the join and the stream stages in one faust app (``causalmem worker``).

``app`` wires them: ``join`` (the batched join), ``outcomes``, ``labels``, ``drift`` and
``upkeep``; ``active_learning`` is the rule they share, ``records`` and ``tables`` the
typed state. Each stage takes its own configuration (:class:`pipeline.config.WorkerConfig`).
"""
