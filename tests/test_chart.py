"""The Helm chart (charts/harnessrl) through the real helm v4 binary: lint, render, schema and the objects it makes.

Every rendered built-in object must pass kubernetes-validate --strict for the oldest and newest Kubernetes the
chart supports; the chart's CRD must be the generated one; its webhook configuration must be what the
operator's own renderer makes; and what the Deployment passes to the operator (arguments, environment) must be
accepted by the operator's real CLI and settings parsers. The install itself is in test_chart_cluster.py.
"""

from __future__ import annotations

import base64
import datetime
import importlib.util
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from harnessrl.devcluster.helm import HelmError, ensure_helm

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "harnessrl"
ALL_OPTIONS = CHART / "ci" / "all-options-values.yaml"
NAMESPACE = "harnessrl-system"
KUBE_VERSIONS = ("1.30.0", "1.36.0")
CERT_MANAGER, PROMETHEUS = "cert-manager.io/v1", "monitoring.coreos.com/v1"
OPTIONAL_APIS = ("--api-versions", CERT_MANAGER, "--api-versions", PROMETHEUS)
# Kinds from other projects' CRDs: kubernetes-validate has no schema for them.
FOREIGN_KINDS = {"Issuer", "Certificate", "ServiceMonitor", "PodMonitor"}

# name -> helm template arguments; together they render every template branch.
RENDERINGS = {
    "defaults": (),
    "defaults-with-cert-manager-and-prometheus": OPTIONAL_APIS,
    "all-options": ("-f", str(ALL_OPTIONS), *OPTIONAL_APIS),
    "all-options-embedded-postgres-cert-manager": (
        "-f", str(ALL_OPTIONS), "--set", "postgresql.enabled=true,webhook.certificates=cert-manager",
        *OPTIONAL_APIS,
    ),
    "minimal": ("--set", "webhook.enabled=false,operator.metricsPort=0,monitoring.enabled=false"),
    "ui-embedded-postgres": ("--set", "ui.enabled=true"),
}


@pytest.fixture(scope="session")
def helm() -> Path:
    """The cached helm binary (scripts/test.sh fetches it; fetched here when missing). No helm is a failure."""
    try:
        return ensure_helm()
    except HelmError as error:
        pytest.fail(f"no helm: {error}", pytrace=False)


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(helm), *args], capture_output=True, text=True, check=False, cwd=ROOT)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}", pytrace=False)
    return result


def render(helm: Path, *args: str) -> list[dict[str, Any]]:
    out = run_helm(helm, "template", "hrl", str(CHART), "--namespace", NAMESPACE, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def test_helm_is_the_pinned_v4_and_a_second_call_downloads_nothing(helm: Path) -> None:
    assert run_helm(helm, "version", "--template", "{{.Version}}").stdout == "v4.1.4"
    before = helm.stat().st_mtime_ns
    assert ensure_helm() == helm and helm.stat().st_mtime_ns == before


def test_lint_strict_passes_for_defaults_and_all_options(helm: Path) -> None:
    run_helm(helm, "lint", "--strict", str(CHART))
    run_helm(helm, "lint", "--strict", str(CHART), "-f", str(ALL_OPTIONS))


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_every_rendered_object_passes_kubernetes_validate_strict(helm: Path, rendering: str) -> None:
    docs = render(helm, *RENDERINGS[rendering])
    assert docs
    for doc in docs:
        if doc["kind"] in FOREIGN_KINDS:
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{rendering}: {doc['kind']}/{doc['metadata']['name']} invalid for {version}: {error}")


def test_a_validation_error_is_caught() -> None:
    """The check above can fail: a misspelled container field is refused in strict mode."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "i", "imagePullPolicie": "Always"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBE_VERSIONS[0], strict=True)


def _leaves(value: Any, prefix: str = "") -> set[str]:
    if isinstance(value, dict) and value:
        return set().union(*(_leaves(v, f"{prefix}.{k}" if prefix else k) for k, v in value.items()))
    return {prefix}


def test_the_all_options_file_sets_every_documented_value_differently() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    options = yaml.safe_load(ALL_OPTIONS.read_text())
    # Leaves of the defaults (an empty map such as podAnnotations: {} is one leaf) must all be set.
    missing = {leaf for leaf in _leaves(defaults) if not any(o == leaf or o.startswith(leaf + ".")
                                                             for o in _leaves(options))}
    assert not missing, f"charts/harnessrl/ci/all-options-values.yaml does not set {sorted(missing)}"
    same = {leaf for leaf in _leaves(defaults) & _leaves(options) if _get(defaults, leaf) == _get(options, leaf)}
    assert same == {"rbac.create", "serviceAccount.create", "webhook.enabled", "monitoring.enabled",
                    "dashboards.enabled"}


def _get(values: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        values = values[key]
    return values


def test_every_values_field_is_documented() -> None:
    """Each key of values.yaml has a comment right above it, or sits inside a documented map (resources)."""
    undocumented, documented_at = [], []  # documented_at: (indent, documented) of the enclosing keys
    lines = (CHART / "values.yaml").read_text().splitlines()
    for number, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        documented_at = [(level, ok) for level, ok in documented_at if level < indent]
        ok = lines[number - 1].strip().startswith("#") or any(ok for _, ok in documented_at)
        if not ok and not stripped.endswith(":"):
            undocumented.append(stripped)
        documented_at.append((indent, ok))
    assert not undocumented, f"values.yaml fields without a comment: {undocumented}"


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("operator.podCreatesPerSecond=fast", "/operator/podCreatesPerSecond"),
        ("operator.metricsPort=http", "/operator/metricsPort"),
        ("operator.minPassIntervalSeconds=-1", "/operator/minPassIntervalSeconds"),
        ("webhook.certificates=self-signed", "/webhook/certificates"),
        ("webhook.enabled=yes-please", "/webhook/enabled"),
        ("postgresql.persistence.size=lots", "/postgresql/persistence/size"),
        ("operator.watchNamespaces[0]=Not_A_Namespace", "/operator/watchNamespaces/0"),
        ("operator.replicas=2", "/operator"),  # an unknown field (standalone kopf runs one replica)
        ("image.digest=latest", "/image/digest"),
        ("monitoring.interval=often", "/monitoring/interval"),
        ("ui.port=web", "/ui/port"),
        ("ui.colour=blue", "/ui"),
    ],
)
def test_wrong_values_are_refused_naming_the_field(helm: Path, setting: str, field: str) -> None:
    result = run_helm(helm, "template", "hrl", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0, f"--set {setting} was accepted"
    assert f"at '{field}'" in result.stderr, result.stderr


def test_an_external_store_needs_its_secret_named(helm: Path) -> None:
    result = run_helm(helm, "template", "hrl", str(CHART), "--set", "postgresql.enabled=false", check=False)
    assert result.returncode != 0 and "store.existingSecret" in result.stderr, result.stderr
    result = run_helm(helm, "template", "hrl", str(CHART), "--set", "webhook.certificates=cert-manager",
                      check=False)
    assert result.returncode != 0 and "cert-manager.io/v1" in result.stderr, result.stderr


def test_the_charts_crd_is_the_generated_one() -> None:
    name = "trainingruns.harnessrl.io.yaml"
    assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
        f"charts/harnessrl/crds/{name} differs from crds/{name}: cp crds/{name} charts/harnessrl/crds/"
    )


def test_the_webhook_configuration_is_the_operators_own(helm: Path) -> None:
    from harnessrl.operator.webhook import render_mutating_webhook_configuration

    docs = render(helm)
    chart = one(docs, "MutatingWebhookConfiguration")
    service = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"].endswith("-webhook"))
    ca_bundle = chart["webhooks"][0]["clientConfig"]["caBundle"]
    target = {"namespace": NAMESPACE, "name": service["metadata"]["name"], "port": 443}
    expected = render_mutating_webhook_configuration(target, ca_bundle, chart["metadata"]["name"])
    assert chart["webhooks"] == expected["webhooks"]
    assert service["spec"]["ports"][0]["port"] == 443


def test_cert_manager_injects_the_ca_instead_of_a_generated_bundle(helm: Path) -> None:
    docs = render(helm, "--api-versions", CERT_MANAGER)
    config = one(docs, "MutatingWebhookConfiguration")
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    issued = [c for c in by_kind(docs, "Certificate") if not c["spec"].get("isCA")]
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/{issued[0]['metadata']['name']}"
    )
    assert not [s for s in by_kind(docs, "Secret") if s["type"] == "kubernetes.io/tls"]


def test_the_generated_certificate_is_signed_by_the_bundle_for_the_service_name(helm: Path) -> None:
    from cryptography import x509

    docs = render(helm)
    tls = next(s for s in by_kind(docs, "Secret") if s["type"] == "kubernetes.io/tls")
    ca = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    bundle = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"]
    assert base64.b64decode(bundle) == base64.b64decode(tls["data"]["ca.crt"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert f"hrl-harnessrl-webhook.{NAMESPACE}.svc" in names
    assert cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=3000)


def _containers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    out = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            pod = doc["spec"]["template"]["spec"]
            for container in pod.get("initContainers", []) + pod["containers"]:
                out.append((f"{doc['kind']}/{container['name']}", pod, container))
    return out


def component(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of ``kind`` labelled app.kubernetes.io/component ``name`` (operator, ui, postgresql)."""
    found = [d for d in by_kind(docs, kind) if d["metadata"]["labels"].get("app.kubernetes.io/component") == name]
    assert len(found) == 1, f"expected one {kind} of {name}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


@pytest.mark.parametrize(("rendering", "extra"), [
    ("defaults", set()),
    ("all-options-embedded-postgres-cert-manager", {"Deployment/ui"}),
    ("ui-embedded-postgres", {"Deployment/ui", "Job/ui-role"}),
])
def test_every_container_is_non_root_read_only_with_resources(helm: Path, rendering: str, extra: set[str]) -> None:
    docs = render(helm, *RENDERINGS[rendering])
    containers = _containers(docs)
    assert {name for name, _, _ in containers} == {
        "Deployment/db-upgrade", "Deployment/operator", "StatefulSet/postgresql"
    } | extra
    for name, pod, container in containers:
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"], name
        assert container["resources"]["requests"] and container["resources"]["limits"]["memory"], name


def test_the_operator_deployment_speaks_the_operators_real_cli_and_settings(helm: Path) -> None:
    """Arguments through the real click parser of `harnessrl`, environment through the real settings parsers:
    a flag or variable the operator does not know fails here, not in a crash-looping pod."""
    from harnessrl.cli import main
    from harnessrl.operator.config import OperatorConfig
    from harnessrl.operator.webhook import WebhookSettings

    docs = render(helm, *RENDERINGS["all-options"])
    deployment = component(docs, "Deployment", "operator")
    pod = deployment["spec"]["template"]["spec"]
    operator = next(c for c in pod["containers"] if c["name"] == "operator")
    context = main.make_context("harnessrl", list(operator["args"]))
    command = main.get_command(context, context.protected_args[0])
    params = command.make_context("operator", list(operator["args"][1:])).params
    assert params["namespaces"] == ("team-a", "team-b")
    assert params["metrics_port"] == 9191 and params["liveness"] == "http://0.0.0.0:8181/healthz"
    probe_port = operator["livenessProbe"]["httpGet"]["port"]
    assert next(p for p in operator["ports"] if p["name"] == probe_port)["containerPort"] == 8181

    plain = {var["name"]: var["value"] for var in operator["env"] if "value" in var}
    config = OperatorConfig.from_env(plain)
    assert config.pod_creates_per_second == 5.5 and config.provisioning_timeout_seconds == 600
    assert config.min_pass_interval_seconds == 0.5
    assert config.proxy_image == "registry.example.com/harnessrl/proxy:0.1.0-rc1"
    assert config.learner_image == "registry.example.com/harnessrl/learner:0.1.0-rc1"
    store = next(var for var in operator["env"] if var["name"] == "HARNESSRL_OPERATOR_STORE_URL")
    assert store["valueFrom"]["secretKeyRef"] == {"name": "external-store", "key": "dsn"}
    unknown = {name for name in plain if name.startswith("HARNESSRL_OPERATOR_")} - {
        f"HARNESSRL_OPERATOR_{field.upper()}" for field in OperatorConfig.__dataclass_fields__
    }
    assert not unknown, f"the chart sets variables OperatorConfig does not read: {unknown}"
    webhook = WebhookSettings.from_env(plain)
    assert webhook is not None and webhook.port == 10443 and webhook.configuration is None
    mounts = {m["mountPath"] for m in operator["volumeMounts"]}
    assert str(Path(webhook.certfile).parent) in mounts

    init = pod["initContainers"][0]
    context = main.make_context("harnessrl", list(init["args"]))
    group = main.get_command(context, "db")
    assert group.get_command(context, init["args"][1]) is not None, init["args"]
    assert init["env"][0]["name"] == "HARNESSRL_STORE_URL"  # `harnessrl db upgrade --url`'s default


def test_the_embedded_store_url_points_at_the_postgresql_service(helm: Path) -> None:
    from sqlalchemy.engine import make_url

    docs = render(helm, "--set", "postgresql.password=p@ss:w/rd")
    secret = next(s for s in by_kind(docs, "Secret") if s["metadata"]["name"] == "hrl-harnessrl-postgresql")
    url = make_url(base64.b64decode(secret["data"]["url"]).decode())
    assert url.password == "p@ss:w/rd" and url.drivername == "postgresql+psycopg"
    service = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "hrl-harnessrl-postgresql")
    assert url.host == f"{service['metadata']['name']}.{NAMESPACE}.svc" and url.port == 5432
    statefulset = one(docs, "StatefulSet")
    assert statefulset["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"


def test_monitoring_objects_only_where_the_prometheus_operator_api_exists(helm: Path) -> None:
    without = render(helm)
    assert not by_kind(without, "ServiceMonitor") and not by_kind(without, "PodMonitor")
    with_api = render(helm, "--api-versions", PROMETHEUS)
    monitor = one(with_api, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True  # the series' own namespace and run labels win
    metrics = next(d for d in by_kind(with_api, "Service") if d["metadata"]["name"].endswith("-metrics"))
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= metrics["metadata"]["labels"].items()
    webhook = next(d for d in by_kind(with_api, "Service") if d["metadata"]["name"].endswith("-webhook"))
    assert not selector.items() <= webhook["metadata"]["labels"].items()
    monitors = {d["metadata"]["name"].rsplit("-", 1)[-1]: d for d in by_kind(with_api, "PodMonitor")}
    assert sorted(monitors) == ["learner", "proxy", "rollout"]
    pod_monitor = monitors["rollout"]
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    # It selects the vLLM pods the operator renders, by their labels and port name.
    from harnessrl.operator.config import OperatorConfig
    from harnessrl.operator.render_rollout import render_rollout_deployment
    from harnessrl.spec.problems import parse_training_run

    run = parse_training_run(yaml.safe_load((ROOT / "examples" / "trainingrun-cluster.yaml").read_text()))
    pod = render_rollout_deployment(run, "team-a", "uid", OperatorConfig())["spec"]["template"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= ports
    # and the learner's pod 0 (the Job controller adds the completion-index label), where rank 0 serves
    from harnessrl.operator.render_learner import render_learner_job

    learner = render_learner_job(run, "team-a", "uid", OperatorConfig())["spec"]["template"]
    selector = dict(monitors["learner"]["spec"]["selector"]["matchLabels"])
    assert selector.pop("batch.kubernetes.io/job-completion-index") == "0"
    assert selector.items() <= learner["metadata"]["labels"].items()
    (container,) = learner["spec"]["containers"]
    port = next(p for p in container["ports"] if p["name"] == monitors["learner"]["spec"]["podMetricsEndpoints"][0]["port"])
    assert container["command"][container["command"].index("--metrics-port") + 1] == str(port["containerPort"])
    # and each harness pod's proxy sidecar, on the port the chart gives the operator
    from harnessrl.operator.render_harness import render_harness_pod
    from harnessrl.scheduler import Launch

    deployment = one(render(helm, "--set", "operator.proxyMetricsPort=9101"), "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    config = OperatorConfig.from_env({k: v for k, v in env.items() if k.startswith("HARNESSRL_OPERATOR_") and v is not None})
    assert config.proxy_metrics_port == 9101
    launch = Launch("swe-qwen", "swe-qwen-g000000-r000", 0, "t", {"id": "t"}, 0, 60.0)
    harness = render_harness_pod(run, "team-a", "uid", config, launch)
    proxy_monitor = monitors["proxy"]["spec"]
    assert proxy_monitor["selector"]["matchLabels"].items() <= harness["metadata"]["labels"].items()
    (sidecar,) = harness["spec"]["initContainers"]
    assert [(p["name"], p["containerPort"]) for p in sidecar["ports"]] == [
        (proxy_monitor["podMetricsEndpoints"][0]["port"], 9101)
    ]
    off = render(helm, "--set", "operator.proxyMetricsPort=0", "--api-versions", PROMETHEUS)
    assert sorted(d["metadata"]["name"].rsplit("-", 1)[-1] for d in by_kind(off, "PodMonitor")) == ["learner", "rollout"]


def test_watched_namespaces_bind_workload_rights_only_there(helm: Path) -> None:
    docs = render(helm, "--set", "operator.watchNamespaces={team-a,team-b}")
    assert sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")) == ["team-a", "team-b"]
    cluster_bindings = by_kind(docs, "ClusterRoleBinding")
    assert [b["roleRef"]["name"] for b in cluster_bindings] == ["hrl-harnessrl-cluster"]
    cluster_role = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == "hrl-harnessrl-cluster")
    assert {res for rule in cluster_role["rules"] for res in rule["resources"]} == {
        "customresourcedefinitions", "namespaces"
    }


# --- dashboards ------------------------------------------------------------------------------------------------

METRIC = re.compile(r"\bharnessrl_[a-z_]+\b")
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("harnessrl_chart_dashboards", ROOT / "charts" / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exported_series() -> set[str]:
    """Every series name the proxy, learner and operator registries can expose (labelled metrics have no
    samples until used, so names come from each family's type)."""
    from harnessrl.operator.metrics import OperatorMetrics
    from harnessrl.proxy.metrics import ProxyMetrics
    from harnessrl.trainer.metrics import LearnerMetrics

    names = set()
    for metrics in (ProxyMetrics(), LearnerMetrics(), OperatorMetrics()):
        for family in metrics.registry.collect():
            names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def test_the_charts_dashboards_are_what_the_generator_makes() -> None:
    generated = _generator().render()
    on_disk = {path.name: path.read_text() for path in (CHART / "dashboards").glob("*.json")}
    assert on_disk == generated, "charts/harnessrl/dashboards/ is stale: run python charts/dashboards.py"


def test_every_dashboard_query_names_an_exported_metric_and_every_panel_is_complete() -> None:
    exported = _exported_series()
    dashboards = {name: json.loads(text) for name, text in _generator().render().items()}
    assert set(dashboards) == {"runs.json", "proxy.json", "learner.json", "operator.json"}
    for name, dashboard in dashboards.items():
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        assert {"datasource", "namespace", "run"} <= variables, name
        for variable in dashboard["templating"]["list"]:
            assert set(METRIC.findall(str(variable.get("query", "")))) <= exported, (name, variable["name"])
        for panel in _panels(dashboard):
            where = f"{name}: panel {panel.get('title')!r}"
            assert panel.get("title") and panel.get("datasource", {}).get("uid"), where
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{where} has no unit"
            assert panel["targets"], f"{where} has no query"
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"] and target["refId"], where
                used = set(METRIC.findall(target["expr"]))
                assert used and used <= exported, f"{where}: {sorted(used - exported)} is exported by no code"


def test_a_query_on_a_metric_nobody_exports_is_caught() -> None:
    assert "harnessrl_proxy_requests_total" in _exported_series()
    assert "harnessrl_proxy_requests" not in _exported_series()  # a counter is exposed with _total


def test_dashboards_are_configmaps_for_the_grafana_sidecar(helm: Path) -> None:
    docs = render(helm, "-f", str(ALL_OPTIONS))
    maps = {m["metadata"]["name"]: m for m in by_kind(docs, "ConfigMap")}
    assert len(maps) == 4
    for config_map in maps.values():
        assert config_map["metadata"]["labels"]["grafana_dashboard_harnessrl"] == "yes"
        assert config_map["metadata"]["namespace"] == "monitoring"
        (file_name, text), = config_map["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / file_name).read_text())
    assert not by_kind(render(helm, "--set", "dashboards.enabled=false"), "ConfigMap")


def test_the_ui_deployment_speaks_the_real_cli_and_reads_its_own_secret(helm: Path) -> None:
    """`harnessrl ui`'s real click parser takes the rendered arguments; the store URL is the read-only one the
    user named, and the Service reaches the container's port."""
    from harnessrl.cli import main

    docs = render(helm, *RENDERINGS["all-options"])
    deployment = component(docs, "Deployment", "ui")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/harnessrl/ui:0.1.0-rc1"
    context = main.make_context("harnessrl", list(container["args"]))
    command = main.get_command(context, container["args"][0])
    url = next(v for v in container["env"] if v["name"] == "HARNESSRL_STORE_URL")
    assert url["valueFrom"]["secretKeyRef"] == {"name": "ui-readonly-store", "key": "dsn"}
    params = command.make_context("ui", list(container["args"][1:]), default_map={"store_url": "x"}).params
    assert params["port"] == 8600 and params["host"] == "0.0.0.0"
    assert "HARNESSRL_STORE_URL" in {p.envvar for p in command.params if getattr(p, "envvar", None)}
    service = component(docs, "Service", "ui")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"][0]["port"] == 8600 and service["spec"]["ports"][0]["targetPort"] == "http"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8600}
    assert "Job" not in {d["kind"] for d in docs}  # a role the user made: the chart creates none
    assert not by_kind(render(helm), "Deployment")[1:]  # off by default: the operator alone


def test_the_ui_with_the_embedded_postgresql_gets_a_read_only_role(helm: Path) -> None:
    from sqlalchemy.engine import make_url

    docs = render(helm, *RENDERINGS["ui-embedded-postgres"])
    secret = next(s for s in by_kind(docs, "Secret") if s["metadata"]["name"] == "hrl-harnessrl-ui-store")
    url = make_url(base64.b64decode(secret["data"]["url"]).decode())
    assert url.username == "harnessrl_ui" and url.password == base64.b64decode(secret["data"]["password"]).decode()
    assert url.host == f"hrl-harnessrl-postgresql.{NAMESPACE}.svc" and url.database == "harnessrl"
    job = one(docs, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    env = {v["name"]: v for v in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "hrl-harnessrl-postgresql", "key": "password"}
    assert env["UI_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "hrl-harnessrl-ui-store"
    script = component(docs, "ConfigMap", "ui")["data"]["ui-readonly-role.sql"]
    assert script.strip() == (CHART / "files" / "ui-readonly-role.sql").read_text().strip()
    ui = component(docs, "Deployment", "ui")["spec"]["template"]["spec"]
    assert ui["automountServiceAccountToken"] is False
    assert "PGPASSWORD" not in str(ui)  # the UI pod never sees the owner's password


@pytest.mark.postgres
def test_the_ui_role_script_reads_every_table_and_writes_none(pg_url: str) -> None:
    """The chart's SQL, run by psql as the tables' owner on a real PostgreSQL before and after the migrations:
    the role reads every table (later ones included) and cannot write."""
    import shutil

    from sqlalchemy import text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DBAPIError

    from harnessrl.store import TraceStore

    psql = shutil.which("psql")
    if psql is None:
        pytest.fail("no psql (Debian's postgresql-client, installed with PostgreSQL by scripts/test.sh)")
    owner = make_url(pg_url)
    libpq = owner.set(drivername="postgresql").render_as_string(hide_password=False)
    sql = CHART / "files" / "ui-readonly-role.sql"
    role = "harnessrl_ui_test"

    def run_script() -> None:
        subprocess.run([psql, libpq, "-q", "-v", "ON_ERROR_STOP=1", "-v", f"ui_role={role}", "-v",
                        "ui_password=pw'with\"quotes", "-f", str(sql)], check=True, capture_output=True, text=True)

    run_script()  # before the tables exist: default privileges cover them
    store = TraceStore.connect(pg_url)
    store.upgrade()
    store.add_tasks("r", [{"id": "t"}])
    store.close()
    run_script()  # again, as after an upgrade: idempotent
    reader = TraceStore.connect(owner.set(username=role, password="pw'with\"quotes"))
    try:
        with reader.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM tasks")).scalar() == 1
            assert conn.execute(text("SELECT count(*) FROM llm_calls")).scalar() == 0
        with reader.engine.connect() as conn, pytest.raises(DBAPIError, match="read-only transaction"):
            conn.execute(text("INSERT INTO runs (name, created_at) VALUES ('x', now())"))
        with reader.engine.connect() as conn, pytest.raises(DBAPIError, match="permission denied"):
            conn.execute(text("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE"))  # lifting the default
            conn.commit()
            conn.execute(text("INSERT INTO runs (name, created_at) VALUES ('x', now())"))
    finally:
        reader.close()
        admin = TraceStore.connect(pg_url)
        with admin.engine.connect() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
            conn.commit()
        admin.close()


def test_the_embedded_postgresql_accepts_hundreds_of_proxies(helm: Path) -> None:
    """PostgreSQL's default max_connections (100) is below one connection per harness pod at the operator
    benchmark's concurrency (200): the chart sets 500, and a value changes it."""
    for values, expected in (((), 500), (("--set", "postgresql.maxConnections=800"), 800)):
        [container] = one(render(helm, *values), "StatefulSet")["spec"]["template"]["spec"]["containers"]
        assert container["args"] == ["-c", f"max_connections={expected}"]
