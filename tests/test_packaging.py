"""The distribution's metadata: what ``pip install`` sees."""

from __future__ import annotations

import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_the_distribution_does_not_take_the_name_of_the_trio_async_library():
    """``trio`` on PyPI is a widely used async library: installing a distribution of that
    name would replace it. The import names and the ``trio`` command stay ours."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["name"] == "trio-platform"
    assert project["scripts"]["trio"] == "trio_server.cli:main"
    extras = [dep for dep in project["optional-dependencies"]["dev"] if dep.startswith("trio")]
    assert extras == ["trio-platform[server,ray]"]  # the dev extra installs this distribution's own
