"""The ``trio`` commands that only talk to a service: a user's runs and checkpoints.

    trio runs list                              run id, base model, rank, step, created
    trio checkpoints list [RUN]                 path, kind, size, created
    trio checkpoints download PATH [DEST]       the checkpoint as a .tar; resumes if interrupted
    trio checkpoints delete PATH
    trio usage                                  tokens trained, prefilled, sampled: per run, total, budget

They go through ``ServiceClient`` like any user program: ``--base-url`` (or
``$PYTRIO_BASE_URL``) with ``--api-key`` (or ``$PYTRIO_API_KEY``) reaches ``trio serve``;
with no URL, the embedded service runs in this process on its own data dir
(``$TRIO_HOME/embedded``), the one ``trio.ServiceClient()`` uses.

Where the ``trio`` commands live follows the layering of DESIGN.md section 2 (checked by
tests/test_layering.py):

- here, in the SDK: commands that need only a client. No torch, no server code (the
  embedded service comes in through the local transport, as for any SDK user);
- ``trio_server.cli``: ``serve``, ``keys``, ``tokenizers``, which start or administer a
  service where the models live;
- ``trio_engine.export``: the arithmetic of ``trio export`` (torch, safetensors);
- ``trio_cli``: the ``trio`` entry point above all three. The server may not import the
  SDK's clients and the SDK may import neither the server's CLI nor the engine, so the
  one command that needs both sides, ``trio export``, is composed there from
  ``fetch_checkpoint`` below and ``trio_engine.export``.

Errors a user can act on are raised as ``CommandError`` or the SDK's ``TrioError``; the
entry point prints them as ``trio: error: ...`` and exits with status 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tarfile
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from .errors import NotFoundError, TrioError
from .rest import RestClient
from .service import ServiceClient


class CommandError(Exception):
    """A failure the user can act on; the message names what is wrong."""


# --------------------------------------------------------------------------- connecting


def connection_options() -> argparse.ArgumentParser:
    """``--base-url`` and ``--api-key``, as a parent parser for every client command."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("service")
    group.add_argument("--base-url", metavar="URL",
                       help="a `trio serve` address (default $PYTRIO_BASE_URL; with neither, "
                            "the embedded service in this process, data in $TRIO_HOME/embedded)")
    group.add_argument("--api-key", metavar="KEY",
                       help="the key from `trio keys create` (default $PYTRIO_API_KEY)")
    return parser


def connect(args: argparse.Namespace) -> RestClient:
    """A RestClient on the service the flags (or the environment) name.

    Raises:
        CommandError: a key without a URL, or no URL where the embedded service cannot run.
    """
    base_url = args.base_url or os.environ.get("PYTRIO_BASE_URL")
    if base_url:
        return ServiceClient(base_url=base_url, api_key=args.api_key).create_rest_client()
    if args.api_key:
        raise CommandError("--api-key given but no service to send it to: "
                           "add --base-url URL or set PYTRIO_BASE_URL")
    if os.environ.get("PYTRIO_API_KEY"):  # set for a server, likely: say which service this is
        print("trio: note: PYTRIO_API_KEY is set but no --base-url or PYTRIO_BASE_URL: this is the embedded "
              "service", file=sys.stderr)
    try:
        return ServiceClient().create_rest_client()
    except ImportError as exc:
        raise CommandError(
            f"no --base-url or PYTRIO_BASE_URL, and the embedded service cannot run here: "
            f"{exc}. Point --base-url at a `trio serve`, or install the service: "
            "pip install 'trio-platform[server]'") from None


def _is_remote(args: argparse.Namespace) -> bool:
    return bool(args.base_url or os.environ.get("PYTRIO_BASE_URL"))


def _not_yours(exc: NotFoundError, args: argparse.Namespace) -> CommandError:
    """A 404 on a checkpoint or run: it does not exist, or another key owns it (the
    service does not say which, on purpose). Say so, and where to look."""
    owner = "this API key" if _is_remote(args) else "the embedded service"
    return CommandError(f"{exc.message}: nothing of that name belongs to {owner} "
                        "(see `trio runs list` and `trio checkpoints list`)")


# --------------------------------------------------------------------------- commands


def runs_list(args: argparse.Namespace) -> None:
    runs = connect(args).list_training_runs()
    rows = [[r.run_id, r.base_model, str(r.lora_rank), str(r.step), when(r.created_at)] for r in runs]
    print(table(["RUN", "BASE MODEL", "RANK", "STEP", "CREATED (UTC)"], rows, right={2, 3}))


def usage(args: argparse.Namespace) -> None:
    """The key's token usage as a table: one row per run, a total, and the budget left."""
    print(usage_table(connect(args).get_usage()))


def usage_table(u: Any) -> str:
    """``trio usage``'s text for a ``pytrio.Usage``."""
    def row(name: str, r: Any) -> list[str]:
        return [name, f"{r.trained:,}", f"{r.prefilled:,}", f"{r.sampled:,}", f"{r.total:,}"]

    rows = [row(r.run_id or "(base model sampling)", r) for r in u.runs] + [row("TOTAL", u)]
    text = table(["RUN", "TRAINED", "PREFILLED", "SAMPLED", "TOTAL"], rows, right={1, 2, 3, 4})
    if u.budget_tokens is None:
        return text + "\nbudget: no limit"
    left = max(0, u.budget_tokens - u.total)
    return text + f"\nbudget: {u.budget_tokens:,} tokens, {left:,} left" + (" (spent: new work is refused)"
                                                                             if not left else "")


def checkpoints_list(args: argparse.Namespace) -> None:
    rest = connect(args)
    try:
        found = rest.list_checkpoints(args.run) if args.run else rest.list_user_checkpoints()
    except NotFoundError as exc:
        raise _not_yours(exc, args) from None
    rows = [[c.path, c.kind, human_size(c.size_bytes), when(c.created_at)] for c in found]
    print(table(["PATH", "KIND", "SIZE", "CREATED (UTC)"], rows, right={2}))


def checkpoints_download(args: argparse.Namespace) -> None:
    dest = Path(args.dest)
    trailing_slash = args.dest.endswith(("/", os.sep))  # a folder, made if need be
    if not trailing_slash and not dest.is_dir() and not dest.parent.is_dir():
        raise CommandError(f"{args.dest}: its folder {str(dest.parent)!r} does not exist")
    try:
        target = connect(args).download_checkpoint_archive(args.path, args.dest, progress=not args.quiet)
    except NotFoundError as exc:
        raise _not_yours(exc, args) from None
    except TrioError:  # the service's (a TimeoutError is an OSError too): not the destination's
        raise
    except OSError as exc:  # the destination: read-only, full, not a folder
        raise CommandError(f"cannot write the archive to {args.dest}: {exc.strerror or exc} (what was received "
                           "is kept as a .part file: run again to resume)") from None
    print(target)


def checkpoints_delete(args: argparse.Namespace) -> None:
    try:
        connect(args).delete_checkpoint(args.path)
    except NotFoundError as exc:
        raise _not_yours(exc, args) from None
    print(f"deleted {args.path}")


def fetch_checkpoint(args: argparse.Namespace, workdir: Path) -> Path:
    """Download checkpoint ``args.path`` into ``workdir`` (with a progress bar, resuming an
    earlier partial download there) and unpack it; returns the checkpoint's folder."""
    try:
        archive = connect(args).download_checkpoint_archive(args.path, workdir, progress=True)
    except NotFoundError as exc:
        raise _not_yours(exc, args) from None
    return unpack(archive, workdir / "unpacked")


def unpack(archive: Path, dest: Path) -> Path:
    """Extract a checkpoint archive (one folder of regular files) into ``dest``; returns
    that folder. Anything else in the archive (links, absolute or ``..`` paths) is refused."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for m in members:
            if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in Path(m.name).parts:
                raise CommandError(f"{archive}: unexpected entry {m.name!r}; not a checkpoint archive")
        tops = {Path(m.name).parts[0] for m in members}
        if len(tops) != 1:
            raise CommandError(f"{archive}: expected one checkpoint folder, found {sorted(tops)}")
        # the "data" filter (Python >= 3.10.12) re-checks the above and drops modes and owners
        safe: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **safe)
    return dest / tops.pop()


def checkpoint_path(value: str) -> str:
    """argparse type: a checkpoint path, ``tinker://`` (the tinker SDK's name for the same
    checkpoint) taken as ``trio://``."""
    return "trio://" + value.removeprefix("tinker://") if value.startswith("tinker://") else value


# --------------------------------------------------------------------------- formatting


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> str:
    """Columns padded to their widest cell, two spaces apart; ``right``: right-aligned columns."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join(line(row) for row in [headers, *rows])


def human_size(n: int) -> str:
    """Bytes in binary units: 512 B, 1.5 KiB, 12.3 MiB, 2.0 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def when(timestamp: str) -> str:
    """A stored ISO timestamp as ``YYYY-MM-DD HH:MM:SS`` in UTC (unparseable: as given)."""
    try:
        moment = dt.datetime.fromisoformat(timestamp)
    except ValueError:
        return timestamp
    if moment.tzinfo is not None:
        moment = moment.astimezone(dt.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


# --------------------------------------------------------------------------- the parser


def add_commands(sub: Any) -> None:
    """Add ``runs``, ``checkpoints`` and ``usage`` to the ``trio`` parser's subcommands ``sub``."""
    conn = connection_options()

    def command(parent: Any, name: str, func: Callable[[argparse.Namespace], None], help: str) -> Any:
        p = parent.add_parser(name, parents=[conn], help=help, description=help)
        p.set_defaults(func=func)
        return p

    runs = sub.add_parser("runs", help="your training runs").add_subparsers(dest="runs_command", required=True)
    command(runs, "list", runs_list, "list your training runs: id, base model, LoRA rank, step, created")

    ckpt = sub.add_parser("checkpoints", help="your checkpoints: list, download, delete")
    csub = ckpt.add_subparsers(dest="checkpoints_command", required=True)
    p = command(csub, "list", checkpoints_list, "list checkpoints: path, kind, size, created")
    p.add_argument("run", nargs="?", help="only this run's (default: all of yours)")
    p = command(csub, "download", checkpoints_download,
                "download a checkpoint as a .tar, with a progress bar; "
                "an interrupted download resumes when run again")
    p.add_argument("path", type=checkpoint_path,
                   help="trio://<run-id>/weights/<name> or trio://<run-id>/sampler_weights/<name>")
    p.add_argument("dest", nargs="?", default=".",
                   help="a folder (an existing one, or any ending in /), or the archive's file name (default: .)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p = command(csub, "delete", checkpoints_delete, "delete a checkpoint")
    p.add_argument("path", type=checkpoint_path, help="trio://<run-id>/<kind>/<name>")

    p = sub.add_parser("usage", parents=[conn], help="your token usage: trained, prefilled, sampled; per run",
                       description="Tokens your API key's successful requests processed, per run and in "
                                   "total, and its budget. trained: forward_backward datum tokens; "
                                   "prefilled: forward datum tokens and prompt tokens of sample and "
                                   "compute_logprobs (once per request); sampled: generated tokens.")
    p.set_defaults(func=usage)
