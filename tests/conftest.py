"""Shared fixtures. Engine hosts are expensive, so one per model per session.

Unit tests use tiny random-init models (fp32); a few integration tests, marked
``slow``, use the bundled SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import itertools
import logging
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's references are CPU tensors with CPU tolerances: its hosts run on the CPU even
# where CUDA is present. The CUDA tests (``needs_cuda``) name their device themselves.
os.environ.setdefault("TRIO_DEVICE", "cpu")

if os.environ.get("TRIO_MUTATION_WARMUP"):
    # `make mutate` forks one pytest session per mutant from a warmed-up process: load the
    # tiny models' tokenizers (files only, no code under test) once, before the forks.
    import functools

    from trio_engine import catalog

    catalog._tiny_tokenizer = functools.cache(catalog._tiny_tokenizer)
    for which in ("smollm2", "qwen"):
        catalog._tiny_tokenizer(which)

_ids = itertools.count()


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_co_batch_bug(request):
    """Fails a test in which a co-batched pass raised what none of its jobs alone did: the
    engine hides such a bug from users (their answers come from the jobs run one at a
    time) and only logs it (``trio_engine.host._report_co_batch_bug``). A test that makes
    one on purpose is marked ``co_batch_bug``."""
    errors = _Errors()
    logger = logging.getLogger("trio.engine")
    logger.addHandler(errors)
    try:
        yield
    finally:
        logger.removeHandler(errors)
    if errors.records and request.node.get_closest_marker("co_batch_bug") is None:
        from trio_engine.host import CO_BATCH_BUG

        bugs = [r.getMessage() for r in errors.records if getattr(r, CO_BATCH_BUG, False)]
        if bugs:
            pytest.fail(f"a co-batched pass failed where its jobs alone did not fail that way: {bugs}")


@pytest.fixture
def new_id():
    """Unique adapter ids, so tests sharing a host never collide."""
    return lambda prefix="a": f"{prefix}-{next(_ids)}"


@pytest.fixture(scope="session")
def tiny_host():
    from trio_engine import TINY_LLAMA, ModelHost

    return ModelHost(TINY_LLAMA, dtype="float32")


@pytest.fixture(scope="session")
def qwen_host():
    from trio_engine import TINY_QWEN3, ModelHost

    return ModelHost(TINY_QWEN3, dtype="float32")


@pytest.fixture(scope="session")
def bundled_host():
    from trio_engine import DEFAULT_MODEL, ModelHost

    return ModelHost(DEFAULT_MODEL, dtype="float32")


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text",
                                         "phi3", "cohere", "granite"])
def family_host(request):
    """A tiny random-init host of each model family (tests/engine/helpers.FAMILY_SOURCES)."""
    from trio_engine import ModelHost

    from .engine.helpers import FAMILY_SOURCES, TEST_CATALOG

    if request.param == "llama":
        return request.getfixturevalue("tiny_host")
    if request.param == "qwen3":
        return request.getfixturevalue("qwen_host")
    return ModelHost(FAMILY_SOURCES[request.param].name, dtype="float32", catalog=TEST_CATALOG)
