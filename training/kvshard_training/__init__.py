"""Training a cacheable recommender: ``kvshard model finetune``, adapter merging, the teachers.

Its own distribution (``pip install ./training``): the serving images do not install it. It ships the
LoRA adapters kvshard's MovieLens models are merged from (``adapters/``, each with its provenance), and
imports the sidecar's engine for what training shares with serving (the prompt, the scorers' masks).
"""
