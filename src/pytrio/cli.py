"""The ``trio`` command: ``trio serve`` and ``trio keys create``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _data_dir(value: str | None) -> Path:
    return Path(value or os.environ.get("TRIO_HOME") or Path.home() / ".cache" / "trio")


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from trio_server.app import create_app
    from trio_server.core import ServiceCore

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    log = logging.getLogger("trio.server")
    if args.no_auth:
        log.warning("=" * 72)
        log.warning("AUTHENTICATION IS OFF (--no-auth): anyone who reaches %s:%d acts as one", args.host, args.port)
        log.warning("shared user. Use this for localhost development only.")
        log.warning("=" * 72)
    core = ServiceCore(_data_dir(args.data_dir), db_url=args.db, dtype=args.dtype)
    log.info("data dir %s, database %s", core.data_dir, core.store.engine.url.render_as_string(hide_password=True))
    uvicorn.run(create_app(core, auth=not args.no_auth), host=args.host, port=args.port, log_level="warning")


def keys_create(args: argparse.Namespace) -> None:
    from trio_server.store import Store

    folder = _data_dir(args.data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    store = Store(args.db or f"sqlite:///{folder / 'trio.db'}")
    key = store.create_api_key(args.name)
    print(key)
    print(f"# key {args.name!r} created; it is shown only this once. Use: export PYTRIO_API_KEY={key}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trio", description="TRIO post-training service")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the HTTP service")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", help="checkpoints and database (default $TRIO_HOME or ~/.cache/trio)")
    p.add_argument("--db", help="SQLAlchemy URL, e.g. postgresql://user@host/db (default SQLite in the data dir)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=os.environ.get("TRIO_DTYPE"))
    p.add_argument("--no-auth", action="store_true", help="no API keys: localhost development only")
    p.set_defaults(func=serve)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    k = keys.add_parser("create", help="create an API key and print it once")
    k.add_argument("--name", required=True)
    k.add_argument("--data-dir")
    k.add_argument("--db")
    k.set_defaults(func=keys_create)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
