"""The ``trio`` command's argument checks and its listening socket."""

from __future__ import annotations

import os
import socket

import pytest

from trio_server.cli import build_parser, limits_from, listen


@pytest.fixture(autouse=True)
def _keep_freed_memory_setting(monkeypatch):
    """``serve`` sets ``$TRIO_KEEP_FREED_MEMORY`` if unset; set here, it goes back after the test."""
    monkeypatch.setenv("TRIO_KEEP_FREED_MEMORY", os.environ.get("TRIO_KEEP_FREED_MEMORY", "1"))


def test_listening_socket_reports_its_port_and_disables_nagle():
    sock = listen("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
        # accepted connections inherit this; without it small requests wait ~40 ms
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


def test_serve_flags():
    args = build_parser().parse_args(["serve", "--engine", "ray", "--device", "cuda:1",
                                      "--ray-place", "org/model=gpu_a100", "--ray-place", "m2=x"])
    assert (args.engine, args.device, args.ray_place) == ("ray", "cuda:1", [("org/model", "gpu_a100"), ("m2", "x")])


def test_max_pass_tokens_flag_and_zero_for_never_split():
    from trio_server.core import Limits

    def limits(*argv: str) -> Limits:
        return limits_from(build_parser().parse_args(["serve", *argv]))

    assert limits().max_pass_tokens == Limits().max_pass_tokens is not None
    assert limits("--max-pass-tokens", "96", "--max-batch-tokens", "512").max_pass_tokens == 96
    assert limits("--max-pass-tokens", "0").max_pass_tokens is None
    assert not limits().slice_alone and limits("--slice-alone").slice_alone
    assert limits().max_resident_runs == Limits().max_resident_runs == 64
    assert limits("--max-resident-runs", "5").max_resident_runs == 5
    assert [build_parser().parse_args(["serve", "--port", p]).port for p in ("0", "65535")] == [0, 65535]


@pytest.mark.parametrize("argv", [["--device", "gpu"], ["--device", "cuda:x"], ["--engine", "spark"],
                                  ["--ray-place", "no-resource"], ["--max-resident-runs", "0"],
                                  ["--max-pending-per-user", "0"], ["--max-pending-total", "-3"],
                                  ["--max-batch-tokens", "0"], ["--max-pass-tokens", "-1"],
                                  ["--max-runs-per-user", "x"], ["--max-checkpoint-bytes-per-user", "0"],
                                  ["--port", "-1"], ["--port", "70000"], ["--dtype", "fp8"],
                                  ["--seq-gap-seconds", "-5"], ["--seq-gap-seconds", "nan"]])
def test_bad_serve_flags_name_the_value(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    assert argv[1] in capsys.readouterr().err


def test_serve_fixes_glibcs_mmap_threshold_unless_the_environment_sets_it(monkeypatch):
    """Why: benchmarks/soak.py (the server's RSS grew ~30% in 10 minutes with glibc's
    dynamic threshold, and stayed flat with a fixed one); here only that it is applied."""
    import platform
    import sys

    from trio_server.cli import fix_mmap_threshold

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_mmap_threshold() is False  # the operator's choice stands
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert fix_mmap_threshold() is glibc


def test_a_port_in_use_a_bad_database_or_an_unknown_model_is_a_one_line_error(tmp_path):
    """What the user can fix is said in one line, not a traceback (and before the service
    starts, for the port)."""
    from trio_server import cli

    taken = listen("127.0.0.1", 0)
    try:
        argv = ["serve", "--port", str(taken.getsockname()[1]), "--data-dir", str(tmp_path)]
        with pytest.raises(SystemExit, match="cannot listen on 127.0.0.1:.*in use"):
            cli.main(argv)
    finally:
        taken.close()
    with pytest.raises(SystemExit, match="cannot open the database 'sqlite:////nonexistent/x.db'"):
        cli.main(["keys", "list", "--db", "sqlite:////nonexistent/x.db"])
    with pytest.raises(SystemExit, match="trio tokenizers install: .*no/such-model"):
        cli.main(["tokenizers", "install", "--cache-dir", str(tmp_path / "hub"), "no/such-model"])


@pytest.mark.parametrize("flags, downloads", [((), False), (("--allow-downloads",), True)])
def test_serve_fetches_no_hub_model_unless_allowed(tmp_path, monkeypatch, flags, downloads):
    """Any user naming any hub model made a shared server fetch and load it."""
    from trio_server import cli, core

    made = {}

    def refused_core(*args, **kwargs):
        made.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(core, "ServiceCore", refused_core)
    with pytest.raises(SystemExit, match="stop here"):
        cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path), *flags])
    assert made["catalog"].downloads is downloads


def test_a_bad_bound_on_kept_freed_memory_is_refused_at_start(tmp_path, monkeypatch):
    from trio_server import cli

    monkeypatch.setenv("TRIO_KEEP_FREED_MEMORY", "lots")
    with pytest.raises(SystemExit, match=r"trio serve: TRIO_KEEP_FREED_MEMORY: .*got 'lots'"):
        cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path)])


def test_a_second_server_on_a_data_dir_or_a_missing_device_is_refused_at_start(tmp_path, monkeypatch):
    """Before serving: another server's data dir, and (on a machine without CUDA) --device
    cuda, which used to start and then fail every request with a 500."""
    import torch

    from trio_server import cli
    from trio_server.core import ServiceCore

    owner = ServiceCore(tmp_path / "data", dtype="float32")
    try:
        with pytest.raises(SystemExit, match=r"trio serve: data dir .*/data is in use by another TRIO service \(pid"):
            cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path / "data")])
    finally:
        owner.close()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="trio serve: device: 'cuda' requested but CUDA is not available"):
            cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path / "other"), "--device", "cuda"])


def test_a_data_dir_that_cannot_be_written_is_a_one_line_error(tmp_path, monkeypatch):
    """A read-only file system (or another user's folder) gave a traceback from the lock
    file's open; it is one line naming the path. (Root may write anywhere, and mounting a
    read-only file system needs root: the open fails here as it does there.)"""
    import builtins
    import errno

    from trio_server import cli

    real_open = builtins.open

    def read_only(file, *args, **kwargs):
        if str(file).endswith("trio.lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only)
    with pytest.raises(SystemExit, match=r"trio serve: cannot use .*/data/trio.lock: Read-only file system; give a "
                                         "writable --data-dir"):
        cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path / "data")])


def test_a_dtype_from_the_environment_is_checked_like_the_flag(monkeypatch, capsys):
    """argparse checks ``choices`` against the command line only: $TRIO_DTYPE=fp8 started a
    server whose every first request failed."""
    monkeypatch.setenv("TRIO_DTYPE", "fp8")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert "invalid dtype 'fp8'" in capsys.readouterr().err
    monkeypatch.setenv("TRIO_DTYPE", "bfloat16")
    assert build_parser().parse_args(["serve"]).dtype == "bfloat16"


@pytest.mark.parametrize("value", ["99999999999999999999", "\u0661\u0662", "-1", "1e3"])
def test_a_budget_past_the_database_or_not_ascii_digits_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["keys", "budget", "bob", value])
    assert "a budget is a whole number of tokens from 0 to 9223372036854775807" in capsys.readouterr().err


def test_database_and_data_dir_mistakes_are_one_line_errors(tmp_path):
    """A typo in --data-dir listed an empty, new database; a missing driver, a database
    down, a data dir that is a file or TLS files that do not load gave tracebacks (the
    last after the server said it listened); a password in --db was echoed."""
    from trio_server import cli

    with pytest.raises(SystemExit, match="trio keys: no TRIO database in .*/typo"):
        cli.main(["keys", "list", "--data-dir", str(tmp_path / "typo")])
    assert not (tmp_path / "typo").exists()
    with pytest.raises(SystemExit, match=r"cannot open the database 'mysql://x/y': .*is its driver installed"):
        cli.main(["keys", "list", "--db", "mysql://x/y"])
    with pytest.raises(SystemExit, match=r"cannot open the database 'postgresql://u:\*\*\*@127.0.0.1:1/x'"):
        cli.main(["keys", "revoke", "k", "--db", "postgresql://u:s3cret@127.0.0.1:1/x"])
    with pytest.raises(SystemExit, match=r"trio serve: cannot open 'postgresql://u:\*\*\*@127.0.0.1:1/x': "):
        cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path / "d"), "--db", "postgresql://u:s3cret@127.0.0.1:1/x"])
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match=r"trio serve: cannot use .*afile.*give a writable --data-dir"):
        cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path / "afile")])
    (tmp_path / "cert.pem").write_text("not a certificate")
    with pytest.raises(SystemExit, match=r"trio serve: --ssl-keyfile .*missing.key: no such readable file"):
        cli.main(["serve", "--port", "0", "--ssl-certfile", str(tmp_path / "cert.pem"),
                  "--ssl-keyfile", str(tmp_path / "missing.key")])
    with pytest.raises(SystemExit, match=r"trio serve: --ssl-certfile .*cert.pem and --ssl-keyfile .*cert.pem do "
                                         r"not load as a PEM certificate chain and its private key \(.*PEM lib"):
        cli.main(["serve", "--port", "0", "--ssl-certfile", str(tmp_path / "cert.pem"),
                  "--ssl-keyfile", str(tmp_path / "cert.pem")])
    assert cli.main(["keys", "create", "--name", "first", "--data-dir", str(tmp_path / "new")]) is None  # made


def test_ray_flags_without_the_ray_engine_and_an_empty_key_name_are_refused(tmp_path):
    """--ray-* flags were ignored silently on the local engine; an empty name made a key
    that list, revoke and rotate cannot name."""
    from trio_server import cli

    with pytest.raises(SystemExit, match=r"trio serve: --ray-address, --ray-gpus-per-model need --engine ray"):
        cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path), "--ray-address", "h:1",
                  "--ray-gpus-per-model", "0.5"])
    with pytest.raises(SystemExit, match="--name must not be empty"):
        cli.main(["keys", "create", "--name", " ", "--data-dir", str(tmp_path)])


def test_a_data_dir_given_as_tilde_is_the_home_folder(monkeypatch, tmp_path):
    from trio_server import cli

    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli._data_dir("~/trio-data") == tmp_path / "trio-data"


def test_a_broken_pipe_ends_the_command_quietly(tmp_path):
    """`trio keys list | head -1` gave a BrokenPipeError traceback once head had gone."""
    import subprocess
    import sys

    from trio_server.store import Store

    store = Store(f"sqlite:///{tmp_path / 'trio.db'}")
    for k in range(3000):  # far past a pipe's buffer: the writes go on after head has gone
        store.create_api_key(f"key-{k}")
    for command in ("trio_cli", "trio_server.cli"):
        done = subprocess.run(f"{sys.executable} -m {command} keys list --data-dir {tmp_path} | head -1",
                              shell=True, capture_output=True, text=True, timeout=120)
        assert done.stdout.startswith("ID") and done.stderr == "", (command, done.stderr[-500:])


def test_a_cache_dir_that_cannot_be_written_is_a_one_line_error(tmp_path):
    from trio_server import cli

    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match=r"trio tokenizers install: cannot write .*afile.*give a writable --cache-dir"):
        cli.main(["tokenizers", "install", "--cache-dir", str(tmp_path / "afile"), "trio/tiny-llama"])
