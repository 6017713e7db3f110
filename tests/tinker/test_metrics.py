"""A run trained through the tinker SDK has its steps recorded as a pytrio run's are: the
recording sits in the service core's handlers, behind both front doors."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
import pytrio as trio  # noqa: E402
from tests.sdk.conftest import core_server  # noqa: E402
from tinker import types as tt  # noqa: E402

TINY = "trio/tiny-llama"
ROWS = [([1, 17, 23, 99, 5, 8], [0.0, 0.0, 1.0, 1.0, 0.5, 2.0]), ([3, 40, 11, 7], [1.0, 1.0, 1.0, 1.0])]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with core_server(tmp_path_factory.mktemp("tinker-metrics")) as server:
        yield server


def test_tinker_steps_are_recorded_and_read_over_pytrio(server):
    key = server.core.store.create_api_key("tinker-metrics")
    data = [tt.Datum(model_input=tt.ModelInput.from_ints(toks[:-1]),
                     loss_fn_inputs={"target_tokens": toks[1:], "weights": w[1:]}) for toks, w in ROWS]
    with tinker.ServiceClient(base_url=server.url + "/tinker", api_key="tml-" + key) as service:
        tc = service.create_lora_training_client(base_model=TINY, rank=2, seed=3).result()
        fbs, ops = [], []
        for _ in range(2):
            fbs.append(tc.forward_backward(data, "cross_entropy").result())
            ops.append(tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result())

    weight_sum = sum(sum(w[1:]) for _, w in ROWS)
    rest = trio.ServiceClient(base_url=server.url, api_key=key).create_rest_client()
    (run,) = rest.list_training_runs()  # the same user: a tinker key is "tml-" + the TRIO key
    steps = rest.get_run_metrics(run.run_id)
    assert [s.step for s in steps] == [1, 2]
    for step, fb, op in zip(steps, fbs, ops):
        nll = sum(float(-(np.array(w[1:]) * out["logprobs"].to_numpy()).sum())
                  for (_, w), out in zip(ROWS, fb.loss_fn_outputs))
        assert step.metrics == pytest.approx({"loss": nll / weight_sum, "tokens": 5 + 3,
                                              "grad_norm": op.metrics["grad_norm"], "learning_rate": 1e-2},
                                             rel=1e-5)
