"""The peer tier: a miss is fetched from a peer sidecar over HTTP, checksummed, never served corrupt."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
import torch
from sidecar_process import PEER_TOKEN, SidecarFactory

from kvshard_sidecar.blockstore import BlockStore, CorruptBlockError, KVBlock, encode_block
from kvshard_sidecar.blockstore.peers import PeerFetcher, static_holders

KEY = "ab" * 32


def _block() -> KVBlock:
    generator = torch.Generator().manual_seed(0)
    return KVBlock(torch.randn(2, 1, 3, 4, generator=generator), torch.randn(2, 1, 3, 4, generator=generator))


class _OnePayload(http.server.BaseHTTPRequestHandler):
    payload = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve_bytes() -> Iterator[object]:
    servers: list[http.server.HTTPServer] = []

    def start(payload: bytes) -> str:
        handler = type("Handler", (_OnePayload,), {"payload": payload})
        server = http.server.HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()


def test_a_corrupt_peer_payload_is_counted_and_not_served(serve_bytes) -> None:  # type: ignore[no-untyped-def]
    damaged = bytearray(encode_block(KEY, _block()))
    damaged[-5] ^= 0xFF
    fetcher = PeerFetcher(static_holders([serve_bytes(bytes(damaged))]), PEER_TOKEN)
    with pytest.raises(CorruptBlockError):
        fetcher(KEY)
    store = BlockStore(memory_bytes=1 << 20, fetcher=fetcher)
    assert store.get(KEY) is None
    assert store.stats()["peer"].corrupt == 1 and store.contains(KEY) is None


def test_a_good_peer_after_a_corrupt_one_serves_the_block(serve_bytes) -> None:  # type: ignore[no-untyped-def]
    good = encode_block(KEY, _block())
    peers = [serve_bytes(good[:-10]), serve_bytes(good)]
    store = BlockStore(memory_bytes=1 << 20, fetcher=PeerFetcher(static_holders(peers), PEER_TOKEN))
    hit = store.get(KEY)
    assert hit is not None and hit.tier == "peer"
    assert torch.equal(hit.block.keys, _block().keys)
    assert store.get(KEY).tier == "memory"  # type: ignore[union-attr]


def test_unreachable_peers_are_a_plain_miss() -> None:
    fetcher = PeerFetcher(static_holders(["http://127.0.0.1:9"]), PEER_TOKEN, timeout_seconds=0.5)
    assert fetcher(KEY) is None


@pytest.mark.slow
@pytest.mark.model
def test_a_sidecar_fetches_missing_blocks_from_its_peer(start_sidecar: SidecarFactory) -> None:
    holder = start_sidecar(name="holder")
    request = {"user_id": "9", "history": ["10", "11"], "candidates": ["20", "21", "22"]}
    assert holder.json("POST", "/v1/recommend", request)[0] == 200
    asker = start_sidecar("--peers", holder.url, name="asker")
    status, body = asker.json("POST", "/v1/recommend", request)
    assert status == 200
    hits = body["tokens"]["hit"]
    assert hits["item"]["peer"] == body["tokens"]["query"]["item"]
    assert hits["history"]["peer"] == body["tokens"]["query"]["history"]
    assert 'tier="peer"' in asker.metrics()
