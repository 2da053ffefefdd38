"""Full prefill computed in the demo's own process: the reference for pods whose vLLM computes.

Why: ``kvshard demo`` measures agreement by re-sending sampled requests with ``blend.method = full``
to the sidecar that served them. A sidecar started with ``--engine vllm`` for a scorer model holds no
weights and no engine — vLLM does all its math — so it cannot compute that reference, and asking its
vLLM would compare vLLM with itself. Instead the demo loads the same model once, here, with the blend
engine, builds the same prompt the sidecar builds (the model's trained template over the same catalog)
and runs :meth:`~kvshard_sidecar.engine.blend.BlendEngine.full` with the model's readout: the scorer's
exact full prefill, independent of vLLM, of the connector and of every cached block. Its answer has the
shape of a ``/v1/recommend`` answer in rank mode (ranking with label-restricted log-probabilities,
chosen label and candidate, ``timings.ttft_ms``), so the demo's report takes it as it takes a sidecar's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvshard.datasets import Dataset
from kvshard.models import model_retrieval_weight, model_template
from kvshard.prompts import PromptBuilder, RecommendationRequest
from kvshard.ranking import fuse_scores, rank_candidates


class FullPrefillReference:
    """The scorer ``model``'s full prefill over ``dataset`` (loads the weights: ~1 s and ~0.6 GB for SmolLM2)."""

    def __init__(self, model: Path, dataset: Dataset) -> None:
        from kvshard_sidecar.engine.blend import BlendEngine
        from kvshard_sidecar.engine.isolated_scorer import Readout
        from kvshard_sidecar.engine.model import load_tokenizer

        tokenizer, _, _ = load_tokenizer(model)
        readout = Readout.for_model(tokenizer, model)
        if readout is None:
            raise ValueError(f"{model.name} is not a scorer model: its reference is the sidecar's own full prefill")
        self.readout = readout
        self.retrieval_weight = model_retrieval_weight(model)
        """What the sidecar fuses with when a request names no weight: the model's recorded one."""
        self.builder = PromptBuilder(tokenizer, dataset, template=model_template(model))
        self.engine = BlendEngine.load(model)

    def answer(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The full-prefill answer to one ``/v1/recommend`` body (blocking: run it in a thread)."""
        from kvshard_sidecar.engine.isolated_scorer import scoring_prompt

        request = RecommendationRequest(str(body["user_id"]), tuple(body["history"]), tuple(body["candidates"]))
        built = self.builder.build(request)
        result = self.engine.full(scoring_prompt(built), readout=self.readout)
        if result.scores is None:
            raise ValueError("the full prefill with a readout returned no scores")
        scores = result.scores.tolist()
        stage = body.get("retrieval_scores")  # ranked as the sidecar ranks it: fused with the stage's scores
        weight = float(body.get("retrieval_weight", self.retrieval_weight))
        fused = None if stage is None else fuse_scores(scores, stage, weight)
        ranking = rank_candidates(request.candidates, built.labels, scores, fused)
        return {"mode": "rank", "engine": "in-process full prefill", "label": ranking[0].label,
                "candidate": ranking[0].candidate, "ranking": [ranked.as_json() for ranked in ranking],
                "timings": {"ttft_ms": round(result.ttft_s * 1000, 3)}}
