"""Envoy's side of the Gateway API endpoint-picker protocol, in a process of its own, for the routing bench.

``kvshard bench routing`` times the endpoint picker's decision inside the real gRPC server. Envoy is a
separate process in a deployment, so the bench plays it from one too: between two decisions the
picker's process then runs what an endpoint picker runs (its gRPC server and the picker), not also a
client building and parsing Envoy's messages — which would leave the decision's code and data less in
the CPU's caches than a deployment does.

``python -m kvshard_bench.envoy_player HOST:PORT N PER_ROUND`` sends requests ``0 … N-1`` (the body is
the request's index), one ext_proc stream each, one after the other, and prints each request phase's
end-to-end nanoseconds (headers and body out, both answers back) as a JSON list.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time

from kvshard_router import epp


async def play(target: str, n: int, per_round: int) -> list[int]:
    """Each request's phase time in nanoseconds; every request must get a destination."""
    envoy = epp.EnvoyClient(target)
    took: list[int] = []
    try:
        for k in range(n):
            if k % per_round == 0:
                gc.collect()
            started = time.perf_counter_ns()
            stream, answers = await envoy.request(b"%d" % k)
            took.append(time.perf_counter_ns() - started)
            if epp.destination(answers) is None:
                raise RuntimeError(f"request {k} got no destination: {answers}")
            await envoy.finish(stream, 200)
    finally:
        await envoy.close()
    return took


def main() -> None:
    target, n, per_round = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(asyncio.run(play(target, n, per_round))))


if __name__ == "__main__":
    main()
