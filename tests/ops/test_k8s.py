"""deploy/k8s renders and its objects are valid, and deploy/container/Dockerfile is what the docs
say it is.

Rendering: ``kubectl kustomize`` where kubectl exists; otherwise the base's own files are read
(this base uses only resources, a configMapGenerator, labels and an image tag). Schema: the
Kubernetes objects are validated in strict mode against Kubernetes' published JSON schemas
(``kubernetes-validate``); the ServiceMonitor, a CRD they do not cover, gets a structural check.
The ConfigMap's TOML must pass kvrelay's own validation with the Deployment's environment.
No container engine is needed: the Dockerfile is read, not built.
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvrelay.ops.config import parse_config

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "k8s"
DOCKERFILE = REPO / "deploy" / "container" / "Dockerfile"
K8S_VERSION = "1.30.0"
HEALTH_SERVICE = "dynamo.kvrelay.v1.KvEventRelay"


def _render_without_kubectl() -> list[dict[str, Any]]:
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert set(kust) == {"apiVersion", "kind", "labels", "resources", "configMapGenerator",
                         "images"}, "the fallback renderer knows only these fields"  # fmt: skip
    objects = [yaml.safe_load((BASE / r).read_text()) for r in kust["resources"]]
    for gen in kust["configMapGenerator"]:
        data = {f: (BASE / f).read_text() for f in gen["files"]}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": gen["name"]}, "data": data})  # fmt: skip
    (pairs,) = [entry["pairs"] for entry in kust["labels"]]
    for obj in objects:
        obj["metadata"].setdefault("labels", {}).update(pairs)
        if obj["kind"] == "Deployment":
            obj["spec"]["selector"]["matchLabels"].update(pairs)
            obj["spec"]["template"]["metadata"]["labels"].update(pairs)
        if obj["kind"] == "Service":
            obj["spec"]["selector"].update(pairs)
    return objects


def render() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return _render_without_kubectl()
    res = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.fixture(scope="module")
def objects() -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in render()}


def test_renders_the_documented_objects(objects: dict[str, dict[str, Any]]) -> None:
    assert set(objects) == {"Deployment", "Service", "ConfigMap", "ServiceMonitor"}
    if shutil.which("kubectl"):
        # the fallback renderer agrees with kustomize on everything but the generated name
        ours = {o["kind"]: o for o in _render_without_kubectl()}
        for kind, obj in objects.items():
            expected = ours[kind]
            if kind == "ConfigMap":
                assert obj["data"] == expected["data"]
                assert obj["metadata"]["name"].startswith("kvrelay-config-")
            elif kind == "Deployment":
                vols = obj["spec"]["template"]["spec"]["volumes"]
                assert vols[0]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
                images = {c["image"] for c in _containers(obj)}
                assert images == {"kvrelay:0.1.0"}
            else:
                assert obj == expected, kind


def _containers(dep: dict[str, Any]) -> list[dict[str, Any]]:
    spec = dep["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.mark.parametrize("kind", ["Deployment", "Service", "ConfigMap"])
def test_objects_match_the_kubernetes_schema(
    kind: str, objects: dict[str, dict[str, Any]]
) -> None:
    kubernetes_validate.validate(objects[kind], K8S_VERSION, strict=True)


def test_schema_validation_is_not_vacuous(objects: dict[str, dict[str, Any]]) -> None:
    bad = yaml.safe_load(yaml.safe_dump(objects["Deployment"]))
    bad["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["sevice"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_deployment_probes_ports_security_and_config(objects: dict[str, dict[str, Any]]) -> None:
    dep, svc, cm = objects["Deployment"], objects["Service"], objects["ConfigMap"]
    pod = dep["spec"]["template"]
    (main,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"grpc": 50161, "metrics": 50162}
    for probe in ("startupProbe", "readinessProbe"):
        assert main[probe]["grpc"] == {"port": 50161, "service": HEALTH_SERVICE}, probe
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180  # a first compile
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert pod["spec"]["terminationGracePeriodSeconds"] > 10  # > default shutdown_timeout_s
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    for c in _containers(dep):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
    env = {e["name"]: e["value"] for e in main["env"]}
    mounts = {m["mountPath"] for m in main["volumeMounts"]}
    assert env["NUMBA_CACHE_DIR"].startswith("/cache/") and "/cache" in mounts
    # the Service reaches the pod by name, on the container's named ports
    labels = pod["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {
        "grpc": "grpc", "metrics": "metrics",
    }  # fmt: skip
    # the mounted TOML is a valid kvrelay config with the Deployment's environment
    cfg, problems = parse_config(tomllib.loads(cm["data"]["kvrelay.toml"]), env=env)
    assert cfg is not None, problems
    assert (cfg.bind_host, cfg.bind_port, cfg.metrics.port) == ("0.0.0.0", 50161, 50162)
    assert [p.path for p in problems] == ["relay.bind"]  # the plaintext-on-network warning
    # a writable state_dir on a volume (the root is read-only): warm filters after a restart
    assert cfg.relay.state_dir == env["KVRELAY_RELAY_STATE_DIR"] and cfg.relay.state_dir in mounts
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    (state,) = [m for m in main["volumeMounts"] if m["mountPath"] == cfg.relay.state_dir]
    assert "emptyDir" in volumes[state["name"]] and not state.get("readOnly")


def test_service_monitor_structure(objects: dict[str, dict[str, Any]]) -> None:
    sm = objects["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) == {"selector", "endpoints"}
    (ep,) = sm["spec"]["endpoints"]
    assert ep == {"port": "metrics", "path": "/metrics", "interval": "15s"}
    svc_labels = objects["Service"]["metadata"]["labels"]
    assert all(svc_labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())


def _instructions(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_is_slim_non_root_warm_and_exposes_the_ports() -> None:
    steps = _instructions(DOCKERFILE.read_text())
    froms = [rest for word, rest in steps if word == "FROM"]
    assert froms and all("-slim" in f for f in froms)
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    words = [w for w, _ in final]
    user = [rest for w, rest in final if w == "USER"]
    assert user == ["10001:10001"]
    runs_after_user = [rest for w, rest in final[words.index("USER"):] if w == "RUN"]
    assert runs_after_user == ["kvrelay warm"]  # the cache belongs to the user that runs it
    assert "EXPOSE" in words and dict(final)["EXPOSE"].split() == ["50161", "50162"]
    env = dict(final)["ENV"]
    assert "NUMBA_CACHE_DIR=/var/cache/kvrelay/numba" in env and "/opt/kvrelay/venv/bin" in env
    assert dict(final)["ENTRYPOINT"] == '["kvrelay"]'
    # what the Dockerfile copies from the build context exists in the repository
    for w, rest in steps:
        if w == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (REPO / src).exists(), src
    # the init container copies the cache the image warmed
    deploy_text = (BASE / "deployment.yaml").read_text()
    assert "/var/cache/kvrelay/numba/." in deploy_text


def test_dockerignore_keeps_only_what_the_dockerfile_copies() -> None:
    """The build context is what COPY needs and nothing else (a .venv is hundreds of MB)."""
    rules = [ln for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln and not ln.startswith("#")]  # fmt: skip
    assert rules[0] == "**"  # exclude everything, then re-include
    kept = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    steps = _instructions(DOCKERFILE.read_text())
    copies = [rest for w, rest in steps if w == "COPY" and not rest.startswith("--from")]
    copied = {src for rest in copies for src in rest.split()[:-1]}
    assert kept == copied, (kept, copied)


def test_documented_docker_run_binds_both_listeners_on_every_interface() -> None:
    readme = (REPO / "deploy" / "README.md").read_text()
    run = readme.split("docker run", 1)[1].split("```", 1)[0]
    assert "-e KVRELAY_RELAY_BIND=0.0.0.0:50161" in run
    assert "-e KVRELAY_METRICS_BIND=0.0.0.0:50162" in run

