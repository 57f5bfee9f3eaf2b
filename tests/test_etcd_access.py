"""The etcd backend over TLS with the mesh's certificates, and with etcd's users: what an operator's
cluster asks of a client (`etcd+https://`, ETCDCTL_CACERT/ETCDCTL_CERT/ETCDCTL_KEY, ETCDCTL_USER)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from stagemesh import tls
from stagemesh.certs import CertsConfig, make_certs
from stagemesh.discovery.backends import etcd_target, open_registry
from stagemesh.discovery.registry import RegistryError, chains_key
from tests.harness.etcd_cluster import EtcdCluster


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, tls.Tls]:
    root = tmp_path_factory.mktemp("certs")
    return {name: tls.load(make_certs(CertsConfig(str(root / name), roles=["mesh"]))) for name in ("mesh", "other")}


async def test_etcd_over_tls_with_the_mesh_certificate(certs, tmp_path):
    cluster = await asyncio.to_thread(EtcdCluster(tmp_path, members=1, tls=certs["mesh"]).start)
    try:
        assert cluster.url.startswith("etcd+https://")
        registry = open_registry(cluster.url, certs["mesh"])
        try:
            await registry.kv_put(chains_key("m"), b"over tls")
            assert (await registry.kv_get(chains_key("m")))[0] == b"over tls"
        finally:
            await registry.close()
        for url, mesh in ((cluster.url, certs["other"]), (cluster.url.replace("etcd+https", "etcd"), None)):
            stranger = open_registry(url, mesh)  # another CA's certificate, or no TLS at all: refused
            stranger.call_timeout_s = 2.0
            try:
                with pytest.raises(RegistryError, match="etcd at"):
                    await stranger.kv_get(chains_key("m"))
            finally:
                await stranger.close()
    finally:
        await asyncio.to_thread(cluster.stop)


def test_etcd_tls_settings_come_from_etcdctl_variables_first(certs, tmp_path):
    mesh, other = certs["mesh"], certs["other"]
    env = {"ETCDCTL_CACERT": str(other.ca_path), "ETCDCTL_CERT": str(other.directory / tls.CERT_FILE),
           "ETCDCTL_KEY": str(other.directory / tls.KEY_FILE), "ETCDCTL_USER": "stagemesh:secret"}
    target = etcd_target("etcd+https://10.0.0.1:2379,10.0.0.2:2379", mesh, env)
    assert (target.target, target.server_name) == ("ipv4:10.0.0.1:2379,10.0.0.2:2379", "10.0.0.1")
    assert target.ca == other.ca and target.cert == (other.cert, other.key) and target.user == ("stagemesh", "secret")
    target = etcd_target("etcd+https://10.0.0.1", mesh, {})  # the --tls directory otherwise
    assert target.ca == mesh.ca and target.cert == (mesh.cert, mesh.key) and target.target == "ipv4:10.0.0.1:2379"
    assert etcd_target("etcd://10.0.0.1", None, {"ETCDCTL_USER": "u", "ETCDCTL_PASSWORD": "p"}).user == ("u", "p")
    with pytest.raises(ValueError, match="ETCDCTL_CERT and ETCDCTL_KEY"):
        etcd_target("etcd+https://10.0.0.1", None, {"ETCDCTL_CERT": "c.pem"})


async def test_etcd_with_auth_takes_a_user_and_refuses_a_wrong_password(tmp_path, monkeypatch):
    cluster = await asyncio.to_thread(EtcdCluster(tmp_path, members=1).start)
    try:
        await asyncio.to_thread(cluster.etcdctl, "user", "add", "root:rootpw")
        await asyncio.to_thread(cluster.etcdctl, "auth", "enable")
        anonymous = open_registry(cluster.url)
        monkeypatch.setenv("ETCDCTL_USER", "root:rootpw")
        registry = open_registry(cluster.url)
        monkeypatch.setenv("ETCDCTL_USER", "root:wrong")
        wrong = open_registry(cluster.url)
        try:
            await registry.kv_put(chains_key("m"), b"authenticated")
            assert (await registry.kv_get(chains_key("m")))[0] == b"authenticated"
            assert await registry.acquire_lock(chains_key("lock"), "a-holders-secret-0001", 2.0)
            for refused in (anonymous, wrong):
                with pytest.raises(RegistryError, match="etcd at"):
                    await refused.kv_get(chains_key("m"))
        finally:
            for r in (registry, anonymous, wrong):
                await r.close()
    finally:
        await asyncio.to_thread(cluster.stop)


@pytest.mark.parametrize("first", ["etcd3aio.kv", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"])
def test_etcd3aio_and_the_otlp_exporter_load_in_either_order(first):
    """etcd3aio puts its copy of google.api's generated modules on sys.path; the tracing exporter's must
    still load (and both sets of messages work) whichever comes first."""
    second = ({"etcd3aio.kv", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"} - {first}).pop()
    code = (f"import {first}, {second}, google.api.http_pb2 as h, stagemesh.tracing, stagemesh.discovery.etcd; "
            f"from etcd3aio._protobuf import RangeRequest; h.HttpRule(get='/x'); RangeRequest(key=b'k')")
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, timeout=120)
