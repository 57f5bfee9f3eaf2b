"""Prometheus metrics of the router, the stage servers, the scheduler and the embedded registry (`--metrics-port`;
scrape /metrics). Every name starts with stagemesh_; deploy/grafana and deploy/prometheus chart and alert on them
(tests/test_deploy.py holds them to the names defined here)."""

from __future__ import annotations

import importlib.metadata

from prometheus_client import Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
"""A whole request: from a fraction of a second (a few tokens) to minutes (thousands of tokens)."""
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5)

# Every process
BUILD_INFO = Gauge("stagemesh_build_info",
                   "1 for each component this process runs (router, stage, scheduler, registry), with the model it "
                   "serves (empty for the registry, which serves every model) and stagemesh's version: join on it "
                   "(`* on(instance) group_left(model) stagemesh_build_info{component=\"router\"}`) for a "
                   "per-model view",
                   ["component", "model", "version"])

TLS_CERT_EXPIRY = Gauge("stagemesh_tls_cert_expiry_seconds",
                        "When the certificate this process presents expires (notAfter, seconds since the epoch), by "
                        "role (router, stage, scheduler, client; public: the router's --public-cert); alert well "
                        "before it, renew the files and send SIGHUP", ["role"])


def version() -> str:
    try:
        return importlib.metadata.version("stagemesh")
    except importlib.metadata.PackageNotFoundError:  # a checkout run without installing it
        return "unknown"


def announce(component: str, model: str = "") -> None:
    """Sets stagemesh_build_info for one component of this process."""
    BUILD_INFO.labels(component, model, version()).set(1)


# Router
REQUESTS = Counter("stagemesh_router_requests_total", "Generate requests by how they ended", ["status"])
CALLER_REQUESTS = Counter("stagemesh_router_caller_requests_total",
                          "Generate requests by caller (its token's name; empty without --auth-tokens) and how "
                          "they ended", ["caller", "status"])


def count_request(status: str, caller: str) -> None:
    REQUESTS.labels(status).inc()
    CALLER_REQUESTS.labels(caller, status).inc()
TOKENS = Counter("stagemesh_router_tokens_total", "Tokens streamed to callers")
PROMPT_TOKENS = Counter("stagemesh_router_prompt_tokens_total", "Prompt tokens of the requests admitted")
TIME_TO_FIRST_TOKEN = Histogram("stagemesh_router_time_to_first_token_seconds",
                                "From request arrival to its first token", ["priority_class"],
                                buckets=LATENCY_BUCKETS)
INTER_TOKEN = Histogram("stagemesh_router_inter_token_seconds",
                        "Between a token streamed to the caller and the next one: one observation per token after "
                        "a request's first (tokens that leave together count the gap once, the others 0)",
                        ["priority_class"], buckets=LATENCY_BUCKETS)
REQUEST_SECONDS = Histogram("stagemesh_router_request_seconds",
                            "End to end: from a request's arrival to its last token, for requests that finished "
                            "(status OK)", ["priority_class"], buckets=REQUEST_BUCKETS)
QUEUE_WAIT = Histogram("stagemesh_router_queue_wait_seconds", "Time spent waiting for admission",
                       ["priority_class"], buckets=LATENCY_BUCKETS)
WAITING = Gauge("stagemesh_router_waiting_requests", "Requests waiting for admission")
RUNNING = Gauge("stagemesh_router_running_requests", "Requests streaming now")
USABLE_CHAINS = Gauge("stagemesh_router_usable_chains", "Chains whose stages all serve")
TOKEN_TURNAROUND = Histogram(
    "stagemesh_router_token_turnaround_seconds",
    "The router's share of a decode step: from the last stage's token read to the next step written to the first "
    "stage (the caller's copy of the token is sent after it)", buckets=OVERHEAD_BUCKETS)
PANIC_TABLES = Counter("stagemesh_router_panic_tables_total",
                       "Published chain tables followed only in part: they dropped most of the chains passing the "
                       "router's checks (--panic-threshold), and those kept serving")
CHAIN_PROBES = Counter("stagemesh_router_chain_probes_total",
                       "End-to-end chain probes (one token stepped through a whole chain) by result: pass, fail, or "
                       "busy (a stage had no room for the probe's session)", ["result"])
FAILOVERS = Counter("stagemesh_router_failovers_total", "Streams moved to another chain after a stage failed")
REPAIRS = Counter("stagemesh_router_repairs_total",
                  "Streams kept on their chain after a stage failed, another stage taking its place (rebuilt alone)")
REPAIR_FALLBACKS = Counter("stagemesh_router_repair_fallbacks_total",
                           "Stage failures that could not be repaired and were replayed on another chain instead, by "
                           "why: log_dropped (the previous stage's output log was dropped: --repair-log-tokens), "
                           "not_kept (the stages keep no logs), no_stage_named (a timeout that names no stage), "
                           "not_stage_fault, no_replacement, repair_off, repair_failed", ["reason"])
STEP_TIMEOUTS = Counter("stagemesh_router_step_timeouts_total",
                        "Stage answers that did not come within the progress timeout (hung or unreachable stage)")
AUTH_REFUSED = Counter("stagemesh_router_auth_refused_total",
                       "Calls refused by --auth-tokens: by status, and the caller's name when its token was valid",
                       ["code", "caller"])
ROUTED = Counter("stagemesh_router_routed_total",
                 "Chain picks by prompt length (class: short, or long past --long-prompt-tokens) and whether a chain "
                 "of the kind that suits it took it (path: preferred) or another, that kind being missing or full "
                 "(fallback); a failover or retry picks again", ["class", "path"])
FULL_RETRIES = Counter("stagemesh_router_full_retries_total",
                       "Waits (with backoff) because every chain tried was full")
PREFIX_HIT_TOKENS = Counter("stagemesh_router_prefix_hit_tokens_total",
                            "Prompt (or replay) tokens not sent: every stage of the chain had them in its prefix cache")

# Stage (a process holds one stage; the labels say which pass or direction)
PASS_SECONDS = Histogram("stagemesh_stage_pass_seconds", "Time of one batched forward pass, by steps in it",
                         ["batch"], buckets=LATENCY_BUCKETS)
PASS_TOKENS = Histogram("stagemesh_stage_pass_tokens", "Tokens in one forward pass",
                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
OPEN_SESSIONS = Gauge("stagemesh_stage_open_sessions", "Inference sessions holding KV cache")
KV_USED_BYTES = Gauge("stagemesh_stage_kv_used_bytes", "KV pool bytes in use")
KV_FREE_BYTES = Gauge("stagemesh_stage_kv_free_bytes", "KV pool bytes free")
QUEUED_STEPS = Gauge("stagemesh_stage_queued_steps", "Session steps waiting for a pass")
WIRE_BYTES = Counter("stagemesh_stage_wire_bytes_total", "Bytes of Forward messages, in from the caller and out",
                     ["direction"])
STEP_PHASE_SECONDS = Histogram(
    "stagemesh_stage_step_phase_seconds",
    "Time of one step (or pass) in each phase: wire_decode, assemble, model, sample, encode "
    "(stage_server/engine/step_timing.py)", ["phase"],
    buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1))
EAGER_PASSES = Counter("stagemesh_stage_eager_passes_total",
                       "Passes of a CUDA stage with graphs that ran eager, by why: no bucket (too_many_tokens, "
                       "too_many_sessions, past_max_len) or its bucket not captured (not_captured)", ["reason"])
GRAPH_CAPTURE_FAILURES = Counter("stagemesh_stage_graph_capture_failures_total",
                                 "CUDA graph captures that failed in a warm-up (the stage serves those passes eager)")
OUTPUT_LOG_DROPPED = Counter("stagemesh_stage_output_log_dropped_total",
                             "Sessions' output logs (repair) given up, by why: full (no room left in "
                             "--repair-log-tokens), gap (a step did not continue the log: the session started from "
                             "prefix-cached positions); such a session is replayed, not repaired, if its next stage "
                             "fails", ["reason"])
STALLED = Gauge("stagemesh_stage_stalled", "1 while steps wait and no pass finished within --stall-timeout-s")
QUEUE_FULL_WAITS = Counter("stagemesh_stage_queue_full_waits_total",
                           "Times a full queue held work back: stream (an incoming stream's reader stopped reading, "
                           "--stream-queue-*), link (a pass waited for room on the link to its next stage, "
                           "--relay-queue-mb)", ["queue"])
LINK_SESSIONS = Gauge("stagemesh_stage_link_sessions", "Sessions the stage's links to next stages carry now")

# Scheduler (every scheduler process; only the leader plans)
SCHEDULER_LEADER = Gauge("stagemesh_scheduler_is_leader", "1 while this scheduler holds the leader lock")
SCHEDULER_TAKEOVERS = Counter("stagemesh_scheduler_leadership_acquired_total",
                              "Times this scheduler took the leader lock")
CHAINS_PUBLISHED = Gauge("stagemesh_scheduler_chains_published",
                         "Chains in the table this scheduler last published (0 while it stands by)")
CHAIN_TABLE_WRITES = Counter("stagemesh_scheduler_chain_table_writes_total",
                             "Chain tables written, by outcome: ok, or conflict (someone else wrote it meanwhile)",
                             ["outcome"])
STAGES_SEEN = Gauge("stagemesh_scheduler_stages", "Stage registrations the leader's last reconcile saw, by state: "
                    "passing (heartbeating), critical (late), assigned (passing, with a layer range), lapsed "
                    "(late but answering the scheduler's health check: kept in the plan)", ["state"])
RECONCILE_SECONDS = Histogram("stagemesh_scheduler_reconcile_seconds",
                              "One reconcile of the leader: plan, assignments written, chain table published",
                              buckets=LATENCY_BUCKETS)

# Embedded registry (stagemesh registry, or a scheduler with --registry local)
REGISTRY_SERVICES = Gauge("stagemesh_registry_services", "Registered services, by state: passing or critical",
                          ["state"])
REGISTRY_KV_KEYS = Gauge("stagemesh_registry_kv_keys", "Keys in the registry's key-value store (locks included)")
REGISTRY_WATCHERS = Gauge("stagemesh_registry_watch_waiters", "Watch calls waiting for a change now")
REGISTRY_EXPIRIES = Counter("stagemesh_registry_lease_expiries_total",
                            "Leases that ran out: service (no heartbeat within its TTL: critical), deregistered "
                            "(critical for its deregister delay: removed), lock (a lock not renewed: freed)",
                            ["kind"])


def observe_inter_token(gap_s: float | None, tokens: int, priority_class: str) -> None:
    """INTER_TOKEN for `tokens` streamed together gap_s after the request's previous token: the gap once, 0 for
    the others. gap_s None: the request's first tokens (the first one's wait is its time to first token)."""
    if tokens <= 0:
        return
    observe = INTER_TOKEN.labels(priority_class).observe
    if gap_s is not None:
        observe(gap_s)
    for _ in range(tokens - 1):
        observe(0.0)


def batch_label(steps: int) -> str:
    """Passes grouped by size: "1", "2", "3-4", "5-8", ... so the label set stays small."""
    if steps <= 2:
        return str(steps)
    upper = 1 << (steps - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


def serve_metrics(port: int | None, host: str = "127.0.0.1") -> None:
    """Serves /metrics on host:port when a port is given."""
    if port:
        start_http_server(port, addr=host)
