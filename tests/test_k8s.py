"""deploy/k8s: every overlay renders with `kubectl kustomize`, every rendered object validates offline
(core objects against the Kubernetes 1.32 schemas that `kubernetes-validate` ships, strict; the KEDA
and prometheus-operator objects against the JSON schemas committed in deploy/k8s/schemas), and the
pieces agree with each other and with the code: Services select Deployments' pods, probes and
Services name declared ports, the gateway's targets name Services, the container args parse as
pdserve commands, the autoscalers read the metric the gateway exports, and the alerts name metrics
the services define. No cluster is needed: nothing is applied.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.targets import parse_target
from pdserve.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
SCHEMAS = K8S / "schemas"
KUBERNETES_VERSION = "1.32.0"  # the kubectl on our machines; kubernetes-validate ships its schemas
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: `kubectl kustomize` renders "
                                                         "the manifests (install kubectl >= 1.27 to run these tests)")

OVERLAYS = ["cpu", "gpu", "cpu-keda"]
# Builds that are not overlays of their own: the base alone and each component on it (a component
# cannot be rendered by itself), written as throwaway kustomizations that reference them.
COMPOSED = {
    "base": [],
    "base+hpa": ["hpa"],
    "base+hpa+keda": ["hpa", "keda"],
    "base+monitoring": ["monitoring"],
    "base+external-redis": ["external-redis"],
    "base+external-secrets": ["external-secrets"],
}
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobject_v1alpha1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrule_v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitor_v1.json",
}
PDSERVE_KINDS = ("gateway", "prefill", "decode", "kvstore")
SLO_METRIC = "pdserve_slo_desired_replicas_hint"


def kustomize(directory: Path) -> list[dict]:
    result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {directory}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    rendered = {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}
    for name, components in COMPOSED.items():
        directory = tmp_path_factory.mktemp(name.replace("+", "_"))
        (directory / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "pdserve",
            "resources": [os.path.relpath(K8S / "base", directory)],  # kustomize refuses absolute paths
            "components": [os.path.relpath(K8S / "components" / c, directory) for c in components]}))
        rendered[name] = kustomize(directory)
    return rendered


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def all_containers(deployment: dict) -> Iterator[dict]:
    spec = pod_spec(deployment)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def main_container(deployment: dict) -> dict:
    name = deployment["metadata"]["name"]
    return next(c for c in pod_spec(deployment)["containers"] if c["name"] == name)


def port_number(container: dict, port: int | str) -> int:
    """A probe's or Service's container port (a number or a name) as declared by the container."""
    declared = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    if isinstance(port, str):
        assert port in declared, f"{container['name']}: port {port!r} is not a declared container port"
        return declared[port]
    assert port in declared.values(), f"{container['name']}: port {port} is not a declared container port"
    return port


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft202012Validator(schema)


# -- rendering and schemas -------------------------------------------------------------------------

def test_every_overlay_renders_the_whole_stack(builds: dict[str, list[dict]]) -> None:
    for name, docs in builds.items():
        deployments = objects(docs, "Deployment")
        assert set(PDSERVE_KINDS) <= set(deployments), name
        assert set(PDSERVE_KINDS) <= set(objects(docs, "Service")), name
        assert {"pdserve-internal-token", "pdserve-kv-mac-key"} <= set(objects(docs, "Secret")) \
            or name == "base+external-secrets", name
        assert all(d["metadata"].get("namespace") == "pdserve" for d in docs if d["kind"] != "Namespace"), name
    for name in ("cpu", "gpu"):
        assert set(objects(builds[name], "HorizontalPodAutoscaler")) == {"prefill", "decode"}
        assert not objects(builds[name], "ScaledObject")
    keda = builds["cpu-keda"]
    assert set(objects(keda, "ScaledObject")) == {"prefill", "decode"}
    assert not objects(keda, "HorizontalPodAutoscaler"), "KEDA owns the HPAs: two autoscalers would fight"
    assert objects(keda, "PrometheusRule") and objects(keda, "PodMonitor")
    assert "redis" not in objects(builds["base+external-redis"], "Deployment")
    assert "redis" not in objects(builds["base+external-redis"], "Service")
    assert not objects(builds["base+external-secrets"], "Secret")


def test_the_base_needs_no_crd(builds: dict[str, list[dict]]) -> None:
    for name in ("base", "cpu", "gpu"):
        groups = {d["apiVersion"] for d in builds[name]}
        assert not {g for g in groups if g.startswith(("keda.sh/", "monitoring.coreos.com/"))}, name


def test_core_objects_match_the_kubernetes_schemas(builds: dict[str, list[dict]]) -> None:
    checked = 0
    for name, docs in builds.items():
        for doc in docs:
            if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
                continue
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {err.message} at "
                            f"{'/'.join(map(str, err.path))}")
            checked += 1
    assert checked > 100


def test_crd_objects_match_their_committed_schemas(builds: dict[str, list[dict]]) -> None:
    seen = set()
    for name, docs in builds.items():
        for doc in docs:
            key = (doc["apiVersion"], doc["kind"])
            if key not in CRD_SCHEMAS:
                assert not key[0].startswith(("keda.sh/", "monitoring.coreos.com/")), f"{key}: no schema committed"
                continue
            errors = sorted(crd_validator(*key).iter_errors(doc), key=lambda e: list(e.path))
            assert not errors, (f"{name}: {doc['kind']}/{doc['metadata']['name']}: "
                                + "; ".join(f"{'/'.join(map(str, e.path))}: {e.message[:200]}" for e in errors))
            seen.add(key)
    assert seen == set(CRD_SCHEMAS)


def test_the_validators_are_strict(builds: dict[str, list[dict]]) -> None:
    """A misspelt field fails: the schemas are closed, as the API server is with --validate=strict."""
    deployment = copy.deepcopy(objects(builds["cpu"], "Deployment")["decode"])
    main_container(deployment)["readinessProbe"]["grcp"] = {"port": 50062}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    keda = builds["cpu-keda"]
    scaled = copy.deepcopy(objects(keda, "ScaledObject")["prefill"])
    scaled["spec"]["minReplicaCounts"] = 1
    assert list(crd_validator("keda.sh/v1alpha1", "ScaledObject").iter_errors(scaled))
    scaled = copy.deepcopy(objects(keda, "ScaledObject")["prefill"])
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # KEDA's metadata is map[string]string
    assert list(crd_validator("keda.sh/v1alpha1", "ScaledObject").iter_errors(scaled))
    rule = copy.deepcopy(objects(keda, "PrometheusRule")["pdserve"])
    rule["spec"]["groups"][0]["rules"][1]["for"] = "one minute"
    assert list(crd_validator("monitoring.coreos.com/v1", "PrometheusRule").iter_errors(rule))


# -- consistency ------------------------------------------------------------------------------------

def test_services_select_deployments_and_name_their_ports(builds: dict[str, list[dict]]) -> None:
    for name, docs in builds.items():
        deployments = objects(docs, "Deployment")
        for svc_name, svc in objects(docs, "Service").items():
            selector = svc["spec"]["selector"]
            matched = [d for d in deployments.values()
                       if selects(selector, d["spec"]["template"]["metadata"]["labels"])]
            assert len(matched) == 1, f"{name}: Service {svc_name} selects {len(matched)} Deployments"
            container = main_container(matched[0])
            for port in svc["spec"]["ports"]:
                port_number(container, port.get("targetPort", port["port"]))
        for dep_name, dep in deployments.items():
            labels = dep["spec"]["template"]["metadata"]["labels"]
            assert selects(dep["spec"]["selector"]["matchLabels"], labels), dep_name
            for constraint in pod_spec(dep).get("topologySpreadConstraints", []):
                assert selects(constraint["labelSelector"]["matchLabels"], labels), dep_name
        for pdb_name, pdb in objects(docs, "PodDisruptionBudget").items():
            matched = [d for d in deployments.values()
                       if selects(pdb["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])]
            assert len(matched) == 1, f"{name}: PodDisruptionBudget {pdb_name} selects {len(matched)} Deployments"
    for kind in ("prefill", "decode"):
        assert objects(builds["cpu"], "Service")[kind]["spec"]["clusterIP"] == "None", \
            f"{kind}: headless, so that the gateway resolves one address per pod"


def test_probes_use_grpc_health_on_declared_ports(builds: dict[str, list[dict]]) -> None:
    for name, docs in builds.items():
        for dep_name, dep in objects(docs, "Deployment").items():
            for container in pod_spec(dep)["containers"]:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if dep_name == "redis" and probe == "startupProbe":
                        continue
                    assert probe in container, f"{name}: {dep_name} has no {probe}"
                    spec = container[probe]
                    for handler in ("grpc", "tcpSocket", "httpGet"):
                        if handler in spec:
                            port_number(container, spec[handler]["port"])
                    if dep_name in PDSERVE_KINDS:
                        assert "grpc" in spec and "service" not in spec["grpc"], f"{dep_name} {probe}: grpc.health.v1"
                        bind = build_parser().parse_args(container["args"]).bind
                        assert spec["grpc"]["port"] == int(bind.rsplit(":", 1)[1]), f"{dep_name} probes another port"


def test_container_args_are_pdserve_commands_bound_to_all_interfaces(builds: dict[str, list[dict]]) -> None:
    parser = build_parser()
    for name, docs in builds.items():
        for kind in PDSERVE_KINDS:
            container = main_container(objects(docs, "Deployment")[kind])
            try:
                args = parser.parse_args(container["args"])
            except SystemExit:
                pytest.fail(f"{name}: {kind}: `pdserve {' '.join(container['args'])}` does not parse")
            assert args.command == kind
            host, port = args.bind.rsplit(":", 1)
            assert host == "0.0.0.0", f"{kind} must bind all interfaces explicitly (the default is loopback)"
            port_number(container, int(port))
            if kind in ("prefill", "decode"):
                assert (getattr(args, "device", "cpu") == "cuda") == (name == "gpu"), f"{name}: {kind} device"


def test_gateway_targets_name_services(builds: dict[str, list[dict]]) -> None:
    parser = build_parser()
    for name, docs in builds.items():
        services = objects(docs, "Service")
        deployments = objects(docs, "Deployment")
        gateway = parser.parse_args(main_container(deployments["gateway"])["args"])
        targets = {"prefill": parse_target(gateway.prefill), "decode": parse_target(gateway.decode),
                   "kvstore": parse_target(gateway.kvstore)}
        for kind in ("prefill", "decode"):  # every replica its own endpoint
            assert targets[kind].resolve_all, f"{kind}: dns:/// so that each pod is routed to"
        for kind, target in targets.items():
            assert target.host in services, f"{name}: gateway --{kind} {target.host}: no such Service"
            assert target.port in {p["port"] for p in services[target.host]["spec"]["ports"]}
            worker = parser.parse_args(main_container(deployments[target.host])["args"])
            assert worker.command == kind and int(worker.bind.rsplit(":", 1)[1]) == target.port
        for kind in ("prefill", "decode"):
            worker = parser.parse_args(main_container(deployments[kind])["args"])
            assert parse_target(worker.kvstore).host == "kvstore"


def config_data(docs: list[dict]) -> dict[str, str]:
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pdserve-config")]
    return config["data"]


def test_config_and_secrets_reach_the_services_as_compose_gives_them(builds: dict[str, list[dict]]) -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    secret_of = {"internal-token": ("pdserve-internal-token", "PDSERVE_INTERNAL_TOKEN_FILE"),
                 "kv-mac-key": ("pdserve-kv-mac-key", "PDSERVE_KV_MAC_KEY_FILE")}
    for name, docs in builds.items():
        deployments = objects(docs, "Deployment")
        data = config_data(docs)
        assert data["PDSERVE_METRICS_HOST"] == "0.0.0.0" and data["PDSERVE_METRICS_PORT"] == "9100"
        assert data["PDSERVE_SLO_TTFT_P99_MS"] == "250"
        redis_host = re.match(r"redis://(?:[^@]*@)?([^:/]+)", data["PDSERVE_KV_BACKEND"]).group(1)
        if name != "base+external-redis":
            assert redis_host in objects(docs, "Service"), "PDSERVE_KV_BACKEND names the Redis Service"
        configs = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
        secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
        for kind in PDSERVE_KINDS:
            dep = deployments[kind]
            container = main_container(dep)
            assert [ref["configMapRef"]["name"] for ref in container["envFrom"]][0] in configs
            env = {e["name"]: e.get("value") for e in container["env"]}
            volumes = {v["name"]: v for v in pod_spec(dep)["volumes"]}
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            mounted = set()
            for compose_secret in compose[kind].get("secrets", []):
                secret_name, variable = secret_of[compose_secret]
                path = Path(env[variable])
                volume = volumes[mounts[str(path.parent)]]
                assert volume["secret"]["secretName"] == secret_name and path.name == compose_secret, kind
                assert secret_name in secrets or name == "base+external-secrets"
                mounted.add(secret_name)
            given = {v["secret"]["secretName"] for v in volumes.values()
                     if "secret" in v and not v["secret"].get("optional")}
            assert given == mounted, f"{kind}: gets {sorted(given)}, compose gives it {sorted(mounted)}"
            for container in all_containers(dep):
                for mount in container.get("volumeMounts", []):
                    assert mount["name"] in volumes
            for volume in volumes.values():
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in objects(docs, "PersistentVolumeClaim")


def test_placeholder_secrets_are_refused_at_start(builds: dict[str, list[dict]], tmp_path: Path) -> None:
    """The base's secret files are placeholders; every pdserve pod's init container refuses them."""
    for key in ("internal-token", "kv-mac-key"):
        assert (K8S / "base" / "secrets" / key).read_text().strip() == "REPLACE_ME"
    for kind in PDSERVE_KINDS:
        init = pod_spec(objects(builds["cpu"], "Deployment")[kind])["initContainers"]
        (check,) = [c for c in init if c["name"] == "check-secrets"]
        script = check["command"][-1].replace('"/run/secrets"', repr(str(tmp_path)))
        mounts = {m["mountPath"] for m in check["volumeMounts"]}
        assert mounts == {m["mountPath"] for m in main_container(objects(builds["cpu"], "Deployment")[kind])
                          ["volumeMounts"] if m["mountPath"].startswith("/run/secrets/pdserve-")
                          and not m["mountPath"].endswith("-tls")}
    token_dir = tmp_path / "pdserve-token"
    token_dir.mkdir()
    (token_dir / "internal-token").write_text("REPLACE_ME\n")
    refused = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "placeholder secret" in refused.stderr
    (token_dir / "internal-token").write_text("a-real-token-of-32-characters-xx\n")
    accepted = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert accepted.returncode == 0, accepted.stderr


def test_pods_are_hardened_and_sized(builds: dict[str, list[dict]]) -> None:
    for name, docs in builds.items():
        for dep_name, dep in objects(docs, "Deployment").items():
            spec = pod_spec(dep)
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert isinstance(spec["securityContext"]["runAsUser"], int) and spec["securityContext"]["runAsUser"] > 0
            assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
            assert spec["automountServiceAccountToken"] is False
            for container in all_containers(dep):
                sc = container["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, dep_name
                assert sc["capabilities"]["drop"] == ["ALL"], dep_name
                assert {"cpu", "memory"} <= set(container["resources"]["requests"]), dep_name
                assert {"cpu", "memory"} <= set(container["resources"]["limits"]), dep_name
            if dep_name in ("gateway", "prefill", "decode"):
                keys = {c["topologyKey"] for c in spec["topologySpreadConstraints"]}
                assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}, dep_name


def test_gpu_overlay_puts_the_workers_on_gpus(builds: dict[str, list[dict]]) -> None:
    for name in ("cpu", "gpu"):
        for dep_name, dep in objects(builds[name], "Deployment").items():
            container = main_container(dep)
            gpus = {section: container["resources"][section].get("nvidia.com/gpu")
                    for section in ("requests", "limits")}
            on_gpu = name == "gpu" and dep_name in ("prefill", "decode")
            assert gpus == ({"requests": 1, "limits": 1} if on_gpu else {"requests": None, "limits": None}), dep_name
            tolerations = {t["key"] for t in pod_spec(dep).get("tolerations", [])}
            assert ("nvidia.com/gpu" in tolerations) == on_gpu, dep_name
            if dep_name in PDSERVE_KINDS:
                assert container["image"] == ("pdserve-gpu:latest" if name == "gpu" else "pdserve:latest")


# -- autoscaling and alerts agree with the metrics the code exports ---------------------------------

def source_defines_metric(metric: str) -> bool:
    """Whether a prometheus_client metric of this exported name is declared in the services' code."""
    base = re.sub(r"_(bucket|sum|count|total)$", "", metric)
    pattern = re.compile(r'(Counter|Gauge|Histogram|Summary)\(\s*"(%s|%s)"' % (re.escape(metric), re.escape(base)))
    for directory in ("gateway", "pdserve", "kvstore", "prefill", "decode"):
        for path in (REPO / directory).rglob("*.py"):
            if pattern.search(path.read_text(encoding="utf-8", errors="replace")):
                return True
    return False


def test_autoscalers_read_the_gateways_slo_signal(builds: dict[str, list[dict]]) -> None:
    assert source_defines_metric(SLO_METRIC), f"{SLO_METRIC} is no longer defined in gateway/slo.py"
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    exposed = {rule["name"]["as"]: rule for rule in adapter["rules"]["external"]}
    assert SLO_METRIC in exposed and SLO_METRIC in exposed[SLO_METRIC]["seriesQuery"]
    for name in ("cpu", "gpu"):
        deployments = objects(builds[name], "Deployment")
        for hpa_name, hpa in objects(builds[name], "HorizontalPodAutoscaler").items():
            assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
            external = [m["external"] for m in hpa["spec"]["metrics"] if m["type"] == "External"]
            assert [e["metric"]["name"] for e in external] == [SLO_METRIC], hpa_name
            assert external[0]["metric"]["name"] in exposed, "the adapter must serve the metric the HPA reads"
            # the hint is a replica count: AverageValue 1 makes the desired replicas the hint itself
            assert external[0]["target"] == {"type": "AverageValue", "averageValue": "1"}
    for so_name, so in objects(builds["cpu-keda"], "ScaledObject").items():
        assert so["spec"]["scaleTargetRef"]["name"] in objects(builds["cpu-keda"], "Deployment")
        (prometheus,) = [t for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
        assert SLO_METRIC in prometheus["metadata"]["query"] and prometheus["metadata"]["threshold"] == "1"
        assert f'namespace="{so["metadata"]["namespace"]}"' in prometheus["metadata"]["query"], \
            "the query's namespace must be the one the stack runs in"
        assert prometheus["metricType"] == "AverageValue"


def promql_expressions(builds: dict[str, list[dict]]) -> dict[str, str]:
    exprs = {}
    for rule_name, rule in objects(builds["cpu-keda"], "PrometheusRule").items():
        for group in rule["spec"]["groups"]:
            for item in group["rules"]:
                exprs[f"{rule_name}/{item.get('alert') or item.get('record')}"] = item["expr"]
    for so_name, so in objects(builds["cpu-keda"], "ScaledObject").items():
        for trigger in so["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                exprs[f"ScaledObject/{so_name}"] = trigger["metadata"]["query"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    for rule in adapter["rules"]["external"]:
        series = rule["seriesQuery"]
        exprs[f"adapter/{rule['name']['as']}"] = (rule["metricsQuery"].replace("<<.Series>>", series.split("{")[0])
                                                   .replace("<<.LabelMatchers>>", 'namespace="pdserve"'))
        exprs[f"adapter-series/{rule['name']['as']}"] = series
    return exprs


def test_alerts_cover_the_slo_errors_kv_and_workers(builds: dict[str, list[dict]]) -> None:
    items = [item for rule in objects(builds["cpu-keda"], "PrometheusRule").values()
             for group in rule["spec"]["groups"] for item in group["rules"]]
    rules = {item["alert"]: item for item in items if "alert" in item}
    records = {item["record"]: item["expr"] for item in items if "record" in item}
    ttft = rules["PdserveTTFTP99High"]
    expr = ttft["expr"]
    for record, body in records.items():
        expr = expr.replace(record, f"({body})")
    assert "histogram_quantile(0.99" in expr and "pdserve_ttft_seconds_bucket" in expr and "> 0.25" in expr
    assert ttft["for"] == "1m"
    assert "pdserve_requests_total" in rules["PdserveErrorRateHigh"]["expr"]
    assert "pdserve_kv_blocks_used" in rules["PdserveKVCacheNearlyFull"]["expr"]
    assert {"PdserveNoReadyWorker", "PdserveNoScrapedWorker"} <= set(rules)


def test_alert_and_scaler_queries_name_metrics_the_services_export(builds: dict[str, list[dict]]) -> None:
    outside = {"kube_deployment_status_replicas_available", "up"}  # kube-state-metrics, Prometheus itself
    for where, expr in promql_expressions(builds).items():
        for metric in set(re.findall(r"\b(pdserve_[a-z0-9_]+)\b", expr)):
            assert source_defines_metric(metric), f"{where}: {metric} is not a metric any service defines"
        for metric in set(re.findall(r"\b([a-z_]+)\{", expr)) - outside:
            assert metric.startswith("pdserve_"), f"{where}: {metric}: not a pdserve metric"


def test_queries_are_valid_promql(builds: dict[str, list[dict]]) -> None:
    import promql_parser  # the dev extra installs it
    for where, expr in promql_expressions(builds).items():
        try:
            promql_parser.parse(expr)
        except ValueError as err:
            pytest.fail(f"{where}: {err}: {expr}")


def test_committed_crd_schemas_say_where_they_come_from() -> None:
    for filename in CRD_SCHEMAS.values():
        schema = json.loads((SCHEMAS / filename).read_text())
        assert "generate.py" in schema["$comment"] and schema["additionalProperties"] is False
        assert {"apiVersion", "kind", "spec"} <= set(schema["required"])
