"""A stage server's configuration: every `stagemesh stage` flag is a field here (stagemesh/config_flags.py)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from stagemesh import grpc_server
from stagemesh.checkpoint import QUANTIZE, DtypeChoice, Quantization
from stagemesh.config_flags import PORT_RULE, refused
from stagemesh.discovery.backends import plaintext_hosts
from stagemesh.stage_server.service.backpressure import QueueConfig
from stagemesh.tls import PlaintextConfig
from stagemesh.tracing import TracingConfig

PASS_TOKENS = {"cpu": 256, "cuda": 2048}
"""--max-batch-tokens where it is left out, by the stage's device. A CPU's pass is compute-bound from a few dozen
rows on, so a larger one costs the same per token and only holds the next stage, and every stream whose next token
waits on it, back longer: on a 2-stage ~270M chain at 64 streams passes of 256 gave 1.08x the tokens/s of 2048 and
the streams' first tokens ~22% sooner (docs/decisions.md, "Passes of 256 tokens on a CPU"). A GPU's pass gains
from rows into the thousands."""


@dataclass
class BatcherConfig:
    batch_window_ms: float = 0.0
    """Wait this long for more steps after the first arrives, to batch them together (0: take what is queued)."""
    max_batch_tokens: int | None = None
    """Token budget of one forward pass (default: 256 on a CPU, 2048 on CUDA: PASS_TOKENS); one step larger than
    it still runs, alone."""
    inline_max_ms: float = 5.0
    """On a CPU stage of one compute thread, a lone decode step runs on the event loop while the last decode pass
    took less than this (0: never); above it the hop to the compute thread costs less than holding the loop. A GPU
    stage never runs a pass on the loop (the wait for its tokens would hold every session's messages)."""
    decode_groups: int = 2
    """A stage that is not the last of its chain runs at most 1/N of its open sessions' decode steps (N: this)
    in one pass (never fewer than --decode-group-min-rows), so that its chain holds that many groups of steps in
    flight: while the next stage runs one group, this one runs the next, where one pass of every step left each
    stage idle while the others ran it (1: one pass takes every waiting step)."""
    decode_group_min_rows: int = 16
    """The fewest decode steps a group holds: below ~16 rows a pass costs about what the weights take to read,
    and two small passes cost twice one."""
    lone_session_threads: int = 0
    """Torch threads for the decode passes of a stage that serves one session, where they run on its compute
    thread (0: --threads). A lone stream's stages take turns, so the one whose turn it is may use the cores the
    others are not using: where one thread streams half the memory's bandwidth, as on this project's Intel VMs, a
    2-stage chain of 1-thread stages decoded a ~270M stream 1.3-1.6x faster with 2 (docs/decisions.md, "A lone session's
    stages take the chain's cores")."""

    def __post_init__(self) -> None:
        if not self.batch_window_ms >= 0:
            raise refused(self, "batch_window_ms", "must be >= 0 milliseconds (0: no waiting, take what is queued)")
        if self.max_batch_tokens is not None and not self.max_batch_tokens >= 1:
            raise refused(self, "max_batch_tokens", "must be >= 1 token (leave it out for the device's default)")
        if not self.inline_max_ms >= 0:
            raise refused(self, "inline_max_ms", "must be >= 0 milliseconds (0: every pass on the compute thread)")
        if not self.decode_groups >= 1:
            raise refused(self, "decode_groups", "must be >= 1 (1: one pass takes every waiting decode step)")
        if not self.decode_group_min_rows >= 1:
            raise refused(self, "decode_group_min_rows", "must be >= 1 decode step")
        if not self.lone_session_threads >= 0:
            raise refused(self, "lone_session_threads", "must be >= 0 threads (0: --threads)")

    def pass_tokens(self, device_type: str) -> int:
        """The token budget of one pass on a device of this type ("cpu", "cuda"): --max-batch-tokens, or
        PASS_TOKENS's."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return PASS_TOKENS.get(device_type, PASS_TOKENS["cuda"])


STEP_HEADROOM_BYTES = 1 << 20
"""Room in a step message besides its hidden states: framing, ids, sampling, a row scale per token."""


def max_step_bytes(max_batch_tokens: int, hidden_size: int) -> int:
    """The largest message (a Sessions or Relay batch's step) a stage accepts: a whole pass's hidden states in
    float32 (the widest wire dtype) and headroom. Routers send no larger chunk; anything larger is refused by gRPC
    (RESOURCE_EXHAUSTED) from its length prefix, before it is buffered."""
    return max_batch_tokens * hidden_size * 4 + STEP_HEADROOM_BYTES


def parse_layers(spec: str) -> tuple[int, int | None]:
    """--layers A:B -> (A, B); "A:" runs through the last layer."""
    try:
        a, b = spec.split(":")
        return int(a), (int(b) if b else None)
    except ValueError:
        raise ValueError("use A:B (layers A..B-1), e.g. 0:4") from None


def split_host_port(text: str) -> tuple[str, int | None]:
    """--advertise: "HOST", "HOST:PORT", "[V6]" or "[V6]:PORT" -> (host, port or None); a bare IPv6
    address is a host."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or rest[:1] not in ("", ":"):
            raise ValueError("use HOST, HOST:PORT or [IPv6]:PORT")
        port = rest[1:] or None
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, None
    if not host or grpc_server.is_wildcard(host):
        raise ValueError("give the host others reach this stage at, not a wildcard")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"port {port!r} must be 1..65535")
    return host, int(port) if port else None


@dataclass
class StageConfig:
    model: str
    """Local Hugging Face checkpoint directory (config.json + safetensors)."""
    layer_start: int | None = field(default=None, metadata={"flag": "--layers", "type": parse_layers,
                                                            "metavar": "A:B"})
    """A:B serves decoder layers A..B-1 (default: the scheduler assigns a range; needs --registry)."""
    layer_end: int | None = field(default=None, metadata={"flag": "--layers"})
    """None: through the last layer."""
    host: str = "127.0.0.1"
    """The address to serve on (a wildcard such as 0.0.0.0 or :: needs --advertise)."""
    port: int = 50061
    """The port to serve on (0 picks a free one: several stages on one host need a port each; `stagemesh up` gives
    its stages 0)."""
    advertise: str = field(default="", metadata={"metavar": "HOST[:PORT]"})
    """The address others reach this stage at: registered in the registry, shown in logs, part of the
    stage's id (default: --host and the bound port; PORT defaults to the bound port)."""
    device: str = "auto"
    """auto, cpu or cuda (cuda:N for one of several)."""
    dtype: DtypeChoice = "auto"
    """The dtype the weights and the KV cache are held in: auto takes the checkpoint's (config.json's
    torch_dtype), a float32 checkpoint in bfloat16 on CUDA (stagemesh/checkpoint.py, serving_dtype)."""
    kv_cache_gb: float | None = None
    """KV cache pool size (default: a quarter of the memory available at start), allocated once, in blocks."""
    repair_log_tokens: int | None = None
    """Repair: positions of hidden states this stage keeps for the sessions it sends on (their output logs, for
    routers that ask: keep_output), so that a stage replacing a dead next stage is rebuilt from them instead of the
    whole chain being replayed. Allocated once, in chunks of --kv-block-size positions: on the stage's device
    where its memory plan has room, else in pinned host memory (stage_server/engine/memory_plan.py). Default: as many
    as the KV pool holds (every position can be logged; the KV pool is sized with the log's share counted), none on
    a last stage. A session whose log does not fit is replayed, counted (stagemesh_stage_output_log_dropped_total)
    and logged (0: keep none)."""
    kv_block_size: int = 16
    """Positions per KV block: sessions take blocks as they grow and return them when they end."""
    kv_lookahead_blocks: int = 4
    """Blocks a session reserves beyond those it holds, for admission (OpenSession's max_length is an upper
    bound, not a reservation); a session that outgrows it while the pool is dry preempts the newest session."""
    prefix_cache: bool = True
    """Keep the KV blocks of the prompts' leading full blocks after their sessions end, and attach them to a new
    session that starts with the same tokens instead of computing them again (a shared system prompt, the
    prompts of a conversation's earlier turns, a replay); those no session holds are taken back first when the
    pool is full. Not with --tp (its ranks' pools are not shared block by block)."""
    session_timeout_s: float = field(default=300.0, metadata={"deprecated": "--session-timeout"})
    """Seconds after which an idle session is closed and its cache freed."""
    unstepped_session_timeout_s: float = 30.0
    """Seconds after which a session opened and left is closed (never stepped, and no stream of its opener
    holds it): opening sessions without using them must not hold the KV pool for the whole idle timeout. A
    router's sessions are held by its streams from the open, so a first step queued for long on the stages
    before this one (long prompts ahead of it) does not count against this."""
    stall_timeout_s: float = 30.0
    """Health turns NOT_SERVING while steps wait and no pass has finished for this long (a stuck
    compute thread), so that routers stop sending it work; it turns back when passes finish again."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: out of the registry and NOT_SERVING at once, no new sessions, and this long for
    the sessions it holds to finish before the process exits (those left are cut: routers replay them)."""
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    queues: QueueConfig = field(default_factory=QueueConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (default: none): passes, tokens, sessions, KV pool, wire bytes."""
    threads: int | None = None
    """torch intra-op threads (default: torch's choice)."""
    registry: str | None = None
    """local://HOST:PORT, consul://HOST:PORT, consul+https://HOST:PORT, etcd://HOST:PORT[,HOST:PORT...] or
    etcd+https://...: announce this stage there (needed without --layers)."""
    tls: str | None = None
    """A directory with ca.pem, stage.pem and stage-key.pem (`stagemesh certs`; or a role-less mesh.pem): serve
    mutual TLS (sessions only from router certificates, Relay only from stage certificates) and reach the registry
    with it; reloaded on SIGHUP (default: plaintext)."""
    plaintext: PlaintextConfig = field(default_factory=PlaintextConfig)
    model_name: str = ""
    """The model's name in the registry (default: the checkpoint directory's name)."""
    memory_gb: float | None = None
    """Memory budget announced to the scheduler (default: the memory available at start)."""
    speed: float = 1.0
    """Relative speed announced to the scheduler: a host half as fast says 0.5 and gets fewer layers."""
    quantize: Quantization = "none"
    """int8: Linear weights in int8 (int8 kernels on CPU float32, weight-only elsewhere); int8-weight-only:
    int8 weights, activations in the model's dtype, on any device (on a CPU float32 stage in int8 panels for
    stagemesh's kernel, on CUDA widened tile by tile by a Triton kernel); fp8: float8_e4m3 weights and FP8 matrix
    products (CUDA compute capability 8.9+, i.e. Ada and Hopper; stage_server/engine/quantize.py; the docs give the
    accuracy cost)."""
    preload: bool = False
    """Read every weight page at start, so that no request pays for a cold page (tensors used as stored
    are otherwise views of the memory-mapped safetensors file, read on first use); Stage/Info reports
    the load time as cold start."""
    host_id: str = ""
    """The machine this stage runs on, announced to the scheduler (meta "host"); every stage of one machine
    says the same (default: this machine's hostname). A tensor-parallel group never spans two."""
    devices: int | None = None
    """Accelerator devices on this machine, announced to the scheduler (meta "devices"; default: CUDA's device
    count on CUDA, else 1): on a machine with several it may advise --tp."""
    compile: bool = False
    """torch.compile (inductor) the whole decode pass (all layers, KV writes, attention, LM head) as one graph;
    prefill stays eager. Compiled in the warm-up before SERVING (the time shows in the cold start); eager, logged
    once, if compilation fails (stage_server/engine/compiled.py). Not with --quantize or --tp."""
    enforce_eager: bool = False
    """On CUDA, run every pass eager: no CUDA graphs. By default a CUDA stage with the Triton attention kernel
    captures graphs in its warm-up, before SERVING: decode passes by session count (1, 2, 4 ... 128) and other
    passes by token count (16, 32 ... --max-batch-tokens), and replays them (stage_server/gpu/cuda_graphs.py); a pass
    that fits no bucket runs eager, counted by reason."""
    max_model_len: int | None = None
    """The longest session, prompt and output together, this stage admits (default: the model's context,
    max_position_embeddings): sizes the graphs' block tables and bounds what one session may hold of the pool."""
    gpu_memory_utilization: float = 0.9
    """On CUDA, without --kv-cache-gb: the share of the GPU's memory this stage may use in all. The KV pool takes
    what is left of it after the weights, the activations of a full pass (measured by a profiling pass) and as
    much again for the CUDA graphs' memory (stage_server/engine/memory_plan.py)."""
    attention_kernel: bool = True
    """Attention reads K/V where they lie in the pool (stage_server/engine/paged_attention.py): on the CPU decode steps
    by stagemesh's C++ kernel (built with this host's C++ compiler on first use and cached), on CUDA every pass
    by a Triton kernel; off, or where the kernel cannot be had (logged once), K/V are gathered into a padded
    buffer for SDPA."""

    packed_weights: bool = True
    """On the CPU in float32, every Linear weight is held in panels of 16 output columns and multiplied by
    stagemesh's kernel, which reads it once per pass whatever the pass's rows and splits it across the threads
    (stage_server/cpu/packed_weights.py; built with the paged attention kernel): on an AMD EPYC a ~270M stage's pass of
    4 decode steps 2x faster than MKL's, a lone step 1.2x on one thread and 1.6x on two. The same memory as the
    weights as loaded. With --compile the kernel is an op in the graph. Not applied (logged) on other devices and
    dtypes, with --quantize int8 or --tp (their Linears are their own), or where the kernels cannot be built;
    with --quantize int8-weight-only the panels hold its int8 weights and their scales; --no-packed-weights keeps
    torch's layout."""
    huge_pages: bool = True
    """On the CPU, the packed weights (and float32 weights in torch's transposed layout) and the KV pool lie on 2 MiB
    pages where the kernel offers transparent huge pages (stage_server/cpu/huge_pages.py): fewer TLB misses for the
    memory every step streams (on an Intel Xeon VM a GEMV ~10% and decode attention ~15% faster). A fresh 2 MiB page
    is zeroed whole at its first touch, which on a VM whose host backs memory lazily makes the first stage after a
    boot load slower (~14 s against ~2 for a ~270M slice); --no-huge-pages keeps 4 KiB pages."""
    fused_layers: bool = True
    """On the CPU in float32, with packed weights and the paged attention kernel, a decode pass runs its decoder
    layers in one call of stagemesh's kernels (stage_server/cpu/decode_layers.py) instead of ~25 eager ops a layer: on
    the tiny model a 2-stage chain's model phase 1.3-1.6x faster (one call per layer then; all layers in one call
    since), on the ~270M model within noise. The same arithmetic (within 1e-6 of the layers' own ops). Prefill
    chunks and mixed passes, and --compile's graphs, are unchanged. On CUDA, every pass (and every CUDA graph) runs a
    layer's small ops in one Triton kernel each: RMSNorm with the residual add before it, the rotary embedding with
    the K/V writes, SiLU-and-multiply (stage_server/gpu/triton_fused.py: ~30 kernels a layer become nine, rounding
    where the ops they replace round). --no-fused-layers keeps every pass op by op."""

    tp: int = 1
    """Tensor-parallel ranks: the slice runs on this many processes of this host (one per CUDA device on a GPU
    host), each with its share of the attention heads, KV heads and MLP columns; it must divide the model's
    attention and KV heads. To routers and other stages the stage is still one stage."""

    def __post_init__(self) -> None:
        if self.dtype not in get_args(DtypeChoice):
            raise ValueError(f"--dtype {self.dtype!r}: use one of {', '.join(get_args(DtypeChoice))}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device {self.device!r}: use auto, cpu or cuda")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"--quantize {self.quantize!r}: use one of {', '.join(QUANTIZE)}")
        if self.layer_start is not None and not (
                self.layer_start >= 0 and (self.layer_end is None or self.layer_end > self.layer_start)):
            raise ValueError(f"--layers {self.layer_start}:{self.layer_end}: use A:B with 0 <= A < B "
                             "(layers A..B-1), e.g. 0:4")
        if self.layer_start is None and not self.registry:
            raise ValueError("give --layers A:B, or --registry so that the scheduler assigns a range")
        if not 0 <= self.port <= 65535:
            raise refused(self, "port", PORT_RULE)
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise refused(self, "kv_cache_gb", "must be > 0 GiB (leave it out for a quarter of the available memory)")
        if self.repair_log_tokens is not None and not self.repair_log_tokens >= 0:
            raise refused(self, "repair_log_tokens", "must be >= 0 positions (0: keep no output logs, failover "
                                                     "replays; leave it out for the KV pool's capacity)")
        if not 1 <= self.kv_block_size <= 4096:
            raise refused(self, "kv_block_size", "must be 1..4096 positions (16 is ordinary)")
        if not self.kv_lookahead_blocks >= 0:
            raise refused(self, "kv_lookahead_blocks", "must be >= 0 blocks (0: admit while any block is unreserved)")
        if not self.session_timeout_s > 0:
            raise refused(self, "session_timeout_s", "must be > 0 seconds (how long an idle session keeps its cache)")
        if not self.unstepped_session_timeout_s > 0:
            raise refused(self, "unstepped_session_timeout_s", "must be > 0 seconds (longer than a router takes "
                                                               "from opening a session to its first step)")
        if self.advertise:
            try:
                split_host_port(self.advertise)
            except ValueError as exc:
                raise refused(self, "advertise", str(exc)) from None
        elif not self.host or grpc_server.is_wildcard(self.host):
            raise refused(self, "host", "listens on every interface, which is no address others can reach; "
                                        "give --advertise HOST[:PORT], the address to register and reach it at")
        if not self.stall_timeout_s > 0:
            raise refused(self, "stall_timeout_s", "must be > 0 seconds (longer than the slowest honest pass)")
        if not self.drain_timeout_s >= 0:
            raise refused(self, "drain_timeout_s", "must be >= 0 seconds (0: cut open sessions at once)")
        if self.threads is not None and not self.threads >= 1:
            raise refused(self, "threads", "must be >= 1 (leave it out for torch's choice)")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise refused(self, "memory_gb", "must be > 0 GiB (leave it out to announce the memory available "
                                             "at start)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise refused(self, "metrics_port", "must be 0..65535 (left out: no metrics)")
        if not self.speed > 0:
            raise refused(self, "speed", "must be > 0 (a relative speed; 1.0 is an ordinary host)")
        if not 1 <= self.tp <= 64:
            raise refused(self, "tp", "must be 1..64 ranks (1: no tensor parallelism; it must divide the model's "
                                      "attention and KV heads)")
        if self.tp > 1 and (self.quantize != "none" or self.compile):
            raise refused(self, "tp", "is not supported with --quantize or --compile yet; leave those out")
        if self.compile and self.quantize != "none":
            raise refused(self, "compile", "is not supported with --quantize yet (the compiled decode pass has no "
                                           "int8 kernels); leave one of them out")
        if self.max_model_len is not None and not self.max_model_len >= 1:
            raise refused(self, "max_model_len", "must be >= 1 position (leave it out for the model's context)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise refused(self, "gpu_memory_utilization", "must be a share of the GPU's memory, in (0, 1]")
        if self.devices is not None and not self.devices >= 1:
            raise refused(self, "devices", "must be >= 1 (leave it out to count this machine's CUDA devices)")
        self.plaintext.refuse(self.tls, listens=(self.host,), dials=plaintext_hosts(self.registry))
        self.host_id = self.host_id or socket.gethostname()
        self.model_name = self.model_name or Path(self.model).name
