"""The blend engine: serve a prompt from cached per-segment KV, recomputing only a few tokens.

Public surface (the sidecar's HTTP service calls :meth:`BlendEngine.generate`, or
:meth:`BlendEngine.blend` then :meth:`BlendEngine.decode`)::

    engine = BlendEngine.load(store=block_store, settings=BlendSettings(selector="boundary", ratio=0.15))
    result, generation = engine.generate(prompt, max_new_tokens=1)
    result.logits, result.ttft_s, result.recompute_ratio, result.hit_tokens

Modules: :mod:`.settings` (one dataclass), :mod:`.rope` (key re-rotation), :mod:`.selectors` (pure
selection), :mod:`.executor` (layer halves over the Hugging Face modules), :mod:`.kvbuffer` (the
blended KV), :mod:`.source` (the block-store protocol), :mod:`.contexts` (what a block is prefilled
behind, averaged item blocks), :mod:`.blocks` (fetching, computing and placing blocks), :mod:`.layers`
(the layer loop), :mod:`.blend` (the engine).
"""

from kvshard_sidecar.engine.blend import BlendEngine
from kvshard_sidecar.engine.executor import Executor
from kvshard_sidecar.engine.kvbuffer import KVBuffer
from kvshard_sidecar.engine.model import UnsupportedModelError
from kvshard_sidecar.engine.results import BlendResult, Generation, Sampling
from kvshard_sidecar.engine.settings import BlendSettings, SettingsError
from kvshard_sidecar.engine.source import BlockSource, MemoryBlockSource

__all__ = [
    "BlendEngine", "BlendResult", "BlendSettings", "BlockSource", "Executor", "Generation", "KVBuffer",
    "MemoryBlockSource", "Sampling", "SettingsError", "UnsupportedModelError",
]
