"""The Kubernetes example in docs/ parses and has the shape the docs promise: a
Deployment whose pods are ready on /health and a Service that selects them."""

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
