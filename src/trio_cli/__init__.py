"""The ``trio`` command: one parser over the subcommands of the three packages.

    trio serve | keys create|list|revoke|rotate|budget | tokenizers install   trio_server.cli
    trio runs list | checkpoints list|download|delete | usage          pytrio.cli: a client (no torch)
    trio export PATH OUT [--merge]                      here: pytrio fetches, trio_engine converts

This package sits above the three layers of DESIGN.md section 2: it is the one place that
imports all of them, and none of them imports it (tests/test_layering.py). The server may
use only the SDK's wire types and the SDK may import neither the server's CLI nor the
engine, so a single parser can only be assembled here; so is ``trio export``, the one
command that needs both sides (the SDK downloads the checkpoint from wherever it lives,
the engine merges it with local base weights). It holds no logic beyond that wiring.

Heavy imports (torch, the server) wait until a command runs, so ``trio --help`` is instant
and the client commands work on an install without the server's dependencies.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from pytrio import cli as client_cli
from pytrio.cli import CommandError
from pytrio.errors import TrioError
from trio_server import cli as server_cli

__all__ = ["build_parser", "main"]

_ENGINE_MISSING = (
    "trio export needs the engine's dependencies, which are not installed here ({exc}): "
    "pip install 'trio-platform[server]'. (A sampler_weights checkpoint is already a PEFT "
    "folder: `trio checkpoints download` it and unpack the .tar.)"
)


def export(args: argparse.Namespace) -> None:
    """``trio export``: fetch the checkpoint through the SDK, convert it with the engine."""
    try:
        from trio_engine import InvalidInputError, ModelNotAvailableError
        from trio_engine import export as engine
    except ImportError as exc:
        raise CommandError(_ENGINE_MISSING.format(exc=exc)) from None
    out = Path(args.out)
    try:
        engine.check_output_folder(out)  # before the download, not after it
        with tempfile.TemporaryDirectory(prefix="trio-export-") as tmp:
            folder = client_cli.fetch_checkpoint(args, Path(tmp))
            if args.merge:
                engine.export_merged(folder, out)
            else:
                engine.export_peft(folder, out)
    except (engine.ExportError, InvalidInputError) as exc:  # the latter: a PEFT folder TRIO cannot hold
        raise CommandError(f"cannot export {args.path}: {exc}") from None
    except ModelNotAvailableError as exc:
        raise CommandError(f"--merge needs the base model's weights on this machine: {exc}") from None
    print(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trio", description="TRIO post-training service")
    sub = parser.add_subparsers(dest="command", required=True)
    server_cli.add_commands(sub)
    client_cli.add_commands(sub)
    what = ("export a checkpoint as a PEFT adapter folder (adapter_config.json + "
            "adapter_model.safetensors), or with --merge as a standalone Hugging Face model")
    p = sub.add_parser("export", parents=[client_cli.connection_options()], help=what, description=what)
    p.add_argument("path", type=client_cli.checkpoint_path,
                   help="trio://<run-id>/weights/<name> or trio://<run-id>/sampler_weights/<name>")
    p.add_argument("out", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--merge", action="store_true",
                   help="merge the LoRA into the base model's weights (which must be available "
                        "locally: see `trio serve`'s model catalog) and write the whole model")
    p.set_defaults(func=export)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (CommandError, TrioError) as exc:
        print(f"trio: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C: no traceback (an interrupted download resumes when run again)
        print("trio: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:
        server_cli.reader_gone()
