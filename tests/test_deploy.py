"""deploy/kubernetes/: the InferencePool validates against the Inference Extension's own
CRD schema (vendored in deploy/kubernetes/crd/), and every flag and port the manifests
give tierserve exists in `tierserve epp --help` and agrees across the files."""

from pathlib import Path

import jsonschema
import pytest
import yaml

from tierserve.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"


def _docs() -> list[dict]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for d in _docs() if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _schema(version: str = "v1") -> dict:
    crd = yaml.safe_load((DEPLOY / "crd" / "inference.networking.k8s.io_inferencepools.yaml")
                         .read_text())
    v = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return v["schema"]["openAPIV3Schema"]


def test_the_inferencepool_validates_against_the_extensions_crd():
    pool = _one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, _schema())


def test_the_schema_check_can_fail():
    """The vendored schema is strict where it matters: a pool without a picker port or
    with a bad failure mode is refused."""
    pool = _one("InferencePool")
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _schema())
    bad = yaml.safe_load(yaml.safe_dump(pool))
    del bad["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _schema())


def _epp_flags() -> dict:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    epp = sub.choices["epp"]
    return {opt: action for action in epp._actions for opt in action.option_strings}


def test_every_flag_the_picker_is_given_exists_in_its_help():
    flags = _epp_flags()
    container = _one("Deployment", "tierserve-epp")["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "epp"
    given = {}
    for arg in args[1:]:
        assert arg.startswith("--"), arg
        name, _, value = arg.partition("=")
        assert name in flags, f"{name} is not a flag of `tierserve epp` (see --help)"
        given[name] = value
    grpc_port = int(given["--grpc-port"])
    http_port = int(given["--port"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": grpc_port, "http": http_port}
    assert container["readinessProbe"]["grpc"]["port"] == grpc_port
    service = _one("Service", "tierserve-epp")
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == ports
    pool = _one("InferencePool")
    assert pool["spec"]["endpointPickerRef"]["name"] == service["metadata"]["name"]
    svc_grpc = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == svc_grpc
    # the replicas the picker lists are the pool's pods, on the pool's target port
    config = yaml.safe_load(_one("ConfigMap", "tierserve-epp")["data"]["epp.yaml"])
    vllm = _one("StatefulSet", "vllm")
    target = pool["spec"]["targetPorts"][0]["number"]
    assert vllm["spec"]["template"]["metadata"]["labels"] == \
        pool["spec"]["selector"]["matchLabels"]
    assert vllm["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] \
        == target
    urls = [b["url"] for b in config["backends"]]
    assert urls == [f"http://vllm-{i}.vllm:{target}" for i in range(vllm["spec"]["replicas"])]


def test_the_picker_reads_the_config_map_it_is_given():
    """The ConfigMap's YAML is a valid `tierserve epp --config` file."""
    from tierserve.server.settings import ServerSettings

    config = yaml.safe_load(_one("ConfigMap", "tierserve-epp")["data"]["epp.yaml"])
    specs = ServerSettings.parse_backends(config["backends"])
    assert [s.kind for s in specs] == ["vllm", "vllm"]
    ServerSettings.parse_fleet(config["fleet"])


def test_the_route_sends_to_the_pool():
    route = _one("HTTPRoute")
    ref = route["spec"]["rules"][0]["backendRefs"][0]
    pool = _one("InferencePool")
    assert (ref["group"], ref["kind"], ref["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
