"""``causalmem broker``: the embedded (memory-only) Tansu broker in the foreground.

SIGINT (Ctrl-C), SIGTERM and SIGHUP stop it: the verb terminates its Tansu child, waits
for it and exits 0 (:func:`pipeline.broker.run_foreground`).
"""

from __future__ import annotations

import argparse

from pipeline.broker import DEFAULT_PORT, run_foreground, stop_recorded_broker
from pipeline.cli.common import settings_from


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=None, help="loopback port (default 19092)")
    p.add_argument("--stop", action="store_true", help="stop the shared embedded broker started by another verb")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if args.stop:
        print(stop_recorded_broker(settings.state_path()))
        return 0
    return run_foreground(settings.state_path(), args.port or DEFAULT_PORT)
