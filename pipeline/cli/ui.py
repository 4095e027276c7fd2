"""``causalmem ui``: the web app for labelers and operators (docs/ui.md)."""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.config import UiConfig  # the flags' defaults are UiConfig's own


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=UiConfig.host, help="address to listen on (default %(default)s: loopback only)")
    p.add_argument("--port", type=int, default=UiConfig.port, help="port (default %(default)s)")
    p.add_argument(
        "--secure-cookie",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="mark the session cookie Secure (HTTPS only); default: on unless --host is loopback",
    )
    p.add_argument(
        "--labelers",
        type=Path,
        metavar="FILE.toml",
        help="labelers and their tokens or password hashes (without it: log in with your SASL user)",
    )
    p.add_argument("--overlap", type=int, default=UiConfig.overlap, help="labelers per sample (default %(default)s)")
    p.add_argument(
        "--lease", dest="lease_s", type=float, default=UiConfig.lease_s, help="seconds a shown sample stays leased"
    )
    p.add_argument(
        "--undo",
        dest="undo_s",
        type=float,
        default=UiConfig.undo_s,
        help="seconds an answer is held, and can be taken back, before it is sent (0: at once)",
    )
    p.add_argument(
        "--refresh", dest="refresh_s", type=float, default=UiConfig.refresh_s, help="seconds between topic reads"
    )
    p.add_argument(
        "--worker",
        dest="worker_urls",
        action="append",
        default=[],
        metavar="URL",
        help="a worker's /metrics URL, for the live health score (repeatable)",
    )
    p.add_argument(
        "--learner",
        dest="learner_urls",
        action="append",
        default=[],
        metavar="URL",
        help="a learner's /metrics URL, for the gate's estimates (repeatable)",
    )
    p.add_argument(
        "--shadow",
        dest="shadow_window",
        type=int,
        nargs="?",
        const=2000,
        default=UiConfig.shadow_window,
        metavar="N",
        help="show shadow mode's gain estimate over the last N joined steps (default 2000; docs/byo-retriever.md)",
    )
    p.add_argument(
        "--trusted-proxy",
        dest="trusted_proxies",
        action="append",
        default=[],
        metavar="ADDR",
        help="a reverse proxy's address or network whose X-Forwarded-For is believed (repeatable; default: none)",
    )
    login = p.add_argument_group("login throttling (per client address, then per name; docs/operations.md)")
    for who, what in (("name", "labeler name"), ("address", "client address")):
        login.add_argument(
            f"--login-{who}-burst",
            type=int,
            default=getattr(UiConfig, f"login_{who}_burst"),
            help=f"failed attempts per {what}{' from one client address' if who == 'name' else ''} "
            "before the throttle holds (default %(default)s)",
        )
        login.add_argument(
            f"--login-{who}-refill",
            dest=f"login_{who}_refill_s",
            type=float,
            default=getattr(UiConfig, f"login_{who}_refill_s"),
            help=f"then one more attempt per {what} every this many seconds (default %(default)s)",
        )
    p.add_argument(
        "--hash-password",
        action="store_true",
        help="print a password_hash for the labelers file (reads the password from the terminal) and exit",
    )


LOGIN_OPTIONS = ("login_name_burst", "login_name_refill_s", "login_address_burst", "login_address_refill_s")


def run(args: argparse.Namespace) -> int:
    from pipeline.ui.auth import hash_password

    if args.hash_password:
        password = getpass.getpass("password: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
        if not password:
            raise ValueError("an empty password")
        print(hash_password(password))
        return 0
    from pipeline.ui.app import LOOPBACK, create_app, serve

    settings = settings_from(args)
    config = settings.ui(
        host=args.host,
        port=args.port,
        secure_cookie=args.secure_cookie,
        labelers_file=args.labelers,
        overlap=args.overlap,
        lease_s=args.lease_s,
        undo_s=args.undo_s,
        shadow_window=args.shadow_window,
        refresh_s=args.refresh_s,
        worker_urls=tuple(args.worker_urls),
        learner_urls=tuple(args.learner_urls),
        trusted_proxies=tuple(args.trusted_proxies),
        **{k: getattr(args, k) for k in LOGIN_OPTIONS},
    )
    app = create_app(config, resolve_bootstrap(settings))
    if config.host not in LOOPBACK:
        print(f"causalmem ui: listening on {config.host}, not loopback: put TLS in front", file=sys.stderr)
    print(f"causalmem ui: http://{config.host}:{config.port}/", file=sys.stderr)
    serve(app, config)  # uvicorn believes X-Forwarded-For from --trusted-proxy only
    return 0
