"""Hosts with several devices (tier 1, pure functions): chains' kind and tensor-parallel width, the published
table's tp and host, tensor-parallel stages in the plan, and the plan's `--tp` advice, per machine only."""

from __future__ import annotations

import socket

import pytest

from stagemesh.checkpoint import ModelArgs
from stagemesh.discovery.chain_table import PublishedChain, PublishedStage, decode_chains, encode_chains
from stagemesh.discovery.registry import ServiceRecord, ServiceStatus
from stagemesh.scheduler.placement import Host, PlacementConfig, plan
from stagemesh.scheduler.scheduler import host_of
from stagemesh.scheduler.tp_advice import advise, tp_sizes
from stagemesh.stage_server.config import StageConfig
from tests.test_placement import HALF, MODEL, WHOLE


def model_args(heads: int, kv_heads: int) -> ModelArgs:
    return ModelArgs.from_config({"model_type": "llama", "hidden_size": 24 * heads, "intermediate_size": 688,
                                  "num_hidden_layers": 8, "num_attention_heads": heads,
                                  "num_key_value_heads": kv_heads, "vocab_size": 1000, "max_position_embeddings": 2048})


ARGS = model_args(8, 4)


def advice(hosts: list[Host], args: ModelArgs = ARGS) -> str:
    return "\n".join(advise(MODEL, args, PlacementConfig(), hosts, plan(MODEL, hosts)))


def record(**meta: str) -> ServiceStatus:
    base = {"budget_bytes": "1000", "layers": "", "ready": "0", "fixed": "0"}
    return ServiceStatus(ServiceRecord("s1", "127.0.0.1:1", "m", {**base, **meta}), passing=True)


def test_kind_and_width_of_published_chains_and_tables_from_before_them():
    def chain(*tps: int) -> PublishedChain:
        n = len(tps)
        return PublishedChain(tuple(PublishedStage(f"s{i}", f"127.0.0.1:{i + 1}", i * 8 // n, (i + 1) * 8 // n, tp,
                                                   "m1") for i, tp in enumerate(tps)))

    assert (chain(1).kind, chain(1).tp_width) == ("replica", 1)
    assert (chain(2).kind, chain(2).tp_width) == ("tp", 2)
    assert (chain(4, 2).kind, chain(4, 2).tp_width) == ("pipeline", 2)  # the narrowest stage's
    assert "tp 4" in chain(4, 2).label
    table = [chain(1), chain(2), chain(4, 2)]
    assert decode_chains(encode_chains(table)) == table
    old = b'{"chains": [{"chain_id": "c", "stages": [{"service_id": "s", "address": "a:1", "layer_start": 0, ' \
          b'"layer_end": 8}]}]}'
    assert [(c.kind, c.tp_width, c.stages[0].host) for c in decode_chains(old)] == [("replica", 1, "")]
    with pytest.raises(ValueError, match="tp an integer >= 1"):
        decode_chains(old.replace(b'"layer_end": 8', b'"layer_end": 8, "tp": 0'))


def test_registration_meta_gives_tp_devices_and_machine():
    host = host_of(record(tp="2", devices="4", host="m1"), 8)
    assert (host.tp, host.devices, host.machine) == (2, 4, "m1")
    host = host_of(record(), 8)  # stages from before: one rank, one device, machine unknown
    assert (host.tp, host.devices, host.machine) == (1, 1, "")
    assert host_of(record(tp="2", devices="1", host="cpu-box"), 8).tp == 2  # CPU ranks share the cores
    for bad in ({"tp": "0"}, {"tp": "two"}, {"devices": "0"}):
        with pytest.raises(ValueError, match="tp|devices"):
            host_of(record(**bad), 8)


def test_a_tensor_parallel_stage_is_one_stage_with_its_groups_budget():
    # A TP-2 stage announcing two devices' budget holds the model alone: a one-stage chain of kind tp.
    hosts = [Host("tp", 2 * HALF, tp=2, machine="m1", devices=2), Host("a", HALF, machine="m2"),
             Host("b", HALF, machine="m3")]
    p = plan(MODEL, hosts)
    assert [[s.host_id for s in c.stages] for c in p.chains] == [["tp"], ["a", "b"]]
    assert "chain 0 (tp)" in p.explanation and "tp on m1, tp 2: layers 0:8" in p.explanation
    assert "chain 1 (pipeline)" in p.explanation


def test_advice_in_host_pipeline_becomes_one_tp_stage():
    hosts = [Host("a", HALF, machine="m1", devices=2), Host("b", HALF, machine="m1", devices=2)]
    text = advice(hosts)
    assert "advice for m1: start a stage there with --tp 2" in text
    assert "pipelines of 2 stages inside it" in text and "cannot start ranks" in text


def test_advice_when_chains_cross_hosts_and_never_across_them():
    # m1 has two devices, its one-rank stage needs m2's to make a chain: TP-2 on m1 holds the model alone.
    crossing = advice([Host("a", HALF, machine="m1", devices=2), Host("b", HALF, machine="m2")])
    assert "advice for m1" in crossing and "fits on m1 alone" in crossing and "advice for m2" not in crossing
    # Two machines of one device each: together they would hold a TP-2 group, but TP never spans machines.
    assert advice([Host("a", HALF, machine="m1"), Host("b", HALF, machine="m2")]) == ""
    # No chain fits: a TP group over m1's four devices would.
    small = [Host("a", 300, machine="m1", devices=4)]
    assert "no chain fits now" in advice(small) and "--tp 4" in advice(small)


def test_advice_for_long_prompts_only_without_a_tp_stage_in_the_mesh():
    replicas = [Host("a", WHOLE, machine="m1", devices=2), Host("b", WHOLE, machine="m1", devices=2)]
    assert "--tp 2" in advice(replicas) and "for long prompts" in advice(replicas)
    assert advice([*replicas, Host("t", 2 * WHOLE, tp=2, machine="m2", devices=2)]) == ""
    assert advice([Host("a", WHOLE, machine="m1")]) == ""  # one device: nothing to split over


def test_tp_sizes_divide_the_heads():
    assert tp_sizes(ARGS, 8) == [2, 4]  # 8 heads, 4 KV heads
    odd = model_args(3, 3)
    assert tp_sizes(odd, 2) == []
    text = advice([Host("a", HALF, machine="m1", devices=2), Host("b", HALF, machine="m1", devices=2)], odd)
    assert "no tensor-parallel size 2..2 divides" in text


def test_a_stage_announces_its_machine_by_default():
    assert StageConfig(model="m", layer_start=0, layer_end=8).host_id == socket.gethostname()
    assert StageConfig(model="m", layer_start=0, layer_end=8, host_id="gpu-7").host_id == "gpu-7"
