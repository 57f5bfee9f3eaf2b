"""Placement (tier 1, pure functions): how many stages, which host holds which layers, who is spare, and why."""

from __future__ import annotations

import json
import math
import random

import pytest
from safetensors import safe_open

from stagemesh.checkpoint import ModelFootprint
from stagemesh.scheduler.placement import (
    ChainPlan,
    Host,
    PlacementConfig,
    Plan,
    StagePlan,
    plan,
    serving_plan,
    split_layers,
    usable_bytes,
)
from stagemesh.tiny_model import make_tiny_model

# 8 layers of 100 B, embed 50 B, head 50 B: 900 B in all. With the default 20% headroom a host of
# memory M holds 0.8 * M of weights.
MODEL = ModelFootprint(num_layers=8, layer_bytes=100, embed_bytes=50, head_bytes=50, kv_bytes_per_token_per_layer=4)
WHOLE = 1200  # 960 usable: the whole model fits
HALF = 570  # 456 usable: 4 layers + embed (or head), not the whole model
THIRD = 450  # 360 usable: 3 layers + embed, so three hosts hold 9 >= 8 layers, two only 6
GIB = 2**30


def make_hosts(n: int, memory: int, prefix: str = "h", **kwargs) -> list[Host]:
    return [Host(f"{prefix}{i}", memory, **kwargs) for i in range(n)]


def layout(p: Plan) -> list[list[tuple[str, int, int]]]:
    return [[(s.host_id, s.layer_start, s.layer_end) for s in c.stages] for c in p.chains]


def assert_sound(p: Plan, hosts: list[Host], model: ModelFootprint = MODEL,
                 config: PlacementConfig | None = None) -> None:
    """Every chain covers 0..N contiguously, every host is used once or spare, no host is over its budget."""
    config = config or PlacementConfig()
    by_id = {h.host_id: h for h in hosts}
    placed = [s.host_id for c in p.chains for s in c.stages]
    assert sorted(placed + p.spare) == sorted(by_id)
    for chain in p.chains:
        bounds = [(s.layer_start, s.layer_end) for s in chain.stages]
        assert bounds[0][0] == 0 and bounds[-1][1] == model.num_layers
        assert all(a < b for a, b in bounds)
        assert all(prev[1] == nxt[0] for prev, nxt in zip(bounds, bounds[1:], strict=False))
        assert len(chain.stages) <= config.max_stages
        for s in chain.stages:
            host = by_id[s.host_id]
            if host.fixed_layers is None:
                assert model.stage_bytes(s.layer_start, s.layer_end) <= usable_bytes(host, config)


def test_hosts_that_each_hold_the_model_serve_it_alone():
    hosts = make_hosts(4, WHOLE)
    p = plan(MODEL, hosts)
    assert layout(p) == [[(f"h{i}", 0, 8)] for i in range(4)]
    assert p.spare == []
    assert "fits in h0's" in p.explanation


def test_hosts_holding_just_over_half_pair_into_two_stage_chains():
    hosts = make_hosts(4, HALF)
    p = plan(MODEL, hosts)
    assert len(p.chains) == 2
    assert all(len(c.stages) == 2 for c in p.chains)
    assert sorted(h for c in p.chains for h in c.host_ids) == ["h0", "h1", "h2", "h3"]
    assert_sound(p, hosts)
    assert "2 stages" in p.explanation


def test_host_that_cannot_complete_a_chain_is_spare():
    hosts = make_hosts(3, HALF)
    p = plan(MODEL, hosts)
    assert [len(c.stages) for c in p.chains] == [2]
    assert p.spare == ["h2"]
    assert "spare: h2" in p.explanation
    assert_sound(p, hosts)


@pytest.mark.parametrize(("n_hosts", "n_chains", "n_spare"), [(3, 1, 0), (5, 1, 2), (6, 2, 0), (7, 2, 1)])
def test_hosts_holding_a_third_form_three_stage_chains(n_hosts, n_chains, n_spare):
    hosts = make_hosts(n_hosts, THIRD)
    p = plan(MODEL, hosts)
    assert [len(c.stages) for c in p.chains] == [3] * n_chains
    assert len(p.spare) == n_spare
    assert_sound(p, hosts)


def test_big_hosts_serve_alone_and_small_ones_pair_up():
    hosts = [*make_hosts(2, WHOLE, "big"), *make_hosts(2, HALF, "small")]
    p = plan(MODEL, hosts)
    assert sorted(len(c.stages) for c in p.chains) == [1, 1, 2]
    assert [c.host_ids for c in p.chains if len(c.stages) == 2] == [["small0", "small1"]]
    assert_sound(p, hosts)


def test_small_host_completes_a_big_one_so_more_chains_form():
    # 0.9 + 0.9 would make one chain and strand the small hosts; 0.9 + small twice makes two.
    hosts = [*make_hosts(2, 950, "big"), *make_hosts(2, 320, "small")]  # 760 and 256 usable
    p = plan(MODEL, hosts)
    assert len(p.chains) == 2
    assert all(sorted(h[:3] for h in c.host_ids) == ["big", "sma"] for c in p.chains)
    assert_sound(p, hosts)


def test_faster_host_gets_more_layers():
    hosts = [Host("a", 950, speed=1.0), Host("b", 950, speed=2.0)]  # each holds 7 layers, not 8
    p = plan(MODEL, hosts)
    (chain,) = p.chains
    layers = {s.host_id: s.layer_end - s.layer_start for s in chain.stages}
    assert layers["b"] > layers["a"]
    assert_sound(p, hosts)


def test_layers_follow_speed_so_the_slowest_stage_is_balanced():
    hosts = [Host("a", 2000, speed=1.0), Host("b", 2000, speed=3.0)]
    stages = split_layers(MODEL, PlacementConfig(), hosts)
    by_id = {h.host_id: h for h in hosts}
    times = {s.host_id: (s.layer_end - s.layer_start + (s.layer_end == 8)) / by_id[s.host_id].speed for s in stages}
    # 9 layer-units over speeds 1 + 3: the best bottleneck is 2.25 units; layers are whole, so 7/3 or less.
    assert max(times.values()) <= 7 / 3 + 1e-9


def test_memory_caps_a_fast_host():
    hosts = [Host("fast", 300, speed=10.0), Host("slow", 1100, speed=1.0)]  # fast: 240 usable, 1 layer + head
    p = plan(MODEL, hosts)
    (chain,) = p.chains
    assert [(s.host_id, s.layer_start, s.layer_end) for s in chain.stages] == [("slow", 0, 7), ("fast", 7, 8)]
    assert_sound(p, hosts)


def test_chains_pair_fast_hosts_with_slow_ones():
    hosts = [Host("a", HALF, 2.0), Host("b", HALF, 2.0), Host("c", HALF, 1.0), Host("d", HALF, 1.0)]
    p = plan(MODEL, hosts)
    speeds = [sorted({"a": 2, "b": 2, "c": 1, "d": 1}[h] for h in c.host_ids) for c in p.chains]
    assert speeds == [[1, 2], [1, 2]]
    assert_sound(p, hosts)


def test_slowest_host_is_the_spare_when_memory_is_equal():
    hosts = [Host("a", HALF, 1.0), Host("b", HALF, 0.5), Host("c", HALF, 1.0)]
    assert plan(MODEL, hosts).spare == ["b"]


def test_max_stages_caps_chain_length():
    p = plan(MODEL, make_hosts(5, THIRD), PlacementConfig(max_stages=2))
    assert p.chains == []
    assert "no chain fits" in p.explanation


def test_min_kv_tokens_leaves_room_for_the_cache():
    # Each layer also needs 10 tokens * 4 B of KV: 140 B a layer, so a HALF host (456 B usable) takes
    # 2 layers at either end and 3 in the middle: one chain of 4 stages instead of two of 2.
    config = PlacementConfig(min_kv_tokens=10)
    p = plan(MODEL, make_hosts(4, HALF), config)
    assert [len(c.stages) for c in p.chains] == [4]
    for s in p.chains[0].stages:
        n = s.layer_end - s.layer_start
        assert n * 140 + 50 * (s.layer_start == 0) + 50 * (s.layer_end == 8) <= 456


def test_random_clusters_respect_memory_and_cover_all_layers():
    rng = random.Random(0)
    for _ in range(200):
        hosts = [Host(f"h{i:02d}", rng.randint(150, 1500), speed=rng.choice([0.5, 1.0, 1.5, 3.0]))
                 for i in range(rng.randint(1, 9))]
        config = PlacementConfig(kv_headroom_fraction=rng.choice([0.0, 0.2, 0.5]), max_stages=rng.randint(1, 6))
        assert_sound(plan(MODEL, hosts, config), hosts, config=config)


def test_plan_does_not_depend_on_host_order():
    hosts = [Host(f"h{i}", m, s) for i, (m, s) in enumerate([(570, 1), (450, 2), (950, 1), (570, 0.5), (450, 1)])]
    shuffled = list(reversed(hosts))
    assert plan(MODEL, hosts) == plan(MODEL, shuffled)


def test_fixed_host_keeps_its_range_and_is_completed():
    hosts = [Host("f", 2000, fixed_layers=(2, 6)), *make_hosts(3, 500)]
    p = plan(MODEL, hosts)
    (chain,) = p.chains
    assert ("f", 2, 6) in [(s.host_id, s.layer_start, s.layer_end) for s in chain.stages]
    assert [s.layer_start for s in chain.stages] == [0, 2, 6]
    assert len(p.spare) == 1
    assert "built around fixed f" in p.explanation
    assert_sound(p, hosts)


def test_fixed_hosts_with_adjacent_ranges_share_a_chain():
    hosts = [Host("x", 500, fixed_layers=(0, 4)), Host("y", 500, fixed_layers=(4, 8)), Host("z", WHOLE)]
    p = plan(MODEL, hosts)
    assert layout(p) == [[("x", 0, 4), ("y", 4, 8)], [("z", 0, 8)]]


def test_fixed_host_that_cannot_be_completed_is_reported():
    hosts = [Host("f", 2000, fixed_layers=(2, 6)), Host("tiny", 100)]
    p = plan(MODEL, hosts)
    assert p.chains == []
    assert sorted(p.spare) == ["f", "tiny"]
    assert "f (2:6) could not be completed" in p.explanation


def test_nothing_fits_explains_the_shortfall():
    model = ModelFootprint(num_layers=32, layer_bytes=GIB // 10, embed_bytes=GIB // 20, head_bytes=GIB // 20,
                           kv_bytes_per_token_per_layer=1024)
    hosts = [Host("a", GIB), Host("b", GIB)]
    p = plan(model, hosts, PlacementConfig(max_stages=2))
    assert p.chains == [] and p.spare == ["a", "b"]
    assert "no chain fits: model needs 3.30 GiB" in p.explanation
    assert "largest 2 together 1.60 GiB" in p.explanation
    assert "add a host or memory" in p.explanation


def test_no_hosts_gives_an_empty_plan():
    p = plan(MODEL, [])
    assert p.chains == [] and p.spare == []
    assert "no free hosts" in p.explanation


def test_replan_keeps_intact_chains_and_repairs_the_broken_one():
    hosts = make_hosts(5, HALF)
    first = plan(MODEL, hosts)
    assert len(first.chains) == 2 and len(first.spare) == 1
    broken, intact = first.chains
    gone = broken.host_ids[0]
    # A fast newcomer would change a fresh plan's pairing; the intact chain must stay as it was.
    survivors = [h for h in hosts if h.host_id != gone] + [Host("new", HALF, speed=3.0)]
    second = plan(MODEL, survivors, previous=first)
    assert second.chains[0] == intact
    assert "kept from the previous plan" in second.explanation
    assert len(second.chains) == 2
    assert_sound(second, survivors)


def test_a_new_leader_keeps_the_chains_that_serve_as_they_are():
    """A scheduler that starts leading on a registry that lost its state (restarted empty) sees hosts that
    serve ranges a fresh plan would not choose (3 + 5 layers, and a pairing by newest host): it moves none."""
    hosts = [Host("a", HALF, serving=(0, 3)), Host("b", WHOLE, serving=(3, 8)), Host("c", HALF, serving=(0, 4)),
             Host("d", HALF, serving=(4, 8)), Host("e", HALF)]
    fresh = plan(MODEL, hosts)
    assert layout(fresh) != [[("a", 0, 3), ("b", 3, 8)], [("c", 0, 4), ("d", 4, 8)]]
    kept = plan(MODEL, hosts, previous=serving_plan(MODEL, hosts))
    assert layout(kept) == [[("a", 0, 3), ("b", 3, 8)], [("c", 0, 4), ("d", 4, 8)]]
    assert kept.spare == ["e"]
    assert_sound(kept, hosts)


def test_a_new_leader_keeps_the_published_pairing_of_interchangeable_hosts():
    """Two chains of interchangeable halves: the published table says which first half feeds which second
    half (their chain ids, which routers know, depend on it); hosts that no longer serve their range there
    are paired afresh from what they serve, and a host without a loaded range is planned as usual."""
    hosts = [Host("a", HALF, serving=(0, 4)), Host("b", HALF, serving=(0, 4)), Host("c", HALF, serving=(4, 8)),
             Host("d", HALF, serving=(4, 8))]
    published = [ChainPlan([StagePlan("a", 0, 4), StagePlan("d", 4, 8)]),
                 ChainPlan([StagePlan("b", 0, 4), StagePlan("c", 4, 8)])]
    assert layout(serving_plan(MODEL, hosts, published)) == [[("a", 0, 4), ("d", 4, 8)], [("b", 0, 4), ("c", 4, 8)]]
    moved = [Host("a", HALF, serving=(0, 4)), Host("b", HALF, serving=(4, 8)), Host("c", HALF, serving=(0, 4)),
             Host("d", HALF, serving=(4, 8))]  # b and c were given each other's range since
    assert layout(serving_plan(MODEL, moved, published)) == [[("a", 0, 4), ("d", 4, 8)], [("c", 0, 4), ("b", 4, 8)]]
    assert layout(serving_plan(MODEL, [Host("a", HALF, serving=(0, 4)), Host("b", HALF)], published)) == []
    twice = [ChainPlan([StagePlan("a", 0, 4), StagePlan("c", 4, 8)]),  # a garbage table: host a in two chains
             ChainPlan([StagePlan("a", 0, 4), StagePlan("d", 4, 8)])]
    assert layout(serving_plan(MODEL, hosts, twice)) == [[("a", 0, 4), ("c", 4, 8)], [("b", 0, 4), ("d", 4, 8)]]


def test_replan_drops_a_chain_whose_host_changed_its_fixed_range():
    first = plan(MODEL, make_hosts(2, HALF))
    hosts = [Host("h0", HALF, fixed_layers=(0, 3)), Host("h1", 950)]
    second = plan(MODEL, hosts, previous=first)
    assert layout(second) == [[("h0", 0, 3), ("h1", 3, 8)]]


def test_explanation_reports_splits_and_time_shares():
    p = plan(MODEL, [Host("a", 950, 1.0), Host("b", 950, 2.0)])
    stage_lines = [line for line in p.explanation.splitlines() if line.startswith("    ")]
    assert len(stage_lines) == 2
    assert all("%)" in line and "usable" in line for line in stage_lines)
    assert "2 stages" in p.explanation and "<- slowest" in p.explanation


def test_from_config_counts_qwen2_qkv_bias():
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 300, "num_hidden_layers": 2}
    llama = ModelFootprint.from_config(config, "float32")
    qwen = ModelFootprint.from_config({**config, "model_type": "qwen2"}, "float32")
    assert qwen.layer_bytes - llama.layer_bytes == (64 + 2 * 32) * 4  # q, k, v bias
    assert llama.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 4
    assert ModelFootprint.from_config(config, "bfloat16").layer_bytes * 2 == llama.layer_bytes


def test_tied_embeddings_are_held_once_by_a_single_stage():
    config = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 300,
              "num_hidden_layers": 2, "tie_word_embeddings": True}
    m = ModelFootprint.from_config(config, "float32")
    assert m.total_bytes == 2 * m.layer_bytes + m.embed_bytes + 64 * 4  # embed + final norm
    assert m.stage_bytes(1, 2) == m.layer_bytes + m.head_bytes  # a last stage still needs the matrix
    no_headroom = PlacementConfig(kv_headroom_fraction=0.0)
    assert layout(plan(m, [Host("a", m.total_bytes)], no_headroom)) == [[("a", 0, 2)]]
    assert plan(m, [Host("a", m.total_bytes - 1)], no_headroom).chains == []


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    dims = {"layers": 3, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 300}
    return {f: make_tiny_model(root / f, f, **dims) for f in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_from_model_dir_adds_up_to_the_checkpoint(tiny_dirs, family):
    path = tiny_dirs[family]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        total = sum(math.prod(f.get_slice(n).get_shape()) * 4 for n in f.keys())  # noqa: SIM118
    m = ModelFootprint.from_model_dir(path)
    assert m.num_layers == 3
    assert m.layer_bytes * m.num_layers + m.embed_bytes + m.head_bytes == total == m.total_bytes
    assert m == ModelFootprint.from_config(json.loads((path / "config.json").read_text()), "float32")
    half = ModelFootprint.from_model_dir(path, "bfloat16")
    assert half.total_bytes * 2 == total
    assert half.kv_bytes_per_token_per_layer * 2 == m.kv_bytes_per_token_per_layer


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("span", [(0, 3), (0, 1), (1, 3)])
def test_int8_footprint_is_what_a_quantized_stage_holds(tiny_dirs, family, span):
    from stagemesh.stage_server.engine.loader import load_stage
    from stagemesh.stage_server.engine.quantize import quantize

    path = tiny_dirs[family]
    m = ModelFootprint.from_model_dir(path, quantize="int8")
    converted = quantize(load_stage(path, *span), "int8-weight-only")
    loaded = load_stage(path, *span, linears="int8")  # how a stage loads it: never full precision
    for stage in (converted, loaded):
        assert m.stage_bytes(*span) == sum(p.nbytes for p in stage.parameters())
    assert m.total_bytes < 0.45 * ModelFootprint.from_model_dir(path).total_bytes


def test_int8_weights_let_hosts_that_needed_two_stages_serve_alone(tiny_dirs):
    full = ModelFootprint.from_model_dir(tiny_dirs["llama"])
    int8 = ModelFootprint.from_model_dir(tiny_dirs["llama"], quantize="int8")
    hosts = make_hosts(2, int(full.total_bytes * 0.8))  # weights + KV headroom: half the model each
    assert [len(c.stages) for c in plan(full, hosts).chains] == [2]
    assert [len(c.stages) for c in plan(int8, hosts).chains] == [1, 1]
