"""pytrio.cli's pure parts (tables, sizes, unpacking) and its promise of no torch.

The commands themselves run against real services in tests/test_cli_user.py.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pytrio import types as t
from pytrio.cli import CommandError, human_size, table, unpack, usage_table, when


@pytest.mark.parametrize("n, shown", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                      (5 * 2**20 + 2**19, "5.5 MiB"), (3 * 2**30, "3.0 GiB"),
                                      (2**50, "1048576.0 GiB")])
def test_human_size(n, shown):
    assert human_size(n) == shown


def test_table_pads_columns_and_right_aligns_numbers():
    text = table(["RUN", "RANK", "NOTE"], [["run-1", "8", "x"], ["run-22", "128", ""]], right={1})
    assert text.splitlines() == [
        "RUN     RANK  NOTE",
        "run-1      8  x",
        "run-22   128",
    ]
    assert table(["A", "B"], []) == "A  B"


def test_usage_table_has_a_row_per_run_a_total_and_the_budget_left():
    runs = [t.RunUsage(run_id=None, prefilled=2, sampled=5),
            t.RunUsage(run_id="run-1", trained=12000, prefilled=10, sampled=3)]
    usage = t.Usage(trained=12000, prefilled=12, sampled=8, budget_tokens=20000, runs=runs)
    assert usage_table(usage).splitlines() == [
        "RUN                    TRAINED  PREFILLED  SAMPLED   TOTAL",
        "(base model sampling)        0          2        5       7",
        "run-1                   12,000         10        3  12,013",
        "TOTAL                   12,000         12        8  12,020",
        "budget: 20,000 tokens, 7,980 left",
    ]
    spent = usage.model_copy(update={"budget_tokens": 12_000})
    assert usage_table(spent).splitlines()[-1] == "budget: 12,000 tokens, 0 left (spent: new work is refused)"
    assert usage_table(t.Usage()).splitlines()[-2:] == ["TOTAL        0          0        0      0",
                                                          "budget: no limit"]


def test_when_shows_utc_seconds():
    assert when("2025-03-04T05:06:07.891+00:00") == "2025-03-04 05:06:07"
    assert when("2025-03-04T07:06:07+02:00") == "2025-03-04 05:06:07"
    assert when("yesterday") == "yesterday"


def _tar(path: Path, entries: list[tarfile.TarInfo]) -> Path:
    with tarfile.open(path, "w") as tar:
        for info in entries:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isfile() else None)
    return path


def _file(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = 1
    return info


def test_unpack_gives_the_checkpoint_folder(tmp_path):
    folder = tarfile.TarInfo("ckpt")
    folder.type = tarfile.DIRTYPE
    archive = _tar(tmp_path / "a.tar", [folder, _file("ckpt/adapter_config.json")])
    assert unpack(archive, tmp_path / "out") == tmp_path / "out" / "ckpt"
    assert (tmp_path / "out" / "ckpt" / "adapter_config.json").read_bytes() == b"x"


@pytest.mark.parametrize("bad", ["../evil", "/abs/evil", "link", "two-folders"])
def test_unpack_refuses_anything_but_one_folder_of_files(tmp_path, bad):
    entries = [_file("ckpt/a")]
    if bad == "link":
        link = tarfile.TarInfo("ckpt/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        entries.append(link)
    elif bad == "two-folders":
        entries.append(_file("other/b"))
    else:
        entries.append(_file(bad))
    with pytest.raises(CommandError, match="unexpected entry|expected one checkpoint folder"):
        unpack(_tar(tmp_path / "a.tar", entries), tmp_path / "out")
    assert not (tmp_path / "evil").exists() and not Path("/abs/evil").exists()


def test_the_client_commands_need_no_torch():
    """``trio runs/checkpoints`` work on a laptop with the SDK alone: building the whole
    ``trio`` parser and the client commands' modules imports neither torch nor the engine."""
    code = ("import sys; import trio_cli; trio_cli.build_parser(); import pytrio.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'trio_engine', 'fastapi')); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
