"""The service's ``trio`` commands: ``trio serve``, ``trio keys create|list|revoke|rotate|budget``,
``trio tokenizers install``.

They live in the service package, not the SDK: they start or administer the server, and
the SDK never imports the server (only ``pytrio.transport.local`` does, to run it
in-process). The ``trio`` entry point (``trio_cli``) puts them on one parser with the
SDK's client commands (``pytrio.cli``); ``python -m trio_server.cli`` runs these alone.
Flags exist only here; everything they set is a keyword argument of ``ServiceCore``.
Heavy imports (uvicorn, the app, torch via the core) wait until a command runs, so
``trio --help`` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_ENGINES = ("local", "ray")
_DTYPES = ("float32", "bfloat16")
_LIMIT_FLAGS = ("seq_gap_seconds", "max_runs_per_user", "max_checkpoint_bytes_per_user", "max_pending_per_user",
                "max_pending_total", "max_batch_tokens", "max_pass_tokens", "max_resident_runs", "slice_alone")


def _data_dir(value: str | None) -> Path:
    # expanded here too: a shell leaves --data-dir=~/x as it is
    return Path(value or os.environ.get("TRIO_HOME") or Path.home() / ".cache" / "trio").expanduser()


def device(value: str) -> str:
    """argparse type for ``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if not _DEVICE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"invalid device {value!r}: expected auto, cpu, cuda or cuda:N (N = 0, 1, ...)")
    return value


def one_of(what: str, values: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type for a flag taking one of ``values``; unlike ``choices=`` it also
    checks a default taken from the environment ($TRIO_ENGINE, $TRIO_DTYPE)."""
    def checked(value: str) -> str:
        if value not in values:
            raise argparse.ArgumentTypeError(f"invalid {what} {value!r}: expected one of {', '.join(values)}")
        return value
    return checked


def positive(value: str) -> int:
    """argparse type for a count that must be at least 1."""
    return _at_least(value, 1)


def count(value: str) -> int:
    """argparse type for a count that may be 0."""
    return _at_least(value, 0)


def port(value: str) -> int:
    """argparse type for a TCP port, 0 (any free one) to 65535."""
    number = count(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"invalid port {value!r}: expected 0 (any free port) to 65535")
    return number


def _at_least(value: str, low: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if number < low:
        raise argparse.ArgumentTypeError(f"invalid count {value!r}: expected a whole number >= {low}")
    return number


def placement(value: str) -> tuple[str, str]:
    """argparse type for ``--ray-place MODEL=RESOURCE``."""
    model, sep, resource = value.rpartition("=")
    if not sep or not model or not resource:
        raise argparse.ArgumentTypeError(f"invalid placement {value!r}: expected MODEL=RESOURCE")
    return model, resource


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound here so that port 0 works and is reported."""
    sock = socket.create_server((host, port))
    # asyncio sets TCP_NODELAY only on sockets made with proto=IPPROTO_TCP, which
    # create_server's are not; accepted sockets inherit it from here. Without it each
    # small request waits ~40 ms (Nagle + delayed ACK).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


SERVER_KEEPS_FREED = "512M"  # $TRIO_KEEP_FREED_MEMORY's default under trio serve (see serve)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept fixed


def fix_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at its starting 128 KiB; True if it was set.

    glibc raises the threshold to the size of each large block freed (up to 32 MiB), so
    after the first freed logits tensor, blocks of a few MiB come from the heap, where
    freed space mostly stays in the process. Under 50 soak clients (benchmarks/soak.py)
    the server's RSS grew ~30% in 10 minutes that way, with no Python object leaking; with
    the threshold fixed it stayed flat. Setting it also stops the trim threshold's dynamic
    raise. An explicit ``MALLOC_MMAP_THRESHOLD_`` in the environment wins; not glibc:
    nothing to do.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # e.g. musl
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def _say_where_models_go(log: logging.Logger) -> None:
    """Name the folder models are converted into ($TRIO_HOME/models, whatever --data-dir
    says), and warn now if it cannot be written: a model not converted there yet would
    fail every user's first request (one that is, a read-only image's, still loads)."""
    from trio_engine.catalog import trio_home

    models = trio_home() / "models"
    existing = next((p for p in (models, *models.parents) if p.exists()), models)
    if not os.access(existing, os.W_OK):
        log.warning("models are converted into %s, which cannot be written: only models converted there "
                    "already will load (set $TRIO_HOME to a writable folder)", models)
    else:
        log.info("models are converted into %s ($TRIO_HOME/models)", models)


def _check_tls(certfile: str, keyfile: str) -> None:
    """Load the certificate and key now: uvicorn would fail on them only after the service
    had started and said it listens, with a traceback that names neither file."""
    import ssl

    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not os.access(path, os.R_OK) or not os.path.isfile(path):
            sys.exit(f"trio serve: {flag} {path}: no such readable file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as exc:
        sys.exit(f"trio serve: --ssl-certfile {certfile} and --ssl-keyfile {keyfile} do not load as a PEM "
                 f"certificate chain and its private key ({getattr(exc, 'reason', None) or exc})")


def limits_from(args: argparse.Namespace) -> Any:
    """The service's ``Limits``: the defaults, overridden by the flags given."""
    from .core import Limits

    limits = Limits(**{name: getattr(args, name) for name in _LIMIT_FLAGS if getattr(args, name) is not None})
    if limits.max_pass_tokens == 0:  # 0: never split a request
        limits = dataclasses.replace(limits, max_pass_tokens=None)
    return limits


def _needs_server_install(command: str) -> None:
    """A one-line error on a client-only install (pip install trio-platform, without [server])."""
    try:
        import trio_engine  # noqa: F401 (torch, transformers: what a client-only install lacks)
    except ImportError as exc:
        sys.exit(f"trio {command} needs the service's dependencies, not installed here ({exc}): "
                 "pip install 'trio-platform[server]'")


def serve(args: argparse.Namespace) -> None:
    _needs_server_install("serve")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):  # before the slow imports
        sys.exit("trio serve: --ssl-certfile and --ssl-keyfile go together (got only one)")
    if args.ssl_certfile:
        _check_tls(args.ssl_certfile, args.ssl_keyfile)
    ray_flags = [flag for flag, given in (("--ray-address", args.ray_address), ("--ray-place", args.ray_place),
                                          ("--ray-gpus-per-model", args.ray_gpus_per_model != 1.0)) if given]
    if ray_flags and args.engine != "ray":
        sys.exit(f"trio serve: {', '.join(ray_flags)} need --engine ray (the engine is {args.engine})")
    from trio_engine import Catalog
    from trio_engine.device import KEEP_FREED_ENV, kept_freed_bytes

    # A long-running shared server keeps its memory flat: keeping all freed memory
    # (trio_engine.device.keep_freed_memory, the default of one user's training process), the
    # soak server's RSS grew 17.6% in 10 minutes and was still climbing; keeping none, each
    # 8 x 128 step of the bundled model page-faulted its activations in again (1.33x its time).
    # Up to 512 MiB kept, looked at every 30 s (device.TRIM_CHECK_SECONDS): +8.7%, and the step
    # as fast as keeping all (benchmarks/soak.py, overhead.py). The operator's own setting wins.
    os.environ.setdefault(KEEP_FREED_ENV, SERVER_KEEPS_FREED)
    try:
        kept_freed_bytes(os.environ[KEEP_FREED_ENV])
    except ValueError as exc:
        sys.exit(f"trio serve: {exc}")
    fix_mmap_threshold()  # before the model and the first requests allocate
    import sqlalchemy as sa
    import uvicorn

    from pytrio.types import MAX_POLL_SECONDS

    from .app import create_app
    from .core import ServiceCore
    from .errors import DataDirInUse

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    log = logging.getLogger("trio.server")
    # Bind here, so that --port 0 works (the log tells which port the OS chose), and first,
    # so that a port in use fails before the service starts.
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        sys.exit(f"trio serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    try:
        core = ServiceCore(
            _data_dir(args.data_dir), db_url=args.db, dtype=args.dtype, limits=limits_from(args),
            engine=args.engine, ray_address=args.ray_address, device=args.device,
            ray_placement=dict(args.ray_place or []), ray_gpus_per_model=args.ray_gpus_per_model, catalog=Catalog(downloads=args.allow_downloads),
        )
    except (DataDirInUse, ValueError) as exc:  # another server on the data dir; no such device
        sys.exit(f"trio serve: {exc}")
    except OSError as exc:  # a read-only, full, foreign or not-a-folder data dir: a line, not a traceback
        if exc.errno not in (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR):
            raise
        sys.exit(f"trio serve: cannot use {exc.filename or args.data_dir}: {exc.strerror}; give a writable --data-dir")
    except (sa.exc.SQLAlchemyError, ModuleNotFoundError) as exc:  # the database: down, no driver, a bad URL
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "ray":
            sys.exit("trio serve: --engine ray needs Ray, not installed here: pip install 'trio-platform[ray]'")
        where = _without_password(args.db) if args.db else "the data dir's database"
        sys.exit(f"trio serve: cannot open {where}: {database_error(exc)}")
    log.info("data dir %s, database %s, engine %s", core.data_dir,
             core.store.engine.url.render_as_string(hide_password=True), args.engine)
    _say_where_models_go(log)
    host, port = sock.getsockname()[:2]
    if args.no_auth:
        log.warning("=" * 72)
        log.warning("AUTHENTICATION IS OFF (--no-auth): anyone who reaches %s:%d acts as one", host, port)
        log.warning("shared user. Use this for localhost development only.")
        log.warning("=" * 72)
    scheme = "https" if args.ssl_certfile else "http"
    log.info("TRIO listening on %s://%s:%d (pid %d)", scheme, host, port, os.getpid())
    log.info("tinker SDK clients: TINKER_BASE_URL=%s://%s:%d/tinker TINKER_API_KEY=tml-<key>", scheme, host, port)
    config = uvicorn.Config(create_app(core, auth=not args.no_auth), log_level="warning",
                            ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # Here, not at exit: after a SIGTERM uvicorn raises the signal again once it has
            # shut down, and the process dies of it without running atexit hooks.
            log.info("stopping: open connections end first (a long poll within %.0f s)", MAX_POLL_SECONDS)
            await super().shutdown(sockets)
            log.info("stopping: the running batch finishes, queued requests fail with the restart error")
            await asyncio.to_thread(core.close)

    Server(config).run(sockets=[sock])


def _store(args: argparse.Namespace, create: bool = False) -> Any:
    """The database of ``--db``, or of the data dir; ``create``: a new data dir's, made
    (``keys create`` before the first ``trio serve``), else one that must exist (a typo
    in --data-dir is an error, not an empty list)."""
    from .store import Store

    url = args.db
    if url is None:
        folder = _data_dir(args.data_dir)
        if not create and not (folder / "trio.db").is_file():
            sys.exit(f"trio keys: no TRIO database in {folder} (give the --data-dir or --db of the server)")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            sys.exit(f"trio keys: cannot use {folder} as the data dir: {exc.strerror}")
        url = f"sqlite:///{folder / 'trio.db'}"
    try:
        return Store(url)
    except Exception as exc:  # no such server, driver or file; a malformed URL: a line, never the password
        sys.exit(f"trio: cannot open the database {_without_password(url)}: {database_error(exc)}")


def _without_password(url: str) -> str:
    import sqlalchemy as sa

    try:
        return repr(sa.engine.make_url(url).render_as_string(hide_password=True))
    except Exception:
        return repr(re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url))


def database_error(exc: BaseException) -> str:
    """What went wrong opening a database, in a line (a driver's own error if it gave one)."""
    import sqlalchemy as sa

    if isinstance(exc, sa.exc.NoSuchModuleError | ModuleNotFoundError):
        return f"{exc} (is its driver installed?)"
    cause = getattr(exc, "orig", None) or exc
    return str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__


def keys_list(args: argparse.Namespace) -> None:
    """One line per key: id (a hash prefix, not secret), name, created, token budget and
    tokens used (trained + prefilled + sampled; see ``trio usage``), revoked."""
    store = _store(args)
    print(f"{'ID':<14}{'NAME':<24}{'CREATED':<31}{'BUDGET':>14}{'USED':>14}  REVOKED")
    for k in store.list_api_keys():
        budget = "-" if k["budget_tokens"] is None else str(k["budget_tokens"])
        print(f"{k['id']:<14}{k['name']:<24}{k['created_at']:<31}{budget:>14}{store.usage_total(k['user_id']):>14}"
              f"  {k['revoked_at'] or '-'}")


def keys_revoke(args: argparse.Namespace) -> None:
    """Revoke a key by id or name; a running server refuses it from its next request."""
    try:
        key = _store(args).revoke_api_key(args.key)
    except KeyError as exc:
        sys.exit(f"trio keys revoke: {exc.args[0]}")
    print(f"revoked key {key['id']} ({key['name']!r})")


def keys_rotate(args: argparse.Namespace) -> None:
    """A new key for the user of a leaked or old one, which is revoked at once: the user's
    runs, checkpoints, usage and budget carry over (a revoke and a create would start a
    new user with none of them)."""
    try:
        key, old = _store(args).rotate_api_key(args.key)
    except KeyError as exc:
        sys.exit(f"trio keys rotate: {exc.args[0]}")
    print(key)
    print(f"# key {old['id']} ({old['name']!r}) revoked; the new key above is shown only this once", file=sys.stderr)


def keys_budget(args: argparse.Namespace) -> None:
    """Set (or with ``none`` lift) a key's token budget; a running server applies it from
    the key's next submit."""
    try:
        key = _store(args).set_budget(args.key, args.tokens)
    except KeyError as exc:
        sys.exit(f"trio keys budget: {exc.args[0]}")
    limit = "no limit" if args.tokens is None else f"{args.tokens} tokens"
    print(f"key {key['id']} ({key['name']!r}): budget {limit}")


MAX_BUDGET = 2**63 - 1  # the database's BIGINT


def budget(value: str) -> int | None:
    """A token budget: a whole number >= 0 (at most MAX_BUDGET), or ``none`` for no limit."""
    if value.lower() == "none":
        return None
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"a budget is a whole number of tokens from 0 to {MAX_BUDGET}, or 'none'; "
                                         f"got {value!r}")
    return int(value)


def seconds(value: str) -> float:
    """argparse type for a duration: a finite number of seconds >= 0."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid duration {value!r}: expected a number of seconds >= 0")
    return number


def keys_create(args: argparse.Namespace) -> None:
    if not args.name.strip():
        sys.exit("trio keys create: --name must not be empty (it is how keys list, revoke and rotate find a key)")
    key = _store(args, create=True).create_api_key(args.name, args.budget_tokens)
    print(key)
    print(f"# key {args.name!r} created; it is shown only this once. Use: export PYTRIO_API_KEY={key}", file=sys.stderr)
    print(f"# for the tinker SDK: export TINKER_API_KEY=tml-{key}", file=sys.stderr)


def tokenizers_install(args: argparse.Namespace) -> None:
    """Write each catalog model's tokenizer into a Hugging Face hub cache, so that
    ``AutoTokenizer.from_pretrained(name)`` works offline (HF_HUB_OFFLINE=1) on a client."""
    _needs_server_install("tokenizers install")
    from trio_engine import Catalog, ModelNotAvailableError

    cache = Path(args.cache_dir) if args.cache_dir else _hf_hub_cache()
    catalog = Catalog()
    names = args.models or catalog.available()
    for name in names:
        try:
            folder = install_tokenizer(catalog, name, cache)
        except ModelNotAvailableError as exc:
            sys.exit(f"trio tokenizers install: {exc}")
        except OSError as exc:  # the cache: read-only, full, a file
            sys.exit(f"trio tokenizers install: cannot write {exc.filename or cache}: {exc.strerror or exc}; "
                     "give a writable --cache-dir")
        print(f"{name}: {folder}")


def _hf_hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def install_tokenizer(catalog: object, name: str, cache: Path) -> Path:
    """``<cache>/models--Org--Name/snapshots/<rev>/`` + ``refs/main``; returns the snapshot."""
    import hashlib
    import json
    import shutil
    import tempfile

    from trio_engine.catalog import load_tokenizer, save_portable_tokenizer

    source = catalog.resolve(name)  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as tmp:
        save_portable_tokenizer(load_tokenizer(source), Path(tmp))
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    files.setdefault("config.json", json.dumps({"model_type": source.config.get("arch", "llama")}).encode())
    digest = hashlib.sha1()
    for fname in sorted(files):
        digest.update(fname.encode() + b"\0" + files[fname])
    revision = digest.hexdigest()
    repo = cache / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    tmp_dir = snapshot.with_name(revision + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    for fname, data in files.items():
        (tmp_dir / fname).write_bytes(data)
    shutil.rmtree(snapshot, ignore_errors=True)
    tmp_dir.rename(snapshot)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trio", description="TRIO post-training service")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``serve``, ``keys`` and ``tokenizers`` to the ``trio`` parser's subcommands ``sub``."""
    p = sub.add_parser("serve", help="run the HTTP service")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--data-dir", help="checkpoints and database (default $TRIO_HOME or ~/.cache/trio)")
    p.add_argument("--db", help="SQLAlchemy URL, e.g. postgresql://user@host/db (default SQLite in the data dir)")
    p.add_argument("--dtype", type=one_of("dtype", _DTYPES), default=os.environ.get("TRIO_DTYPE") or None,
                   help="the base models' dtype: float32 or bfloat16 (default $TRIO_DTYPE, else float32 on a "
                        "CPU and bfloat16 on a GPU that computes it)")
    p.add_argument("--engine", type=one_of("engine", _ENGINES), choices=_ENGINES,
                   default=os.environ.get("TRIO_ENGINE") or "local",
                   help="where model hosts run: threads in this process, or Ray actors "
                        "(default $TRIO_ENGINE or local)")
    p.add_argument("--ray-address", metavar="ADDR", default=None,
                   help="with --engine ray: join an existing Ray cluster at ADDR; "
                        "without it a local Ray instance is started")
    p.add_argument("--ray-place", metavar="MODEL=RESOURCE", type=placement, action="append",
                   help="with --engine ray: run MODEL's host on nodes offering the custom Ray resource "
                        "RESOURCE (ray start --resources); repeatable")
    p.add_argument("--ray-gpus-per-model", metavar="SHARE", type=float, default=1.0,
                   help="with --engine ray on a cluster with GPUs: the share of a GPU each base model's "
                        "host asks for (0.25: four small models on one GPU; default 1)")
    p.add_argument("--seq-gap-seconds", type=seconds, default=None,
                   help="how long a run's later requests wait for a sequence number that never "
                        "arrived before continuing without it (default 30)")
    p.add_argument("--max-runs-per-user", type=positive, metavar="N", help="quota: training runs per API key (default none)")
    p.add_argument("--max-checkpoint-bytes-per-user", type=positive, metavar="BYTES",
                   help="quota: checkpoint bytes per API key; a save is refused once a user holds this many "
                        "(default none)")
    p.add_argument("--max-pending-per-user", type=positive, metavar="N",
                   help="queue bound: requests of one API key accepted and not yet finished; past it a submit "
                        "gets 429 with Retry-After (default 256)")
    p.add_argument("--max-pending-total", type=positive, metavar="N",
                   help="queue bound: requests of all users accepted and not yet finished (default 4096)")
    p.add_argument("--max-batch-tokens", type=positive, metavar="N",
                   help="scheduler: tokens one forward/forward_backward/sample batch may hold; a single larger "
                        "request runs alone (default 8192)")
    p.add_argument("--max-pass-tokens", type=count, metavar="N",
                   help="scheduler: a forward/forward_backward request over N tokens runs as several passes of at "
                        "most N tokens, so other users' steps go between them; 0: never split (default 64; raise it on a GPU). "
                        "A user alone on the server gets passes of up to --max-batch-tokens")
    p.add_argument("--slice-alone", action="store_true", default=None,
                   help="scheduler: passes of --max-pass-tokens for a user training alone on the server too "
                        "(shorter passes, at some training speed)")
    p.add_argument("--max-resident-runs", type=positive, metavar="N",
                   help="memory: training runs kept in memory per base model; past N the least recently used "
                        "is written to its snapshot and freed, and comes back on its next request (default 64)")
    p.add_argument("--device", type=device, default=os.environ.get("TRIO_DEVICE") or "auto",
                   help="auto|cpu|cuda|cuda:N; auto picks CUDA when available (default $TRIO_DEVICE or auto)")
    p.add_argument("--ssl-certfile", metavar="PEM", help="serve HTTPS with this certificate (chain); needs --ssl-keyfile")
    p.add_argument("--ssl-keyfile", metavar="PEM", help="the certificate's private key")
    p.add_argument("--allow-downloads", action="store_true",
                   help="fetch a hub model a user names that is not in the local Hugging Face cache (default: "
                        "serve only the models here; any user could otherwise fill the disk and memory)")
    p.add_argument("--no-auth", action="store_true", help="no API keys: localhost development only")
    p.set_defaults(func=serve)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    k = keys.add_parser("create", help="create an API key and print it once")
    k.add_argument("--name", required=True)
    k.add_argument("--budget-tokens", type=budget, metavar="N",
                   help="tokens (trained + prefilled + sampled) the key may use; then its new work is "
                        "refused (default: no limit)")
    _database_options(k)
    k.set_defaults(func=keys_create)
    k = keys.add_parser("list", help="list API keys: id, name, created, budget, used, revoked (never the key)")
    _database_options(k)
    k.set_defaults(func=keys_list)
    k = keys.add_parser("revoke", help="revoke an API key; a running server refuses it at once")
    k.add_argument("key", help="the key's id (from trio keys list) or its name")
    _database_options(k)
    k.set_defaults(func=keys_revoke)
    k = keys.add_parser("rotate", help="replace an API key: a new key for the same user (runs, checkpoints, "
                                       "usage, budget), the old one revoked at once")
    k.add_argument("key", help="the key's id (from trio keys list) or its name")
    _database_options(k)
    k.set_defaults(func=keys_rotate)
    k = keys.add_parser("budget", help="set a key's token budget (trained + prefilled + sampled); "
                                       "a running server applies it at the key's next submit")
    k.add_argument("key", help="the key's id (from trio keys list) or its name")
    k.add_argument("tokens", type=budget, help="a number of tokens, or 'none' for no limit")
    _database_options(k)
    k.set_defaults(func=keys_budget)

    tok = sub.add_parser("tokenizers", help="tokenizers for clients (the tinker SDK, tinker-cookbook)")
    tsub = tok.add_subparsers(dest="tokenizers_command", required=True)
    t = tsub.add_parser("install", help="write the catalog models' tokenizers into a Hugging Face hub cache, "
                                        "so clients load them by name with HF_HUB_OFFLINE=1")
    t.add_argument("--cache-dir", help="hub cache to write (default: $HF_HUB_CACHE, else $HF_HOME/hub, "
                                       "else ~/.cache/huggingface/hub)")
    t.add_argument("models", nargs="*", help="model names (default: every model available here)")
    t.set_defaults(func=tokenizers_install)


def _database_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help="the server's data dir (default $TRIO_HOME or ~/.cache/trio)")
    parser.add_argument("--db", help="the server's --db URL instead, e.g. postgresql://user@host/db")


def reader_gone() -> NoReturn:
    """``trio keys list | head`` once head has gone: the end, without a traceback (stdout
    goes to /dev/null first, or Python's flush at exit would raise again)."""
    with contextlib.suppress(OSError, ValueError):  # a stdout with no descriptor (captured)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(141)  # as a shell reports a death by SIGPIPE


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except BrokenPipeError:
        reader_gone()


if __name__ == "__main__":
    main()
