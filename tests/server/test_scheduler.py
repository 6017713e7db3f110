"""The scheduler is a pure function: test it without threads or models."""

from trio_server.scheduler import WorkItem, next_batch


def item(rid, op, run=None, seq=None, arrival=0):
    return WorkItem(request_id=rid, op=op, request=None, user_id="u", run_id=run, seq=seq, arrival=arrival)


def test_only_the_head_of_each_run_is_ready():
    pending = [item("b", "optim_step", "r1", 1, arrival=0), item("a", "forward_backward", "r1", 0, arrival=1)]
    assert [i.request_id for i in next_batch(pending, {"r1": 0})] == ["a"]
    assert next_batch(pending[:1], {"r1": 0}) == []  # seq 1 waits for seq 0


def test_forward_backward_of_several_runs_batch_together():
    pending = [
        item("a0", "forward_backward", "a", 0, arrival=0),
        item("a1", "optim_step", "a", 1, arrival=1),
        item("b0", "forward_backward", "b", 0, arrival=2),
        item("c3", "forward_backward", "c", 3, arrival=3),  # not c's turn yet
        item("s", "sample", arrival=4),
    ]
    batch = next_batch(pending, {"a": 0, "b": 0, "c": 2})
    assert [i.request_id for i in batch] == ["a0", "b0"]


def test_sampling_requests_batch_and_others_run_alone():
    pending = [item("s1", "sample", arrival=0), item("c", "create_model", arrival=1), item("s2", "sample", arrival=2)]
    assert [i.request_id for i in next_batch(pending, {})] == ["s1", "s2"]
    assert [i.request_id for i in next_batch(pending[1:2], {})] == ["c"]


def test_batch_size_is_capped():
    pending = [item(f"s{k}", "sample", arrival=k) for k in range(100)]
    assert len(next_batch(pending[:10], {}, max_batch=4)) == 4
    assert len(next_batch(pending, {})) == 64  # the worker's cap: the first 64 arrivals


def test_a_missing_sequence_number_stops_blocking_after_the_gap():
    from trio_server.scheduler import stalled_runs

    pending = [item("b", "forward", "r", 3), item("c", "forward", "r", 4), item("d", "forward", "s", 0)]
    waited = {"b": 100.0, "c": 100.0, "d": 100.0}
    assert stalled_runs(pending, {"r": 2, "s": 0}, waited, now=105.0, gap_seconds=30) == {}
    assert stalled_runs(pending, {"r": 2, "s": 0}, waited, now=131.0, gap_seconds=30) == {"r": 3}


def test_stalled_runs_reports_only_heads_that_waited_longer_than_the_gap():
    from trio_server.scheduler import stalled_runs

    pending = [
        item("s", "sample"),  # no run: never stalls, and later items are still looked at
        item("g", "get_info", "r", None),  # on a run but unsequenced: ignored
        item("r1", "forward", "r", 1),  # r never saw its seq 0 (no next_seq yet: 0)
        item("q5", "forward", "q", 5),  # q's head is ready, however long it waited
        item("n7", "forward", "n", 7),  # just queued: not in ``waited`` yet
        item("e3", "forward", "e", 3),  # waited exactly the gap: not longer
    ]
    waited = {"s": 0.0, "g": 0.0, "r1": 0.0, "q5": 0.0, "e3": 70.0}
    assert stalled_runs(pending, {"q": 5, "e": 1}, waited, now=100.0, gap_seconds=30) == {"r": 1}
    assert stalled_runs(pending, {"q": 5, "r": 1}, waited, now=100.0, gap_seconds=30) == {}
