"""The router's one event loop stays cheap under hostile input (issue 45): a 16 MiB token_ids request is refused
from its count, before anything copies or scans the ids, without stalling the other streams (their largest gap
between tokens measured against the same stream's without the attack); and a call without a valid token is refused
from its metadata, its body never parsed."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from stagemesh.grpc_server import PUBLIC_MAX_MESSAGE_BYTES
from tests.conftest import splits, start_mesh
from tests.test_traffic import request

GENERATE = "/stagemesh.v1.Router/Generate"
ATTACKS = 3
VICTIM_TOKENS = 300


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def huge_token_ids_request() -> bytes:
    """A GenerateRequest just under the public port's 16 MiB with as many token ids as fit (id 1, one byte each),
    written directly: building it through protobuf here would stall the test's own loop."""
    count = PUBLIC_MAX_MESSAGE_BYTES - 64
    return b"\x12" + varint(count) + b"\x01" * count + b"\x18\x01"  # token_ids (packed), max_new_tokens 1


def attack(address: str, body: bytes, metadata=()) -> list[grpc.StatusCode]:
    """ATTACKS calls of raw bytes from another thread, as another client would; their status codes."""
    codes = []
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_stream(GENERATE)  # no serializers: the bytes as they are
        for _ in range(ATTACKS):
            try:
                list(call(body, metadata=metadata, timeout=120))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
    return codes


async def largest_gap(stub, during=None) -> tuple[float, int, object]:
    """The victim stream's largest gap between tokens (from its first), its token count, and what `during` (a
    blocking function started in a thread at the first token) returned."""
    gaps, count, last, result = [], 0, None, None
    async for response in stub.Generate(request([5, 6], VICTIM_TOKENS), timeout=120):
        now = time.perf_counter()
        if last is None and during is not None:
            result = asyncio.ensure_future(asyncio.to_thread(during))
        elif last is not None:
            gaps.append(now - last)
        last, count = now, count + len(response.token_ids)
    if result is not None:
        result = await result
    return max(gaps), count, result


async def test_a_16_mib_token_ids_request_is_refused_without_stalling_other_streams(tiny_model):
    body = huge_token_ids_request()
    mesh = await start_mesh(tiny_model, [splits(4, 4)])
    try:
        stub = mesh.router_stub
        await largest_gap(stub)  # warm: the first stream's costs are no one's gap
        quiet, quiet_tokens, _ = await largest_gap(stub)
        loud, loud_tokens, codes = await largest_gap(stub, lambda: attack(mesh.router.address, body))
        assert set(codes) <= {grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT}, codes
        assert loud_tokens == quiet_tokens >= VICTIM_TOKENS // 2, "the victim stream ended early"
        # Copying and scanning 16M ids took the loop ~2 s here; the count alone takes nothing. Generous, for a
        # machine 10x slower: a few of the quiet stream's own largest gaps.
        assert loud <= 5 * quiet + 0.25, f"largest gap {loud * 1000:.0f} ms under attack, {quiet * 1000:.0f} ms without"
    finally:
        await mesh.stop()


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": [{"name": "a", "token": "a-token-000000001"}]}))
    path.chmod(0o600)
    return str(path)


async def test_a_call_without_a_valid_token_is_refused_before_its_body_is_parsed(tiny_model, tokens_file):
    """A body that is no GenerateRequest at all: refused UNAUTHENTICATED from the metadata. Parsed first (as
    before), it failed deserialization instead; with the token, it still does."""
    mesh = await start_mesh(tiny_model, [splits(8)], router_options={"auth_tokens": tokens_file})
    try:
        garbage = b"\xff" * 64
        address = mesh.router.address
        assert await asyncio.to_thread(attack, address, garbage) == [grpc.StatusCode.UNAUTHENTICATED] * ATTACKS
        wrong = [("authorization", "Bearer not-a-token-of-this-router")]
        assert await asyncio.to_thread(attack, address, garbage, wrong) == [grpc.StatusCode.UNAUTHENTICATED] * ATTACKS
        right = [("authorization", "Bearer a-token-000000001")]
        assert grpc.StatusCode.UNAUTHENTICATED not in await asyncio.to_thread(attack, address, garbage, right)
    finally:
        await mesh.stop()
