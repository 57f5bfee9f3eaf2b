"""One rank (1..K-1) of a tensor-parallel stage: a process started by rank 0 (stage_server/engine/tensor_parallel.py).

It loads its shards of the stage's slice, joins the ranks' group, then runs every pass rank 0 broadcasts
over its own KV pool, until rank 0 goes: it exits when its parent process is gone or a collective fails.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import torch

from stagemesh.log import setup_logging
from stagemesh.stage_server.engine import fused_ops, paged_attention
from stagemesh.stage_server.engine.loader import TORCH_DTYPES, load_stage
from stagemesh.stage_server.engine.tensor_parallel import WATCH_S, new_group, rank_device, receive_pass, shard_layers

log = logging.getLogger("stagemesh.stage")


def _exit_with_parent(parent_pid: int) -> None:
    """Rank 0 gone (even by SIGKILL): this rank goes too."""
    while os.getppid() == parent_pid:
        time.sleep(WATCH_S)
    os._exit(0)


def run(spec: dict) -> None:
    threading.Thread(target=_exit_with_parent, args=(spec["parent_pid"],), daemon=True).start()
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    rank, size = spec["rank"], spec["size"]
    device = rank_device(torch.device(spec["device"]), rank)
    model = load_stage(spec["model"], spec["layer_start"], spec["layer_end"], dtype=TORCH_DTYPES[spec["dtype"]],
                       device=device, tp=(rank, size))
    if spec["attention_kernel"]:
        paged_attention.attach(model)
    if spec.get("fused_layers"):
        fused_ops.attach(model)  # as rank 0 does (a CUDA stage's; a CPU rank runs op by op)
    # Rank 0 runs the final norm and LM head on the reduced hidden states; this rank stops after the layers.
    model.is_last, model.norm, model.lm_head = False, None, None
    group = new_group(spec["backend"], spec["port"], rank, size)
    shard_layers(model, group)
    wire = device if spec["backend"] == "nccl" else torch.device("cpu")
    pool = None
    while True:
        inputs, steps, pool = receive_pass(group, model, pool, wire)
        model(inputs, steps)


def main() -> None:
    setup_logging()
    spec = json.loads(sys.argv[1])
    try:
        run(spec)
    except Exception as exc:  # rank 0 closed the group (it stopped or died), or this rank failed: either way, go
        log.info(f"tensor-parallel rank {spec['rank']} exiting: {type(exc).__name__}: {exc}",
                 extra={"stage": f"tp-rank-{spec['rank']}"})
        sys.exit(1)


if __name__ == "__main__":
    main()
