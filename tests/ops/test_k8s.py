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

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvrelay.ops.config import parse_config
from tests.support.commands import MINIMAL
from tests.support.read_only_root import can_unshare, read_only_root

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
    # SIGKILL never cuts the drain the mounted config allows, nor the liveness probe lose its port
    assert pod["spec"]["terminationGracePeriodSeconds"] > cfg.shutdown_timeout_s
    assert cfg.metrics.enabled
    # a writable state_dir on a volume (the root is read-only): warm filters after a restart; a
    # subdirectory the relay makes private, as the kubelet leaves the volume group-writable
    assert cfg.relay.state_dir == env["KVRELAY_RELAY_STATE_DIR"]
    parent = str(Path(cfg.relay.state_dir).parent)
    assert parent in mounts and cfg.relay.state_dir != parent
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    (state,) = [m for m in main["volumeMounts"] if m["mountPath"] == parent]
    assert "emptyDir" in volumes[state["name"]] and not state.get("readOnly")


#: The least a probe waits for its answer: 50 times the longest the docs measure a relay's loop
#: held at once (a full collection with nothing frozen, docs/scaling.md: up to 96.80 ms; scrapes,
#: windows and descriptor changes hold it for less), the liveness probe's timeout.
PROBE_TIMEOUT_S = 5
#: Bytes of exact state per membership, at most (docs/architecture.md: about 14-18.5).
EXACT_BYTES_PER_MEMBERSHIP = 18.5
#: What the kubelet keeps of a container's log by default (containerLogMaxFiles 5 x 10 MiB).
CONTAINER_LOGS = 50 * 2**20
#: The init container's copy of the image's compiled kernels (a few MB), and a node's own.
KERNEL_CACHE = 64 * 2**20


def _quantity(q: str) -> int:
    """A Kubernetes binary quantity (``128Mi``) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    found = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", q)
    assert found, q
    return int(found.group(1)) * units.get(found.group(2) or "", 1)


def test_probes_wait_out_a_busy_loop_and_storage_is_bounded(
    objects: dict[str, dict[str, Any]],
) -> None:
    """Before: the startup and readiness probes had the kubelet's default 1 s timeout (liveness
    5 s): a loop held a second on a busy node failed them, and two in a row took the only
    replica out of rotation. Each probe now waits far longer than any loop hold the docs
    measure, and no longer than its period. The state volume has room for twice the largest
    pool's state file (a replacement writes the new file beside the old one) with that pool's
    filter full, and the container's ephemeral storage covers it, the kernel cache and its logs:
    unbounded, a full disk of the node was the limit."""
    dep, svc, cm = objects["Deployment"], objects["Service"], objects["ConfigMap"]
    pod = dep["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = main[name]
        assert probe.get("timeoutSeconds", 1) >= PROBE_TIMEOUT_S, name  # the default is 1
        assert probe["timeoutSeconds"] <= probe["periodSeconds"], name
    assert {p["name"]: p.get("appProtocol") for p in svc["spec"]["ports"]} == {
        "grpc": "kubernetes.io/h2c", "metrics": "http",
    }  # fmt: skip
    env = {e["name"]: e["value"] for e in main["env"]}
    cfg, problems = parse_config(tomllib.loads(cm["data"]["kvrelay.toml"]), env=env)
    assert cfg is not None, problems
    # the largest pool's file with its filter full: 8-byte buckets of 4 fingerprints each
    largest = max(p.bucket_count * (8 + 4 * EXACT_BYTES_PER_MEMBERSHIP) for p in cfg.relay.pools)
    assert cfg.relay.state_dir is not None
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    state = volumes[mounts[str(Path(cfg.relay.state_dir).parent)]]["emptyDir"]
    assert _quantity(state["sizeLimit"]) >= 2 * largest
    on_disk = {v["name"] for v in pod["volumes"]
               if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"}  # fmt: skip
    assert on_disk == {"state", "cache"}, "what the ephemeral-storage limit covers"
    res = main["resources"]
    limit = _quantity(res["limits"]["ephemeral-storage"])
    assert _quantity(res["requests"]["ephemeral-storage"]) <= limit
    assert limit >= _quantity(state["sizeLimit"]) + KERNEL_CACHE + CONTAINER_LOGS


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

def test_the_pod_serves_until_its_endpoints_are_gone_then_drains_within_its_grace(
    objects: dict[str, dict[str, Any]],
) -> None:
    """The kubelet sends SIGTERM while the pod's removal from the Service's endpoints is still on
    its way to every node's kube-proxy, and the relay closes its listener at SIGTERM
    (docs/operations.md, "Health"): a router reconnecting in that window is refused. A preStop
    sleep keeps the relay serving until the endpoints are gone; the grace period, which counts
    from the preStop hook, must then still cover the whole drain and the state save
    (``shutdown_timeout_s`` of the mounted config), or SIGKILL cuts them."""
    dep, cm = objects["Deployment"], objects["ConfigMap"]
    pod = dep["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    hook = main.get("lifecycle", {}).get("preStop")
    assert hook is not None, "no preStop: SIGTERM races the endpoint removal"
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    pause = float(command[1])
    assert pause >= 3, "kube-proxy needs a few seconds to drop the endpoint on a busy cluster"
    env = {e["name"]: e["value"] for e in main["env"]}
    cfg, problems = parse_config(tomllib.loads(cm["data"]["kvrelay.toml"]), env=env)
    assert cfg is not None, problems
    grace = pod["terminationGracePeriodSeconds"]
    assert pause + cfg.shutdown_timeout_s + 5 <= grace, (pause, cfg.shutdown_timeout_s, grace)


def test_documented_docker_run_outwaits_the_drain() -> None:
    """``docker stop`` sends SIGTERM and SIGKILLs after 10 s by default: exactly the relay's
    default ``shutdown_timeout_s``, so a drain that needs its whole allowance loses the state save
    to the SIGKILL. The documented ``docker run`` gives the container more time than that."""
    readme = (REPO / "deploy" / "README.md").read_text()
    run = readme.split("docker run", 1)[1].split("```", 1)[0]
    found = re.search(r"--stop-timeout[ =](\d+)", run)
    assert found, "docker run without --stop-timeout: docker stop kills after 10 s"
    default = parse_config(tomllib.loads(MINIMAL), env={})[0]
    assert default is not None
    assert int(found.group(1)) >= default.shutdown_timeout_s + 10


def test_the_pod_runs_four_workers_with_a_writable_runtime_directory(
    objects: dict[str, dict[str, Any]],
) -> None:
    """``workers = 4`` needs a writable runtime directory for its internal socket: the runtime
    directory the Deployment names is an in-memory emptyDir mounted there."""
    dep, cm = objects["Deployment"], objects["ConfigMap"]
    (main,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in main["env"]}
    cfg, problems = parse_config(tomllib.loads(cm["data"]["kvrelay.toml"]), env=env)
    assert cfg is not None, problems
    assert cfg.workers == 4
    assert main["resources"]["requests"]["cpu"] == "4", "one CPU per process"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    assert cfg.runtime_dir in mounts, "the runtime directory is a mounted volume"
    assert volumes[mounts[cfg.runtime_dir]]["emptyDir"]["medium"] == "Memory"


def test_the_pod_meets_the_restricted_pod_security_standard(
    objects: dict[str, dict[str, Any]],
) -> None:
    """What the "restricted" Pod Security Standard checks (Kubernetes 1.30), as deploy/README.md
    and docs/security.md say the pod meets it: every container, the init container included."""
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(key), key
    allowed = {"configMap", "emptyDir", "projected", "secret", "downwardAPI",
               "persistentVolumeClaim", "ephemeral", "csi"}  # fmt: skip
    for vol in pod["volumes"]:
        assert set(vol) - {"name"} <= allowed, vol
    pod_sc = pod["securityContext"]
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in _containers(objects["Deployment"]):
        sc = {**pod_sc, **c.get("securityContext", {})}
        assert sc["runAsNonRoot"] is True and sc.get("runAsUser", 1) != 0, c["name"]
        assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert set(sc["capabilities"].get("add", [])) <= {"NET_BIND_SERVICE"}, c["name"]
        assert sc["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost"), c["name"]
        assert not any("hostPort" in port for port in c.get("ports", [])), c["name"]


def _service_link_env(svc: dict[str, Any], cluster_ip: str) -> dict[str, str]:
    """The variables the kubelet gives every container of a pod with ``enableServiceLinks`` (the
    default) for one Service of its namespace, as ``pkg/kubelet/envvars`` makes them: the name
    upper-cased with ``-`` as ``_``, then ``_SERVICE_HOST``, ``_SERVICE_PORT[_<PORT NAME>]``,
    ``_PORT`` and Docker's link variables per port."""
    prefix = svc["metadata"]["name"].upper().replace("-", "_")
    ports = svc["spec"]["ports"]
    env = {f"{prefix}_SERVICE_HOST": cluster_ip, f"{prefix}_SERVICE_PORT": str(ports[0]["port"])}
    for i, sp in enumerate(ports):
        proto = sp.get("protocol", "TCP")
        url = f"{proto.lower()}://{cluster_ip}:{sp['port']}"
        if "name" in sp:
            env[f"{prefix}_SERVICE_PORT_{sp['name'].upper().replace('-', '_')}"] = str(sp["port"])
        if i == 0:
            env[f"{prefix}_PORT"] = url
        link = f"{prefix}_PORT_{sp['port']}_{proto.upper()}"
        env.update({link: url, f"{link}_PROTO": proto.lower(), f"{link}_PORT": str(sp["port"]),
                    f"{link}_ADDR": cluster_ip})  # fmt: skip
    return env


def test_the_pod_starts_beside_services_whose_names_read_as_overrides(
    objects: dict[str, dict[str, Any]], tmp_path: Path,
) -> None:
    """Another Service of the namespace named like a section of the relay's overrides (a mirror
    tier behind ``kvrelay-mirror``, docs/scaling.md; ``kvrelay-metrics``; a second shard's
    ``kvrelay-relay-b``) would give the pod ``KVRELAY_MIRROR_SERVICE_HOST`` & co. through the
    kubelet's service links: overrides of keys that do not exist, which the relay refuses to
    start on. The pod turns the links off, and mounts no service account token it has no use
    for; the container's environment, with whatever links remain, passes ``kvrelay
    check-config`` (the same check ``serve`` makes before it starts)."""
    from tests.support.commands import clean_env, kvrelay

    dep, cm, own = objects["Deployment"], objects["ConfigMap"], objects["Service"]
    pod = dep["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken") is False
    (main,) = pod["containers"]
    siblings = [own]
    for name in ("kvrelay-mirror", "kvrelay-metrics", "kvrelay-relay-b"):
        svc = yaml.safe_load(yaml.safe_dump(own))
        svc["metadata"]["name"] = name
        siblings.append(svc)
    # always there, whatever enableServiceLinks says: the API server's own Service
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    if pod.get("enableServiceLinks", True):
        for n, svc in enumerate(siblings):
            env.update(_service_link_env(svc, f"10.96.7.{n + 10}"))
    assert "KVRELAY_MIRROR_SERVICE_HOST" in _service_link_env(siblings[1], "10.96.7.1")
    env.update({e["name"]: e["value"] for e in main["env"]})  # the container's own win
    (tmp_path / "kvrelay.toml").write_text(cm["data"]["kvrelay.toml"])
    res = kvrelay("check-config", str(tmp_path / "kvrelay.toml"), env=clean_env(**env))
    assert res.returncode == 0, res.stdout + res.stderr
    assert ": ok: " in res.stdout and "gRPC 0.0.0.0:50161" in res.stdout, res.stdout
    assert "metrics 0.0.0.0:50162" in res.stdout, res.stdout


# ---- a real start of the manifest's settings on a read-only root ------------------------------


def _seed_kernel_cache(dst: Path) -> None:
    """What the init container does (copy the image's compiled kernels into ``/cache``), from
    this checkout's in-tree numba cache: ``NUMBA_CACHE_DIR`` keeps each source directory's files
    in ``<dir name>_<sha1 of its absolute path>``. If numba ever lays it out otherwise, the
    daemon compiles instead: slower, never wrong."""
    import hashlib

    for index in (REPO / "kvrelay").rglob("__pycache__/*.nbi"):
        src = index.parent.parent
        sub = dst / f"{src.name}_{hashlib.sha1(str(src).encode()).hexdigest()}"
        sub.mkdir(parents=True, exist_ok=True)
        for f in index.parent.glob(index.name.rsplit(".", 2)[0] + ".*"):
            shutil.copy2(f, sub / f.name)




def _process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


async def test_the_manifest_starts_four_workers_on_a_read_only_root(
    objects: dict[str, dict[str, Any]], tmp_path: Path,
) -> None:
    """The Deployment's container (its args, env and the ConfigMap's TOML) started for real with
    ``workers`` = 2 (two processes fit this machine; 4 only adds workers) on a read-only root.

    Where the test can unshare a mount namespace (root), every mount is read-only there and the
    pod's volumes are the only writable paths, as in the pod; otherwise the same start runs
    without it and $TMPDIR and $HOME, where a process writes by default, must stay empty. The
    volumes' mount paths (/etc/kvrelay, /cache, /run/kvrelay) become directories of the test,
    the listeners bind loopback ports chosen here (the manifest's fixed ports may be taken on a
    shared machine), and the engine is a simulator. The startup probe's check (gRPC health of
    the relay's service) must pass and a router must be served through a fan-out worker."""
    import asyncio
    import os
    import signal
    import socket
    import sys

    from grpclib.client import Channel
    from grpclib.health.v1.health_grpc import HealthStub
    from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

    from kvrelay._proto.dynamo.kvrelay import v1 as pb
    from kvrelay.sim.config import SimConfig
    from kvrelay.sim.engine import SimEngine
    from tests.support.commands import clean_env
    from tests.support.rig import catalog_producer, first_matching

    dep, cm = objects["Deployment"], objects["ConfigMap"]
    pod = dep["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    vol = tmp_path / "volumes"
    mapped = {m["mountPath"]: vol / m["name"] for m in main["volumeMounts"]}

    def local(path: str) -> str:
        for mount, where in mapped.items():
            if path == mount or path.startswith(mount + "/"):
                return str(where) + path[len(mount):]
        return path

    engine = SimEngine(SimConfig(name="k0", seed=24, capacity_blocks=64))
    await engine.start()
    assert engine.grpc_port is not None and engine.metrics_port is not None
    toml = cm["data"]["kvrelay.toml"]
    host = re.search(r'^host = "([^"]+)"$', toml, re.M)
    assert host and "grpc_port = 50051" in toml and "metrics_port = 8000" in toml
    toml = (toml.replace(host.group(0), 'host = "127.0.0.1"')
            .replace("grpc_port = 50051", f"grpc_port = {engine.grpc_port}")
            .replace("metrics_port = 8000", f"metrics_port = {engine.metrics_port}"))  # fmt: skip
    for where in mapped.values():
        where.mkdir(parents=True)
        # as the kubelet leaves an emptyDir with fsGroup set: group- and world-writable, setgid
        where.chmod(0o2777)
    config_mount = next(m["mountPath"] for m in main["volumeMounts"] if m["name"] == "config")
    (Path(local(config_mount)) / "kvrelay.toml").write_text(toml)
    env = {e["name"]: local(e["value"]) for e in main["env"]}
    assert env["KVRELAY_RELAY_WORKERS"] == "4"
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env.update(KVRELAY_RELAY_WORKERS="2", KVRELAY_RELAY_BIND=f"127.0.0.1:{ports[0]}",
               KVRELAY_METRICS_BIND=f"127.0.0.1:{ports[1]}")  # fmt: skip
    _seed_kernel_cache(Path(env["NUMBA_CACHE_DIR"]))
    runtime = Path(env["KVRELAY_RELAY_RUNTIME_DIR"])
    scratch = {name: tmp_path / name for name in ("tmp", "home")}
    for d in scratch.values():
        d.mkdir()
    writable = [str(mapped[m["mountPath"]]) for m in main["volumeMounts"]
                if not m.get("readOnly")]  # fmt: skip
    args = [local(a) for a in main["args"]]
    command = [sys.executable, "-m", "kvrelay", *args]
    namespaced = can_unshare()
    if namespaced:
        command = read_only_root(command)
    full_env = clean_env(**env, TMPDIR=str(scratch["tmp"]), HOME=str(scratch["home"]),
                         KVRELAY_TEST_PROBE=str(tmp_path / "probe"),
                         KVRELAY_TEST_WRITABLE=" ".join(writable))  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *command, env=full_env, cwd=REPO, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async def serving() -> bool:
            try:
                async with Channel("127.0.0.1", ports[0]) as ch:
                    reply = await asyncio.wait_for(HealthStub(ch).Check(
                        HealthCheckRequest(service=HEALTH_SERVICE)), 5)  # fmt: skip
                return bool(reply.status == HealthCheckResponse.SERVING)
            except Exception:
                return False

        for _ in range(600):
            if proc.returncode is not None or await serving():
                break
            await asyncio.sleep(0.2)
        if proc.returncode is not None or not await serving():
            if proc.returncode is None:
                proc.kill()
            err = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
            raise AssertionError(f"not serving (rc {proc.returncode}): {err[-3000:]}")
        [sock] = list(runtime.glob("kvrelay-*/ingest.sock"))
        assert os.stat(sock.parent).st_mode & 0o777 == 0o700
        async with Channel("127.0.0.1", ports[0]) as ch:
            producer = await catalog_producer(ch)  # served by the fan-out worker
            first = await first_matching(
                ch, "SubscribeKvPool",
                pb.SubscribeKvPoolRequest(subscriber_id="k8s", expected_producer=producer,
                                          contract_marker=0x4B565231),
                pb.FilterUpdate, lambda fu: True,
            )  # fmt: skip
            assert int(first.kind) == int(pb.FilterUpdateKind.SNAPSHOT_CHUNK)

        # Every process of the pod held 1.5 s (stopped), as a loop on a busy node can be: the
        # kubelet's default 1 s timeout fails the probe, the manifest's waits the hold out.
        async def check(timeout: float) -> bool:
            async with Channel("127.0.0.1", ports[0]) as ch:
                reply = await asyncio.wait_for(HealthStub(ch).Check(
                    HealthCheckRequest(service=HEALTH_SERVICE)), timeout)  # fmt: skip
            return bool(reply.status == HealthCheckResponse.SERVING)

        held = _process_tree(proc.pid)
        assert len(held) >= 2, "the ingest process and its fan-out worker"
        probes = [asyncio.create_task(check(t))
                  for t in (1, main["readinessProbe"].get("timeoutSeconds", 1))]  # fmt: skip
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.5)
        finally:
            for pid in held:
                os.kill(pid, signal.SIGCONT)
        with pytest.raises(TimeoutError):
            await probes[0]
        assert await probes[1], "the manifest's probe sees SERVING once the hold ends"

        # The drain refuses new connections from its start, so the readiness probe fails and a
        # reconnecting router tries elsewhere at once, even while a worker's drain is held (a
        # stream whose request never comes keeps it up to its grace, a quarter of
        # shutdown_timeout_s). Before: the ingest process held its copy of the listener to the
        # end, and each connection sat in the backlog unanswered, then was reset.
        held_ch = Channel("127.0.0.1", ports[0])
        held = HealthStub(held_ch).Watch.open()
        await held.__aenter__()
        await held.send_request()  # headers, no message
        await asyncio.sleep(0.3)
        proc.terminate()
        t0 = asyncio.get_running_loop().time()
        refused_after, alive = None, False
        while proc.returncode is None and refused_after is None:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", ports[0])
                writer.close()
            except ConnectionRefusedError:
                refused_after = asyncio.get_running_loop().time() - t0
                alive = proc.returncode is None
            await asyncio.sleep(0.05)
        held_ch.close()
        assert refused_after is not None and alive, "no connection refused during the drain"
        assert refused_after < 1.5, f"connections left unanswered for {refused_after:.1f} s"
        rc = await asyncio.wait_for(proc.wait(), 30)
        err = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
        assert rc == 0, err[-3000:]
        assert '"worker_serving"' in err or "worker_serving" in err
        # the worker set the daemon's 1 ms GIL switch interval too (ops/event_loop.py)
        served = [line for line in err.splitlines() if "worker_serving" in line]
        assert served and all("gil_switch_interval_s" in ln and "0.001" in ln for ln in served)
        assert not list(runtime.iterdir()), "the internal socket's directory is removed"
        # the clean stop saved the pool's state where the next container start finds it
        assert "state_dir_unusable" not in err, err[-3000:]
        assert list(Path(env["KVRELAY_RELAY_STATE_DIR"]).glob("*")), "no state saved"
        for name, d in scratch.items():
            assert not list(d.iterdir()), f"${name.upper()} was written: {list(d.iterdir())}"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await engine.stop()
