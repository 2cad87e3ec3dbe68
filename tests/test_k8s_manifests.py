"""The KubeRay manifests (k8s/) and the Serve configs (configs/), checked without a Kubernetes cluster.

Nothing in the test suite runs on Kubernetes or on GPUs, so a mistake in these files would otherwise
surface only at `kubectl apply` or, worse, minutes into a deployment: a misspelt field that the API
server silently prunes, a string where KubeRay wants an integer, args the application refuses, or a
config that asks for more GPUs than the Ray cluster can ever have (its placement groups then wait
forever without saying why). So:

- every document under k8s/ is validated against the KubeRay CRD of its kind and apiVersion
  (tests/data/kuberay-crds, the operator's own OpenAPI schemas), strictly: unknown fields are errors,
  as with `kubectl apply --validate=strict`;
- every Serve config (configs/*.yaml and each RayService's serveConfigV2) is validated with Ray
  Serve's own schema, its application args with the project's pydantic models, and its GPU and CPU
  needs at max_replicas are compared with what the manifests' worker groups offer at maxReplicas;
- each config's node labels (cluster.target_node_labels / draft_node_labels) must select worker
  groups (their `labels`, as Ray's autoscaler reads them) that hold that role at max_replicas, by
  the placement's own capacity check; and a config that needs new pods must wait for them;
- the RayService's builder and gRPC servicer functions must import, as Serve will import them.
"""
from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _HEAD_GROUP_NAME,
    _derive_autoscaling_config_from_ray_cr,
)

from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.placement import PlacementError, check_capacity
from cluster.serve.service import ServiceLimits

REPO = Path(__file__).resolve().parents[1]
K8S_DIR = REPO / "k8s"
CONFIG_DIR = REPO / "configs"
CRD_DIR = Path(__file__).resolve().parent / "data" / "kuberay-crds"
GPU_EXAMPLE = CONFIG_DIR / "gpu-llama3-8b-tp2-draft1b.yaml"
IMPORT_PATH = "cluster.serve.app:build_app"
ROUTER = "SpecServer"
ARGS_FIELDS = {"cluster", "limits", "model_id", "models"}  # cluster.serve.app.AppArgs, which forbids anything else
GPU_RESOURCE = "nvidia.com/gpu"

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 1 MB each


# ---- loading ----------------------------------------------------------------------------------

def load_documents(path: Path) -> list[dict]:
    """Every non-empty YAML document of a file (a manifest may hold several, split by ---)."""
    with path.open() as handle:
        return [doc for doc in yaml.load_all(handle, Loader=Loader) if doc is not None]


def manifest_documents() -> list[tuple[str, dict]]:
    """(id, document) for every YAML document under k8s/; the id names file and position."""
    found = []
    for path in sorted([*K8S_DIR.glob("*.yaml"), *K8S_DIR.glob("*.yml")]):
        for index, doc in enumerate(load_documents(path)):
            found.append((f"{path.name}#{index}", doc))
    return found


MANIFESTS = manifest_documents()


def manifests_of(kind: str) -> list[tuple[str, dict]]:
    return [(name, doc) for name, doc in MANIFESTS if doc.get("kind") == kind]


def ray_cluster_specs() -> list[tuple[str, dict]]:
    """Every Ray cluster the manifests describe: RayCluster specs and RayServices' rayClusterConfig."""
    specs = [(name, doc["spec"]) for name, doc in manifests_of("RayCluster")]
    specs += [(name, doc["spec"]["rayClusterConfig"]) for name, doc in manifests_of("RayService")]
    return specs


def serve_configs() -> list[Any]:
    """Every Serve config: configs/*.yaml and each RayService's serveConfigV2 (a YAML string).

    configs/serve.yaml is listed even when absent, as a skip, so that its absence shows in the
    test report instead of passing silently.
    """
    params = [pytest.param(yaml.load(path.read_text(), Loader=Loader), id=f"configs/{path.name}")
              for path in sorted(CONFIG_DIR.glob("*.yaml"))]
    if not (CONFIG_DIR / "serve.yaml").exists():
        params.append(pytest.param(None, id="configs/serve.yaml",
                                   marks=pytest.mark.skip(reason="configs/serve.yaml does not exist yet")))
    for name, doc in manifests_of("RayService"):
        params.append(pytest.param(yaml.load(doc["spec"]["serveConfigV2"], Loader=Loader),
                                   id=f"{name}:serveConfigV2"))
    return params


SERVE_CONFIGS = serve_configs()


# ---- CRD schemas as JSON Schema ---------------------------------------------------------------

SCHEMA_MAPS = ("properties", "patternProperties", "definitions")  # name -> schema
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf")
SCHEMA_VALUES = ("items", "additionalProperties", "not")


def to_json_schema(node: dict) -> dict:
    """A Kubernetes structural schema (OpenAPI v3 with x-kubernetes-* extensions) as JSON Schema.

    - `x-kubernetes-int-or-string: true` (resource quantities, ports, maxSurge...): integer or
      string, whatever `type` says; a quantity's `pattern` still applies to the string form.
    - `nullable: true`: null is allowed too.
    - An object with `properties` gets `additionalProperties: false` unless it says otherwise:
      the API server prunes unknown fields without a word (or refuses them under strict field
      validation, kubectl's default), so a misspelt field must fail here.
    - Other `x-kubernetes-*` keys (list types, map types, CEL rules) are dropped: they constrain
      updates and list merging, which one document cannot show. `default`, `enum` and the like are
      data, copied as they are.
    """
    out: dict = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in SCHEMA_MAPS:
            out[key] = {name: to_json_schema(schema) for name, schema in value.items()}
        elif key in SCHEMA_LISTS:
            out[key] = [to_json_schema(schema) for schema in value]
        elif key in SCHEMA_VALUES and isinstance(value, dict):
            out[key] = to_json_schema(value)
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_versions() -> dict[tuple[str, str], dict[str, dict]]:
    """{(group, kind): {version name: version entry}} over every CRD file in CRD_DIR."""
    index: dict[tuple[str, str], dict[str, dict]] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in load_documents(path):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            key = (crd["spec"]["group"], crd["spec"]["names"]["kind"])
            index[key] = {version["name"]: version for version in crd["spec"]["versions"]}
    return index


@functools.cache
def validator(api_version: str, kind: str) -> Draft7Validator:
    """The JSON Schema validator for one kind at one apiVersion.

    A version the CRD no longer serves, or marks deprecated (ray.io/v1alpha1), is refused here:
    the manifest would be converted or rejected by the API server.
    """
    group, _, version = api_version.rpartition("/")
    versions = crd_versions().get((group, kind))
    assert versions, f"no CRD for kind {kind!r} of group {group!r} in {CRD_DIR}"
    entry = versions.get(version)
    assert entry, f"{kind} has no version {version!r}; the CRD has {sorted(versions)}"
    assert entry.get("served") and not entry.get("deprecated"), f"{api_version} {kind} is not served or is deprecated"
    schema = to_json_schema(entry["schema"]["openAPIV3Schema"])
    Draft7Validator.check_schema(schema)
    return Draft7Validator(schema)


def schema_errors(doc: dict) -> list[str]:
    """Every violation of the document's CRD schema, as 'path: message' lines."""
    check = validator(doc["apiVersion"], doc["kind"])
    errors = sorted(check.iter_errors(doc), key=lambda error: list(error.absolute_path))
    return [f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}" for error in errors]


# ---- resources of a Ray cluster spec and of a Serve config --------------------------------------

def cpu_quantity(value: Any) -> float:
    """A Kubernetes CPU quantity ('16', 16, '500m') in CPUs."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def pod_resources(group: dict) -> dict[str, float]:
    """The Ray GPUs and CPUs of one pod of a head or worker group.

    As KubeRay derives them: rayStartParams num-gpus / num-cpus when given, else the Ray
    container's limits (requests when no limit), as `ray start` is told.
    """
    container = group["template"]["spec"]["containers"][0]
    resources = container.get("resources", {})
    amounts = {**resources.get("requests", {}), **resources.get("limits", {})}
    params = group.get("rayStartParams", {})
    gpus = params.get("num-gpus", amounts.get(GPU_RESOURCE, 0))
    cpus = params.get("num-cpus", amounts.get("cpu", 0))
    return {"GPU": float(gpus), "CPU": cpu_quantity(cpus)}


def workers_at_max(cluster_spec: dict) -> dict[str, float]:
    """GPUs and CPUs of all worker pods together when every group is at maxReplicas."""
    total = {"GPU": 0.0, "CPU": 0.0}
    for group in cluster_spec.get("workerGroupSpecs", []):
        pods = group["maxReplicas"] * group.get("numOfHosts", 1)
        for name, amount in pod_resources(group).items():
            total[name] += pods * amount
    return total


def applications(config: dict) -> list[dict]:
    return config.get("applications", [])


def router(app: dict) -> dict:
    """The SpecServer entry of an application's deployments ({} when the config leaves it default)."""
    return next((d for d in app.get("deployments", []) if d.get("name") == ROUTER), {})


def max_replicas(app: dict) -> int:
    """The most SpecServer replicas Serve may run: autoscaling max_replicas, else num_replicas."""
    deployment = router(app)
    if deployment.get("autoscaling_config"):
        return deployment["autoscaling_config"]["max_replicas"]
    replicas = deployment.get("num_replicas", 1)
    assert isinstance(replicas, int), f"num_replicas {replicas!r}: give autoscaling_config.max_replicas instead"
    return replicas


def replica_needs(app: dict, spec: ClusterSpec) -> dict[str, float]:
    """What one SpecServer replica reserves: its own actor plus its placement groups."""
    options = router(app).get("ray_actor_options", {})
    return {
        "GPU": options.get("num_gpus", 0) + spec.total("GPU"),
        "CPU": options.get("num_cpus", 1) + spec.total("CPU"),
    }


def each_app(config: dict) -> Iterator[tuple[dict, ClusterSpec, ServiceLimits]]:
    """Every application with its validated ClusterSpec and ServiceLimits."""
    for app in applications(config):
        args = app.get("args") or {}
        spec = ClusterSpec.model_validate(args.get("cluster", {}))
        yield app, spec, ServiceLimits.model_validate(args.get("limits", {}))


def resolve(dotted: str) -> Any:
    """Import 'module:attr' or 'module.attr' as Ray Serve does, failing with the path in the message."""
    module_name, _, attr = dotted.partition(":") if ":" in dotted else dotted.rpartition(".")
    module = importlib.import_module(module_name)
    assert hasattr(module, attr), f"{module_name} has no attribute {attr!r} ({dotted})"
    return getattr(module, attr)


# ---- the manifests against the CRDs -------------------------------------------------------------

def test_manifests_exist():
    """A glob that finds nothing would make every parametrized test below vanish, not fail."""
    kinds = {doc.get("kind") for _, doc in MANIFESTS}
    assert {"RayService", "RayCluster"} <= kinds, f"k8s/ holds {sorted(map(str, kinds))}"


@pytest.mark.parametrize("doc", [pytest.param(doc, id=name) for name, doc in MANIFESTS])
def test_manifest_matches_crd(doc):
    assert doc.get("apiVersion", "").startswith("ray.io/"), "k8s/ holds only KubeRay resources; others go in README.md"
    assert doc.get("metadata", {}).get("name"), "metadata.name is required"
    assert schema_errors(doc) == []


def _worker(doc: dict, index: int = 0) -> dict:
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][index]


def _set_replicas_text(doc):
    _worker(doc)["replicas"] = "two"


def _set_unknown_upscaling_mode(doc):
    doc["spec"]["rayClusterConfig"]["autoscalerOptions"]["upscalingMode"] = "Fast"


def _misspell_autoscaling_switch(doc):
    """Not a required field: only the strict unknown-field rule can catch this one, which the API
    server would prune in silence, leaving the cluster without an autoscaler."""
    config = doc["spec"]["rayClusterConfig"]
    config["enableInTreeAutoScaling"] = config.pop("enableInTreeAutoscaling")


def _bad_memory_quantity(doc):
    _worker(doc)["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "64 GB"


def _number_in_ray_start_params(doc):
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0


def _drop_group_name(doc):
    del _worker(doc)["groupName"]


@pytest.mark.parametrize("break_it, where", [
    (_set_replicas_text, "workerGroupSpecs.0.replicas"),
    (_set_unknown_upscaling_mode, "autoscalerOptions.upscalingMode"),
    (_misspell_autoscaling_switch, "'enableInTreeAutoScaling' was unexpected"),
    (_bad_memory_quantity, "limits.memory"),
    (_number_in_ray_start_params, "rayStartParams.num-gpus"),
    (_drop_group_name, "workerGroupSpecs.0: 'groupName' is a required property"),
])
def test_validator_catches_broken_manifest(break_it, where):
    """The validator has teeth: each single mistake in a copy of the RayService is reported, at
    the place it was made (a wrong type, an unknown enum value, a misspelt field, a malformed
    quantity, a number where rayStartParams wants a string, a missing required field)."""
    (_, original), *_ = manifests_of("RayService")
    broken = copy.deepcopy(original)
    break_it(broken)
    errors = schema_errors(broken)
    assert errors, f"{break_it.__name__} went unnoticed"
    assert any(where in error for error in errors), errors


def test_deprecated_api_version_is_refused():
    """ray.io/v1alpha1 is still in the CRDs, marked deprecated: a manifest must not use it."""
    with pytest.raises(AssertionError, match="deprecated"):
        validator("ray.io/v1alpha1", "RayService")


# ---- the manifests' own consistency ---------------------------------------------------------------

def test_rayservice_embeds_gpu_example():
    """serveConfigV2 is a copy of configs/gpu-llama3-8b-tp2-draft1b.yaml (comments aside), so the
    example users read and edit is the one the manifest deploys."""
    expected = yaml.load(GPU_EXAMPLE.read_text(), Loader=Loader)
    for name, doc in manifests_of("RayService"):
        assert yaml.load(doc["spec"]["serveConfigV2"], Loader=Loader) == expected, name


def test_raycluster_matches_rayservice():
    """`serve deploy` onto k8s/raycluster.yaml must meet the same cluster the RayService builds."""
    clusters = [doc["spec"] for _, doc in manifests_of("RayCluster")]
    for name, doc in manifests_of("RayService"):
        assert doc["spec"]["rayClusterConfig"] in clusters, f"{name}: no RayCluster with the same spec"


@pytest.mark.parametrize("cluster_spec", [pytest.param(spec, id=name) for name, spec in ray_cluster_specs()])
def test_every_ray_container_gets_the_api_key_from_a_secret(cluster_spec):
    """The GPU config reads its key from limits.api_key_env; a replica may start on any Ray pod, so
    every container must get that variable, from a Secret (never as a literal in the manifest)."""
    variable = yaml.load(GPU_EXAMPLE.read_text(), Loader=Loader)["applications"][0]["args"]["limits"]["api_key_env"]
    groups = [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {item["name"]: item for item in container.get("env", [])}
            assert "secretKeyRef" in env[variable]["valueFrom"] and "value" not in env[variable], container["name"]


@pytest.mark.parametrize("cluster_spec", [pytest.param(spec, id=name) for name, spec in ray_cluster_specs()])
def test_head_runs_no_models(cluster_spec):
    """The head gets no GPU and no Ray CPUs: routers and model actors go to the worker pods, and
    the autoscaler (enabled) adds those pods on demand."""
    head = cluster_spec["headGroupSpec"]
    assert pod_resources(head) == {"GPU": 0.0, "CPU": 0.0}
    assert GPU_RESOURCE not in str(head["template"]["spec"]["containers"][0].get("resources", {}))
    assert cluster_spec.get("enableInTreeAutoscaling") is True


@pytest.mark.parametrize("doc", [pytest.param(doc, id=name) for name, doc in manifests_of("RayService")])
def test_rayservice_exposes_serve_ports(doc):
    """KubeRay's serve service forwards only the head container port named "serve", so it must be
    the HTTP port of serveConfigV2; the gRPC port must be a head port too (the head service)."""
    config = yaml.load(doc["spec"]["serveConfigV2"], Loader=Loader)
    ports = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    by_name = {port.get("name"): port["containerPort"] for port in ports}
    assert by_name.get("serve") == config.get("http_options", {}).get("port", 8000)
    assert config["grpc_options"]["port"] in by_name.values()


@pytest.mark.parametrize("doc", [pytest.param(doc, id=name) for name, doc in manifests_of("RayService")])
def test_rayservice_application_imports(doc):
    """Serve imports the builder and the gRPC servicer functions on the cluster; import them here."""
    config = yaml.load(doc["spec"]["serveConfigV2"], Loader=Loader)
    for function in config.get("grpc_options", {}).get("grpc_servicer_functions", []):
        assert callable(resolve(function)), function
    apps = applications(config)
    assert apps and all(app["import_path"] == IMPORT_PATH for app in apps)
    assert callable(resolve(IMPORT_PATH))
    app_args = resolve("cluster.serve.app:AppArgs")
    for app in apps:
        app_args.model_validate(app.get("args") or {})


# ---- every Serve config ------------------------------------------------------------------------

@pytest.mark.parametrize("config", SERVE_CONFIGS)
def test_serve_config_is_valid(config):
    """Ray Serve's own schema, then the application's args with the project's models: what
    `serve deploy` and build_app would refuse, refused here first."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config)
    apps = applications(config)
    assert apps, "no applications"
    for app in apps:
        assert app["import_path"] == IMPORT_PATH, app["import_path"]
        assert set(app.get("args") or {}) <= ARGS_FIELDS, f"unknown args: {set(app['args']) - ARGS_FIELDS}"
        assert router(app), f"no {ROUTER} deployment: its replica count and resources would be defaults"
    assert list(each_app(config))  # ClusterSpec and ServiceLimits validate every application's args


@pytest.mark.parametrize("config", SERVE_CONFIGS)
def test_limits_fit_kv_cache(config):
    """A request the limits accept is never cut short by the KV cache: prompt + new tokens fit
    engine.max_len (the engine stops a sequence at max_len whatever max_new_tokens says). With
    max_prompt_tokens null each request is held to max_len when it is built (test_requests)."""
    for _, spec, limits in each_app(config):
        prompt = limits.max_prompt_tokens or 1
        assert prompt + limits.max_new_tokens <= spec.engine.max_len, (
            f"{prompt} + {limits.max_new_tokens} > max_len {spec.engine.max_len}")


def capacity_problems(config: dict, cluster_spec: dict) -> list[str]:
    """Why a Serve config cannot be placed on a Ray cluster spec at full scale ([] when it can).

    - At max_replicas, the GPUs and CPUs every SpecServer replica reserves (its own actor plus its
      target groups and draft actors) must fit the worker pods at maxReplicas. A config asking for
      more could never be placed: Ray leaves the placement groups pending and says nothing.
    - A target group's shards rendezvous on 127.0.0.1, so a whole group must fit one pod; and
      placement packs it onto one node only when some live node can hold it, so a group of such
      pods must keep minReplicas >= 1. Each draft actor's bundle must fit some pod as well.
    """
    problems = []
    groups = cluster_spec.get("workerGroupSpecs", [])
    offered = workers_at_max(cluster_spec)

    def holds(group: dict, need: dict[str, float]) -> bool:
        have = pod_resources(group)
        return all(have.get(name, 0.0) >= amount for name, amount in need.items())

    for app, spec, _ in each_app(config):
        replicas = max_replicas(app)
        for resource, amount in replica_needs(app, spec).items():
            if replicas * amount > offered[resource]:
                problems.append(
                    f"{replicas} replicas x {amount:g} {resource} ({spec.describe_total(resource)} + the router) "
                    f"> {offered[resource]:g} {resource} in the worker groups at maxReplicas")
        target_group = {name: sum(b.get(name, 0.0) for b in spec.target_bundles()) for name in ("GPU", "CPU")}
        fitting = [group for group in groups if holds(group, target_group)]
        if not fitting:
            problems.append(f"no worker pod holds a whole target group ({target_group})")
        elif spec.tensor_parallel_size > 1 and not any(group.get("minReplicas", 0) >= 1 for group in fitting):
            problems.append(
                "every worker group that can hold a target group may scale to zero: placement would "
                "then spread the shards over nodes, and they rendezvous on 127.0.0.1")
        for bundle in spec.draft_bundles():
            if not any(holds(group, bundle) for group in groups):
                problems.append(f"no worker pod holds a draft actor ({bundle})")
    return problems


@pytest.mark.parametrize("cluster_spec", [pytest.param(spec, id=name) for name, spec in ray_cluster_specs()])
@pytest.mark.parametrize("config", SERVE_CONFIGS)
def test_config_fits_cluster(config, cluster_spec):
    """Every config can run at its max_replicas on every cluster the manifests describe."""
    assert capacity_problems(config, cluster_spec) == []


def _one_replica_too_many(config):
    router(applications(config)[0])["autoscaling_config"]["max_replicas"] += 1


def _tensor_parallel_4(config):
    cluster = applications(config)[0]["args"]["cluster"]
    cluster["tensor_parallel_size"], cluster["num_target_groups"] = 4, 1
    router(applications(config)[0])["autoscaling_config"]["max_replicas"] = 1


def _draft_needs_four_gpus(config):
    applications(config)[0]["args"]["cluster"]["gpus_per_draft_actor"] = 4
    router(applications(config)[0])["autoscaling_config"]["max_replicas"] = 1


def _target_pods_scale_to_zero(config, cluster_spec):
    for group in cluster_spec["workerGroupSpecs"]:
        group["minReplicas"] = 0


@pytest.mark.parametrize("break_config, break_cluster, expected", [
    (_one_replica_too_many, None, "GPU in the worker groups at maxReplicas"),
    (_tensor_parallel_4, None, "no worker pod holds a whole target group"),
    (_draft_needs_four_gpus, None, "no worker pod holds a draft actor"),
    (None, _target_pods_scale_to_zero, "may scale to zero"),
])
def test_capacity_check_catches_oversized_config(break_config, break_cluster, expected):
    """The capacity check has teeth: the GPU example at one replica beyond what the manifest can
    give, a TP-4 target group on 2-GPU pods, a draft bigger than any pod, and target pods that may
    all scale away are each reported."""
    config = yaml.load(GPU_EXAMPLE.read_text(), Loader=Loader)
    (_, cluster_spec), *_ = ray_cluster_specs()
    cluster_spec = copy.deepcopy(cluster_spec)
    assert capacity_problems(config, cluster_spec) == []
    if break_config:
        break_config(config)
    if break_cluster:
        break_cluster(config, cluster_spec)
    problems = capacity_problems(config, cluster_spec)
    assert any(expected in problem for problem in problems), problems


# ---- node labels: each role on the worker groups its labels select ---------------------------------

GPU_NODE_START_S = 300
"""The least placement_timeout_s of a config that waits for new pods: a GPU pod on a new node means a
cloud VM, an image of several GB and `ray start`, rarely under five minutes."""


def autoscaler_node_types(cluster_spec: dict) -> dict[str, dict]:
    """The worker groups as Ray's autoscaler sees them: {groupName: node type}, each with the Ray
    resources, the node labels and the min/max pods of one group.

    This is Ray's own translation of the CR, the one the autoscaler sidecar runs on the live
    RayCluster, so labels reach the test as they reach the autoscaler (a malformed key fails here
    as it would there), and resources are derived as `ray start` is told them.
    """
    config = _derive_autoscaling_config_from_ray_cr(
        {"metadata": {"name": "specserve", "namespace": "default"}, "spec": copy.deepcopy(cluster_spec)})
    return {name: node_type for name, node_type in config["available_node_types"].items() if name != _HEAD_GROUP_NAME}


def ray_nodes(cluster_spec: dict, scale: str = "max_workers") -> list[dict]:
    """The worker nodes as `ray.nodes()` would list them with every group at maxReplicas
    (scale 'max_workers') or at minReplicas ('min_workers')."""
    return [{"Alive": True, "NodeName": f"{name}-{index}", "Resources": dict(node_type["resources"]),
             "Labels": dict(node_type["labels"])}
            for name, node_type in autoscaler_node_types(cluster_spec).items() for index in range(node_type[scale])]


def at_replicas(spec: ClusterSpec, replicas: int) -> ClusterSpec:
    """One spec reserving what `replicas` SpecServer replicas reserve together (each replica starts
    its own target groups and draft actors)."""
    return spec.model_copy(update={"num_target_groups": spec.num_target_groups * replicas,
                                   "num_draft_actors": spec.num_draft_actors * replicas})


def node_holds(node: dict, bundle: dict[str, float]) -> bool:
    return all(node["Resources"].get(name, 0.0) >= amount for name, amount in bundle.items())


def carries(node_labels: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a node with these labels matches a role's node labels (exact values; {} = any node)."""
    return all(node_labels.get(key) == value for key, value in labels.items())


def where(labels: dict[str, str]) -> str:
    return "nodes labelled " + ", ".join(f"{k}={v}" for k, v in labels.items()) if labels else "any node"


def replica_placement_problems(app: dict, spec: ClusterSpec, nodes: list[dict]) -> list[str]:
    """Why the placement could not reserve the app's max_replicas replicas on these nodes ([] when it can).

    The placement's own check (cluster.runtime.placement.check_capacity, which a replica runs before
    creating its placement groups): the roles' GPUs and CPUs on the nodes their labels select (roles
    sent to the same nodes together), and a whole target group on one such node. One more, which it
    leaves to Ray: each draft actor fits one node its labels select.
    """
    spec = at_replicas(spec, max_replicas(app))
    problems = []
    try:
        check_capacity(spec, nodes)
    except PlacementError as error:
        problems.append(str(error))
    drafts = spec.draft_bundles()
    if drafts and not any(carries(node["Labels"], spec.draft_node_labels) and node_holds(node, drafts[0])
                          for node in nodes):
        problems.append(f"no worker pod of {where(spec.draft_node_labels)} holds a draft actor ({drafts[0]})")
    return problems


def placement_problems(config: dict, cluster_spec: dict, scale: str = "max_workers") -> list[str]:
    """Why a config's replicas at max_replicas could not be placed on the worker pods of a Ray cluster
    spec with every group at `scale` ([] when they can): see replica_placement_problems."""
    nodes = ray_nodes(cluster_spec, scale)
    return [problem for app, spec, _ in each_app(config) for problem in replica_placement_problems(app, spec, nodes)]


def autoscaling_problems(config: dict, cluster_spec: dict) -> list[str]:
    """Why a config would not wait for the pods it needs ([] when it needs none, or waits).

    On an autoscaling cluster, an application that does not fit the worker pods at minReplicas
    reaches max_replicas only on pods the autoscaler adds for its pending placement groups. With
    autoscaling_cluster false the placement refuses such a replica at once (the alive nodes cannot
    hold it), and with a placement_timeout_s shorter than a GPU pod takes to start it gives up first.
    """
    if not cluster_spec.get("enableInTreeAutoscaling"):
        return []
    nodes = ray_nodes(cluster_spec, "min_workers")
    problems = []
    for app, spec, _ in each_app(config):
        if not replica_placement_problems(app, spec, nodes):
            continue
        if not spec.autoscaling_cluster:
            problems.append(f"{app.get('name')}: max_replicas needs pods beyond minReplicas, but autoscaling_cluster "
                            "is false: the replicas that need them fail at once instead of waiting")
        if spec.placement_timeout_s < GPU_NODE_START_S:
            problems.append(f"{app.get('name')}: placement_timeout_s {spec.placement_timeout_s:g} < "
                            f"{GPU_NODE_START_S} s: the placement gives up before a new GPU pod is up")
    return problems


CLUSTER_SPECS = [pytest.param(spec, id=name) for name, spec in ray_cluster_specs()]


@pytest.mark.parametrize("cluster_spec", CLUSTER_SPECS)
@pytest.mark.parametrize("config", SERVE_CONFIGS)
def test_node_labels_select_worker_groups_that_hold_them(config, cluster_spec):
    """Every config at max_replicas passes the placement's capacity check on the pods the autoscaler
    can start: target_node_labels select groups that hold the target groups (TP x
    gpus_per_target_shard on one pod), draft_node_labels groups that hold the draft actors."""
    assert placement_problems(config, cluster_spec) == []


@pytest.mark.parametrize("cluster_spec", CLUSTER_SPECS)
@pytest.mark.parametrize("config", SERVE_CONFIGS)
def test_config_waits_for_the_pods_it_needs(config, cluster_spec):
    """A config that reaches max_replicas only on pods beyond minReplicas waits for the autoscaler:
    autoscaling_cluster true and a placement_timeout_s long enough to start a GPU pod."""
    assert autoscaling_problems(config, cluster_spec) == []


@pytest.mark.parametrize("doc", [pytest.param(doc, id=name) for name, doc in manifests_of("RayService")])
def test_rayservice_keeps_target_and_draft_gpus_apart(doc):
    """The deployed config labels both roles, and the groups their labels select are disjoint: a
    draft actor never takes a GPU of a target-gpu pod (a target group would then need another pod)
    nor a target shard one of a draft-gpu pod."""
    config = yaml.load(doc["spec"]["serveConfigV2"], Loader=Loader)
    node_types = autoscaler_node_types(doc["spec"]["rayClusterConfig"])

    def selected(labels: dict[str, str]) -> set[str]:
        return {name for name, node_type in node_types.items() if carries(node_type["labels"], labels)}

    for _, spec, _ in each_app(config):
        assert spec.draft_bundles(), "the deployed config runs draft actors"
        assert spec.target_node_labels and spec.draft_node_labels, "both roles must be labelled"
        targets, drafts = selected(spec.target_node_labels), selected(spec.draft_node_labels)
        assert targets and drafts and not targets & drafts, (targets, drafts)


def _worker_group(cluster_spec: dict, name: str) -> dict:
    return next(group for group in cluster_spec["workerGroupSpecs"] if group["groupName"] == name)


def _cluster_args(config: dict) -> dict:
    return applications(config)[0]["args"]["cluster"]


def _misspell_target_label(config, cluster_spec):
    _cluster_args(config)["target_node_labels"] = {"specserve.io/role": "targets"}


def _unlabel_draft_group(config, cluster_spec):
    del _worker_group(cluster_spec, "draft-gpu")["labels"]


def _targets_on_draft_pods(config, cluster_spec):
    _cluster_args(config)["target_node_labels"] = dict(_cluster_args(config)["draft_node_labels"])
    router(applications(config)[0])["autoscaling_config"]["max_replicas"] = 1


def _draft_pods_too_few(config, cluster_spec):
    """As many GPUs in all (5 x 2 + 3 x 1 >= 4 x 3), so only the per-role check notices."""
    _worker_group(cluster_spec, "target-gpu")["maxReplicas"] = 5
    _worker_group(cluster_spec, "draft-gpu")["maxReplicas"] = 3


def _drafts_on_full_target_pods(config, cluster_spec):
    """Each role fits the target pods alone (8 of 8 GPUs, 4 of 8), not both together."""
    _cluster_args(config)["draft_node_labels"] = dict(_cluster_args(config)["target_node_labels"])


def _fail_instead_of_waiting(config, cluster_spec):
    _cluster_args(config)["autoscaling_cluster"] = False


def _give_up_before_a_pod_starts(config, cluster_spec):
    _cluster_args(config)["placement_timeout_s"] = 30


@pytest.mark.parametrize("break_it, check, expected", [
    (_misspell_target_label, placement_problems, "on nodes labelled specserve.io/role=targets, which have 0"),
    (_unlabel_draft_group, placement_problems, "draft actors need"),
    (_targets_on_draft_pods, placement_problems, "can hold a whole target group"),
    (_draft_pods_too_few, placement_problems, "draft actors need 4 GPUs"),
    (_drafts_on_full_target_pods, placement_problems, "target groups and draft actors need 12 GPUs"),
    (_fail_instead_of_waiting, autoscaling_problems, "autoscaling_cluster is false"),
    (_give_up_before_a_pod_starts, autoscaling_problems, "placement_timeout_s 30"),
])
def test_label_checks_catch_mistakes(break_it, check, expected):
    """The label checks have teeth: on copies of the GPU example and the RayCluster, a label value the
    groups do not carry, a draft group without its label, target groups sent to 1-GPU draft pods,
    too few draft pods at maxReplicas (while the GPUs in all suffice), draft actors sent to target
    pods that hold either role but not both, and a config that would not wait, or not long enough,
    for new pods are each reported."""
    config = yaml.load(GPU_EXAMPLE.read_text(), Loader=Loader)
    (_, cluster_spec), *_ = ray_cluster_specs()
    cluster_spec = copy.deepcopy(cluster_spec)
    assert placement_problems(config, cluster_spec) == autoscaling_problems(config, cluster_spec) == []
    break_it(config, cluster_spec)
    problems = check(config, cluster_spec)
    assert any(expected in problem for problem in problems), problems
    if break_it is _draft_pods_too_few:
        assert capacity_problems(config, cluster_spec) == [], "the label-blind check should have missed it"


def test_malformed_group_label_is_refused():
    """A worker-group label Ray cannot use (the CRD allows any string) fails where the autoscaler
    would refuse it; `ray start --labels` refuses it too."""
    (_, cluster_spec), *_ = ray_cluster_specs()
    cluster_spec = copy.deepcopy(cluster_spec)
    _worker_group(cluster_spec, "target-gpu")["labels"] = {"specserve.io/role!": "target"}
    with pytest.raises(ValueError, match="Invalid label key"):
        autoscaler_node_types(cluster_spec)
