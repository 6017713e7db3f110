"""The distribution's metadata: what ``pip install`` sees."""

from __future__ import annotations

import re
from pathlib import Path

PYPROJECT = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()


def test_the_distribution_does_not_take_the_name_of_the_trio_async_library():
    """``trio`` on PyPI is a widely used async library: installing a distribution of that
    name would replace it. The import names and the ``trio`` command stay ours.
    (Read with a regex: tomllib is not in Python 3.10, which we support.)"""
    assert re.search(r'^name = "(.*)"$', PYPROJECT, re.M)[1] == "trio-platform"
    # the entry point sits above the three packages (trio_cli: see its docstring)
    assert re.search(r'^trio = "trio_cli:main"$', PYPROJECT, re.M)
    # the dev extra installs this distribution's own extras, by its new name
    assert re.findall(r'"(trio[^"]*\[[^"]*\])"', PYPROJECT) == ["trio-platform[server,ray]"]


def test_the_console_ships_with_the_wheel():
    """Every file of the web console is package data of trio_server (else ``trio serve``
    installed from the wheel would answer 404 at /console)."""
    from fnmatch import fnmatch

    line = re.search(r"^trio_server = \[(.*)\]$", PYPROJECT, re.M)[1]
    globs = re.findall(r'"([^"]+)"', line)
    console = Path(__file__).resolve().parent.parent / "src" / "trio_server" / "console"
    files = [p.relative_to(console.parent).as_posix() for p in console.iterdir()]
    assert len(files) == 3 and all(any(fnmatch(f, g) for g in globs) for f in files), (files, globs)
