"""Starts a stage server: loads its slice, sizes its KV pool, serves Stage + health + reflection."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import psutil
import torch
from grpc_health.v1 import health_pb2

from stagemesh import grpc_server, metrics, roles, tls
from stagemesh.checkpoint import ModelArgs, model_fingerprint, read_config, serving_dtype, serving_fingerprint
from stagemesh.errors import StatusError, StatusInterceptor
from stagemesh.stage_server.config import StageConfig, max_step_bytes, split_host_port
from stagemesh.stage_server.cpu import decode_layers, huge_pages, packed_weights
from stagemesh.stage_server.cpu.compute_thread import compute_executor, hold_to_one_thread
from stagemesh.stage_server.engine import fused_ops, paged_attention
from stagemesh.stage_server.engine.batcher import StepBatcher
from stagemesh.stage_server.engine.compiled import compile_stage, compiled_graphs, is_compiled
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.loader import TORCH_DTYPES, load_stage
from stagemesh.stage_server.engine.memory_plan import plan_memory
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.engine.quantize import check_fp8, linear_format, quantize
from stagemesh.stage_server.engine.tensor_parallel import TPGroup, check_tp
from stagemesh.stage_server.engine.warm_up import warm_up
from stagemesh.stage_server.service.output_log import RepairLog
from stagemesh.stage_server.service.sessions import SessionTable, short_id
from stagemesh.stage_server.service.stage_service import ERROR_CODES, StageService
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

T = TypeVar("T")

log = logging.getLogger("stagemesh.stage")
SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device(name)


class StageSlot(stage_pb2_grpc.StageServicer):
    """The Stage service of a server that may not hold layers yet (waiting for the scheduler to
    assign a range) or may be reloading: it hands calls to the current StageService or says why not."""

    def __init__(self) -> None:
        self.current: StageService | None = None
        self.draining = False
        """Stopping: no new session; the open streams go on until they end or the drain timeout cuts them."""

    def _service(self) -> StageService:
        if self.current is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                              "this stage holds no layers yet: it is waiting for the scheduler to assign a range")
        return self.current

    def _admit(self) -> None:
        if self.draining:
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                              "this stage is draining (stopping): it takes no new session; use another chain")

    async def OpenSession(self, request, context):
        self._admit()
        return await self._service().OpenSession(request, context)

    async def CloseSession(self, request, context):
        return await self._service().CloseSession(request, context)

    async def Relay(self, request_iterator, context):
        # A neighbour's link lives as long as both stages; draining waits for the sessions on it instead.
        async with contextlib.aclosing(self._service().Relay(request_iterator, context)) as statuses:
            async for status in statuses:
                yield status

    async def Sessions(self, request_iterator, context):
        # It lives as long as its router; draining waits for its sessions instead.
        async with contextlib.aclosing(self._service().Sessions(request_iterator, context, self._admit)) as events:
            async for batch in events:
                yield batch

    async def Info(self, request, context):
        return await self._service().Info(request, context)

    async def ReadOutput(self, request, context):
        async for chunk in self._service().ReadOutput(request, context):
            yield chunk


ROLE_POLICY = roles.ServicePolicy(stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name, "router",
                                  {"Relay": "stage", "Info": None})
"""With TLS: sessions (every RPC but these two, any added later included) only from routers, the hop between two
stages only from stages; Info (and health, another service) from any mesh certificate."""


class StageServer:
    """A gRPC server that is up (and alive for the registry) before it holds layers; load() then
    activate() give it a slice. Health: "" is SERVING while the process lives, SERVICE_NAME only
    while a slice is loaded and serving."""

    def __init__(self, config: StageConfig):
        self.config = config
        self.tls = tls.load(config.tls, "stage")  # first: a wrong --tls stops the process before any weights are read
        self.device = resolve_device(config.device)
        self.pass_tokens = config.batcher.pass_tokens(self.device.type)  # --max-batch-tokens, or the device's
        model_config = read_config(config.model)
        self.num_layers = model_config["num_hidden_layers"]
        check_tp(ModelArgs.from_config(model_config), config.tp, self.device)
        if config.quantize == "fp8":
            check_fp8(self.device)
        self.dtype = serving_dtype(config.dtype, model_config, self.device.type)  # --dtype, auto resolved
        # The longest session admitted: --max-model-len, at most the model's context.
        self.max_len = min(config.max_model_len or model_config["max_position_embeddings"],
                           model_config["max_position_embeddings"])
        # What this stage serves (checkpoint.serving_fingerprint): registered, and in Stage/Info.
        self.fingerprint = serving_fingerprint(model_fingerprint(config.model), self.dtype, config.quantize)
        self.server = grpc_server.new_server(
            [StatusInterceptor(log, ERROR_CODES), *([roles.RoleInterceptor(ROLE_POLICY)] if self.tls else [])],
            max_step_bytes(self.pass_tokens, model_config["hidden_size"]))
        self.slot = StageSlot()
        stage_pb2_grpc.add_StageServicer_to_server(self.slot, self.server)
        self.health = grpc_server.add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = grpc_server.bind(self.server, config.host, config.port,
                                     self.tls.server_credentials() if self.tls else None)
        host, port = split_host_port(config.advertise) if config.advertise else (config.host, None)
        # Where others reach this stage (--advertise, else the bind address): registered and logged.
        self.address = grpc_server.host_port(host, port or self.port)
        self.model: StageModel | None = None
        self.pool: KVPool | None = None
        self.sessions: SessionTable | None = None
        self.batcher: StepBatcher | None = None
        self.stalled = False
        self._tasks: list[asyncio.Task] = []
        self.compute = compute_executor()  # every load, pool, warm-up and pass (compute_thread.py)

    @property
    def bind_address(self) -> str:
        return grpc_server.host_port(self.config.host, self.port)

    @property
    def layers(self) -> tuple[int, int] | None:
        return (self.model.layer_start, self.model.layer_end) if self.model else None

    async def in_compute(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the stage's compute thread (see self.compute)."""
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    def _why_not_packed(self, model: StageModel) -> str | None:
        """Why this stage's Linear weights stay in torch's layout (None: they are packed, packed_weights.py)."""
        if self.config.quantize in ("int8", "fp8") or self.config.tp > 1:  # int8-weight-only packs its int8 weights
            return "--quantize int8 or fp8 and --tp hold their Linears their own way"
        return packed_weights.available(model)

    def load(self, layer_start: int, layer_end: int | None) -> StageModel:
        """Reads the slice's weights (blocking: when serving, call it through in_compute), and what it serves: the
        model digest of the checkpoint's files as they were read (model.fingerprint), taken before and after the
        read (files replaced meanwhile: ValueError), so a slice loaded after new weights were put on disk
        announces the new build, never the one the process started with."""
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        t0 = time.perf_counter()
        digest = model_fingerprint(self.config.model)  # the files as they are now, not as they were at start
        dtype = TORCH_DTYPES[self.dtype]
        tp = None
        if self.config.tp > 1:  # the other ranks load their shards meanwhile
            tp = TPGroup({"model": self.config.model, "layer_start": layer_start, "layer_end": layer_end,
                          "dtype": self.dtype, "device": str(self.device), "threads": self.config.threads,
                          "size": self.config.tp, "attention_kernel": self.config.attention_kernel,
                          "fused_layers": self.config.fused_layers}, self.device)
        model = load_stage(self.config.model, layer_start, layer_end, dtype=dtype, device=self.device,
                           linears=linear_format(self.config.quantize, self.device.type, dtype),
                           tp=(0, self.config.tp), huge=self.config.huge_pages)
        if tp is not None:
            tp.join(model)
        model = quantize(model, self.config.quantize)  # torch.ao's path on CPU float32; else done at load
        if self.config.attention_kernel:
            paged_attention.attach(model)
        if self.config.packed_weights:
            if (why := self._why_not_packed(model)) is None:
                packed = packed_weights.pack(model, self.config.huge_pages)
                int8 = "int8 " if self.config.quantize != "none" else ""
                log.info(f"Linear weights packed in {int8}panels for stagemesh's kernel: {packed / 2**20:.0f} MiB")
            else:
                log.info(f"Linear weights in torch's layout: {why}")
        if self.config.fused_layers and self.device.type == "cuda":
            why = fused_ops.attach(model)
            log.info("a layer's small ops fused" if why is None else f"a layer's small ops one by one: {why}")
        elif self.config.fused_layers:
            why = decode_layers.attach(model)
            log.info("decode passes: all layers in one call" if why is None else f"decode passes op by op: {why}")
        if self.config.compile:
            compile_stage(model)  # compiles in the warm-up, before SERVING
        if self.config.preload:
            with torch.inference_mode():
                for p in model.parameters():
                    p.sum()  # touches every page of the weights
        if model_fingerprint(self.config.model) != digest:
            raise ValueError(f"the checkpoint in {self.config.model} changed while layers {layer_start}:{layer_end} "
                             "were read from it; load them again once its files are in place")
        model.fingerprint = serving_fingerprint(digest, self.dtype, self.config.quantize)
        model.load_s = time.perf_counter() - t0
        rss, huge = psutil.Process().memory_info().rss, huge_pages.huge_page_bytes()
        log.info(f"loaded layers {model.layer_start}:{model.layer_end} in {model.load_s:.2f}s, "
                 f"{sum(p.nbytes for p in model.parameters()) / 2**20:.0f} MiB of weights, process RSS "
                 f"{rss / 2**20:.0f} MiB{'' if huge is None else f', {huge / 2**20:.0f} MiB on 2 MiB pages'} "
                 f"(cold start{', preloaded' if self.config.preload else ''}, before serving)",
                 extra={"stage": self.address})
        return model

    async def activate(self, model: StageModel) -> None:
        """Serves model from now on; sessions of a previous slice are closed."""
        await self.deactivate()
        self._release()
        # What the slice was read as: in Info from now, registered again by the caller (registration.py).
        self.fingerprint = model.fingerprint or self.fingerprint
        config, args = self.config, model.args
        graphs = (not config.enforce_eager and model.device.type == "cuda" and not config.compile
                  and config.tp == 1)  # --compile has its own graphs; --tp ranks step together
        plan = await self.in_compute(plan_memory, model, config.kv_cache_gb, self.pass_tokens,
                                     config.gpu_memory_utilization, graphs, config.repair_log_tokens)
        self.pool = await self.in_compute(KVPool, plan.kv_bytes, len(model.layers), args.num_kv_heads, args.head_dim,
                                          model.dtype, model.device, config.kv_block_size, config.kv_lookahead_blocks,
                                          config.huge_pages)
        repair_log = await self.in_compute(RepairLog, plan.log_tokens, args.hidden_size, model.dtype, plan.log_device,
                                           config.kv_block_size)
        log.info(f"repair log: {repair_log.capacity_tokens} tokens ({repair_log.capacity_bytes / 2**20:.0f} MiB) "
                 f"{repair_log.where}, in chunks of {repair_log.chunk_tokens}, beside a KV pool of "
                 f"{self.pool.usable_blocks * self.pool.block_size} positions"
                 f"{' (the last stage sends nothing on)' if model.is_last else ''}", extra={"stage": self.address})
        warm = await self.in_compute(warm_up, model, self.pool, self.pass_tokens, graphs, self.max_len)
        warm_s = warm.seconds
        compiled = (f" with torch.compile ({compiled_graphs(model)} decode graphs)" if is_compiled(model)
                    else " (eager: compilation failed)") if config.compile else ""
        model.load_s += warm_s  # the cold start: load, then warm-up (and compilation) before serving
        log.info(f"warm-up in {warm_s * 1000:.0f} ms{compiled}{warm.graphs}; "
                 f"cold start {model.load_s:.2f}s before serving; "
                 f"a decode step ~{warm.step_ms:.1f} ms, a full pass ({self.pass_tokens} tokens) "
                 f"~{warm.full_pass_ms:.0f} ms", extra={"stage": self.address})
        self.sessions = SessionTable(self.pool, self.max_len, repair_log,
                                     prefix_cache=config.prefix_cache and config.tp == 1)
        sessions = self.sessions
        self.batcher = StepBatcher(model, config.batcher, self.compute, warm.step_ms, warm.full_pass_ms,
                                   open_sessions=lambda: len(sessions),
                                   compute_threads=await self.in_compute(torch.get_num_threads))
        self.batcher.start()
        self.model = model
        self.slot.current = StageService(model, self.sessions, self.batcher, config.model_name, self.fingerprint,
                                         self.address, self.tls, config.plaintext.insecure, config.queues)
        await grpc_server.set_serving(self.health, [SERVICE_NAME], True)
        bound = f", bound to {self.bind_address}" if self.bind_address != self.address else ""
        log.info(f"stage serving layers {model.layer_start}:{model.layer_end} of {args.num_layers} on {self.address}"
                 f"{bound} ({model.dtype}, {model.device}, model {self.fingerprint})", extra={"stage": self.address})

    async def deactivate(self) -> None:
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.slot.current is not None:
            await self.slot.current.close()
        self.slot.current = None
        if self.batcher:
            await self.batcher.stop()
        if self.sessions:
            for sid in list(self.sessions.sessions):
                self.sessions.close(sid)
        if self.model is not None and self.model.tp_group is not None:
            self.model.tp_group.close()
        self.model = None

    def _release(self) -> None:
        """Drops the old slice's KV pool (its weights went with deactivate) before a new one is sized and allocated."""
        self.pool, self.sessions, self.batcher = None, None, None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def swap(self, layer_start: int, layer_end: int) -> None:
        """Serves layers layer_start:layer_end instead: the new slice loads while the old one serves, unless memory
        cannot hold both; then the old one is released first (and the stage serves nothing until the new is in)."""
        if self.model is not None and (why := self._no_room_beside(layer_start, layer_end)):
            log.warning(f"releasing layers {self.model.layer_start}:{self.model.layer_end} before loading "
                        f"{layer_start}:{layer_end} ({why}): not serving until they are loaded",
                        extra={"stage": self.address})
            await self.deactivate()
            self._release()
        await self.activate(await self.in_compute(self.load, layer_start, layer_end))

    def _no_room_beside(self, layer_start: int, layer_end: int) -> str:
        """Why the new slice's weights would not fit beside the old slice's ("": they fit). Estimated per layer from
        the old slice; free memory is what --memory-gb leaves beside the old weights and pool, else the device's."""
        model, pool = self.model, self.pool
        held = sum(p.nbytes for p in model.parameters())
        need = held * (layer_end - layer_start) // max(1, model.layer_end - model.layer_start)
        if self.config.memory_gb:
            free = int(self.config.memory_gb * 2**30) - held - (pool.capacity_bytes if pool else 0)
        elif self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            free = psutil.virtual_memory().available
        return "" if need < free else f"~{need / 2**20:.0f} MiB of new weights, {max(free, 0) / 2**20:.0f} MiB free"

    async def start(self, model: StageModel | None = None) -> None:
        """Starts serving: model's slice at once if given, else nothing until activate()."""
        hold_to_one_thread()  # the event loop's torch work (compute_thread.py)
        await self.server.start()
        metrics.announce("stage", self.config.model_name)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reap_idle()), loop.create_task(self._watch_progress())]
        if model is not None:
            await self.activate(model)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Drains, then stops: NOT_SERVING and no new session at once (health checks and Info are still
        answered, so routers see why); the open streams (sessions) get `grace` seconds to end, and those left
        then are cut (routers replay them elsewhere)."""
        await grpc_server.set_serving(self.health, [SERVICE_NAME], False)
        self.slot.draining = True
        for task in self._tasks:
            task.cancel()
        if grace:
            await self._drain(grace)
        # The streams ended before the server stops: a stream's end that raced the server's shutdown was
        # seen by its handler as the server gone (an error, logged as one). Links to next stages too.
        if self.slot.current is not None:
            await self.slot.current.close()
        await self.server.stop(0)
        await self.deactivate()
        self.compute.shutdown(wait=False, cancel_futures=True)

    async def _drain(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.sessions and len(self.sessions) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.sessions and len(self.sessions):
            log.warning(f"drain timeout: cutting {len(self.sessions)} session(s) still open after {timeout:g}s",
                        extra={"stage": self.address})

    async def _reap_idle(self) -> None:
        """Closes idle sessions, and unstepped ones soon: ticks at a quarter of the shorter timeout (at
        most a second), so that a session outlives its timeout by little."""
        timeout, unstepped = self.config.session_timeout_s, self.config.unstepped_session_timeout_s
        period = min(1.0, min(timeout, unstepped) / 4)
        while True:
            await asyncio.sleep(period)
            if self.sessions is None:
                continue
            for sid in self.sessions.expire_idle(timeout, unstepped):
                log.info("session expired", extra={"session_id": short_id(sid)})

    def _export_gauges(self) -> None:
        if self.sessions is None or self.pool is None or self.batcher is None:
            return
        metrics.OPEN_SESSIONS.set(len(self.sessions))
        metrics.KV_USED_BYTES.set(self.pool.used_bytes)
        metrics.KV_FREE_BYTES.set(self.pool.capacity_bytes - self.pool.used_bytes)
        metrics.QUEUED_STEPS.set(self.batcher.queued)
        if self.slot.current is not None:
            metrics.LINK_SESSIONS.set(self.slot.current.links.sessions)

    async def _watch_progress(self) -> None:
        """The watchdog: a stage whose event loop answers health checks while its compute thread is
        stuck must not look healthy ("healthy but dead")."""
        limit = self.config.stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            self._export_gauges()
            stalled = self.batcher is not None and self.batcher.stalled_for() > limit
            if stalled == self.stalled or self.model is None:
                continue
            self.stalled = stalled
            metrics.STALLED.set(int(stalled))
            if stalled:
                log.error(f"no forward pass finished in {limit:.0f}s with steps waiting: NOT_SERVING until one does",
                          extra={"stage": self.address})
            else:
                log.info("forward passes finish again: SERVING", extra={"stage": self.address})
            await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING if stalled
                                  else health_pb2.HealthCheckResponse.SERVING)
