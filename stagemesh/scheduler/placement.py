"""Which host serves which decoder layers: pure functions, no I/O besides reading checkpoint headers.

The rule of thumb: a host that holds the whole model serves it alone (no hops); otherwise the model is
split into as few contiguous stages as fit and the remaining hosts build more replicas of that pipeline.
Within a chain, layers are shared in proportion to host speed (subject to memory) so the slowest stage,
which sets the chain's throughput, is as fast as it can be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from stagemesh.checkpoint import ModelFootprint
from stagemesh.config_flags import refused
from stagemesh.discovery.chain_table import chain_kind


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.2f} MiB" if n >= 2**16 else f"{n:.0f} B"


@dataclass(frozen=True)
class Host:
    host_id: str
    memory_bytes: int  # budget for weights + KV cache
    speed: float = 1.0  # relative throughput; a weak host has < 1
    fixed_layers: tuple[int, int] | None = None  # started with --layers A:B: serves exactly that
    fingerprint: str = ""  # what it serves (model digest/dtype/quantization): chains never mix two
    tp: int = 1  # ranks of its tensor-parallel group: one stage, one host; memory_bytes and speed are the group's
    machine: str = ""  # the physical host it runs on (its --host-id); "" when not announced
    devices: int = 1  # accelerator devices that machine has
    serving: tuple[int, int] | None = None  # the range it has loaded and serves now (None: nothing yet)


@dataclass(frozen=True)
class PlacementConfig:
    kv_headroom_fraction: float = field(default=0.2, metadata={"flag": "--kv-headroom"})
    """Share of each host's memory kept for the KV cache (0..1)."""
    max_stages: int = 8
    """Longest chain allowed: every hop adds latency."""
    min_kv_tokens: int = 0
    """KV positions each held layer must also fit, on top of the headroom share."""
    head_cost_layers: float = 1.0
    """Time of the final norm and LM head, in decoder layers (the last stage gets fewer layers for it)."""

    def __post_init__(self) -> None:
        if not 0 <= self.kv_headroom_fraction < 1:
            raise refused(self, "kv_headroom_fraction", "must be >= 0 and < 1 (a share of each host's memory; "
                                                        "1 would leave none for weights)")
        if not self.max_stages >= 1:
            raise refused(self, "max_stages", "must be >= 1 stage per chain")
        if not self.min_kv_tokens >= 0:
            raise refused(self, "min_kv_tokens", "must be >= 0 KV positions")
        if not self.head_cost_layers >= 0:
            raise refused(self, "head_cost_layers", "must be >= 0 decoder layers' time")


@dataclass(frozen=True)
class StagePlan:
    host_id: str
    layer_start: int
    layer_end: int


@dataclass
class ChainPlan:
    stages: list[StagePlan]
    fingerprint: str = ""  # what every stage of it serves

    @property
    def host_ids(self) -> list[str]:
        return [s.host_id for s in self.stages]


@dataclass
class Plan:
    chains: list[ChainPlan]
    spare: list[str]  # hosts serving nothing: waiting capacity
    explanation: str

    def assignments(self) -> dict[str, tuple[int, int]]:
        return {s.host_id: (s.layer_start, s.layer_end) for c in self.chains for s in c.stages}


def usable_bytes(host: Host, config: PlacementConfig) -> int:
    """Memory a host may fill with weights: the rest is kept for the KV cache."""
    return int(host.memory_bytes * (1 - config.kv_headroom_fraction))


def _max_layers(model: ModelFootprint, config: PlacementConfig, host: Host, first: bool, last: bool) -> int:
    """How many decoder layers the host holds in this position (the first carries embed, the last the head)."""
    room = usable_bytes(host, config) - model.embed_bytes * first - model.head_bytes * last
    room += model.embed_bytes * (first and last and model.tied_embeddings)
    per_layer = model.layer_bytes + config.min_kv_tokens * model.kv_bytes_per_token_per_layer
    return -1 if room < 0 else model.num_layers if per_layer == 0 else room // per_layer


def _orders(hosts: list[Host]) -> list[list[Host]]:
    """Candidate orders: every choice of first and last host (they carry embed/head), the middle by id."""
    if len(hosts) == 1:
        return [hosts]
    return [[f, *[h for h in hosts if h not in (f, la)], la] for f in hosts for la in hosts if f is not la]


def _caps(model, config, order: list[Host], lo: int, hi: int) -> list[int] | None:
    """Most layers each host can take in this order, or None if together they cannot hold [lo, hi)."""
    k, n = len(order), hi - lo
    caps = [min(n, _max_layers(model, config, h, lo == 0 and i == 0, hi == model.num_layers and i == k - 1))
            for i, h in enumerate(order)]
    return caps if n >= k and min(caps) >= 1 and sum(caps) >= n else None


def _split_ordered(model, config, order: list[Host], lo: int, hi: int) -> tuple[list[StagePlan], float] | None:
    """Layer counts for a fixed host order that minimise the slowest stage time ((layers + head) / speed)."""
    k, n, caps = len(order), hi - lo, _caps(model, config, order, lo, hi)
    extra = [config.head_cost_layers if hi == model.num_layers and i == k - 1 else 0.0 for i in range(k)]
    if caps is None:
        return None

    def bounds(t: float) -> list[int]:
        return [min(c, math.floor(t * h.speed - e + 1e-9)) for c, h, e in zip(caps, order, extra, strict=True)]

    times = sorted({(m + e) / h.speed for c, h, e in zip(caps, order, extra, strict=True) for m in range(1, c + 1)})
    a, b = 0, len(times) - 1  # the largest time is feasible: every host at its cap
    while a < b:
        mid = (a + b) // 2
        ok = min(bounds(times[mid])) >= 1 and sum(bounds(times[mid])) >= n
        a, b = (a, mid) if ok else (mid + 1, b)
    counts = bounds(times[a])
    while sum(counts) > n:  # trim the slowest stages until the counts cover [lo, hi) exactly
        i = max((j for j in range(k) if counts[j] > 1), key=lambda j: ((counts[j] + extra[j]) / order[j].speed, -j))
        counts[i] -= 1
    stages, start = [], lo
    for h, c in zip(order, counts, strict=True):
        stages.append(StagePlan(h.host_id, start, start + c))
        start += c
    return stages, max((c + e) / h.speed for c, e, h in zip(counts, extra, order, strict=True))


def split_layers(model, config, hosts: list[Host], lo: int = 0, hi: int | None = None) -> list[StagePlan] | None:
    """Best contiguous split of layers [lo, hi) over exactly these hosts, or None if they cannot hold it."""
    hi = model.num_layers if hi is None else hi
    best = None
    for order in _orders(sorted(hosts, key=lambda h: h.host_id)):
        found = _split_ordered(model, config, order, lo, hi)
        if found and (best is None or found[1] < best[1] - 1e-9):
            best = found
    return best and best[0]


def _can_hold(model, config, hosts: list[Host], lo: int, hi: int) -> bool:
    return any(_caps(model, config, order, lo, hi) for order in _orders(hosts))


def _pick_hosts(model, config, pool: list[Host], lo: int, hi: int, limit: int) -> list[Host] | None:
    """Fewest hosts that hold [lo, hi): the largest first, then the smallest one that completes the set,
    so big hosts stay free for more chains. Ties go to the faster host, then the smaller id."""
    rest = sorted(pool, key=lambda h: (-usable_bytes(h, config), -h.speed, h.host_id))
    chosen: list[Host] = []
    while rest and len(chosen) < limit:
        done = [h for h in rest if _can_hold(model, config, [*chosen, h], lo, hi)]
        if done:
            return [*chosen, min(done, key=lambda h: (usable_bytes(h, config), -h.speed, h.host_id))]
        chosen.append(rest.pop(0))
    return None


def _balance(model, config, groups: list[list[Host]]) -> list[list[Host]]:
    """Deal same-size chains' hosts out again in snake order by speed (fast with slow), so chains run at
    similar speeds; kept only if that narrows the spread of chain speeds and memory still fits."""
    dealt: list[list[Host]] = [[] for _ in groups]
    for i, h in enumerate(sorted((h for g in groups for h in g), key=lambda h: (-h.speed, h.host_id))):
        r, c = divmod(i, len(groups))
        dealt[c if r % 2 == 0 else len(groups) - 1 - c].append(h)

    def spread(gs: list[list[Host]]) -> float:
        return max(sum(h.speed for h in g) for g in gs) - min(sum(h.speed for h in g) for g in gs)

    ok = all(_can_hold(model, config, g, 0, model.num_layers) for g in dealt)
    return dealt if len(groups) > 1 and ok and spread(dealt) < spread(groups) - 1e-9 else groups


def _still_valid(model, config, chain: ChainPlan, by_id: dict[str, Host]) -> bool:
    """A previous chain survives if its hosts are all here, still hold their ranges and still cover the model."""
    stages, n = chain.stages, model.num_layers
    if not stages or stages[0].layer_start != 0 or stages[-1].layer_end != n or len(stages) > config.max_stages:
        return False
    for i, s in enumerate(stages):
        h = by_id.get(s.host_id)
        if h is None or (h.fixed_layers and tuple(h.fixed_layers) != (s.layer_start, s.layer_end)):
            return False
        if i and stages[i - 1].layer_end != s.layer_start or s.layer_end <= s.layer_start:
            return False
        if _max_layers(model, config, h, i == 0, s.layer_end == n) < s.layer_end - s.layer_start:
            return False
    return True


def serving_plan(model: ModelFootprint, hosts: list[Host], published: list[ChainPlan] = ()) -> Plan:
    """The chains these hosts serve as they stand (each host's loaded range), as a `previous` plan for a
    scheduler that starts leading: the chains the registry last published where every host still serves its
    range there, then chains joined up from the other serving hosts' ranges, 0 to the last layer. Planning
    from it moves no layer that works, however the registry's state was lost or who planned before."""
    n, by_id = model.num_layers, {h.host_id: h for h in hosts}
    chains: list[ChainPlan] = []
    used: set[str] = set()
    for c in published:  # anyone can write the table: a host named twice counts once
        ids = [s.host_id for s in c.stages]
        if len(set(ids)) == len(ids) and not used & set(ids) and all(
                (h := by_id.get(s.host_id)) and h.serving == (s.layer_start, s.layer_end) for s in c.stages):
            chains.append(c)
            used |= set(ids)
    for first in sorted((h for h in hosts if h.serving and h.serving[0] == 0 and h.host_id not in used),
                        key=lambda h: h.host_id):
        stages, end = [first], first.serving[1]
        while end < n and (following := min((h for h in hosts if h.serving and h.serving[0] == end
                                             and h.fingerprint == first.fingerprint and h.host_id not in used
                                             and h not in stages), key=lambda h: h.host_id, default=None)):
            stages.append(following)
            end = following.serving[1]
        if end == n:
            chains.append(ChainPlan([StagePlan(h.host_id, *h.serving) for h in stages], first.fingerprint))
            used |= {h.host_id for h in stages}
    return Plan(chains, [], "")


def resume(model: ModelFootprint, hosts: list[Host], previous: Plan | None, published: list[ChainPlan] = ()) -> Plan:
    """The `previous` plan to plan from: the last plan (or, for a scheduler that starts leading, what serves:
    serving_plan), plus chains joined up from serving hosts none of its chains holds, so a stage that registers
    again after the rest of its chain (a registry restarted empty) finds its chain instead of being re-planned."""
    if previous is None:
        return serving_plan(model, hosts, published)
    ids = {h.host_id for h in hosts}
    held = {s.host_id for c in previous.chains if all(s.host_id in ids for s in c.stages) for s in c.stages}
    joined = serving_plan(model, [h for h in hosts if h.host_id not in held])
    return Plan(previous.chains + joined.chains, previous.spare, previous.explanation)


def partial(hosts: list[Host], previous: Plan) -> dict[str, tuple[int, int]]:
    """Hosts (not fixed) that serve a range no chain of `previous` holds: parts of chains whose other hosts are
    missing, with their ranges."""
    held = {s.host_id for c in previous.chains for s in c.stages}
    return {h.host_id: h.serving for h in hosts if h.serving and not h.fixed_layers and h.host_id not in held}


def _describe(model, config, chain: ChainPlan, by_id: dict[str, Host]) -> list[str]:
    """One line per stage: range, memory use, estimated time (layer-units / speed) and its share."""
    n = model.num_layers
    times = [((s.layer_end - s.layer_start) + config.head_cost_layers * (s.layer_end == n)) / by_id[s.host_id].speed
             for s in chain.stages]
    lines, slowest = [], max(times) if len(times) > 1 else None
    for s, t in zip(chain.stages, times, strict=True):
        h, parts = by_id[s.host_id], ["embed"] * (s.layer_start == 0) + ["head"] * (s.layer_end == n)
        where = f" on {h.machine}" * bool(h.machine) + f", tp {h.tp}" * (h.tp > 1)
        lines.append(f"    {s.host_id}{where}: layers {s.layer_start}:{s.layer_end} ({s.layer_end - s.layer_start}"
                     f"{''.join(', ' + p for p in parts)}), speed {h.speed:g}, "
                     f"{_gib(model.stage_bytes(s.layer_start, s.layer_end))} of {_gib(usable_bytes(h, config))} "
                     f"usable, est. time {t:.2f} ({t / sum(times):.0%}){' <- slowest' * (t == slowest)}")
    return lines


def _fixed_chains(model, config, fixed_hosts: list[Host], free: list[Host], notes: list[str]):
    """Chains around hosts started with fixed ranges, the missing ranges filled from `free`.
    Returns (chains with reasons, free hosts left)."""
    n, groups, chains = model.num_layers, [], []
    for h in sorted(fixed_hosts, key=lambda h: (h.fixed_layers, h.host_id)):
        a, b = h.fixed_layers
        if not 0 <= a < b <= n:
            notes.append(f"fixed host {h.host_id} ({a}:{b}) is outside the model's 0:{n}; left out")
        elif g := next((g for g in groups if g[-1].fixed_layers[1] == a), None):
            g.append(h)  # joins a group whose range ends where this one begins
        else:
            groups.append([h])
    for g in groups:
        fixed = [StagePlan(h.host_id, *h.fixed_layers) for h in g]
        before, after, pool = [], [], list(free)
        for lo, hi in ((0, fixed[0].layer_start), (fixed[-1].layer_end, n)):
            if lo == hi:
                continue
            picked = _pick_hosts(model, config, pool, lo, hi, config.max_stages - len(g) - len(before))
            if picked is None:
                notes.append(f"fixed {', '.join(f'{s.host_id} ({s.layer_start}:{s.layer_end})' for s in fixed)} "
                             f"could not be completed: layers {lo}:{hi} need {_gib(model.stage_bytes(lo, hi))}, "
                             f"the free hosts hold {_gib(sum(usable_bytes(h, config) for h in pool))} usable; "
                             "left out")
                break
            stages = split_layers(model, config, picked, lo, hi)
            before, after = (stages, after) if lo == 0 else (before, stages)
            pool = [h for h in pool if h not in picked]
        else:
            helpers = ", ".join(s.host_id for s in before + after)
            chains.append((ChainPlan(before + fixed + after), f"built around fixed {', '.join(h.host_id for h in g)}"
                           + (f", completed with {helpers}" if helpers else "")))
            free = pool
    return chains, free


def _explain(model, config, hosts, chains, spare, free, notes) -> str:
    """Why this many chains and stages, why these splits, who is spare, and what is missing if nothing fits."""
    by_id, headroom = {h.host_id: h for h in hosts}, config.kv_headroom_fraction
    lines = [f"model: {model.num_layers} layers, {_gib(model.total_bytes)} of weights (layer "
             f"{_gib(model.layer_bytes)}, embed {_gib(model.embed_bytes)}, head {_gib(model.head_bytes)}); each host "
             f"keeps {headroom:.0%} of its memory for the KV cache",
             f"{len(chains)} chain(s) over {len(hosts) - len(spare)} of {len(hosts)} host(s); layers are shared in "
             "proportion to speed within memory, est. time = (layers + head) / speed"]
    for i, (c, why) in enumerate(chains):
        kind = chain_kind([by_id[s.host_id].tp for s in c.stages])
        lines += [f"  chain {i} ({kind}): {why}", *_describe(model, config, c, by_id)]
    lines += [f"  {note}" for note in notes]
    if spare:
        left = [h for h in free if h.host_id in spare]
        lines.append(f"spare: {', '.join(spare)}" + (
            f" (free ones hold {_gib(sum(usable_bytes(h, config) for h in left))} usable together, not enough "
            f"for another chain of at most {config.max_stages} stages)" if left and chains else ""))
    if not chains:
        top = sorted((usable_bytes(h, config) for h in free), reverse=True)[: config.max_stages]
        need = model.total_bytes
        lines.append(f"no chain fits: model needs {_gib(need)} ({_gib(need / (1 - headroom))} of memory with "
                     f"{headroom:.0%} KV headroom); " + (f"largest host holds {_gib(top[0])} usable, the largest "
                     f"{len(top)} together {_gib(sum(top))}; " if top else "there are no free hosts; ")
                     + "add a host or memory")
    return "\n".join(lines)


def plan(model: ModelFootprint, hosts: list[Host], config: PlacementConfig | None = None,
         previous: Plan | None = None) -> Plan:
    """Chains of (host, layer range) for these hosts; keeps `previous` chains that are still intact, so a
    re-plan after a host leaves only touches its chain. Hosts that serve different builds of the model
    (fingerprints) never share a chain: each build's hosts are planned on their own (a rolling update
    runs old and new chains side by side, never a mixed one)."""
    config = config or PlacementConfig()
    hosts = sorted(hosts, key=lambda h: h.host_id)
    by_id = {h.host_id: h for h in hosts}
    if len(by_id) != len(hosts) or any(h.speed <= 0 for h in hosts):
        raise ValueError("host ids must be unique and speeds positive")
    builds = sorted({h.fingerprint for h in hosts})
    if len(builds) <= 1:
        return _plan_build(model, hosts, config, previous, builds[0] if builds else "")
    parts = [_plan_build(model, [h for h in hosts if h.fingerprint == fp], config, previous, fp) for fp in builds]
    named = ", ".join(fp or "?" for fp in builds)
    lines = [f"{len(builds)} builds of the model among the hosts (fingerprints {named}): each build's hosts are "
             "planned on their own, and no chain mixes two"]
    for fp, part in zip(builds, parts, strict=True):
        lines += [f"fingerprint {fp or '? (not announced)'}:", *("  " + line for line in part.explanation.splitlines())]
    return Plan([c for p in parts for c in p.chains], [h for p in parts for h in p.spare], "\n".join(lines))


def _plan_build(model: ModelFootprint, hosts: list[Host], config: PlacementConfig, previous: Plan | None,
                fingerprint: str) -> Plan:
    """plan() for hosts that all serve one build (fingerprint)."""
    by_id = {h.host_id: h for h in hosts}
    chains = [(c, "kept from the previous plan: its hosts are all still here")
              for c in (previous.chains if previous else [])
              if c.fingerprint == fingerprint and _still_valid(model, config, c, by_id)]
    used = {s.host_id for c, _ in chains for s in c.stages}
    notes: list[str] = []
    fixed_chains, free = _fixed_chains(model, config, [h for h in hosts if h.fixed_layers and h.host_id not in used],
                                       [h for h in hosts if not h.fixed_layers and h.host_id not in used], notes)
    chains += fixed_chains

    groups: list[list[Host]] = []
    while picked := _pick_hosts(model, config, free, 0, model.num_layers, config.max_stages):
        groups.append(picked)
        free = [h for h in free if h not in picked]
    biggest = max((usable_bytes(h, config) for h in hosts), default=0)
    for k in sorted({len(g) for g in groups}):
        for g in _balance(model, config, [g for g in groups if len(g) == k]):
            why = (f"1 stage: the whole model ({_gib(model.total_bytes)}) fits in {g[0].host_id}'s "
                   f"{_gib(usable_bytes(g[0], config))} usable" if k == 1 else
                   f"{k} stages: the fewest free hosts that hold the model ({_gib(model.total_bytes)}; "
                   f"largest host holds {_gib(biggest)} usable)")
            chains.append((ChainPlan(split_layers(model, config, g)), why))

    serving = {s.host_id for c, _ in chains for s in c.stages}
    spare = [h.host_id for h in hosts if h.host_id not in serving]
    explanation = _explain(model, config, hosts, chains, spare, free, notes)
    for c, _ in chains:
        c.fingerprint = fingerprint
    return Plan([c for c, _ in chains], spare, explanation)
