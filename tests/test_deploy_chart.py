"""Issue 25, item 2: the Helm chart (deploy/helm/stovepipe) renders manifests that a
cluster would accept, offline. Every manifest is validated against the Kubernetes schemas
`kubernetes-validate` ships (strict: an unknown field fails), at the oldest and newest
Kubernetes the chart supports; KEDA's resources against the `openAPIV3Schema` of KEDA's
published CRDs (deploy/schemas/keda), with unknown fields refused as a strict API server
does. Then what the manifests must say: static membership (the pod's name as the
instance id; session timeout >= grace + startup allowance, else helm refuses), the KEDA
bounds (min 1, max the stage topics' partitions), the probes, requests, hooks, selectors,
and Kafka's TLS/SASL variables only when set — exactly the ones the worker reads.

helm comes from deploy/tools/helm.sh: built once from its Go module into a cache; `make
test` starts that build beside the tests, and this module waits for it (a lock).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from streams.config.kafka_security import KafkaSecurity
from streams.config.settings import REPO_ROOT, load_settings
from streams.config.topics import load_topics
from streams.devstack.tls import ensure_secrets

CHART = REPO_ROOT / "deploy" / "helm" / "stovepipe"
KEDA_CRDS = REPO_ROOT / "deploy" / "schemas" / "keda"
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())

SECURE = {
    "kafka": {"bootstrap": "b-1.kafka.example.com:9096", "securityProtocol": "SASL_SSL",
              "sasl": {"mechanism": "SCRAM-SHA-512", "username": "stovepipe"},
              "tls": {"caSecret": "kafka-ca", "clientSecret": "kafka-client"}},
    "postgres": {"dsn": "postgresql://stovepipe@db.example.com/stovepipe?sslmode=verify-full"
                        "&sslrootcert=/etc/stovepipe/postgres-tls/ca.crt",
                 "caSecret": "postgres-ca"},
    "secrets": {"values": {"PGPASSWORD": "pg-pass", "STOVEPIPE_KAFKA_SASL_PASSWORD": "k-pass",
                           "STOVEPIPE_API_TOKEN": "api-token"}},
    "topicsYaml": (REPO_ROOT / "topics.yaml").read_text().replace("replication_factor: 1",
                                                                  "replication_factor: 3"),
}
OAUTH = {"kafka": {"securityProtocol": "SASL_SSL",
                   "sasl": {"mechanism": "OAUTHBEARER",
                            "oauthbearer": {"clientId": "stovepipe",
                                            "tokenEndpointUrl": "https://idp.example/token",
                                            "scope": "kafka"}}},
         "secrets": {"existingSecret": "stovepipe-secrets"}}


def _helm() -> str:
    return subprocess.run([str(REPO_ROOT / "deploy" / "tools" / "helm.sh")], check=True,
                          capture_output=True, text=True, timeout=900).stdout.strip()


def _helm_run(*args: str, values: dict[str, Any] | None = None,
              tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    extra: list[str] = []
    if values is not None:
        assert tmp is not None
        path = tmp / f"values-{len(list(tmp.glob('values-*')))}.yaml"
        path.write_text(yaml.safe_dump(values))
        extra = ["--values", str(path)]
    return subprocess.run([_helm(), *args, *extra], capture_output=True, text=True,
                          timeout=300)


def render(tmp: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = _helm_run("template", "stovepipe", str(CHART), "--namespace", "ci",
                    values=values, tmp=tmp)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def refusal(tmp: Path, values: dict[str, Any]) -> str:
    out = _helm_run("template", "stovepipe", str(CHART), values=values, tmp=tmp)
    assert out.returncode != 0, "helm rendered values it should refuse"
    return out.stderr


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = by_kind(docs, kind)
    return doc


def _strict(schema: Any) -> Any:
    """An openAPIV3Schema that refuses unknown fields, as the API server does with
    fieldValidation=Strict: every object that lists its properties allows no others,
    unless it keeps unknown fields on purpose."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def keda_schema(kind: str, version: str, tmp: Path) -> Path:
    plural = {"ScaledObject": "scaledobjects", "TriggerAuthentication": "triggerauthentications"}
    crd = yaml.safe_load((KEDA_CRDS / f"keda.sh_{plural[kind]}.yaml").read_text())
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    path = tmp / f"{kind}-{version}.schema.json"
    path.write_text(json.dumps(_strict(served["schema"]["openAPIV3Schema"])))
    return path


def validate_all(docs: list[dict[str, Any]], tmp: Path) -> None:
    """Every manifest against its schema; AssertionError naming each failure."""
    problems = []
    for n, doc in enumerate(docs):
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        group, _, version = doc["apiVersion"].rpartition("/")
        if group == "keda.sh":
            manifest = tmp / f"manifest-{n}.json"
            manifest.write_text(json.dumps(doc))
            out = subprocess.run(
                [sys.executable, "-m", "check_jsonschema", "--schemafile",
                 str(keda_schema(doc["kind"], version, tmp)), str(manifest)],
                capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                problems.append(f"{name}: {out.stdout}{out.stderr}")
            continue
        for k8s in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, k8s, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{name} (Kubernetes {k8s}): {exc.message} at "
                                f"{'.'.join(map(str, exc.path))}")
    assert not problems, "\n".join(problems)


def worker_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [container] = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chart")


@pytest.fixture(scope="module")
def defaults(tmp: Path) -> list[dict[str, Any]]:
    return render(tmp)


def test_the_default_manifests_validate_against_kubernetes_and_kedas_schemas(
        defaults: list[dict[str, Any]], tmp: Path) -> None:
    assert sorted(d["kind"] for d in defaults) == sorted([
        "ConfigMap", "Job", "NetworkPolicy", "PodDisruptionBudget", "ScaledObject", "Secret",
        "Secret", "Service", "Service", "ServiceAccount", "StatefulSet"])
    validate_all(defaults, tmp)


@pytest.mark.parametrize("values", [SECURE, OAUTH], ids=["scram-mtls", "oauthbearer"])
def test_secure_kafka_manifests_validate_too(values: dict[str, Any], tmp: Path) -> None:
    docs = render(tmp, values)
    assert by_kind(docs, "TriggerAuthentication")
    validate_all(docs, tmp)


def test_the_validation_catches_what_a_cluster_refuses(defaults: list[dict[str, Any]],
                                                       tmp: Path) -> None:
    """The checks could fail: a misspelt field and a wrong type are refused, in a core
    kind and in KEDA's."""
    broken = copy.deepcopy(defaults)
    one(broken, "StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(AssertionError, match="terminationGracePeriod"):
        validate_all(broken, tmp)
    broken = copy.deepcopy(defaults)
    one(broken, "ScaledObject")["spec"]["maxReplicas"] = 12
    with pytest.raises(AssertionError, match="maxReplicas"):
        validate_all(broken, tmp)
    broken = copy.deepcopy(defaults)
    one(broken, "ScaledObject")["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 50
    with pytest.raises(AssertionError, match="ScaledObject"):
        validate_all(broken, tmp)


def test_workers_are_static_members_named_by_their_pods(defaults: list[dict[str, Any]]) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    env = worker_env(defaults)
    assert env["STOVEPIPE_CONSUMER_GROUP_INSTANCE_ID"] == {
        "fieldRef": {"fieldPath": "metadata.name"}}
    pod = one(defaults, "StatefulSet")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    startup = container["startupProbe"]
    allowance = startup["periodSeconds"] * startup["failureThreshold"]
    session = int(env["STOVEPIPE_SESSION_TIMEOUT"])
    assert session == values["worker"]["sessionTimeoutSeconds"]
    assert session >= pod["terminationGracePeriodSeconds"] + allowance
    assert env["STOVEPIPE_APP_ID"] == values["kafka"]["consumerGroup"]


def test_a_session_shorter_than_a_restart_is_refused(tmp: Path) -> None:
    error = refusal(tmp, {"worker": {"sessionTimeoutSeconds": 45}})
    assert "worker.sessionTimeoutSeconds (45) must be at least" in error
    assert "terminationGracePeriodSeconds (30)" in error and "(30 = " in error


def test_keda_scales_the_workers_on_their_groups_lag_within_the_partitions(
        defaults: list[dict[str, Any]]) -> None:
    scaled = one(defaults, "ScaledObject")["spec"]
    stages = load_topics(REPO_ROOT / "topics.yaml").stages.values()
    partitions = {spec.partitions for spec in stages}
    assert scaled["minReplicaCount"] == 1
    assert scaled["maxReplicaCount"] == max(partitions)
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                        "name": one(defaults, "StatefulSet")["metadata"]["name"]}
    [trigger] = scaled["triggers"]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["consumerGroup"] == worker_env(defaults)["STOVEPIPE_APP_ID"]
    # KEDA owns the replicas: the StatefulSet leaves them unset
    assert "replicas" not in one(defaults, "StatefulSet")["spec"]
    assert render_replicas(defaults) is None


def render_replicas(docs: list[dict[str, Any]]) -> int | None:
    return one(docs, "StatefulSet")["spec"].get("replicas")


def test_without_keda_the_replicas_are_fixed(tmp: Path) -> None:
    docs = render(tmp, {"keda": {"enabled": False}, "worker": {"replicas": 3}})
    assert not by_kind(docs, "ScaledObject") and render_replicas(docs) == 3


def test_probes_requests_and_selectors(defaults: list[dict[str, Any]]) -> None:
    stateful = one(defaults, "StatefulSet")
    pod = stateful["spec"]["template"]
    [container] = pod["spec"]["containers"]
    paths = {kind: container[f"{kind}Probe"]["httpGet"]["path"]
             for kind in ("startup", "liveness", "readiness")}
    assert paths == {"startup": "/startupz", "liveness": "/livez", "readiness": "/readyz"}
    job = one(defaults, "Job")["spec"]["template"]["spec"]
    for each in [container, *job["initContainers"], *job["containers"]]:
        assert {"cpu", "memory"} <= set(each["resources"]["requests"]), each["name"]
        assert each["securityContext"]["readOnlyRootFilesystem"] is True
    labels = pod["metadata"]["labels"]
    for kind in ("PodDisruptionBudget",):
        assert one(defaults, kind)["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert stateful["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in by_kind(defaults, "Service"):
        assert service["spec"]["selector"].items() <= labels.items()
    policy = one(defaults, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
    assert policy.items() <= labels.items()
    assert policy.items() <= one(defaults, "Job")["spec"]["template"]["metadata"]["labels"].items()
    for doc in defaults:
        meta = doc["metadata"]["labels"]
        assert {"app.kubernetes.io/name", "app.kubernetes.io/instance",
                "app.kubernetes.io/version", "app.kubernetes.io/managed-by",
                "helm.sh/chart"} <= set(meta), doc["kind"]


def test_the_migration_job_runs_before_the_workers_of_an_install_or_upgrade(
        defaults: list[dict[str, Any]]) -> None:
    job = one(defaults, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    spec = job["spec"]["template"]["spec"]
    assert [c["args"] for c in spec["initContainers"]] == [["db", "migrate"]]
    assert [c["args"] for c in spec["containers"]] == [["topics", "create"]]
    # what the Job reads exists before it: its Secret is a hook of a lower weight
    read = spec["containers"][0]["envFrom"][0]["secretRef"]["name"]
    [secret] = [s for s in by_kind(defaults, "Secret") if s["metadata"]["name"] == read]
    assert int(secret["metadata"]["annotations"]["helm.sh/hook-weight"]) < \
        int(job["metadata"]["annotations"]["helm.sh/hook-weight"])


def test_no_kafka_security_variable_unless_set(defaults: list[dict[str, Any]]) -> None:
    assert not [name for name in worker_env(defaults)
                if name.startswith("STOVEPIPE_KAFKA_") and name != "STOVEPIPE_KAFKA_BOOTSTRAP"]
    assert not by_kind(defaults, "TriggerAuthentication")


def test_secure_values_become_exactly_the_variables_the_worker_reads(tmp: Path) -> None:
    docs = render(tmp, SECURE)
    env = {k: v for k, v in worker_env(docs).items() if isinstance(v, str)}
    [secret] = [s for s in by_kind(docs, "Secret") if "helm.sh/hook" not in
                s["metadata"].get("annotations", {})]
    env.update({k: base64.b64decode(v).decode() for k, v in secret["data"].items()})
    # the Secrets' files as the pod mounts them: here a dev CA and client certificate
    # (the worker reads them at start); the key's password is a key of the secret
    dev = ensure_secrets(dataclasses.replace(load_settings(), home=tmp / "home"))
    files = {"/etc/stovepipe/kafka-tls/ca/ca.crt": dev.ca,
             "/etc/stovepipe/kafka-tls/client/tls.crt": dev.client_cert,
             "/etc/stovepipe/kafka-tls/client/tls.key": dev.client_key}
    assert {v for k, v in env.items() if k.startswith("STOVEPIPE_KAFKA_SSL_")} == set(files)
    env.update({k: str(files[v]) for k, v in env.items() if v in files})
    env["STOVEPIPE_KAFKA_SSL_KEY_PASSWORD"] = dev.client_key_password()
    security = KafkaSecurity.from_env(env)  # refuses any variable the protocol ignores
    assert (security.protocol, security.mechanism, security.username, security.password) == \
        ("SASL_SSL", "SCRAM-SHA-512", "stovepipe", "k-pass")
    assert (security.ca_location, security.certificate_location, security.key_location) == \
        (str(dev.ca), str(dev.client_cert), str(dev.client_key))
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {"/etc/stovepipe/kafka-tls/ca", "/etc/stovepipe/kafka-tls/client",
            "/etc/stovepipe/postgres-tls"} <= mounts
    assert one(docs, "ScaledObject")["spec"]["triggers"][0]["metadata"]["sasl"] == "scram_sha512"
    # replication factor 3 reaches the Job and the workers through the topics override
    for config in by_kind(docs, "ConfigMap"):  # the workers' and the Job's
        assert "replication_factor: 3" in config["data"]["topics.yaml"]
    assert worker_env(docs)["STOVEPIPE_TOPICS_FILE"] == "/etc/stovepipe/config/topics.yaml"


@pytest.mark.parametrize(("values", "message"), [
    ({"kafka": {"sasl": {"username": "u"}}}, "kafka.sasl is set but kafka.securityProtocol is "
                                             "PLAINTEXT"),
    ({"kafka": {"tls": {"caSecret": "ca"}, "securityProtocol": "SASL_PLAINTEXT",
                "sasl": {"mechanism": "PLAIN"}}}, "kafka.tls is set but"),
    ({"kafka": {"securityProtocol": "SASL_SSL"}}, "needs kafka.sasl.mechanism"),
    ({"worker": {"maxReplicas": "many"}}, "maxReplicas"),
    ({"wokrer": {}}, "wokrer"),
    ({"secrets": {"values": {"not a variable": "x"}}}, "not a variable"),
])
def test_values_that_cannot_work_are_refused_by_name(tmp: Path, values: dict[str, Any],
                                                      message: str) -> None:
    assert message in refusal(tmp, values)


def test_the_chart_is_lint_clean_and_follows_the_release(tmp: Path) -> None:
    out = _helm_run("lint", "--strict", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    import tomllib

    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["version"] == chart["appVersion"] == version
