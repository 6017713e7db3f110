"""Persistence through SQLAlchemy Core: SQLite in the data dir by default, or PostgreSQL.

Tables: api_keys (hashed), runs, requests (futures with their serialized results),
checkpoints, samplers, step_metrics (each run's per-step metrics, one row per value),
usage (tokens each user's successful requests processed, per run; see ``add_usage``).
Results are stored as the JSON text that is sent to clients.

Every method is one transaction, run by ``_transaction``. A transaction that fails because
the connection to the database was lost (a PostgreSQL restart, a killed backend, the
server not yet accepting connections) is run again, with backoff, for up to
``retry_seconds``; then the error goes to the caller. Retrying is safe because each
transaction is idempotent: selects, updates and deletes by key, upserts, and inserts of
rows with a fresh random key, which a retry first looks for (the lost connection may
have committed the first attempt). The exception is ``add_usage``, an increment: it runs
once, not retried. Pooled connections are checked before use
(``pool_pre_ping``), so connections left over from before a restart are replaced
rather than failing a request.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa

log = logging.getLogger("trio.server")
T = TypeVar("T")

metadata = sa.MetaData()

api_keys = sa.Table(
    "api_keys", metadata,
    sa.Column("key_hash", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(64), nullable=False),
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("created_at", sa.String(32), nullable=False),
    sa.Column("revoked_at", sa.String(32)),  # set by ``trio keys revoke``; a revoked key is refused
    # tokens (trained + prefilled + sampled) this key may use; NULL: no limit (core._check_budget)
    sa.Column("budget_tokens", sa.BigInteger),
)
runs = sa.Table(
    "runs", metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(64), nullable=False, index=True),
    sa.Column("base_model", sa.String(256), nullable=False),
    sa.Column("lora_config", sa.Text, nullable=False),
    sa.Column("created_at", sa.String(32), nullable=False),
    sa.Column("last_request_at", sa.String(32)),
    sa.Column("next_seq", sa.Integer, nullable=False, default=0),
    sa.Column("step", sa.Integer, nullable=False, default=0),
)
requests = sa.Table(
    "requests", metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(64), nullable=False),
    sa.Column("op", sa.String(64), nullable=False),
    sa.Column("run_id", sa.String(64)),
    sa.Column("seq", sa.Integer),
    sa.Column("status", sa.String(16), nullable=False),  # pending | done | failed
    sa.Column("result", sa.Text),
    sa.Column("error_category", sa.String(32)),
    sa.Column("error_message", sa.Text),
    sa.Column("idempotency_key", sa.String(128)),
    sa.Column("created_at", sa.String(32), nullable=False),
    sa.UniqueConstraint("user_id", "idempotency_key", name="uq_idempotency"),
)
checkpoints = sa.Table(
    "checkpoints", metadata,
    sa.Column("path", sa.String(512), primary_key=True),
    sa.Column("user_id", sa.String(64), nullable=False, index=True),
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("created_at", sa.String(32), nullable=False),
    sa.Column("size_bytes", sa.BigInteger, nullable=False, default=0),
    sa.Column("expires_at", sa.String(32), nullable=True, index=True),  # now()'s format: compares as text
    sa.Column("user_metadata", sa.Text, nullable=True),  # JSON
)
samplers = sa.Table(
    "samplers", metadata,
    sa.Column("sampler_id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(64), nullable=False),
    sa.Column("base_model", sa.String(256), nullable=False),
    sa.Column("model_path", sa.String(512)),
    sa.Column("created_at", sa.String(32), nullable=False),
)
step_metrics = sa.Table(
    "step_metrics", metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    # "service": recorded from forward_backward/optim_step results; "client": log_metrics.
    # Both kept, so a client metric named like a service one hides it without erasing it.
    sa.Column("source", sa.String(16), primary_key=True),
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("value", sa.Float, nullable=False),  # double precision on PostgreSQL and SQLite
)

usage = sa.Table(
    "usage", metadata,
    # A key is its own user (``create_api_key`` makes one user per key), so a user's rows
    # are its key's usage. run_id "" collects sampling that belongs to no run (a sampler
    # on a base model): a primary key column cannot be NULL.
    sa.Column("user_id", sa.String(64), primary_key=True),
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("trained", sa.BigInteger, nullable=False, default=0),
    sa.Column("prefilled", sa.BigInteger, nullable=False, default=0),
    sa.Column("sampled", sa.BigInteger, nullable=False, default=0),
)
NO_RUN = ""
USAGE_KINDS = ("trained", "prefilled", "sampled")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def later(moment: str, seconds: float) -> str:
    """``seconds`` after ``moment``, in ``now()``'s format (so the two compare as text)."""
    return (dt.datetime.fromisoformat(moment) + dt.timedelta(seconds=seconds)).isoformat(timespec="milliseconds")


KEY_ID_LEN = 12
SERVICE_LOCK_KEY = 0x7472696F  # "trio": the PostgreSQL advisory lock of the service using the database


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _new_key() -> str:
    return "trio-" + secrets.token_urlsafe(32)


def _key_update(key: dict, **values: Any) -> Any:
    """The UPDATE of one key's columns, the key found as ``Store.find_api_key`` returns it
    (by its hash's id prefix)."""
    return api_keys.update().where(api_keys.c.key_hash.startswith(key["id"])).values(**values)


class Store:
    claim_check_seconds = 10.0  # how often ``claim``'s connection is checked

    def __init__(self, url: str, retry_seconds: float = 60.0):
        """Args:
            url: a SQLAlchemy URL (``sqlite:///...`` or ``postgresql://...``).
            retry_seconds: how long a transaction that lost its connection is retried.
        """
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        else:
            kwargs["pool_pre_ping"] = True
        self.retry_seconds = retry_seconds
        self._claim: sa.Connection | None = None  # ``claim``'s connection, holding the lock
        self._claim_lock = threading.Lock()
        self._released = threading.Event()
        self.engine = sa.create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        metadata.create_all(self.engine)
        _add_missing_columns(self.engine)

    # -- one service per database ---------------------------------------------------

    def claim(self, holder: str) -> str | None:
        """Hold this PostgreSQL database for one service's life: None, or who holds it.

        Two services on one database (each with its own data dir, so the data-dir lock
        does not see it) would fail each other's in-flight requests and delete each
        other's sampler weights at start-up. A session advisory lock on a connection kept
        open is freed by the server however this process ends; ``holder`` names us to a
        second one (as the connection's application_name). A PostgreSQL restart ends the
        session too: a thread checks the connection every ``claim_check_seconds`` and takes
        the lock again. SQLite: nothing to do, the database lives in the data dir, whose
        lock guards it."""
        if self.engine.dialect.name != "postgresql":
            return None
        held_by = self._take_claim(holder)
        if held_by is None:
            threading.Thread(target=self._keep_claim, args=(holder,), name="trio-db-claim", daemon=True).start()
        return held_by

    def _take_claim(self, holder: str) -> str | None:
        connection = self.engine.connect()
        try:
            connection.execute(sa.text("SELECT set_config('application_name', :name, false)"), {"name": holder[:63]})
            if connection.execute(sa.text("SELECT pg_try_advisory_lock(:key)"), {"key": SERVICE_LOCK_KEY}).scalar():
                connection.commit()
                with self._claim_lock:
                    self._claim = connection
                return None
            held_by = connection.execute(sa.text(  # advisory locks are per database: this one's
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.objid = :key AND l.granted "
                "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"),
                {"key": SERVICE_LOCK_KEY}).scalar()
        except BaseException:
            connection.invalidate()
            raise
        connection.invalidate()  # not back to the pool: it carries our application_name
        return held_by or "another session"

    def _keep_claim(self, holder: str) -> None:
        while not self._released.wait(self.claim_check_seconds):
            with self._claim_lock:
                claim = self._claim
                if claim is not None:
                    try:
                        claim.execute(sa.text("SELECT 1"))
                        claim.rollback()  # no transaction left open on it
                        continue
                    except sa.exc.DBAPIError:
                        claim.invalidate()
                        self._claim = None
            if self._released.is_set():
                return
            try:
                held_by = self._take_claim(holder)
            except sa.exc.DBAPIError as exc:  # the database is still down: the next check tries again
                log.warning("the database claim was lost and cannot be taken again yet: %s", exc)
                continue
            if held_by is not None:
                log.error("the database claim was lost (PostgreSQL restarted?) and another TRIO service holds "
                          "the database now (%s): two services on one database fail each other's requests", held_by)
            else:
                log.warning("the database claim was lost (PostgreSQL restarted?) and is taken again")

    def release(self) -> None:
        """Give up ``claim``'s hold: its connection is closed, not returned to the pool,
        whose connections keep their sessions and so would keep the lock."""
        self._released.set()
        with self._claim_lock:
            claim, self._claim = self._claim, None
        if claim is not None:
            claim.invalidate()

    # -- api keys -------------------------------------------------------------------
    def create_api_key(self, name: str, budget_tokens: int | None = None) -> str:
        """A new key of a new user; ``budget_tokens``: see ``set_budget``."""
        key = _new_key()
        user_id = "user-" + secrets.token_hex(6)
        self.insert(api_keys, key_hash=hash_key(key), user_id=user_id, name=name, created_at=now(),
                    budget_tokens=budget_tokens)
        return key

    def user_for_key(self, key: str) -> str | None:
        """The user of an unrevoked key, or None.

        Looked up by the key's SHA-256, so the database never holds a secret and the
        index lookup's timing depends only on the hash of what the caller sent: learning
        which stored hashes share a prefix with it tells an attacker nothing about a key
        (finding a preimage is the hard part). The hashes are still compared with
        ``hmac.compare_digest``, so no code of ours compares secrets byte by byte. There
        is no cache: ``trio keys revoke`` runs in another process, and a revoked key must
        be refused by the very next request (one indexed SELECT per request is cheap).
        """
        digest = hash_key(key)
        query = sa.select(api_keys.c.key_hash, api_keys.c.user_id, api_keys.c.revoked_at).where(
            api_keys.c.key_hash == digest)
        row = self._transaction(lambda c: c.execute(query).first())
        if row is None or not hmac.compare_digest(row.key_hash, digest) or row.revoked_at is not None:
            return None
        return str(row.user_id)

    def list_api_keys(self) -> list[dict]:
        """Every key as {id, name, user_id, created_at, revoked_at}; ``id`` is the first
        12 hex digits of the key's hash: a handle for revoking, useless for signing in."""
        rows = self.select(api_keys, order_by="created_at")
        return [{"id": r["key_hash"][:KEY_ID_LEN], "name": r["name"], "user_id": r["user_id"],
                 "created_at": r["created_at"], "revoked_at": r["revoked_at"],
                 "budget_tokens": r["budget_tokens"]} for r in rows]

    def find_api_key(self, id_or_name: str, action: str = "revoke") -> dict:
        """The one key (as ``list_api_keys`` lists it) whose id or name is ``id_or_name``.

        Raises:
            KeyError: no key, or several, match (the message says which).
        """
        keys = self.list_api_keys()
        named = [k for k in keys if k["name"] == id_or_name]
        found = ([k for k in keys if k["id"] == id_or_name] or [k for k in named if not k["revoked_at"]]
                 or named)  # a name rotated keeps one key in use: that one
        if len(found) != 1:
            ids = ", ".join(k["id"] for k in found)
            raise KeyError(f"key {id_or_name!r}: " + (f"matches {len(found)} keys ({ids}); {action} by id"
                                                      if found else "no key has this id or name"))
        return found[0]

    def revoke_api_key(self, id_or_name: str) -> dict:
        """Revoke the one key whose id or name is ``id_or_name`` (KeyError: see find_api_key)."""
        key = self.find_api_key(id_or_name)
        self._update_key(key, revoked_at=key["revoked_at"] or now())
        return key

    def rotate_api_key(self, id_or_name: str) -> tuple[str, dict]:
        """(a new key, the key it replaces): the new one for the same user, name and budget,
        the old one revoked in the same transaction. A leaked key is replaced without
        orphaning its user's runs, checkpoints and usage (KeyError: see find_api_key)."""
        old = self.find_api_key(id_or_name, action="rotate")
        key = _new_key()

        def replace(c: Any) -> None:
            in_use = c.execute(sa.select(api_keys.c.key_hash).where(
                api_keys.c.user_id == old["user_id"], api_keys.c.revoked_at.is_(None))).scalars().all()
            others = [h for h in in_use if not h.startswith(old["id"])]
            if others:  # one key in use per user
                raise KeyError(f"key {id_or_name!r}: its user has another key in use ({others[0][:KEY_ID_LEN]}): "
                               "rotate that")
            c.execute(api_keys.insert().values(key_hash=hash_key(key), user_id=old["user_id"], name=old["name"],
                                               created_at=now(), budget_tokens=old["budget_tokens"]))
            c.execute(_key_update(old, revoked_at=old["revoked_at"] or now()))

        self._transaction(replace)
        return key, old

    def set_budget(self, id_or_name: str, budget_tokens: int | None) -> dict:
        """Set a key's token budget (None: unlimited); returns the key as it was.

        The budget bounds the key's total usage (trained + prefilled + sampled, all its
        runs, since the key was made); raising it lets a key that ran out work again.
        """
        key = self.find_api_key(id_or_name, action="set the budget")
        self._update_key(key, budget_tokens=budget_tokens)
        return key

    def _update_key(self, key: dict, **values: Any) -> None:
        """Set columns of one key, found as ``find_api_key`` returned it (by its hash's id prefix)."""
        self._transaction(lambda c: c.execute(_key_update(key, **values)))

    def revoked(self, user_id: str) -> bool:
        """Whether every key of this user is revoked (False for a user with no key: --no-auth).
        Read once, never retried: the worker asks, and must not wait out a database outage."""
        query = sa.select(api_keys.c.revoked_at).where(api_keys.c.user_id == user_id)
        revoked = self._transaction(lambda c: [row.revoked_at is not None for row in c.execute(query)], retry=False)
        return bool(revoked) and all(revoked)

    def budget_of(self, user_id: str) -> int | None:
        """The token budget of this user's key (None: no key, as with --no-auth, or no limit)."""
        query = (sa.select(api_keys.c.budget_tokens)
                 .where(api_keys.c.user_id == user_id, api_keys.c.revoked_at.is_(None))  # the key in use
                 .order_by(api_keys.c.created_at.desc()).limit(1))
        return self._transaction(lambda c: c.execute(query).scalar())

    # -- usage ------------------------------------------------------------------------
    def add_usage(self, user_id: str, run_id: str | None, trained: int, prefilled: int, sampled: int) -> None:
        """Add one request's tokens to its user's row for its run, in one statement (an
        upsert that increments), so concurrent workers and processes never lose a count.

        The one transaction not retried after a lost connection: an increment is not
        idempotent, and a retry after a commit whose acknowledgement was lost would count
        the request twice. The caller logs the failure; the request itself is unaffected."""
        if not (trained or prefilled or sampled):
            return
        query = self._upsert(usage).values(user_id=user_id, run_id=run_id or NO_RUN, trained=trained,
                                           prefilled=prefilled, sampled=sampled)
        query = query.on_conflict_do_update(
            index_elements=list(usage.primary_key.columns),
            set_={k: usage.c[k] + query.excluded[k] for k in USAGE_KINDS})
        with self.engine.begin() as c:
            c.execute(query)

    def usage_by_run(self, user_id: str, run_id: str | None = None) -> list[dict]:
        """This user's rows (``run_id``: only that run's): {run_id (None: no run), trained,
        prefilled, sampled}, by run id."""
        where = {} if run_id is None else {"run_id": run_id}
        rows = self.select(usage, user_id=user_id, order_by="run_id", **where)
        return [{"run_id": r["run_id"] or None, **{k: r[k] for k in USAGE_KINDS}} for r in rows]

    def usage_total(self, user_id: str) -> int:
        """Every token this user's requests processed: trained + prefilled + sampled."""
        total = sa.func.coalesce(sa.func.sum(usage.c.trained + usage.c.prefilled + usage.c.sampled), 0)
        query = sa.select(total).where(usage.c.user_id == user_id)
        return int(self._transaction(lambda c: c.execute(query).scalar()) or 0)

    def _upsert(self, table: sa.Table) -> Any:
        """An INSERT that can say ON CONFLICT DO UPDATE, in this database's dialect."""
        dialect = self.engine.dialect.name
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        elif dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
        else:
            raise NotImplementedError(f"upserts on {dialect}")
        return insert(table)

    # -- transactions -------------------------------------------------------------------
    def _transaction(self, work: Callable[[sa.Connection], T], retry: bool = True) -> T:
        """``work(connection)`` in one transaction, run again while the failure is a lost
        connection and ``retry_seconds`` have not passed (see the module docstring);
        ``retry=False``: once (a read that may go without, on a thread that must not wait)."""
        deadline = time.monotonic() + (self.retry_seconds if retry else 0.0)
        delay = 0.05
        while True:
            try:
                with self.engine.begin() as c:
                    return work(c)
            except sa.exc.DBAPIError as exc:
                if not self._lost_connection(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("database connection lost (%s); retrying in %.2fs",
                            str(exc.orig).strip().splitlines()[0] if exc.orig else exc, delay)
            time.sleep(delay)  # backoff while the database comes back, not a race with a test
            delay = min(delay * 2, 1.0)

    def _lost_connection(self, exc: sa.exc.DBAPIError) -> bool:
        """A failure of the connection, not of the statement: retrying may succeed.
        On PostgreSQL every OperationalError is one (refused, shutting down, starting up,
        terminated backend); on SQLite only what SQLAlchemy saw invalidate the connection."""
        if exc.connection_invalidated:
            return True
        return self.engine.dialect.name == "postgresql" and isinstance(exc, sa.exc.OperationalError)

    # -- generic helpers --------------------------------------------------------------
    def insert(self, table: sa.Table, **values: Any) -> None:
        """Insert one row. ``values`` must include the primary key, fresh (random) for a new
        row: a retried attempt finding that key already stored is taken as the first
        attempt having committed before its connection was lost."""
        attempts = 0

        def work(c: sa.Connection) -> None:
            nonlocal attempts
            attempts += 1
            if attempts > 1 and c.execute(sa.select(table).where(*_key_clause(table, values))).first():
                return
            c.execute(table.insert().values(**values))

        self._transaction(work)

    def replace(self, table: sa.Table, **values: Any) -> None:
        """Insert one row, replacing the row with its primary key if there is one."""
        def work(c: sa.Connection) -> None:
            c.execute(table.delete().where(*_key_clause(table, values)))
            c.execute(table.insert().values(**values))

        self._transaction(work)

    def update(self, table: sa.Table, key: str, key_value: str, **values: Any) -> None:
        self.update_together((table, key, key_value, values))

    def update_together(self, *updates: tuple[sa.Table, str, str, dict[str, Any]]) -> None:
        """Several ``update``s (table, key column, key value, values) in one transaction."""
        queries = [table.update().where(table.c[key] == key_value).values(**values)
                   for table, key, key_value, values in updates if values]

        def work(c: sa.Connection) -> None:
            for query in queries:
                c.execute(query)

        self._transaction(work)

    def get(self, table: sa.Table, **where: Any) -> dict | None:
        rows = self.select(table, **where)
        return rows[0] if rows else None

    def select(self, table: sa.Table, order_by: str | None = None, **where: Any) -> list[dict]:
        query = sa.select(table)
        for k, v in where.items():
            query = query.where(table.c[k] == v)
        if order_by:
            query = query.order_by(table.c[order_by])
        return self._transaction(lambda c: [dict(r._mapping) for r in c.execute(query)])

    def expired_checkpoints(self, at: str) -> list[dict]:
        """The checkpoints whose ``expires_at`` is at or before ``at`` (``now()``'s format)."""
        query = sa.select(checkpoints).where(checkpoints.c.expires_at <= at)
        return self._transaction(lambda c: [dict(r._mapping) for r in c.execute(query)])

    def delete(self, table: sa.Table, **where: Any) -> None:
        query = table.delete()
        for k, v in where.items():
            query = query.where(table.c[k] == v)
        self._transaction(lambda c: c.execute(query))

    # -- step metrics ---------------------------------------------------------------------
    def put_metrics(self, run_id: str, step: int, source: str, metrics: dict[str, float]) -> None:
        """Set these metrics of one step (a name set again takes the new value)."""
        if not metrics:
            return
        rows = [{"run_id": run_id, "step": step, "source": source, "name": k, "value": float(v)}
                for k, v in metrics.items()]
        # An upsert, in one statement: two writers of one name cannot collide on the key.
        query = self._upsert(step_metrics).values(rows)
        query = query.on_conflict_do_update(index_elements=list(step_metrics.primary_key.columns),
                                            set_={"value": query.excluded.value})
        self._transaction(lambda c: c.execute(query))

    def run_metrics(self, run_id: str) -> list[tuple[int, dict[str, float]]]:
        """The run's steps in order, each with its metrics; a client value of a name
        hides the service's value of it at that step."""
        query = (sa.select(step_metrics.c.step, step_metrics.c.source, step_metrics.c.name, step_metrics.c.value)
                 .where(step_metrics.c.run_id == run_id)
                 .order_by(step_metrics.c.step, step_metrics.c.source.desc(), step_metrics.c.name))
        steps: dict[int, dict[str, float]] = {}
        for step, _source, name, value in self._transaction(lambda c: c.execute(query).all()):
            steps.setdefault(step, {})[name] = value  # "service" before "client"
        return list(steps.items())

    def max_seq_by_run(self) -> dict[str, int]:
        query = sa.select(requests.c.run_id, sa.func.max(requests.c.seq)).where(requests.c.seq.is_not(None)).group_by(requests.c.run_id)
        return self._transaction(lambda c: {run_id: seq for run_id, seq in c.execute(query)})

    def calls_since_last_step(self) -> dict[str, int]:
        """Per run, its done ``forward_backward`` calls after its last done ``optim_step``
        or ``load_weights`` (the calls whose gradients are pending): read at start-up, when
        a crash has lost those gradients."""
        resets = (sa.select(requests.c.run_id, sa.func.max(requests.c.seq).label("seq"))
                  .where(requests.c.status == "done", requests.c.op.in_(("optim_step", "load_weights")))
                  .group_by(requests.c.run_id).subquery())
        query = (sa.select(requests.c.run_id, sa.func.count())
                 .select_from(requests.outerjoin(resets, requests.c.run_id == resets.c.run_id))
                 .where(requests.c.status == "done", requests.c.op == "forward_backward",
                        sa.or_(resets.c.seq.is_(None), requests.c.seq > resets.c.seq))
                 .group_by(requests.c.run_id))
        return self._transaction(lambda c: {run_id: n for run_id, n in c.execute(query)})

    def fail_pending(self, message: str) -> list[dict]:
        """At start-up: requests left pending by a crash become failed."""
        def work(c: sa.Connection) -> list[dict]:
            pending = [dict(r._mapping) for r in c.execute(sa.select(requests).where(requests.c.status == "pending"))]
            c.execute(requests.update().where(requests.c.status == "pending")
                      .values(status="failed", error_category="server", error_message=message))
            return pending

        return self._transaction(work)


def _key_clause(table: sa.Table, values: dict[str, Any]) -> list[sa.ColumnElement[bool]]:
    return [column == values[column.name] for column in table.primary_key.columns]


ADDED_COLUMNS = {  # table -> columns added since the first release, with their SQL types
    "api_keys": {"revoked_at": "VARCHAR(32)", "budget_tokens": "BIGINT"},
    "checkpoints": {"expires_at": "VARCHAR(32)", "user_metadata": "TEXT"},
}


def _add_missing_columns(engine: sa.Engine) -> None:
    """Columns added since a database was created (create_all adds only tables), with the
    indexes ``metadata`` declares on them."""
    for table, added in ADDED_COLUMNS.items():
        have = {c["name"] for c in sa.inspect(engine).get_columns(table)}
        for name, sql_type in added.items():
            if name not in have:
                with engine.begin() as c:
                    c.execute(sa.text(f"ALTER TABLE {table} ADD COLUMN {name} {sql_type}"))
                    for index in metadata.tables[table].indexes:
                        if [col.name for col in index.columns] == [name]:
                            index.create(c, checkfirst=True)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
