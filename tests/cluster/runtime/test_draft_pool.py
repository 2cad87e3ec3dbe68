"""A draft pool shared by target groups of several replicas (SpecClusters standing for Serve
replicas), on a local Ray cluster with 4 fake GPUs: sharing, routing, a lost drafter, a hung one,
sizing live, a lost keeper, planning."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import pytest
import ray

from actors.model.loader import load_model
from cluster.engine.build import cost_key_of, local_engine
from cluster.engine.config import EngineConfig
from cluster.engine.cost import TOKEN_POINTS, CostCurve, CostPoint, curves_folder
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.draft_pool import NAMESPACE
from cluster.runtime.draft_pool_spec import DraftPoolSpec
from cluster.runtime.member_checks import MemberChecks
from cluster.runtime.pool_sizing import Window, decide_size
from cluster.runtime.spec_cluster import SpecCluster
from speculators.proposers.base import DraftRequest
from tests.cluster.ray_fixtures import ray_four_gpus  # noqa: F401  (module-scoped fixture)
from tests.cluster.runtime.cluster_requests import (  # noqa: F401  (expected is a fixture)
    NEW_TOKENS,
    PROMPTS,
    UNPLANNED,
    expected,
    requests,
    run_while,
)
from tests.conftest import IdTokenizer


def pooled_spec(model_dir, name: str, **pool) -> ClusterSpec:
    engine = EngineConfig(model=str(model_dir), dtype="float32", method="draft", draft="layer-skip:2", max_sequences=4,
                          max_len=256, **UNPLANNED)
    return ClusterSpec(engine=engine, draft_pool=DraftPoolSpec(name=name, report_period_s=0.5, idle_shutdown_s=2,
                                                               **pool))


def pool_is_gone(name: str, timeout_s: float = 30) -> bool:
    """Whether the pool ended within `timeout_s`: its idle_shutdown_s after the last replica leaves.
    A replacement it may be placing then (on a loaded 2-core CI machine a drafter can miss its health
    checks during a test) does not delay that: placing runs beside the keeper's watch."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(f"draft-pool-{name}", namespace=NAMESPACE)
        except ValueError:
            return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def long_expected(tiny_model_dir):
    """Plain decoding of the longer requests `run_while` sends."""
    engine = local_engine(load_model(tiny_model_dir), IdTokenizer(), None)
    return [o.token_ids for o in engine.generate(requests("d", NEW_TOKENS * 4))]


def test_replicas_share_the_pool_spread_over_its_drafters_and_lose_nothing_when_one_dies(ray_four_gpus, tiny_model_dir,
                                                                                        expected, long_expected):
    """Two replicas (SpecClusters) name one pool of two drafters: 2 target shards + 2 drafters take the
    4 GPUs. One replica's requests spread over both drafters; one drafter is killed mid-generation
    while both replicas decode: every output equals plain decoding. The pool ends after them."""
    spec = pooled_spec(tiny_model_dir, "shared", min_drafters=2, max_drafters=2)
    replicas = [SpecCluster(spec).start() for _ in range(2)]
    try:
        assert ray.available_resources().get("GPU", 0) == 0
        pooled = replicas[0].pooled[0]
        assert len(pooled.members) == 2 and set(pooled.members) == set(replicas[1].pooled[0].members)
        other, holders = {}, {}
        neighbour = threading.Thread(target=lambda: other.update(outputs=replicas[1].generate(requests("b"), 180)))

        def kill_a_drafter():
            neighbour.start()
            holders.update(pooled.holder)
            ray.kill(pooled.members[pooled.holder["d0"]], no_restart=False)

        outputs = run_while(replicas[0], kill_a_drafter, "d")
        neighbour.join(180)
        assert sorted(holders.values()).count(holders["d0"]) == 2  # 4 requests, 2 on each drafter
        assert [o.token_ids for o in outputs] == long_expected
        assert [o.token_ids for o in other["outputs"]] == expected
        again = replicas[0].generate(requests("n"), timeout_s=120)
        assert [o.token_ids for o in again] == expected
        assert sum(o.stats.accepted for o in again) > 0  # drafting goes on after the loss
        mismatched = ClusterSpec(engine=spec.engine.model_copy(update={"max_len": 128}), draft_pool=spec.draft_pool)
        with pytest.raises(Exception, match="give it a draft_pool.name of its own"):
            SpecCluster(mismatched).start()
    finally:
        for replica in replicas:
            replica.shutdown()
    assert pool_is_gone("shared")


def test_a_hung_drafter_costs_only_its_requests_drafts_and_is_replaced(ray_four_gpus, tiny_model_dir, expected):
    """One of a pool's two drafters hangs in a call that never returns. A draft call split over both
    is answered at the member deadline with the other's trees (the hung one's request root-only,
    reported unknown); the replica decodes on, drafting on the other drafter, output equal to plain
    decoding; the keeper replaces the hung drafter after member_misses unanswered health checks."""
    spec = pooled_spec(tiny_model_dir, "hung", min_drafters=2, max_drafters=2, member_timeout_s=1.0, member_misses=4)
    replica = SpecCluster(spec).start()
    try:
        pooled = replica.pooled[0]
        (hung_id, hung), (other_id, _) = pooled.members.items()
        hung.__ray_call__.remote(lambda worker: threading.Event().wait(600))  # the drafter's one thread, stuck
        began = time.monotonic()
        future = pooled.submit("propose", [DraftRequest("a", PROMPTS[0], 4, 16), DraftRequest("b", PROMPTS[3], 4, 16)])
        assert pooled.holder == {"a": hung_id, "b": other_id}
        reply = future.result(timeout=10)
        assert time.monotonic() - began < 5
        assert reply.trees[0].num_drafted == 0 and reply.unknown == ["a"] and reply.trees[1].num_drafted > 0
        pooled.submit("release", ["a", "b"])
        outputs = replica.generate(requests("h"), timeout_s=120)
        assert [o.token_ids for o in outputs] == expected
        assert all(o.stats.drafted > 0 for o in outputs) and sum(o.stats.accepted for o in outputs) > 0
        keeper = ray.get_actor("draft-pool-hung", namespace=NAMESPACE)
        members = lambda: dict(ray.get(keeper.members_now.remote())[1])  # noqa: E731
        wait_for(lambda: hung_id not in members() and len(members()) == 2, 30, "the hung drafter was not replaced")
        wait_for(lambda: set(pooled.members) == set(members()), 10, "the replica did not learn of the new drafter")
        ray.get([member.ping.remote() for member in pooled.members.values()], timeout=60)
        again = replica.generate(requests("n"), timeout_s=120)
        assert [o.token_ids for o in again] == expected and sum(o.stats.accepted for o in again) > 0
    finally:
        replica.shutdown()
    assert pool_is_gone("hung")


def pool_size(name: str) -> int:
    return ray.get(ray.get_actor(f"draft-pool-{name}", namespace=NAMESPACE).size.remote())


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def test_the_pool_grows_under_load_shrinks_when_idle_and_is_created_again_when_lost(ray_four_gpus, tiny_model_dir,
                                                                                   expected, long_expected):
    """Live, on its own signal: draft calls that wait (any wait, with this threshold) grow the pool
    from 1 to 2 drafters while a replica decodes; idle, it goes back to 1. Then its keeper is killed
    for good (its drafters die with it) while the replica decodes: those requests decode plainly and
    stay right, the replica creates the pool again, and drafting resumes on the new one. The
    replica plans its pooled drafts on its cost curve (given here, a flat one), as with its own."""
    spec = pooled_spec(tiny_model_dir, "elastic", min_drafters=1, max_drafters=2, scale_up_wait_fraction=1e-6,
                       scale_down_after_s=1)
    spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"step_token_budget": None})})
    curve = CostCurve([CostPoint(tokens, 1, 1.0) for tokens in TOKEN_POINTS])  # given: drafts always pay
    path = curves_folder() / f"{cost_key_of(spec.engine)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve.to_json()))
    replica = SpecCluster(spec).start()
    try:
        assert replica.loops[0].engine.speculation.planner is not None and replica.loops[0].engine.speculation.costly_drafter
        assert pool_size("elastic") == 1
        stop, outputs = threading.Event(), []

        def decode_until_stopped():
            while not stop.is_set():
                outputs.extend(replica.generate(requests("g"), timeout_s=120))

        load = threading.Thread(target=decode_until_stopped)
        load.start()
        try:
            wait_for(lambda: pool_size("elastic") == 2, 60, "the pool did not grow under load")
            wait_for(lambda: len(replica.pooled[0].members) == 2, 10, "the replica did not learn of the new drafter")
        finally:
            stop.set()
            load.join(120)
        assert [o.token_ids for o in outputs] == expected * (len(outputs) // len(expected))
        wait_for(lambda: pool_size("elastic") == 1, 30, "the idle pool did not shrink")

        keeper, incarnation = ray.get_actor("draft-pool-elastic", namespace=NAMESPACE), replica.pooled[0].version
        lost = run_while(replica, lambda: ray.kill(keeper, no_restart=True), "k")
        assert [o.token_ids for o in lost] == long_expected
        new_pool = lambda: replica.pooled[0].version.split(".")[0] != incarnation.split(".")[0]  # noqa: E731
        wait_for(lambda: new_pool() and replica.pooled[0].members, 60, "the replica did not create the pool again")
        ray.get([member.ping.remote() for member in replica.pooled[0].members.values()], timeout=60)  # drafters up
        again = replica.generate(requests("n"), timeout_s=120)
        assert [o.token_ids for o in again] == expected
        assert sum(o.stats.accepted for o in again) > 0
    finally:
        replica.shutdown()
    assert pool_is_gone("elastic")


def test_the_pool_grows_when_calls_wait_and_shrinks_after_waits_stay_low():
    spec = DraftPoolSpec(name="p", min_drafters=1, max_drafters=3, scale_up_wait_fraction=0.2,
                         scale_down_wait_fraction=0.02, scale_down_after_s=60)
    window = Window()
    assert window.wait_fraction() is None and decide_size(2, None, spec, None, 0.0) == (2, None)  # nobody reported
    window.add(calls=0, wait_s=0.0, passes=0, pass_s=0.0)
    assert window.wait_fraction() == 0.0  # clients reported, idle: no wait, so an idle pool shrinks
    window.add(calls=10, wait_s=0.5, passes=20, pass_s=2.0)  # 50 ms waits against 100 ms passes
    assert window.wait_fraction() == pytest.approx(0.5)
    unpaired = Window()
    unpaired.add(calls=3, wait_s=0.1, passes=0, pass_s=0.0)
    assert unpaired.wait_fraction() is None  # waits without passes to compare them with
    assert decide_size(1, 0.5, spec, None, 0.0) == (2, None)
    assert decide_size(3, 0.5, spec, None, 0.0) == (3, None)  # at max_drafters
    assert decide_size(2, 0.1, spec, 5.0, 10.0) == (2, None)  # between the thresholds: no change, timer reset
    assert decide_size(2, 0.01, spec, None, 10.0) == (2, 10.0)  # low: the timer starts
    assert decide_size(2, 0.01, spec, 10.0, 69.0) == (2, 10.0)
    assert decide_size(2, 0.01, spec, 10.0, 70.0) == (1, None)
    assert decide_size(1, 0.0, spec, 10.0, 500.0) == (1, 10.0)  # at min_drafters
    with pytest.raises(ValueError, match="max_drafters"):
        DraftPoolSpec(name="p", min_drafters=2, max_drafters=1)


class FakeDrafter:
    """What the keeper's checks use of a pool member: its id and `actor.ping.remote().future()`."""

    def __init__(self, member_id: str):
        self.member_id, self.actor, self.pings = member_id, self, []

    @property
    def ping(self):
        return self

    def remote(self):
        return self

    def future(self) -> Future:
        self.pings.append(Future())
        return self.pings[-1]


def test_a_drafter_is_replaced_after_missed_checks_in_a_row_not_while_it_starts_or_is_slow():
    checks, drafter = MemberChecks(timeout_s=0.0, misses=3), FakeDrafter("d")  # every ping out is late
    assert [checks.check([drafter]) for _ in range(5)] == [[]] * 5  # starting: never answered yet
    assert len(drafter.pings) == 1  # one ping out at a time
    drafter.pings[-1].set_result(True)
    assert checks.check([drafter]) == [] and len(drafter.pings) == 2  # started; asked again
    assert checks.check([drafter]) == [] and checks.check([drafter]) == []  # two misses
    drafter.pings[-1].set_result(True)  # slow, not hung: the run of misses ends
    assert [checks.check([drafter]) for _ in range(3)] == [[], [], []]
    assert checks.check([drafter]) == [drafter]  # the third miss in a row
    gone = FakeDrafter("gone")
    for _ in range(3):
        assert checks.check([gone]) == []
        gone.pings[-1].set_exception(RuntimeError("the actor died"))  # a failed ping counts, started or not
    assert checks.check([gone]) == [gone]


def test_a_drafters_deadline_must_end_before_the_engines():
    with pytest.raises(ValueError, match="draft_pool.member_timeout_s"):
        ClusterSpec(engine=EngineConfig(method="pld", draft_timeout_s=2), draft_pool=DraftPoolSpec(name="p"))
