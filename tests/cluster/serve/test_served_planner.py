"""Served requests take the planner: the Serve app, driven over HTTP as a client drives it, verifies
no drafted token under a steep cost curve and keeps drafts under a flat one, with a request's own
lookahead as a cap only. Before the one request path, a served request always carried a lookahead
and so skipped the planner whatever the curve said."""
from __future__ import annotations

import json
import urllib.request

import pytest
import ray
from ray import serve

from cluster.engine.build import cost_key_of
from cluster.engine.config import EngineConfig
from cluster.engine.cost import TOKEN_POINTS, CostCurve, CostPoint, curves_folder
from cluster.serve.app import build_app
from tests.cluster.ray_fixtures import ray_four_gpus, shared_serve  # noqa: F401  (module-scoped fixtures)

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [3] * 12, [7, 8, 9, 7, 8, 9, 7, 8], list(range(10, 30)) * 2]
STEP_S = 0.01


def curve(seconds_per_extra_token: float) -> CostCurve:
    """A pass of n tokens costs STEP_S + (n - 1) x this; flat at 0, as dear as a whole step per token at STEP_S."""
    return CostCurve([CostPoint(n, 1, STEP_S + (n - 1) * seconds_per_extra_token) for n in TOKEN_POINTS])


@pytest.fixture(scope="module")
def http_port(shared_serve):
    """The HTTP port of Serve on the shared Ray, and the session's cost-curve folder, which the Ray's
    workers (the replica, its actors) inherited from this process's environment."""
    return shared_serve[0], curves_folder()


ENGINE = {"max_sequences": 4, "max_len": 128}


def serve_with(tiny_model_dir, folder, cost: CostCurve) -> None:
    """(Re)deploy the app, its target's cost curve given as `cost` instead of measured. The curve's
    cache key is computed where a replica computes it (a Ray worker of one CPU: its threads are part
    of the key), and the replica is asked which curve it plans on."""
    serve.delete("specserve")  # first: its replica holds the CPU the key's worker needs
    engine = EngineConfig(model=str(tiny_model_dir), method="pld", **ENGINE)
    key = ray.get(ray.remote(num_cpus=1)(cost_key_of).remote(engine))
    (folder / f"{key}.json").write_text(json.dumps(cost.to_json()))
    args = {"cluster": {"engine": {"model": str(tiny_model_dir), "method": "pld", **ENGINE},
                        "gpus_per_target_shard": 0, "gpus_per_draft_actor": 0},
            "limits": {"max_prompt_tokens": 64, "max_new_tokens": 32}}
    handle = serve.run(build_app(args), name="specserve", route_prefix="/")
    assert handle.cost_curves.remote().result() == [cost.to_json()]


def complete(port: int, prompt: list[int], speculation: dict | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0} | ({"speculation": speculation} if speculation else {})
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def drafted_and_texts(port: int, speculation: dict | None = None) -> tuple[int, list[str]]:
    answers = [complete(port, prompt, speculation) for prompt in PROMPTS]
    return sum(a["speculation"]["drafted"] for a in answers), [a["choices"][0]["text"] for a in answers]


def test_the_planner_sizes_served_drafts_by_the_cost_curve(http_port, tiny_model_dir):
    port, folder = http_port
    chosen = {"lookahead": "fixed", "num_speculative_tokens": 4}

    serve_with(tiny_model_dir, folder, curve(STEP_S))  # a drafted token costs a whole step: none pays
    steep, steep_texts = drafted_and_texts(port)
    steep_chosen, _ = drafted_and_texts(port, chosen)
    serve_with(tiny_model_dir, folder, curve(0.0))  # drafted tokens are free: every draft pays
    flat, flat_texts = drafted_and_texts(port)
    flat_chosen, _ = drafted_and_texts(port, chosen)
    _, plain_texts = drafted_and_texts(port, {"method": "off"})

    assert steep == 0 and steep_chosen == 0  # a request's own lookahead does not get around the planner
    assert flat > 0 and flat_chosen > 0
    assert steep_texts == flat_texts == plain_texts
