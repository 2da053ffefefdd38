"""Peak host memory of one prefill per method, measured in a fresh process (``kvshard bench fidelity --memory``).

Python's ``tracemalloc`` does not see torch's allocations, and ``ru_maxrss`` only ever grows, so
the probe runs in a child process with glibc's mmap threshold pinned (large tensors are mmapped and
go back to the OS when freed) and resets the kernel's peak-RSS counter (``/proc/self/clear_refs``,
value 5) before each method: ``peak - baseline`` is then what that prefill added on top of the model
and the cached blocks. The target (issue 3) is blended ≤ full + the blended KV's bytes.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MMAP_THRESHOLD = str(128 * 1024)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def probe(config: dict[str, Any]) -> list[dict[str, Any]]:
    """In this process: build one prompt, warm its blocks, then measure each method's peak RSS delta."""
    import torch

    from kvshard.datasets import load_dataset
    from kvshard.models import model_template
    from kvshard.prompts import PromptBuilder, sample_requests
    from kvshard_bench.fidelity import engine_tokenizer
    from kvshard_sidecar.engine import BlendEngine, BlendSettings, MemoryBlockSource

    if config.get("threads"):
        torch.set_num_threads(int(config["threads"]))
    dataset = load_dataset(config["dataset"])
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in config["settings"].items()}
    settings = BlendSettings(**fields)
    engine = BlendEngine.load(config["model"], MemoryBlockSource(), settings)
    model = Path(config["model"])
    builder = PromptBuilder(engine_tokenizer(model), dataset, template=model_template(model))
    request = sample_requests(dataset, 1, config["history"], config["candidates"], config["seed"])[0]
    prompt = builder.build(request).prompt
    methods: dict[str, Any] = {
        "full": lambda: engine.full(prompt),
        "prefix": lambda: engine.prefix(prompt),
        settings.selector: lambda: engine.blend(prompt, settings),
    }
    for call in methods.values():  # warm: blocks cached, allocator and kernels initialised
        call()
    rows = []
    for name, call in methods.items():
        gc.collect()
        exact = _reset_peak()
        baseline = _status_kib("VmRSS")
        result = call()
        peak = _status_kib("VmHWM")
        rows.append({"method": name, "peak_delta_mb": round((peak - baseline) / 1024, 2),
                     "kv_mb": round(result.kv.nbytes / 2**20, 2), "tokens": result.num_tokens,
                     "peak_reset": exact})
        del result
    return rows


def measure(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Run :func:`probe` in a child process with the mmap threshold pinned; return its rows."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    out = subprocess.run(
        [sys.executable, "-m", "kvshard_bench.blend_memory"], input=json.dumps(config), env=env,
        capture_output=True, text=True, check=True,
    )
    rows: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def main() -> None:
    rows = probe(json.loads(sys.stdin.read()))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
