from types import SimpleNamespace

from cluster.serve.autoscaling import SpeculationAwarePolicy, desired_replicas


def test_speculation_raises_each_replicas_capacity():
    load = {"a": 16.0, "b": 16.0}
    plain = desired_replicas(load, {}, {"a": 1.0, "b": 1.0}, current=2, target_ongoing=8)
    speculative = desired_replicas(load, {}, {"a": 2.0, "b": 2.0}, current=2, target_ongoing=8)
    assert (plain, speculative) == (4, 2)


def test_credit_for_speculation_is_capped_and_never_below_plain():
    load = {"a": 64.0}
    assert desired_replicas(load, {}, {"a": 50.0}, 1, 8, max_speedup=4) == 2
    assert desired_replicas(load, {}, {"a": 0.2}, 1, 8) == 8


def test_a_waiting_request_adds_a_replica_and_idle_goes_to_zero():
    assert desired_replicas({"a": 4.0}, {"a": 1.0}, {"a": 3.0}, current=1, target_ongoing=8) == 2
    assert desired_replicas({}, {}, {}, current=3, target_ongoing=8) == 0


def test_policy_respects_bounds_and_reads_serve_metrics():
    policy = SpeculationAwarePolicy(target_ongoing_requests=4)
    ctx = SimpleNamespace(
        aggregated_metrics={"ongoing": {"r1": 40.0}, "queued": {"r1": 0.0}, "tokens_per_step": {"r1": 1.0}},
        current_num_replicas=1, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=5,
        policy_state={},
    )
    assert policy(ctx) == (5, {})
    ctx.aggregated_metrics = {}
    assert policy(ctx) == (1, {})
