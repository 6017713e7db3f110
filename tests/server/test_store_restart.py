"""PostgreSQL restarted under load: the service recovers by itself and no accepted request
is lost (runs against ``TRIO_TEST_POSTGRES_URL``, the server .ci/run starts).

The database is really restarted (``pg_ctlcluster <version> <cluster> restart`` on the
cluster that listens on the URL's port) when this process may do that (root, Debian's
tools); otherwise every backend of the database is terminated from a separate
connection, which breaks the service's connections the same way. Nothing waits on a
clock: the clients' progress before and after the restart is polled for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest
import sqlalchemy as sa

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_server.core import ServiceCore
from trio_server.store import requests as requests_table

from ..polling import wait_until
from .postgres import empty_postgres_url

MODEL = "trio/tiny-llama"
CLIENTS = 3
TOKENS = [1, 5, 9, 200, 31, 7, 7, 300]


@pytest.fixture
def pg_url():
    return empty_postgres_url()


def restart_postgres(url: str) -> str:
    """Restart the cluster serving ``url``, or else kill its database's backends; says which."""
    port = sa.make_url(url).port or 5432
    if shutil.which("pg_lsclusters") and shutil.which("pg_ctlcluster") and os.geteuid() == 0:
        for line in subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True,
                                   check=True).stdout.splitlines():
            version, cluster, cluster_port = line.split()[:3]
            if int(cluster_port) == port:
                subprocess.run(["pg_ctlcluster", version, cluster, "restart"], check=True)
                return f"restarted cluster {version}/{cluster}"
    killer = sa.create_engine(url)
    with killer.begin() as c:
        c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = current_database() AND pid <> pg_backend_pid()"))
    killer.dispose()
    return "terminated the database's backends"


def datum() -> trio.Datum:
    return trio.Datum(model_input=trio.ModelInput.from_ints(TOKENS[:-1]),
                      loss_fn_inputs={"target_tokens": TOKENS[1:]})


class TrainingLoop(threading.Thread):
    """Submits forward_backward + optim_step (learning rate 0: the weights, and so the
    loss, stay the same) back to back, over and over, recording each outcome."""

    def __init__(self, tc: trio.TrainingClient, stop: threading.Event):
        super().__init__(daemon=True)
        self.tc, self.stop = tc, stop
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.errors: list[BaseException] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                fb = self.tc.forward_backward([datum()], "cross_entropy")
                step = self.tc.optim_step(trio.AdamParams(learning_rate=0.0))
                self.losses.append(fb.result(timeout=300).metrics["loss:sum"])
                self.steps.append(int(step.result(timeout=300).metrics["step"]))
            except BaseException as exc:  # recorded: the test fails on any
                self.errors.append(exc)
                return


def test_a_postgres_restart_under_load_loses_no_accepted_request(pg_url, tmp_path):
    core = ServiceCore(tmp_path, db_url=pg_url, dtype="float32")
    try:
        svc = trio.ServiceClient(transport=LocalTransport(core))
        trainers = [svc.create_lora_training_client(base_model=MODEL, rank=2, seed=i) for i in range(CLIENTS)]
        expected = [tc.forward([datum()]).result(timeout=120).metrics["loss:sum"] for tc in trainers]
        stop = threading.Event()
        loops = [TrainingLoop(tc, stop) for tc in trainers]
        for loop in loops:
            loop.start()
        wait_until(lambda: all(len(lp.steps) >= 2 or lp.errors for lp in loops), "load before the restart", 300)
        before = [len(lp.steps) for lp in loops]
        how = restart_postgres(pg_url)
        wait_until(lambda: all(len(lp.steps) >= n + 3 or lp.errors for lp, n in zip(loops, before)),
                   f"progress after the database restart ({how})", 300)
        stop.set()
        for loop in loops:
            loop.join(300)

        assert [lp.errors for lp in loops] == [[]] * CLIENTS, how
        for loop, loss in zip(loops, expected):
            assert loop.losses == pytest.approx([loss] * len(loop.losses), rel=1e-5)
            assert loop.steps == list(range(1, len(loop.steps) + 1))  # each step once, in order
        with core.store.engine.connect() as c:  # every outcome reached the database too
            statuses = c.execute(sa.select(requests_table.c.status, sa.func.count())
                                 .group_by(requests_table.c.status)).all()
        assert dict(statuses).keys() == {"done"}, statuses
        fresh = svc.create_lora_training_client(base_model=MODEL, rank=2)  # and it keeps serving
        assert fresh.forward([datum()]).result(timeout=120).metrics["loss:sum"] > 0
    finally:
        core.close()


def test_a_second_service_on_one_database_is_refused_until_the_first_stops(pg_url, tmp_path):
    """Each service has its own data dir, so the data-dir lock does not see a second one
    on the same database; its start-up recovery would fail the first one's in-flight
    requests and delete its sampler weights."""
    from trio_server.errors import DataDirInUse

    first = ServiceCore(tmp_path / "a", db_url=pg_url, dtype="float32")
    with pytest.raises(DataDirInUse, match=rf"database is in use by another TRIO service \(trio pid {os.getpid()} on "):
        ServiceCore(tmp_path / "b", db_url=pg_url, dtype="float32")
    first.close()
    ServiceCore(tmp_path / "b", db_url=pg_url, dtype="float32").close()  # its hold went with it


def test_the_database_claim_is_taken_again_when_its_session_ends(pg_url, tmp_path, monkeypatch):
    """A PostgreSQL restart ends the claim's session, and with it the lock: the service
    takes it again, so a second service is still refused afterwards."""
    from trio_server.errors import DataDirInUse
    from trio_server.store import SERVICE_LOCK_KEY, Store

    monkeypatch.setattr(Store, "claim_check_seconds", 0.05)
    first = ServiceCore(tmp_path / "a", db_url=pg_url, dtype="float32")

    def holder_pid() -> int | None:
        with first.store.engine.connect() as c:
            return c.execute(sa.text("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = :key AND granted "
                                     "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"),
                             {"key": SERVICE_LOCK_KEY}).scalar()

    try:
        lost = holder_pid()
        assert lost is not None
        with first.store.engine.begin() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": lost})
        wait_until(lambda: holder_pid() not in (None, lost), "the claim to be taken again")
        with pytest.raises(DataDirInUse, match="database is in use by another TRIO service"):
            ServiceCore(tmp_path / "b", db_url=pg_url, dtype="float32")
    finally:
        first.close()
