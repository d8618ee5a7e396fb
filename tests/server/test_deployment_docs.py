"""The Kubernetes examples in docs/ parse and have the shape the docs promise: a
Deployment whose pods are ready on /health and a Service that selects them; an
InferencePool of those pods behind the endpoint picker."""

from __future__ import annotations

from pathlib import Path

import yaml

MANIFEST = Path(__file__).resolve().parents[2] / "docs" / "k8s" / "pagedserve.yaml"


def test_the_kubernetes_example_is_a_deployment_and_a_service() -> None:
    documents = list(yaml.safe_load_all(MANIFEST.read_text()))
    kinds = {d["kind"]: d for d in documents}
    assert set(kinds) == {"Deployment", "Service"}
    deployment, service = kinds["Deployment"], kinds["Service"]
    assert deployment["apiVersion"] == "apps/v1" and service["apiVersion"] == "v1"
    spec = deployment["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = spec["template"]["spec"]["containers"]
    assert container["args"][0] == "serve"
    port = container["ports"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check["path"] == "/health" and check["port"] in (port["name"], port["containerPort"])
    assert service["spec"]["ports"][0]["targetPort"] in (port["name"], port["containerPort"])
    grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
    shutdown_grace = float(container["args"][container["args"].index("--shutdown-grace-s") + 1])
    assert grace > shutdown_grace


def test_the_inference_pool_example_selects_the_pagedserve_pods() -> None:
    """The InferencePool selects the Deployment's pods on their port, and its endpoint
    picker applies its default (vLLM) metric mapping to them; the objectives and the route
    name that pool."""
    pods = {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}["Deployment"]
    template = pods["spec"]["template"]
    (container,) = template["spec"]["containers"]
    pool_file = MANIFEST.with_name("inferencepool.yaml")
    documents = list(yaml.safe_load_all(pool_file.read_text()))
    (pool,) = [d for d in documents if d["kind"] == "InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert not any(key.endswith("/engine-type") for key in template["metadata"]["labels"])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [
        container["ports"][0]["containerPort"]]
    name = pool["metadata"]["name"]
    objectives = [d for d in documents if d["kind"] == "InferenceObjective"]
    assert objectives and all(o["spec"]["poolRef"]["name"] == name for o in objectives)
    (route,) = [d for d in documents if d["kind"] == "HTTPRoute"]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", name)
    # the body's priority is pagedserve's: the pods must schedule by it
    args = container["args"]
    assert args[args.index("--scheduling-policy") + 1] == "priority"
