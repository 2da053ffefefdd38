"""kvshard: beyond-prefix KV caching for LLM generative recommendation.

This package is the small shared core that every component imports: the segment model and block
keys, dataset loading and the recommendation prompt builder, the user cache folder, and the CLI.
It pulls neither torch nor Kubernetes libraries, so the operator image stays small.
"""

__version__ = "0.1.0"
