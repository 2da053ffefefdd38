"""Benchmarks behind ``kvshard bench``: each module measures one component and emits JSON rows."""
