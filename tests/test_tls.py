"""Mutual TLS between the components (`stagemesh certs`, `--tls DIR`): real servers on 127.0.0.1 with
certificates made by our own certs code; a caller without a certificate from the mesh CA is refused
by every stage and by the registry, and a TLS mesh serves the plaintext mesh's tokens."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import shutil
import signal
import socket
import ssl
import stat
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from stagemesh import cli, grpc_server, tls
from stagemesh.certs import CertsConfig, make_certs
from stagemesh.discovery.backends import consul_target, open_registry
from stagemesh.discovery.consul import ConsulRegistry
from stagemesh.discovery.embedded import EmbeddedRegistryClient
from stagemesh.discovery.registry import RegistryError, ServiceRecord, chains_key, leader_key
from stagemesh.launcher import start_local_mesh, wait_for_chains
from stagemesh.processes import LocalMesh
from stagemesh.registry.service import start_registry_server
from stagemesh.router.server import RouterConfig, RouterServer
from stagemesh.scheduler.server import print_plan
from stagemesh.signals import on_reload
from stagemesh.v1 import registry_pb2, registry_pb2_grpc, router_pb2, router_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.conftest import call_status, collect, hf_greedy, splits, start_mesh
from tests.harness.fault_mesh import free_port

PROMPT = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, tls.Tls]:
    """A role-less mesh certificate (as before roles), and those of two other authorities (strangers, and a caller
    CA)."""
    root = tmp_path_factory.mktemp("certs")
    made = {name: tls.load(make_certs(CertsConfig(str(root / name), roles=["mesh"])))
            for name in ("mesh", "other", "callers")}
    # The role certificates, from the mesh's CA and in its directory: components started with that --tls take their
    # own (router.pem, stage.pem, scheduler.pem), while "mesh" stays the role-less one (every role).
    mesh_dir = make_certs(CertsConfig(str(root / "mesh")))
    return {**made, **{role: tls.load(mesh_dir, role) for role in ("router", "stage", "scheduler")},
            "client": tls.load(mesh_dir)}


def stranger_channels(address: str, certs: dict[str, tls.Tls]) -> dict[str, grpc.aio.Channel]:
    """Callers without a certificate from the mesh CA, each trusting the mesh CA (so only their own lack
    of a mesh certificate can fail them): plaintext, TLS without a certificate, TLS with another CA's."""
    mesh, other = certs["mesh"], certs["other"]
    return {
        "plaintext": grpc_server.insecure_channel(address),
        "no certificate": grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(mesh.ca)),
        "another CA's certificate": grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(
            mesh.ca, private_key=other.key, certificate_chain=other.cert)),
    }


async def refused_by(address: str, certs: dict[str, tls.Tls], call) -> dict[str, grpc.StatusCode | None]:
    """{caller kind: the status its call got (None: it got through)}."""
    outcome = {}
    for kind, channel in stranger_channels(address, certs).items():
        try:
            await call(channel)
            outcome[kind] = None
        except grpc.aio.AioRpcError as exc:
            outcome[kind] = exc.code()
        finally:
            await channel.close()
    return outcome


def test_certs_makes_a_ca_and_one_certificate_per_role_for_server_and_client(tmp_path):
    root = tmp_path / "tls"
    cli.main(["certs", str(root), "--hosts", "10.0.0.5,stage-1.internal,::1"])
    roles = ("client", "router", "scheduler", "stage")
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["ca-key.pem", "ca.pem", *(f"{r}.pem" for r in roles), *(f"{r}-key.pem" for r in roles)])
    for key in ("ca-key.pem", *(f"{r}-key.pem" for r in roles)):
        assert stat.S_IMODE((root / key).stat().st_mode) == 0o600, key
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    ca = x509.load_pem_x509_certificate((root / "ca.pem").read_bytes())
    for role in roles:
        cert = x509.load_pem_x509_certificate((root / f"{role}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == ["stage-1.internal"]
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5"),
                                                           ipaddress.ip_address("::1")]
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"stagemesh://role/{role}"]
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == f"stagemesh-{role}"
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        cert.verify_directly_issued_by(ca)
        loaded = tls.load(root, role if role != "client" else None)
        assert loaded.roles == {role} and loaded.cert_path == root / f"{role}.pem"
    with pytest.raises(ValueError, match=r"stage.pem names the role\(s\) router, not stage"):
        shutil.copy(root / "router.pem", root / "stage.pem")
        shutil.copy(root / "router-key.pem", root / "stage-key.pem")
        tls.load(root, "stage")

    # Again, e.g. for more hosts: the CA stays (hosts keep trusting it), the certificates are new; --out writes one
    # host's stage certificate (and the CA to trust) elsewhere; --roles mesh the role-less one of earlier versions.
    ca_before = (root / "ca.pem").read_bytes()
    make_certs(CertsConfig(str(root)))
    assert (root / "ca.pem").read_bytes() == ca_before
    host = tmp_path / "stage-b"
    make_certs(CertsConfig(str(root), hosts=["stage-b.internal"], roles=["stage"], out=str(host)))
    assert sorted(p.name for p in host.iterdir()) == ["ca.pem", "stage-key.pem", "stage.pem"]
    assert tls.load(host, "stage").roles == {"stage"}
    make_certs(CertsConfig(str(root), roles=["mesh"]))
    mesh = tls.load(root, "router")  # router.pem is there: its own role wins over mesh.pem
    assert mesh.roles == {"router"}
    (root / "router.pem").unlink()
    assert tls.load(root, "router").roles == frozenset()  # no role: every role (a warning at start)
    with pytest.raises(ValueError, match="role 'admin': use router, stage, scheduler, client or mesh"):
        CertsConfig(str(root), roles=["admin"])


def test_a_wrong_tls_directory_is_refused_with_a_reason(tmp_path, certs):
    with pytest.raises(FileNotFoundError, match="ca.pem, client.pem, client-key.pem missing there.*stagemesh certs"):
        tls.load(tmp_path)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name in ("ca.pem", "mesh-key.pem"):
        shutil.copy(certs["mesh"].directory / name, mixed / name)
    shutil.copy(certs["other"].directory / "mesh.pem", mixed / "mesh.pem")
    with pytest.raises(ValueError, match="mesh.pem was not issued by ca.pem"):
        tls.load(mixed)
    shutil.copy(certs["mesh"].directory / "mesh.pem", mixed / "mesh.pem")
    shutil.copy(certs["other"].directory / "mesh-key.pem", mixed / "mesh-key.pem")
    with pytest.raises(ValueError, match="mesh-key.pem is not the key of mesh.pem"):
        tls.load(mixed)
    lone_ca = tmp_path / "lone"
    lone_ca.mkdir()
    shutil.copy(certs["mesh"].directory / "ca.pem", lone_ca / "ca.pem")
    with pytest.raises(ValueError, match="has ca.pem but not ca-key.pem"):
        make_certs(CertsConfig(str(lone_ca)))


@pytest.fixture(scope="module")
async def meshes(tiny_model, certs):
    """The same two-stage chain twice: with --tls on stages and router, and plaintext."""
    secure = {"tls": str(certs["mesh"].directory)}
    tls_mesh = await start_mesh(tiny_model, [splits(4, 4)], stage_options=secure, router_options=secure)
    plain_mesh = await start_mesh(tiny_model, [splits(4, 4)])
    yield tls_mesh, plain_mesh
    await tls_mesh.stop()
    await plain_mesh.stop()


async def generate(channel: grpc.aio.Channel, n: int = 12) -> list[int]:
    stub = router_pb2_grpc.RouterStub(channel)
    ids, _, _ = await collect(stub.Generate(router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=n),
                                            timeout=60))
    return ids


async def test_a_tls_mesh_serves_the_plaintext_meshs_greedy_tokens(meshes, certs, hf_models):
    tls_mesh, plain_mesh = meshes
    # The router's public port serves TLS with the mesh certificate; callers need only trust the CA.
    async with grpc.aio.secure_channel(tls_mesh.router.address,
                                       grpc.ssl_channel_credentials(certs["mesh"].ca)) as channel:
        secure_ids = await generate(channel)
    async with grpc_server.insecure_channel(plain_mesh.router.address) as channel:
        plain_ids = await generate(channel)
    assert secure_ids == plain_ids == hf_greedy(hf_models["llama"], PROMPT, 12)


async def test_every_stage_refuses_callers_without_a_mesh_certificate(meshes, certs):
    tls_mesh, _ = meshes

    async def info(channel):
        return await stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=5)

    for stage in tls_mesh.all_stages():
        assert await refused_by(stage.address, certs, info) == {
            "plaintext": grpc.StatusCode.UNAVAILABLE, "no certificate": grpc.StatusCode.UNAVAILABLE,
            "another CA's certificate": grpc.StatusCode.UNAVAILABLE}, stage.address
        async with grpc_server.channel(stage.address, certs["mesh"]) as channel:  # the router's own way in
            assert (await info(channel)).layer_end > 0


async def test_a_router_without_the_mesh_certificate_gets_no_chain(meshes, certs, tiny_model):
    """The stages refuse a router that presents no mesh certificate, or another CA's."""
    tls_mesh, _ = meshes
    spec = ",".join(s.address for s in tls_mesh.stages[0])
    for options in ({}, {"tls": str(certs["other"].directory)}):
        router = RouterServer(RouterConfig(model=str(tiny_model), chains=[spec], port=0, **options))
        try:
            await router.start()
            assert router.chains.usable() == [], options
            assert await router.chains.check(router.chains.chains[0]) is False
        finally:
            await router.stop(0)


async def test_the_public_port_takes_its_own_certificate_and_may_require_callers_certificates(
        meshes, certs, tiny_model, hf_models):
    """--public-cert/--public-key from another authority, --client-ca: callers need a certificate from it;
    the router's own traffic to the stages still uses the mesh certificate."""
    tls_mesh, _ = meshes
    other, callers = certs["other"].directory, certs["callers"]
    router = RouterServer(RouterConfig(
        model=str(tiny_model), chains=[",".join(s.address for s in tls_mesh.stages[0])], port=0,
        health_interval_s=0.2, tls=str(certs["mesh"].directory), public_cert=str(other / "mesh.pem"),
        public_key=str(other / "mesh-key.pem"), client_ca=str(callers.ca_path)))
    await router.start()
    try:
        assert len(router.chains.usable()) == 1
        with_caller_cert = grpc.ssl_channel_credentials(certs["other"].ca, private_key=callers.key,
                                                        certificate_chain=callers.cert)
        async with grpc.aio.secure_channel(router.address, with_caller_cert) as channel:
            assert await generate(channel, 6) == hf_greedy(hf_models["llama"], PROMPT, 6)

        async def list_chains(channel):
            return await router_pb2_grpc.RouterStub(channel).ListChains(router_pb2.ListChainsRequest(), timeout=5)

        refusals = {
            "plaintext": grpc.aio.insecure_channel(router.address),
            "no certificate": grpc.aio.secure_channel(router.address, grpc.ssl_channel_credentials(certs["other"].ca)),
            "the mesh certificate, not a caller's": grpc.aio.secure_channel(
                router.address, grpc.ssl_channel_credentials(certs["other"].ca, private_key=certs["mesh"].key,
                                                             certificate_chain=certs["mesh"].cert)),
        }
        for kind, channel in refusals.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await list_chains(channel)
            await channel.close()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, kind
    finally:
        await router.stop(0)


async def test_the_registry_refuses_callers_without_a_mesh_certificate(certs):
    server = await start_registry_server(tls=certs["mesh"])
    try:
        async def kv_get(channel):
            return await registry_pb2_grpc.RegistryStub(channel).KvGet(registry_pb2.KvGetRequest(key="k"), timeout=5)

        assert set((await refused_by(server.address, certs, kv_get)).values()) == {grpc.StatusCode.UNAVAILABLE}
        member = EmbeddedRegistryClient(server.address, tls=certs["mesh"])
        plain = EmbeddedRegistryClient(server.address)
        try:
            await member.kv_put("stagemesh/m/k", b"v")
            assert (await member.kv_get("stagemesh/m/k"))[0] == b"v"
            with pytest.raises(RegistryError, match="UNAVAILABLE"):
                await plain.kv_get("stagemesh/m/k")
        finally:
            await member.close()
            await plain.close()
    finally:
        await server.stop(0)


def test_consul_over_https_takes_its_ca_token_and_client_certificate(certs):
    mesh = certs["mesh"]
    plain = consul_target("consul://consul.internal", mesh, env={"CONSUL_HTTP_TOKEN": "acl-secret"})
    assert (plain.scheme, plain.host, plain.port, plain.token) == ("http", "consul.internal", 8500, "acl-secret")
    target = consul_target("consul+https://consul.internal", mesh, env={})
    assert (target.scheme, target.port, target.verify, target.cert, target.token) == (
        "https", 8501, str(mesh.ca_path), None, None)
    env = {"CONSUL_CACERT": "/etc/consul/ca.pem", "CONSUL_CLIENT_CERT": "/c.pem", "CONSUL_CLIENT_KEY": "/k.pem",
           "CONSUL_HTTP_TOKEN": "acl-secret"}
    target = consul_target("consul+https://10.0.0.9:9501", mesh, env=env)
    assert (target.host, target.port, target.verify, target.cert, target.token) == (
        "10.0.0.9", 9501, "/etc/consul/ca.pem", ("/c.pem", "/k.pem"), "acl-secret")
    assert consul_target("consul+https://consul.internal", None, env={}).verify is True  # the system's CAs
    with pytest.raises(ValueError, match="both CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY"):
        consul_target("consul+https://h", mesh, env={"CONSUL_CLIENT_CERT": "/c.pem"})
    for bad in ("consul+http://h:1", "consul+https://", "consul+https://h:port", "consul+https://h:1/path"):
        with pytest.raises(ValueError, match="registry URL|address"):
            open_registry(bad, mesh)

    registry = open_registry("consul+https://consul.internal:8501", mesh)  # constructs without an agent
    assert isinstance(registry, ConsulRegistry) and registry.grpc_check_tls
    http = registry._consul.http
    assert (http.base_uri, http.verify) == ("https://consul.internal:8501", str(mesh.ca_path))
    assert not open_registry("consul://127.0.0.1:8500").grpc_check_tls


def test_processes_with_tls_register_schedule_and_serve(tiny_model, certs, hf_models, tmp_path):
    """`stagemesh scheduler/stage/router --tls`: the hosted registry, the stages' registrations, the router's
    watch and its chain, all over mutual TLS; plaintext callers are refused by the registry and the stage."""
    directory = str(certs["mesh"].directory)
    mesh, router = start_local_mesh(str(tiny_model), stages=1, router_port=0, registry="local", tls=directory,
                                    log_dir=tmp_path)
    try:
        chains = wait_for_chains(router.address, 1, timeout=90, tls=directory)
        assert [len(c.stages) for c in chains] == [1]
        with grpc.secure_channel(router.address, grpc.ssl_channel_credentials(certs["mesh"].ca)) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            ids = [t for r in stub.Generate(router_pb2.GenerateRequest(token_ids=PROMPT, max_new_tokens=8),
                                            timeout=60) for t in r.token_ids]
        assert ids == hf_greedy(hf_models["llama"], PROMPT, 8)
        for address in [mesh.registry_url.removeprefix("local://"), *(s.address for s in chains[0].stages)]:
            with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, address
        plan = asyncio.run(print_plan(mesh.registry_url, Path(tiny_model).name, certs["mesh"]))
        assert "published chains:" in plan and "chain" in plan.split("published chains:")[1]
    finally:
        mesh.stop()


def test_a_kubernetes_tls_secret_mounted_as_it_is_is_a_tls_directory(tmp_path, certs):
    """cert-manager's secret keys (ca.crt, tls.crt, tls.key) in place of ca.pem, mesh.pem, mesh-key.pem."""
    mesh = certs["mesh"].directory
    secret = tmp_path / "secret"
    secret.mkdir()
    for ours, theirs in zip(("ca.pem", "mesh.pem", "mesh-key.pem"), tls.SECRET_FILES, strict=True):
        shutil.copy(mesh / ours, secret / theirs)
    (secret / "tls.key").chmod(0o600)
    loaded = tls.load(secret)
    assert (loaded.ca, loaded.cert, loaded.key) == (certs["mesh"].ca, certs["mesh"].cert, certs["mesh"].key)
    assert loaded.ca_path == secret / "ca.crt"
    (secret / "tls.key").unlink()
    with pytest.raises(FileNotFoundError, match="ca.pem, client.pem, client-key.pem missing there.*ca.crt, tls.crt"):
        tls.load(secret)


async def test_a_stage_takes_sessions_only_from_routers_and_relays_only_from_stages(meshes, certs):
    """With role certificates, a stage certificate (or an operator's) cannot open or step a session on a stage, a
    router's cannot relay into one: PERMISSION_DENIED naming the role needed and the one presented."""
    tls_mesh, _ = meshes
    stage = tls_mesh.stages[0][0]
    open_request = stage_pb2.OpenSessionRequest(session_id="roles-test", max_length=8)
    for who in ("stage", "client"):
        async with grpc_server.channel(stage.address, certs[who]) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.OpenSession(open_request, timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, who
            assert "from a router certificate" in err.value.details() and f"role {who}" in err.value.details()
            sessions = stub.Sessions(iter([stage_pb2.SessionBatch()]), timeout=5)
            assert await call_status(sessions.read()) == grpc.StatusCode.PERMISSION_DENIED, who
            assert (await stub.Info(stage_pb2.InfoRequest(), timeout=5)).layer_end > 0  # reads stay open
    async with grpc_server.channel(stage.address, certs["router"]) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        assert await call_status(stub.OpenSession(open_request, timeout=5)) == grpc.StatusCode.OK
        await stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="roles-test"), timeout=5)
        relay = stub.Relay(iter([stage_pb2.RelayBatch()]), timeout=5)
        assert await call_status(relay.read()) == grpc.StatusCode.PERMISSION_DENIED
    async with grpc_server.channel(stage.address, certs["mesh"]) as channel:  # role-less: every role, as before
        stub = stage_pb2_grpc.StageStub(channel)
        assert await call_status(stub.OpenSession(open_request, timeout=5)) == grpc.StatusCode.OK
        await stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="roles-test"), timeout=5)


async def test_only_schedulers_write_the_registry_and_stages_only_their_own_records(certs, tmp_path):
    """The embedded registry with role certificates: a stage's (or a router's) certificate cannot publish a chain
    table, take or delete the leader lock; a router's cannot register a stage; a stage certificate naming one host
    cannot register, renew or remove a stage at another host. Schedulers and stages do their own writes."""
    server = await start_registry_server(tls=certs["scheduler"])
    host_b = make_certs(CertsConfig(str(certs["scheduler"].directory), hosts=["stage-b.internal"], roles=["stage"],
                                    out=str(tmp_path / "stage-b")))
    clients = {who: EmbeddedRegistryClient(server.address, call_timeout_s=60, tls=t) for who, t in
               (("scheduler", certs["scheduler"]), ("stage", certs["stage"]), ("router", certs["router"]),
                ("stage-b", tls.load(host_b, "stage")))}
    table, leader = chains_key("m"), leader_key("m")
    stage_a = ServiceRecord("stage-a", "127.0.0.1:50061", "m")
    try:
        scheduler, stage, router, stage_b = clients.values()
        assert await scheduler.acquire_lock(leader, "scheduler-secret-id", 10)
        await scheduler.kv_put(table, b"{}")
        await stage.register(stage_a, 10)
        for who in ("stage", "router"):
            client = clients[who]
            for write in (client.kv_put(table, b'{"chains": []}'), client.kv_delete(leader),
                          client.acquire_lock(leader, "another-id", 10), client.release_lock(leader, "x")):
                with pytest.raises(RegistryError, match=f"PERMISSION_DENIED.*scheduler certificate.*role {who}"):
                    await write
        with pytest.raises(RegistryError, match="PERMISSION_DENIED.*stage certificate.*role router"):
            await router.register(ServiceRecord("stage-r", "127.0.0.1:50062", "m"), 10)
        for write in (stage_b.register(ServiceRecord("stage-a", "stage-b.internal:50061", "m"), 10),
                      stage_b.register(ServiceRecord("stage-x", "127.0.0.1:50061", "m"), 10),
                      stage_b.heartbeat("stage-a"), stage_b.deregister("stage-a")):
            with pytest.raises(RegistryError, match="PERMISSION_DENIED.*names the hosts stage-b.internal, not 127"):
                await write
        await stage_b.register(ServiceRecord("stage-b", "stage-b.internal:50061", "m"), 10)  # its own host
        assert await stage_b.heartbeat("stage-b")
        assert (await scheduler.kv_get(table))[0] == b"{}"  # nothing the others tried took effect
        assert await scheduler.lock_holder(leader) is not None
        assert [s.record.address for s in await scheduler.services("m")] == ["127.0.0.1:50061",
                                                                            "stage-b.internal:50061"]
    finally:
        for client in clients.values():
            await client.close()
        await server.stop(0)


def served_certificate(address: str, client: tls.Tls) -> x509.Certificate:
    """The certificate a server presents to a new connection now (a handshake of its own, as gRPC's would)."""
    context = ssl.create_default_context(cadata=client.ca.decode())
    context.load_cert_chain(client.cert_path, client.key_path)
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=host) as conn:
        return x509.load_der_x509_certificate(conn.getpeercert(binary_form=True))


def expiry_gauge(metrics_port: int, role: str) -> float:
    """The gauge's value; the metrics port may open a moment after the hosted registry's (bounded wait)."""
    for attempt in range(50):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
                text = response.read().decode()
            break
        except urllib.error.URLError:
            if attempt == 49:
                raise
            time.sleep(0.2)
    line = next(x for x in text.splitlines() if x.startswith(f'stagemesh_tls_cert_expiry_seconds{{role="{role}"}}'))
    return float(line.split()[-1])


def test_sighup_reloads_the_certificate_for_new_connections_and_keeps_open_streams(certs, tiny_model, tmp_path):
    """`stagemesh scheduler --registry local --tls DIR`: the hosted registry serves scheduler.pem and exports its
    expiry; after new files and SIGHUP a new connection gets the new certificate (and the gauge its expiry) while a
    watch opened before the reload still answers on its connection."""
    directory = tmp_path / "tls"
    shutil.copytree(certs["mesh"].directory, directory)
    first = certs["scheduler"]
    metrics_port = free_port()
    mesh = LocalMesh(str(tiny_model), tmp_path)
    proc = mesh.spawn("scheduler", ["scheduler", "--model", str(tiny_model), "--registry", "local", "--registry-port",
                                    "0", "--metrics-port", str(metrics_port), "--tls", str(directory)],
                      dict(os.environ), timeout=60)
    address = proc.address
    try:
        served = served_certificate(address, certs["client"])
        assert served.public_bytes(serialization.Encoding.PEM) == first.cert
        assert expiry_gauge(metrics_port, "scheduler") == first.not_after.timestamp()

        async def watch_across_reload() -> bytes:
            key = "stagemesh/reload/k"
            async with grpc_server.channel(address, certs["client"]) as channel:
                stub = registry_pb2_grpc.RegistryStub(channel)
                index = (await stub.KvGet(registry_pb2.KvGetRequest(key=key), timeout=5)).index
                watch = stub.WatchKey(registry_pb2.WatchKeyRequest(key=key, index=index, timeout_s=30), timeout=60)
                # New files (a shorter validity: another notAfter), then SIGHUP.
                make_certs(CertsConfig(str(directory), roles=["scheduler"], days=30))
                proc.popen.send_signal(signal.SIGHUP)
                renewed = (directory / "scheduler.pem").read_bytes()
                deadline = time.monotonic() + 30
                while served_certificate(address, certs["client"]).public_bytes(serialization.Encoding.PEM) != renewed:
                    assert time.monotonic() < deadline, "the new certificate was not served after SIGHUP"
                    await asyncio.sleep(0.1)
                writer = EmbeddedRegistryClient(address, tls=tls.load(directory, "scheduler"))  # a new connection
                try:
                    await writer.kv_put(key, b"after the reload")
                finally:
                    await writer.close()
                return (await watch).entry.value

        assert asyncio.run(watch_across_reload()) == b"after the reload"
        renewed = tls.load(directory, "scheduler")
        assert renewed.not_after < first.not_after - datetime.timedelta(days=300)
        assert expiry_gauge(metrics_port, "scheduler") == renewed.not_after.timestamp()
        assert proc.running()
    finally:
        mesh.stop()


async def test_the_router_serves_its_own_certificate_on_both_fronts_and_renews_it_on_sighup(certs, tiny_model,
                                                                                             tmp_path):
    """A router with --tls DIR and --http-port: the gRPC and HTTP ports serve router.pem (not the role-less mesh.pem
    beside it); after new files and SIGHUP (its handler as `stagemesh router` installs it) new connections get the
    new one on both, an HTTP connection opened before still answers, and the expiry gauge follows."""
    directory = tmp_path / "tls"
    shutil.copytree(certs["mesh"].directory, directory)
    first = certs["router"]
    router = RouterServer(RouterConfig(model=str(tiny_model), chains=[f"127.0.0.1:{free_port()}"], port=0,
                                       http_port=free_port(), tls=str(directory)))
    await router.start()
    loop = asyncio.get_running_loop()
    on_reload(router.reload)
    fronts = [router.address, f"127.0.0.1:{router.http.port}"]

    async def served() -> list[bytes]:  # handshakes in a thread: this loop serves them
        return [(await asyncio.to_thread(served_certificate, a, certs["client"])).public_bytes(
            serialization.Encoding.PEM) for a in fronts]

    try:
        assert await served() == [first.cert, first.cert]
        assert expiry_gauge_here("router") == first.not_after.timestamp()
        context = ssl.create_default_context(cadata=first.ca.decode())
        with await asyncio.to_thread(lambda: context.wrap_socket(socket.create_connection(
                ("127.0.0.1", router.http.port), timeout=5), server_hostname="127.0.0.1")) as before:
            assert (await asyncio.to_thread(http_health, before)).startswith(b"HTTP/1.1 ")
            make_certs(CertsConfig(str(directory), roles=["router"], days=30))
            os.kill(os.getpid(), signal.SIGHUP)
            renewed = tls.load(directory, "router")
            deadline = time.monotonic() + 30
            while await served() != [renewed.cert, renewed.cert]:
                assert time.monotonic() < deadline, "the new certificate was not served after SIGHUP"
                await asyncio.sleep(0.1)
            assert (await asyncio.to_thread(http_health, before)).startswith(b"HTTP/1.1 ")  # it goes on
        assert renewed.not_after < first.not_after - datetime.timedelta(days=300)
        assert expiry_gauge_here("router") == renewed.not_after.timestamp()
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        await router.stop(0)


def expiry_gauge_here(role: str) -> float | None:
    """stagemesh_tls_cert_expiry_seconds{role} of this process."""
    return REGISTRY.get_sample_value("stagemesh_tls_cert_expiry_seconds", {"role": role})


def http_health(conn: ssl.SSLSocket) -> bytes:
    """GET /health on an open keep-alive connection: the status line and headers of the answer."""
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer and len(answer) < 65536:
        chunk = conn.recv(4096)
        if not chunk:
            break
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")), 0)
    while len(body) < length:  # read the body too, so that the next request starts clean
        chunk = conn.recv(4096)
        if not chunk:
            break
        body += chunk
    return head
