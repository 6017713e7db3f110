"""The store on SQLite and on a real PostgreSQL server (``TRIO_TEST_POSTGRES_URL``,
which .ci/run sets after starting Debian's PostgreSQL)."""

from __future__ import annotations

import pytest

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_server.core import RESTART_MESSAGE, ServiceCore
from trio_server.store import Store

from .postgres import empty_postgres_url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'trio.db'}"
    return empty_postgres_url()


def test_keys_runs_checkpoints_and_restart(db_url, tmp_path):
    store = Store(db_url)
    key = store.create_api_key("k")
    assert store.user_for_key(key) and store.user_for_key("wrong") is None

    core = ServiceCore(tmp_path / "data", db_url=db_url, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core, user_id="u1"))
    tc = svc.create_lora_training_client(base_model="trio/tiny-llama", rank=2)
    toks = [1, 2, 3, 4, 5]
    d = trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})
    tc.forward_backward([d]).result()
    tc.optim_step().result()
    path = tc.save_state("c1").result().path
    # a request pending when the process dies
    core.store.insert(
        __import__("trio_server.store", fromlist=["requests"]).requests, request_id="req-dead", user_id="u1",
        op="forward", run_id=tc.model_id, seq=99, status="pending", created_at="2026-01-01",
    )
    core.close()

    reborn = ServiceCore(tmp_path / "data", db_url=db_url, dtype="float32")
    assert reborn.next_seq[tc.model_id] == 100
    assert [r.run_id for r in reborn.list_runs("u1")] == [tc.model_id]
    assert reborn.list_runs("someone-else") == []
    assert [c.path for c in reborn.list_checkpoints("u1")] == [path]
    ((step, metrics),) = [(s.step, s.metrics) for s in reborn.run_metrics("u1", tc.model_id)]
    assert step == 1 and {"loss", "tokens", "grad_norm", "learning_rate"} == set(metrics)
    outcome = reborn._stored_outcome("u1", "req-dead")
    assert outcome.status == "failed" and outcome.error.message == RESTART_MESSAGE
    reborn.close()


def test_step_metrics_set_again_take_the_new_value_and_client_values_hide_the_services(db_url):
    store = Store(db_url)
    third = 1 / 3  # double precision, exactly, on both databases
    store.put_metrics("run-a", 2, "service", {"loss": 1.5, "tokens": 10})
    store.put_metrics("run-a", 1, "service", {"loss": 2.5, "grad_norm": third})
    store.put_metrics("run-a", 1, "client", {"loss": 9.0, "reward": 0.25})
    store.put_metrics("run-a", 2, "service", {"loss": 1.25})  # again: the new value
    store.put_metrics("run-a", 3, "client", {})  # nothing to record
    store.put_metrics("run-b", 1, "client", {"reward": 1.0})
    assert store.run_metrics("run-a") == [
        (1, {"grad_norm": third, "loss": 9.0, "reward": 0.25}),
        (2, {"loss": 1.25, "tokens": 10.0}),
    ]
    assert store.run_metrics("run-b") == [(1, {"reward": 1.0})]
    assert store.run_metrics("run-c") == []


def test_calls_since_last_step_count_done_forward_backwards_after_the_last_step_or_load(db_url):
    from trio_server.store import requests

    store = Store(db_url)
    rows = [("a", 0, "forward_backward", "done"), ("a", 1, "optim_step", "done"), ("a", 2, "forward_backward", "done"),
            ("a", 3, "forward_backward", "failed"), ("a", 4, "forward", "done"), ("a", 5, "forward_backward", "done"),
            ("b", 0, "forward_backward", "done"), ("b", 1, "forward_backward", "done"),  # never stepped
            ("c", 0, "forward_backward", "done"), ("c", 1, "load_weights", "done"),  # loaded since
            ("d", 0, "forward_backward", "done"), ("d", 1, "optim_step", "failed")]  # the step failed: still pending
    for run, seq, op, status in rows:
        store.insert(requests, request_id=f"req-{run}{seq}", user_id="u", op=op, run_id=run, seq=seq,
                     status=status, created_at="2026-01-01")
    assert store.calls_since_last_step() == {"a": 2, "b": 2, "d": 1}


def test_usage_adds_up_per_user_and_run_and_budgets_belong_to_keys(db_url):
    """The incrementing upsert on both databases: counts add, rows stay per (user, run),
    a request of no run has its own row; budgets are set and lifted by key id or name."""
    store = Store(db_url)
    key = store.create_api_key("capped", budget_tokens=100)
    user = store.user_for_key(key)
    assert user is not None and store.budget_of(user) == 100 and store.budget_of("nobody") is None
    store.add_usage(user, "run-a", 5, 0, 0)
    store.add_usage(user, "run-a", 2, 3, 4)
    store.add_usage(user, None, 0, 6, 7)
    store.add_usage(user, "run-b", 0, 0, 0)  # nothing to count: no row
    store.add_usage("other", "run-c", 1000, 0, 0)
    assert store.usage_by_run(user) == [{"run_id": None, "trained": 0, "prefilled": 6, "sampled": 7},
                                        {"run_id": "run-a", "trained": 7, "prefilled": 3, "sampled": 4}]
    assert store.usage_by_run(user, "run-a") == store.usage_by_run(user)[1:]
    assert store.usage_total(user) == 27 and store.usage_total("nobody") == 0

    key_id = store.list_api_keys()[0]["id"]
    store.set_budget(key_id, None)
    assert store.budget_of(user) is None
    store.set_budget("capped", 5)
    assert store.budget_of(user) == 5 and store.list_api_keys()[0]["budget_tokens"] == 5
    with pytest.raises(KeyError, match="no key has this id or name"):
        store.set_budget("missing", 1)


def test_a_database_made_before_checkpoint_ttls_gains_their_columns(db_url):
    """create_all adds tables, not columns: a store opened on an older database adds the
    columns added since, and its old rows read as kept forever, without metadata."""
    import sqlalchemy as sa

    from trio_server.store import ADDED_COLUMNS, checkpoints, metadata

    engine = sa.create_engine(db_url)
    old = sa.MetaData()
    for table in ADDED_COLUMNS:  # those tables as first released
        columns = metadata.tables[table].columns
        sa.Table(table, old, *[c._copy() for c in columns if c.name not in ADDED_COLUMNS[table]])
    old.create_all(engine)
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO checkpoints (path, user_id, run_id, kind, name, created_at, size_bytes) "
                          "VALUES ('trio://r/weights/a', 'u', 'r', 'weights', 'a', '2026-01-01', 1)"))
    engine.dispose()
    store = Store(db_url)
    assert store.get(checkpoints, path="trio://r/weights/a") == {
        "path": "trio://r/weights/a", "user_id": "u", "run_id": "r", "kind": "weights", "name": "a",
        "created_at": "2026-01-01", "size_bytes": 1, "expires_at": None, "user_metadata": None}
    indexes = {i["name"] for i in sa.inspect(store.engine).get_indexes("checkpoints")}
    assert "ix_checkpoints_expires_at" in indexes  # the sweep on every save and listing uses it
    store.update(checkpoints, "path", "trio://r/weights/a", expires_at="2026-01-02")
    assert [r["path"] for r in store.expired_checkpoints("2026-01-03")] == ["trio://r/weights/a"]
    assert store.expired_checkpoints("2026-01-01T12") == []
