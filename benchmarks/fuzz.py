"""Fuzz every operation of a TRIO server's OpenAPI schema with schemathesis.

Each operation gets ``--cases`` generated requests (valid and invalid bodies, query
strings, path parameters), sent with a valid API key and a per-call timeout. A 5xx
answer, a timeout or a connection error is a failure. Ids that only the server can
mint (run ids, sampler ids, request ids, checkpoint paths) reach the generator through
real objects the driver makes first (``seed_objects``: a run, a checkpoint, a sampler,
a finished request): in about half of the generated cases a field or path parameter of
that name is replaced by a real one, so operations that need them get past validation.

Usage:
    python benchmarks/fuzz.py --cases 200            # a fresh in-process server on tiny-llama
    python benchmarks/fuzz.py --url http://host:port --api-key KEY --cases 50

Prints the cases run, the answers by status code, the operations that answered 2xx at
least once (got past validation), and every failure.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "trio/tiny-llama"


@dataclass
class Report:
    cases: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    reached: set[str] = field(default_factory=set)  # operations with a 2xx answer
    operations: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # "<op>: <status or error> <body>"


def fuzz(url: str, api_key: str, cases: int, timeout: float = 30.0, seed: int = 0) -> Report:
    """Run ``cases`` generated requests per operation against ``url``; see the module doc."""
    import hypothesis
    import requests
    import schemathesis

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    report = Report()
    session = requests.Session()
    headers = {"Authorization": f"Bearer {api_key}", "X-API-Key": f"tml-{api_key}"}
    known = seed_objects(url, api_key)
    settings = hypothesis.settings(max_examples=cases, deadline=None, database=None,
                                   suppress_health_check=list(hypothesis.HealthCheck),
                                   phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
    for result in schema.get_all_operations():
        operation = result.ok()
        report.operations.append(operation.label)
        _fuzz_operation(operation, settings, seed, known, lambda case, label=operation.label: _send(
            case, label, url, session, headers, timeout, report))
    return report


def seed_objects(url: str, api_key: str) -> dict[str, list]:
    """Ids only the server can mint, made through the SDK: field name -> real values."""
    import pytrio as trio

    service = trio.ServiceClient(base_url=url, api_key=api_key)
    tc = service.create_lora_training_client(base_model=MODEL, rank=2)
    datum = trio.Datum(model_input=trio.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": [2, 3, 4]})
    fb = tc.forward_backward([datum], "cross_entropy")
    fb.result()
    state = tc.save_state("fuzz").result().path
    weights = tc.save_weights_for_sampler("fuzz-s").result().path
    sampler = tc.create_sampling_client(weights)
    run_id = tc.model_id
    request_id = _submit_one(url, api_key, run_id)
    ids = {
        "model_id": [run_id], "run_id": [run_id], "training_run_id": [run_id],
        "base_model": [MODEL], "model": [MODEL, weights],
        "path": [state, weights], "model_path": [weights], "sampler_path": [weights],
        "sampler_id": [getattr(sampler, "sampler_id", None)],
        "sampling_session_id": [getattr(sampler, "sampler_id", None)],
        "request_id": [request_id],
        "session_id": [_tinker_session(url, api_key)],
        "tokens": [[1, 2, 3]], "prompt": ["hello"],
        "data": [[datum.model_dump(mode="json")]], "loss_fn": ["cross_entropy"],
    }
    return {name: [v for v in values if v is not None] for name, values in ids.items()}


def _submit_one(url: str, api_key: str, run_id: str) -> str | None:
    """A finished request's id, from a raw submit (the SDK's futures do not expose theirs)."""
    import httpx

    r = httpx.post(url + "/api/v1/get_info", json={"model_id": run_id},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
    return r.json().get("request_id") if r.status_code == 200 else None


def _tinker_session(url: str, api_key: str) -> str | None:
    import httpx

    r = httpx.post(url + "/tinker/api/v1/create_session", json={}, headers={"X-API-Key": f"tml-{api_key}"}, timeout=60)
    return r.json().get("session_id") if r.status_code == 200 else None


def _with_known(case, known: dict[str, list], data) -> None:
    """Replace some generated ids with real ones (each at most a coin flip)."""
    import hypothesis.strategies as st

    containers = [c for c in (case.path_parameters, case.query, case.body) if isinstance(c, dict)]
    for container in containers:
        for name in list(container):
            if known.get(name) and data.draw(st.booleans(), label=f"real {name}"):
                container[name] = data.draw(st.sampled_from(known[name]), label=name)


def _fuzz_operation(operation, settings, seed: int, known: dict[str, list], send) -> None:
    import hypothesis
    import hypothesis.strategies as st

    @settings
    @hypothesis.seed(seed)
    @hypothesis.given(case=operation.as_strategy(), data=st.data())
    def run(case, data):
        _with_known(case, known, data)
        send(case)

    run()


def _send(case, label: str, url: str, session, headers: dict, timeout: float, report: Report) -> None:
    report.cases += 1
    try:
        response = case.call(base_url=url, session=session, headers=headers, timeout=timeout)
    except Exception as exc:  # a timeout, a dropped connection: the server misbehaved
        report.failures.append(f"{label}: {type(exc).__name__}: {exc}")
        return
    report.statuses[response.status_code] += 1
    if response.status_code < 300:
        report.reached.add(label)
    if response.status_code >= 500:
        report.failures.append(f"{label}: {response.status_code} {response.text[:300]} "
                               f"<- {case.as_curl_command()[:400]}")


def async_server_failures(core) -> list[str]:
    """Accepted requests that then failed inside the service (category server): a 5xx the
    HTTP status of the submit cannot show. Needs the core, so only for an in-process server."""
    from trio_server.store import requests as requests_table

    rows = core.store.select(requests_table, error_category="server")
    return [f"{row['op']} {row['request_id']}: {row['error_message']}" for row in rows]


def print_report(report: Report, seconds: float) -> None:
    print(f"operations: {len(report.operations)}  cases run: {report.cases}  in {seconds:.0f} s")
    print("answers by status:", dict(sorted(report.statuses.items())))
    print(f"operations reached past validation (a 2xx answer): {len(report.reached)}/{len(report.operations)}")
    for label in report.operations:
        if label not in report.reached:
            print("  never 2xx:", label)
    print(f"failures (5xx, timeouts, connection errors): {len(report.failures)}")
    for failure in report.failures:
        print("  ", failure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100, help="generated cases per operation")
    parser.add_argument("--url", help="a running server (default: start one in this process)")
    parser.add_argument("--api-key", help="a valid key for --url")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.url:
        started = time.monotonic()
        report = fuzz(args.url, args.api_key, args.cases, args.timeout, args.seed)
        print_report(report, time.monotonic() - started)
        return 1 if report.failures else 0
    with tempfile.TemporaryDirectory() as tmp, local_server(Path(tmp)) as server:
        url, key = server.url, server.key
        started = time.monotonic()
        report = fuzz(url, key, args.cases, args.timeout, args.seed)
        report.failures += async_server_failures(server.core)
        print_report(report, time.monotonic() - started)
    return 1 if report.failures else 0


class local_server:
    """A fresh fp32 core on tiny-llama behind the app (auth on), on a loopback port the OS picks."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir

    def __enter__(self) -> local_server:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.sdk.conftest import ServerThread

        from trio_server.app import create_app
        from trio_server.core import ServiceCore

        self.core = ServiceCore(self.data_dir, dtype="float32")
        self.server = ServerThread(create_app(self.core, auth=True))
        self.url, self.key = self.server.url, self.core.store.create_api_key("fuzz")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self.core.close()


if __name__ == "__main__":
    sys.exit(main())
