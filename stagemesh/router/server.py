"""Starts a router: loads the tokenizer, watches its chains' health, serves Router + health + reflection."""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from stagemesh import grpc_server, metrics, tls
from stagemesh.checkpoint import model_fingerprint, read_accepted_digests
from stagemesh.config_flags import PORT_RULE, refused
from stagemesh.discovery.backends import open_registry, plaintext_hosts
from stagemesh.errors import StatusInterceptor
from stagemesh.router.auth import AuthInterceptor, TokenAuth
from stagemesh.router.chain_client import background
from stagemesh.router.chain_probe import ChainProbeConfig, ChainProber
from stagemesh.router.chain_watch import follow_chains
from stagemesh.router.chains import ChainSet, parse_chain
from stagemesh.router.generation import GenerationConfig
from stagemesh.router.priority_queue import AdmissionConfig, PriorityAdmission
from stagemesh.router.request_size import RequestSizeInterceptor
from stagemesh.router.router_service import RouterService
from stagemesh.signals import on_reload, until_signalled
from stagemesh.tls import PlaintextConfig
from stagemesh.tracing import TracingConfig
from stagemesh.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("stagemesh.router")
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


@dataclass
class PublicPortConfig:
    """The limits of the router's public port, where anyone who reaches it may connect: how many streams one
    connection may hold, how long an idle or old connection lives, how often a client may ping."""

    max_concurrent_streams: int = 1000
    """Streams one connection may have open at once; a client opens more only when some end (HTTP/2's
    SETTINGS_MAX_CONCURRENT_STREAMS)."""
    max_connection_idle_s: float = 600.0
    """A connection with no call for this long is closed (GOAWAY; clients reconnect when they call again)
    (0: never)."""
    max_connection_age_s: float = 0.0
    """A connection older than this is told to go (GOAWAY), its calls given --max-connection-age-grace-s to
    finish, so that a load balancer's new replicas get connections (0: never)."""
    max_connection_age_grace_s: float = 30.0
    """How long calls on a connection past --max-connection-age-s may still run before it is closed."""
    min_ping_interval_s: float = 15.0
    """A client's pings closer together than this (with no data between) are strikes."""
    max_ping_strikes: int = 2
    """Strikes after which the connection is closed (GOAWAY, too_many_pings) (0: no limit)."""

    def __post_init__(self) -> None:
        if not self.max_concurrent_streams >= 1:
            raise refused(self, "max_concurrent_streams", "must be >= 1 stream per connection")
        for name in ("max_connection_idle_s", "max_connection_age_s", "max_connection_age_grace_s",
                     "min_ping_interval_s"):
            if not getattr(self, name) >= 0:
                raise refused(self, name, "must be >= 0 seconds")
        if not self.max_ping_strikes >= 0:
            raise refused(self, "max_ping_strikes", "must be >= 0 (0: no limit)")

    def options(self) -> list[tuple[str, int]]:
        """As gRPC channel arguments (a limit of 0 seconds: the argument left out, gRPC's own infinity)."""
        ms = {"grpc.max_connection_idle_ms": self.max_connection_idle_s,
              "grpc.max_connection_age_ms": self.max_connection_age_s,
              "grpc.max_connection_age_grace_ms": self.max_connection_age_grace_s if self.max_connection_age_s else 0}
        return [("grpc.max_concurrent_streams", self.max_concurrent_streams),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", int(self.min_ping_interval_s * 1000)),
                ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
                *((name, int(seconds * 1000)) for name, seconds in ms.items() if seconds)]


@dataclass
class RouterConfig:
    model: str
    """Local Hugging Face checkpoint directory: the router reads its tokenizer and config, and the weights'
    headers for the model's digest, which every chain's stages must serve."""
    chains: list[str] = field(default_factory=list, metadata={"flag": "--chain"})
    """HOST:PORT,HOST:PORT,... one chain's stages in pipeline order; repeat for more chains."""
    host: str = "127.0.0.1"
    """The address to serve on."""
    port: int = 50051
    """The port callers reach the router on (0 picks a free port)."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    long_prompt_tokens: int = 512
    """Prompts of at most this many tokens go first to the chains that serve short requests best (replicas, then
    narrow chains), longer ones to the widest tensor-parallel chains; any usable chain takes them when those are
    missing or full (0: no length rule, the least loaded chain)."""
    health_interval_s: float = 1.0
    """Seconds between health checks of every chain's stages."""
    probe: ChainProbeConfig = field(default_factory=ChainProbeConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    public_port: PublicPortConfig = field(default_factory=PublicPortConfig)
    registry: str | None = None
    """Follow the chains the scheduler publishes there (local://HOST:PORT, consul://HOST:PORT,
    consul+https://HOST:PORT, etcd://HOST:PORT[,HOST:PORT...] or etcd+https://...) instead of --chain."""
    model_name: str = ""
    """The model's name in the registry (default: the checkpoint directory's name)."""
    panic_threshold: float = 0.5
    """A published table that would leave fewer than this share of the chains passing the router's own checks is
    followed only in part: the chains it drops that still pass keep serving until their checks fail (a scheduler
    that lost sight of stages must not take working chains away). 0: follow every table."""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (default: none)."""
    http_port: int | None = None
    """Serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health) on this
    port too, on --host, with the gRPC port's TLS and tokens (default: none)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: NOT_SERVING and no new calls at once, and this long for the streams it carries to
    finish before the process exits."""
    tls: str | None = None
    """A directory with ca.pem, router.pem and router-key.pem (`stagemesh certs`; or a role-less mesh.pem): reach
    stages and the registry with mutual TLS, and serve the public port with TLS (router.pem, unless --public-cert);
    reloaded on SIGHUP (default: plaintext)."""
    public_cert: str | None = None
    """A PEM certificate (chain) for the public port instead of router.pem, e.g. from the authority callers
    already trust; with --public-key; reloaded on SIGHUP."""
    public_key: str | None = None
    """--public-cert's private key (PEM)."""
    client_ca: str | None = None
    """A PEM file of CAs: callers must present a certificate issued by one of them (needs --tls or --public-cert)."""
    auth_tokens: str | None = None
    """A JSON file of callers' tokens ({"tokens": [{"name", "token", "max_priority", "requests_per_second",
    "max_concurrent", "max_queued", "tokens_per_minute", "max_new_tokens"}]}): calls need 'authorization: Bearer
    <token>' (health and reflection stay open); reloaded on SIGHUP (default: no tokens, any caller)."""
    accept_fingerprints: str | None = None
    """A file of other builds' model fingerprints (one per line, as Stage/Info or ListChains shows them, or their
    first part; "#" comments) whose chains this router serves too, besides its --model's: list the new weights' here
    (same tokenizer) before a rolling weights update, so its chains are used as they come up; reloaded on SIGHUP.
    A chain still never mixes builds (default: the --model's build only)."""
    plaintext: PlaintextConfig = field(default_factory=PlaintextConfig)

    def __post_init__(self) -> None:
        if bool(self.chains) == bool(self.registry):
            raise ValueError("give either --chain (one or more) or --registry, not both")
        if (self.public_cert is None) != (self.public_key is None):
            raise ValueError("give --public-cert and --public-key together (the public port's certificate and "
                             "its key), or neither")
        if self.client_ca and not (self.tls or self.public_cert):
            raise ValueError("--client-ca needs TLS on the public port: give --tls DIR or --public-cert/--public-key")
        if not 0 <= self.port <= 65535:
            raise refused(self, "port", PORT_RULE)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise refused(self, "metrics_port", "must be 0..65535 (0 or left out: no metrics)")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise refused(self, "http_port", "must be 0..65535 (0 or left out: no HTTP API)")
        if not self.drain_timeout_s >= 0:
            raise refused(self, "drain_timeout_s", "must be >= 0 seconds (0: cut open streams at once)")
        if not self.long_prompt_tokens >= 0:
            raise refused(self, "long_prompt_tokens", "must be >= 0 prompt tokens (0: route by load alone)")
        if not self.health_interval_s > 0:
            raise refused(self, "health_interval_s", "must be > 0 seconds between health checks")
        if not 0 <= self.panic_threshold <= 1:
            raise refused(self, "panic_threshold", "must be a share in [0, 1] (0: follow every table)")
        # The public port is TLS with --tls or --public-cert; the hops to stages and the registry with --tls only.
        self.plaintext.refuse(self.tls or self.public_cert, listens=(self.host,),
                              bearer_tokens=self.auth_tokens is not None)
        self.plaintext.refuse(self.tls, dials=(*(a.strip() for c in self.chains for a in c.split(",") if a.strip()),
                                               *plaintext_hosts(self.registry)))
        self.model_name = self.model_name or Path(self.model).name


def eos_token_ids(model_dir: str, tokenizer, model_config) -> frozenset[int]:
    """The ids that end generation, as transformers' generate() reads them."""
    from transformers import GenerationConfig as HFGenerationConfig

    ids = None
    if (Path(model_dir) / "generation_config.json").exists():
        ids = HFGenerationConfig.from_pretrained(model_dir).eos_token_id
    if ids is None:
        ids = getattr(model_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


class PublicCert:
    """The public port's certificate: --public-cert/--public-key, else the router's own (router.pem, or a role-less
    mesh.pem); callers must present a certificate from --client-ca if given. reload() (SIGHUP) reads --public-cert
    again; the router's own is reloaded with its Tls. New handshakes get what is in force (tls.ServedCredentials)."""

    def __init__(self, config: RouterConfig, mesh: tls.Tls | None):
        self.config, self.mesh = config, mesh
        self.client_ca = tls.read_file(config.client_ca, "--client-ca") if config.client_ca else None
        self.own: tuple[bytes, bytes] | None = None
        self.reload()

    def reload(self) -> bool:
        """Reads --public-cert and --public-key again; on an error (logged) the pair in force stays."""
        if not self.config.public_cert or not self.config.public_key:
            return True
        try:
            cert, key, parsed = tls.certificate_pair(self.config.public_cert, self.config.public_key, "--public-cert")
        except (ValueError, OSError) as exc:
            if self.own is None:
                raise
            log.error(f"--public-cert not reloaded, the one in force stays: {exc}")
            return False
        self.own = cert, key
        metrics.TLS_CERT_EXPIRY.labels("public").set(parsed.not_valid_after_utc.timestamp())
        return True

    def current(self) -> tuple[bytes, bytes, bytes | None]:
        cert, key = self.own or (self.mesh.cert, self.mesh.key)
        return cert, key, self.client_ca

    def credentials(self) -> grpc.ServerCredentials | None:
        """None (plaintext) without either certificate."""
        if self.own is None and self.mesh is None:
            return None
        return tls.ServedCredentials(self.current).credentials()


class RouterServer:
    def __init__(self, config: RouterConfig):
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        # First: a wrong --tls or token file stops the process before the tokenizer is loaded.
        self.tls = tls.load(config.tls, "router")
        self.public = PublicCert(config, self.tls)
        self.auth = TokenAuth(config.auth_tokens) if config.auth_tokens else None
        model_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
        interceptors = [AuthInterceptor(self.auth)] if self.auth else []
        # Outermost first: the token (from metadata, before parsing), then errors, then sizes (before parsing).
        self.server = grpc_server.new_server([*interceptors, StatusInterceptor(log),
                                              RequestSizeInterceptor(model_config.max_position_embeddings)],
                                             grpc_server.PUBLIC_MAX_MESSAGE_BYTES, config.public_port.options())
        self.health = grpc_server.add_health_and_reflection(self.server, [SERVICE_NAME])
        self.chains = ChainSet([parse_chain(c, self.tls) for c in config.chains], model_config.num_hidden_layers,
                               model_fingerprint(config.model), on_change=self._on_chains_change,
                               prefill_chunk=config.generation.prefill_chunk, tls=self.tls,
                               long_prompt_tokens=config.long_prompt_tokens,
                               slots_per_chain=config.admission.slots_per_chain,
                               panic_threshold=config.panic_threshold)
        if config.accept_fingerprints:
            self.chains.accepted = read_accepted_digests(config.accept_fingerprints)
        for chain in self.chains.chains:
            chain.healthy = False  # until the first health check passes
        self.prober = ChainProber(self.chains, config.probe, config.generation.wire_dtype)
        self.admission = PriorityAdmission(config.admission, lambda: len(self.chains.usable()))
        self.service = RouterService(
            self.chains, tokenizer, model_config, eos_token_ids(config.model, tokenizer, model_config),
            config.generation,
            Path(config.model).name, self.admission,
        )
        router_pb2_grpc.add_RouterServicer_to_server(self.service, self.server)
        self.port = grpc_server.bind(self.server, config.host, config.port, self.public.credentials())
        self.stopping = False
        self.http = self._http_front() if config.http_port else None
        self._tasks: list[asyncio.Task] = []
        self.registry = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def _http_front(self):
        """The OpenAI-compatible HTTP front over this router's RouterService (router/http_api.py); imported only
        when asked for."""
        from stagemesh.router.http_api import HttpFront
        from stagemesh.router.http_server import HttpServer, tls_files

        config = self.config
        front = HttpFront(self.service, config.model_name, self.auth, stopping=lambda: self.stopping)
        files = None
        if config.public_cert and config.public_key:
            files = tls_files(config.public_cert, config.public_key, config.client_ca)
        elif self.tls is not None:
            files = tls_files(str(self.tls.cert_path), str(self.tls.key_path), config.client_ca)
        return HttpServer(front.app, config.host, config.http_port, files)

    def _on_chains_change(self, serving: bool) -> None:
        # SERVING only while at least one whole chain can serve.
        self.admission.capacity_changed()
        metrics.USABLE_CHAINS.set(len(self.chains.usable()))
        background(grpc_server.set_serving(self.health, [SERVICE_NAME], serving))

    async def start(self) -> None:
        # NOT_SERVING (health's own default for "" is SERVING) until a first check finds a whole chain.
        await grpc_server.set_serving(self.health, [SERVICE_NAME], False)
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        metrics.announce("router", self.config.model_name)
        await self.chains.refresh()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.chains.watch(self.config.health_interval_s))]
        if self.config.probe.probe_interval_s:
            self._tasks.append(loop.create_task(self.prober.watch()))
        if self.config.registry:
            self.registry = open_registry(self.config.registry, self.tls)
            self._tasks.append(loop.create_task(follow_chains(self.registry, self.config.model_name, self.chains)))
        usable = len(self.chains.usable())
        http = f"; OpenAI-compatible HTTP on {self.http.url}" if self.http else ""
        log.info(f"router on {self.address}: {usable} of {len(self.chains.chains)} chains usable{http}")

    def reload(self) -> None:
        """SIGHUP: the certificates (the router's, --public-cert; both fronts), --auth-tokens and --accept-fingerprints,
        each kept if its files fail."""
        renewed = self.tls.reload() if self.tls is not None else False
        if self.public.reload() and (renewed or self.public.own) and self.http is not None:
            try:
                self.http.reload_certificate()  # the files just checked
            except OSError as exc:  # ssl.SSLError: the files changed again since; the pair in force stays
                log.error(f"the HTTP front's certificate not reloaded: {exc}")
        if self.auth is not None:
            self.reload_tokens()
        self.reload_fingerprints()

    def reload_tokens(self) -> bool:
        """Reads --auth-tokens again; a file that does not parse keeps the tokens in force."""
        if self.auth is None:
            return False
        try:
            names = self.auth.reload()
        except (ValueError, OSError) as exc:
            log.error(f"tokens not reloaded, the previous ones stay in force: {exc}")
            return False
        log.info(f"tokens reloaded from {self.auth.path}: {len(names)} caller(s): {', '.join(names)}")
        return True

    def reload_fingerprints(self) -> bool:
        """Reads --accept-fingerprints again (SIGHUP); a file that does not parse keeps the accepted ones in force.
        The next health checks use or drop the chains of the builds it adds or removes."""
        if not self.config.accept_fingerprints:
            return False
        try:
            self.chains.accepted = read_accepted_digests(self.config.accept_fingerprints)
        except (ValueError, OSError) as exc:
            log.error(f"--accept-fingerprints not reloaded, the previous ones stay in force: {exc}")
            return False
        log.info(f"accepted fingerprints reloaded: {', '.join(sorted(self.chains.accepted)) or 'none'}")
        return True

    async def stop(self, grace: float | None = 1.0) -> None:
        self.stopping = True  # the HTTP front's /health turns 503 and it takes no new requests
        for task in self._tasks:
            task.cancel()
        if self.registry is not None:
            await self.registry.close()
        await grpc_server.set_serving(self.health, [SERVICE_NAME], False)
        # Both fronts drain at once: the streams each carries finish within grace.
        await asyncio.gather(self.server.stop(grace), *([self.http.stop(grace)] if self.http else []))
        await self.chains.close()


async def serve(config: RouterConfig) -> None:
    metrics.serve_metrics(config.metrics_port, config.host)
    server = RouterServer(config)
    await server.start()
    # What start-up made (grpc's, protobuf's and our modules: ~60k objects, no torch) lives as long as the process:
    # out of the collector's sight, each collection no longer walks it (the router allocates messages, futures
    # and frames per token; an allocation loop over that heap ran 4x faster frozen).
    gc.collect()
    gc.freeze()
    on_reload(server.reload)
    print(f"router ready on {server.address}", flush=True)
    if server.http is not None:
        print(f"router HTTP (OpenAI-compatible) on {server.http.url}", flush=True)
    await until_signalled()
    t0 = asyncio.get_running_loop().time()
    log.info(f"stopping: NOT_SERVING, no new calls; draining the streams in flight for up to "
             f"{config.drain_timeout_s:g}s")
    await server.stop(config.drain_timeout_s)  # drain: the streams it carries finish
    log.info(f"drained in {asyncio.get_running_loop().time() - t0:.1f}s; exiting")
