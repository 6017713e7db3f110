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


# -- fairness between users: start-time fair queueing by tokens, a token budget per batch --


def fb(rid, user, run, n_tokens, arrival, seq=0):
    """A forward_backward of ``n_tokens`` tokens (one datum) on ``run``."""
    from types import SimpleNamespace

    datum = SimpleNamespace(model_input=SimpleNamespace(length=n_tokens))
    return WorkItem(request_id=rid, op="forward_backward", request=SimpleNamespace(data=[datum]), user_id=user,
                    run_id=run, seq=seq, arrival=arrival)


def test_a_light_user_goes_before_a_flooding_user_who_was_served_more():
    from trio_server.scheduler import Fairness, charge

    flood_done = [fb(f"f{k}", "flood", f"r{k}", 1000, arrival=k) for k in range(4)]
    fair = charge(Fairness(), flood_done)  # the flood's last batch is running
    pending = [fb("f4", "flood", "r0", 1000, arrival=4, seq=1), fb("l0", "light", "l", 10, arrival=5)]
    batch = next_batch(pending, {"r0": 1, "l": 0}, fair=fair)
    assert [i.request_id for i in batch] == ["l0"]  # older flood request waits; and is not co-batched


def test_without_history_the_oldest_ready_request_heads_the_batch():
    pending = [fb("l0", "light", "l", 10, arrival=5), fb("f0", "flood", "r0", 1000, arrival=4)]
    assert [i.request_id for i in next_batch(pending, {})] == ["f0", "l0"]  # equally due: they share the pass


def test_a_user_far_ahead_does_not_join_a_light_users_batch_but_its_own_runs_share_one():
    from trio_server.scheduler import Fairness

    fair = Fairness(vtime=100.0, finish={"flood": 100.0 + 4 * 1032})
    pending = [fb("l0", "light", "l", 10, arrival=9)] + [fb(f"f{k}", "flood", f"r{k}", 1000, arrival=k) for k in range(3)]
    assert [i.request_id for i in next_batch(pending, {}, fair=fair)] == ["l0"]
    assert [i.request_id for i in next_batch(pending[1:], {}, fair=fair)] == ["f0", "f1", "f2"]
    # a user due before the head would finish joins it
    fair = Fairness(vtime=100.0, finish={"other": 100.0 + 42})  # head l0 costs 32 + 10 = 42
    pending = [fb("l0", "light", "l", 10, arrival=0), fb("o0", "other", "o", 10, arrival=1)]
    assert [i.request_id for i in next_batch(pending, {}, fair=fair)] == ["l0", "o0"]
    fair = Fairness(vtime=100.0, finish={"other": 100.0 + 43})
    assert [i.request_id for i in next_batch(pending, {}, fair=fair)] == ["l0"]
    # measured from the head's own tag, not from virtual time, when the head is ahead of it
    fair = Fairness(vtime=100.0, finish={"light": 500.0, "other": 500.0 + 42})
    assert [i.request_id for i in next_batch(pending, {}, fair=fair)] == ["l0", "o0"]


def test_the_token_budget_bounds_a_batch_but_a_larger_request_still_runs_alone():
    pending = [fb("a", "u", "a", 600, arrival=0), fb("b", "u", "b", 500, arrival=1), fb("c", "u", "c", 400, arrival=2)]
    assert [i.request_id for i in next_batch(pending, {}, max_tokens=1000)] == ["a", "c"]  # b does not fit; c does
    assert [i.request_id for i in next_batch(pending, {}, max_tokens=1100)] == ["a", "b"]  # exactly full
    assert [i.request_id for i in next_batch(pending, {}, max_tokens=100)] == ["a"]


def test_charging_moves_virtual_time_to_the_head_and_bills_each_user_its_tokens():
    from trio_server.scheduler import BASE_COST, Fairness, charge

    fair = charge(Fairness(), [fb("a", "u", "a", 100, 0), fb("b", "u", "b", 50, 1), fb("c", "v", "c", 10, 2)])
    assert fair.vtime == 0.0 and fair.finish == {"u": 150 + 2 * BASE_COST, "v": 10 + BASE_COST}
    fair = charge(fair, [fb("d", "v", "c", 10, 3)])  # v is due at its finish tag
    assert fair.vtime == 10 + BASE_COST and fair.finish == {"u": 150 + 2 * BASE_COST, "v": 20 + 2 * BASE_COST}
    assert fair.tag("new") == fair.vtime  # a newcomer is due now: no credit for having been away
    fair = charge(fair, [fb("e", "u", "a", 1, 4)])  # v fell behind virtual time: forgotten
    assert fair.vtime == 150 + 2 * BASE_COST and set(fair.finish) == {"u"}
    assert charge(fair, []) is fair


def test_sampling_and_logprobs_cost_their_tokens():
    from types import SimpleNamespace

    from trio_server.scheduler import tokens

    prompt = SimpleNamespace(length=7)
    sample = SimpleNamespace(prompt=prompt, num_samples=3, sampling_params=SimpleNamespace(max_tokens=5))
    assert tokens(WorkItem("s", "sample", sample, "u")) == 7 + 3 * 5
    assert tokens(WorkItem("p", "compute_logprobs", SimpleNamespace(prompt=prompt), "u")) == 7
    assert tokens(WorkItem("o", "optim_step", SimpleNamespace(), "u")) == 0


def test_max_pass_tokens_bounds_forward_batches_but_not_sampling():
    from types import SimpleNamespace

    fwd = [fb(f"f{k}", "u", f"run{k}", 40, arrival=k) for k in range(3)]
    assert len(next_batch(fwd, {}, max_tokens=8192, max_pass_tokens=64)) == 1  # 40 + 40 > 64
    assert len(next_batch(fwd, {}, max_tokens=100, max_pass_tokens=None)) == 2
    assert len(next_batch(fwd, {}, max_tokens=100, max_pass_tokens=200)) == 2  # the lower budget holds
    sample = SimpleNamespace(prompt=SimpleNamespace(length=40), sampling_params=SimpleNamespace(max_tokens=8),
                             num_samples=1)
    samples = [WorkItem(f"s{k}", "sample", sample, "u", arrival=k) for k in range(3)]
    assert len(next_batch(samples, {}, max_tokens=8192, max_pass_tokens=64)) == 3  # decoding is not sliced


# -- continuous sampling: admissions into the running decode batch --


def sample_item(rid, user, arrival, prompt_tokens=8, max_tokens=8):
    from types import SimpleNamespace

    request = SimpleNamespace(prompt=SimpleNamespace(length=prompt_tokens), num_samples=1,
                              sampling_params=SimpleNamespace(max_tokens=max_tokens))
    return WorkItem(rid, "sample", request, user, arrival=arrival)


def test_samples_are_admitted_up_to_the_room_left_and_another_batch_is_chosen_beside_them():
    from trio_server.scheduler import next_work

    pending = [sample_item(f"s{k}", "u", arrival=k) for k in range(5)] + [fb("f", "u", "r", 10, arrival=9)]
    work = next_work(pending, {}, decoding=60, max_decoding=63)
    assert [i.request_id for i in work.admit] == ["s0", "s1", "s2"]  # oldest first, 3 slots free
    assert [i.request_id for i in work.batch] == ["f"]  # training is not held behind sampling
    full = next_work(pending, {}, decoding=63, max_decoding=63, decoding_users={"u"})
    assert full.admit == [] and [i.request_id for i in full.batch] == ["f"]


def test_a_user_with_nothing_decoding_gets_a_request_into_a_full_batch():
    """One user's long samples filled every slot: another's 4-token sample waited for them
    (12.8 s where it takes 0.15 s). A user with none in the batch gets one request in past
    the bound, up to NEWCOMER_SLOTS more; the full user's wait for freed slots."""
    from trio_server.scheduler import NEWCOMER_SLOTS, next_work

    pending = [sample_item("a9", "a", arrival=0)] + [sample_item(f"{u}{k}", u, arrival=1 + k)
                                                     for u in "bc" for k in range(2)]
    work = next_work(pending, {}, decoding=64, max_decoding=64, decoding_users={"a"})
    assert sorted(i.request_id for i in work.admit) == ["b0", "c0"]  # one each, a's waits
    full = next_work(pending, {}, decoding=64 + NEWCOMER_SLOTS, max_decoding=64, decoding_users={"a"})
    assert full.admit == []
    last = next_work(pending, {}, decoding=64 + NEWCOMER_SLOTS - 1, max_decoding=64, decoding_users={"a"})
    assert len(last.admit) == 1


def test_one_users_many_samples_do_not_keep_anothers_out_of_the_free_slots():
    from trio_server.scheduler import BASE_COST, Fairness, next_work

    pending = [sample_item(f"a{k}", "a", arrival=k) for k in range(4)] + [sample_item("b0", "b", arrival=10)]
    work = next_work(pending, {}, decoding=0, max_decoding=3)
    assert [i.request_id for i in work.admit] == ["a0", "b0", "a1"]  # one each, then by tag
    per_request = BASE_COST + 16
    # each admission billed: a twice; b's one is behind virtual time (a1's start) and forgotten
    assert (work.fair.vtime, work.fair.finish) == (per_request, {"a": 2 * per_request})
    ahead = next_work(pending, {}, decoding=0, max_decoding=1, fair=Fairness(finish={"a": 5.0}))
    assert [i.request_id for i in ahead.admit] == ["b0", "a0"]  # a was served more: b goes first
    # (and a, with nothing decoding, gets one in past the bound: NEWCOMER_SLOTS)
