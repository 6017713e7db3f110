"""The PostgreSQL the store tests use: ``TRIO_TEST_POSTGRES_URL`` (``.ci/run`` starts one)."""

from __future__ import annotations

import os

import pytest

from trio_server.store import Store, metadata

PG_URL = os.environ.get("TRIO_TEST_POSTGRES_URL")


def empty_postgres_url() -> str:
    """The test database's URL, its TRIO tables dropped; skips without one (fails in CI)."""
    if not PG_URL:
        if os.environ.get("CI"):
            pytest.fail("TRIO_TEST_POSTGRES_URL must be set in CI (.ci/run starts PostgreSQL)")
        pytest.skip("no PostgreSQL: set TRIO_TEST_POSTGRES_URL")
    metadata.drop_all(Store(PG_URL).engine)
    return PG_URL
