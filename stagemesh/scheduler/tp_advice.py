"""When a machine with several devices runs stages of one rank each, whether `--tp K` there would serve better:
pure functions over the announced hosts and the plan. The scheduler cannot start ranks itself (a tensor-parallel
stage is one process group that its operator starts on one machine), so it says what to start and why.

Tensor parallelism stays inside one machine: the advice is per machine, over that machine's own devices, and
never groups stages of different machines (their links are slow, and an all-reduce per layer would cross them).
"""

from __future__ import annotations

from stagemesh.checkpoint import ModelArgs, ModelFootprint
from stagemesh.scheduler.placement import Host, PlacementConfig, Plan, split_layers


def tp_sizes(args: ModelArgs, devices: int) -> list[int]:
    """The tensor-parallel sizes a stage of this model can run with on `devices` devices: 2.. devices, dividing
    both the attention and the KV heads (each rank holds whole heads and its share of the KV cache)."""
    return [k for k in range(2, devices + 1) if args.num_heads % k == 0 and args.num_kv_heads % k == 0]


def _fitting_size(model: ModelFootprint, config: PlacementConfig, sizes: list[int], per_device: int) -> int | None:
    """The smallest size whose group (k devices of `per_device` budget each) holds the whole model alone."""
    return next((k for k in sizes if split_layers(model, config, [Host("tp", k * per_device)])), None)


def advise(model: ModelFootprint, args: ModelArgs, config: PlacementConfig, hosts: list[Host], plan: Plan) -> list[str]:
    """Lines for the plan's explanation: for each machine announcing several devices whose stages run one rank
    each, the `--tp K` that would let the model fit on fewer hosts (or with fewer hops), or, where every chain is
    already one hop and no stage of the mesh is tensor-parallel, that would prefill long prompts faster."""
    machine_of = {h.host_id: h.machine for h in hosts}
    any_tp = any(h.tp > 1 for h in hosts)
    lines: list[str] = []
    for machine in sorted({h.machine for h in hosts if h.machine}):
        group = [h for h in hosts if h.machine == machine]
        singles = {h.host_id: h for h in group if h.tp == 1}
        devices = max(h.devices for h in group)
        if devices < 2 or not singles:
            continue
        sizes = tp_sizes(args, devices)
        if not sizes:
            lines.append(f"  {machine}: {devices} devices, but no tensor-parallel size 2..{devices} divides the "
                         f"model's {args.num_heads} attention and {args.num_kv_heads} KV heads; its stages stay at "
                         "tp 1")
            continue
        per_device = min(h.memory_bytes for h in singles.values())  # a one-rank stage announces one device's budget
        k = _fitting_size(model, config, sizes, per_device)
        if k is None:
            continue
        start = (f"  advice for {machine}: start a stage there with --tp {k} (over {k} of its {devices} devices, "
                 f"--memory-gb for all {k} together) instead of one-rank stages")
        chains = [c for c in plan.chains if any(s.host_id in singles for s in c.stages)]
        crossing = [c for c in chains if len({machine_of[s.host_id] for s in c.stages}) > 1]
        in_host = [c for c in chains if len(c.stages) > 1 and c not in crossing]
        if not plan.chains:
            lines.append(f"{start}: no chain fits now, and {k} devices of its stages' budget hold the whole model")
        elif crossing:
            lines.append(f"{start}: its chains now cross to other hosts; as one tensor-parallel stage the model "
                         f"fits on {machine} alone (fewer hosts, no hop between hosts)")
        elif in_host:
            lines.append(f"{start}: its chains are pipelines of {max(len(c.stages) for c in in_host)} stages inside "
                         f"it; one tensor-parallel stage holds the whole model with no hops, its prefill split "
                         f"{k} ways")
        elif not any_tp:
            lines.append(f"{start}, for long prompts: a tensor-parallel stage prefills a long prompt about {k} "
                         f"times as fast (its work splits over {k} devices; decode gains less, an all-reduce per "
                         "layer costs it); routers send prompts over --long-prompt-tokens to the widest "
                         "tensor-parallel chain and keep short ones on the replicas")
    if lines:
        lines.append("  (the scheduler cannot start ranks: restart those stages with the flags above; a "
                     "tensor-parallel group is one machine's devices, never stages of two machines)")
    return lines
