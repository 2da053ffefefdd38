"""Fuzzing the API: malformed and oversized requests never get a 5xx, and the process stays flat."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sidecar_process import Sidecar, SidecarFactory

pytestmark = [pytest.mark.slow, pytest.mark.model]

FIELDS = ["user_id", "history", "candidates", "instruction", "mode", "top_k", "max_tokens", "temperature", "logprobs",
          "blend", "items", "users"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=30), st.sampled_from(["1", "50", "999999", "", "\x00", "1e309"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)),
                                                 inner, max_size=6)), max_leaves=25)
# Near-misses of a valid request: right field names, wrong shapes or values.
near_misses = st.fixed_dictionaries({}, optional={
    "user_id": scalars, "history": st.one_of(scalars, st.lists(scalars, max_size=5)),
    "candidates": st.one_of(scalars, st.lists(st.one_of(scalars, st.sampled_from(["zz", "-1"])), max_size=5)),
    "max_tokens": scalars, "temperature": scalars, "instruction": scalars, "logprobs": scalars,
    "mode": st.one_of(scalars, st.sampled_from(["rank", "generate"])), "top_k": scalars,
    "blend": st.one_of(scalars, st.dictionaries(st.sampled_from(["selector", "ratio", "check_layers", "schedule",
                                                                 "boundary_w", "deviation_on", "method", "epic_k",
                                                                 "x"]),
                                                json_values, max_size=4),
                       # check layers around the model's depth (30): beyond it must be a 4xx, never a 500
                       st.fixed_dictionaries({"selector": st.sampled_from(["deviation", "hybrid"]),
                                              "check_layers": st.lists(st.integers(0, 64), min_size=1, max_size=3)}),
                       # named methods, with and without corrections, ratios and EPIC's k
                       st.fixed_dictionaries({"method": st.sampled_from(["cacheblend", "epic", "full", "none+ape",
                                                                         "tail+segment", "hybrid+tail", "x+y"])},
                                             optional={"ratio": st.floats(-1, 2), "epic_k": st.integers(-2, 9)})),
})
raw_bodies = st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode))
bodies = st.one_of(json_values.map(lambda v: json.dumps(v).encode()),
                   near_misses.map(lambda v: json.dumps(v).encode()), raw_bodies)

COUNTS: dict[str, int] = {"requests": 0}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def fuzzed(start_sidecar: SidecarFactory) -> Sidecar:
    return start_sidecar(name="fuzz")


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=bodies, path=st.sampled_from(["/v1/recommend", "/v1/blocks/prefill"]),
       content_type=st.sampled_from(["application/json", "application/json", "text/plain"]))
def test_no_request_gets_a_5xx(fuzzed: Sidecar, body: bytes, path: str, content_type: str) -> None:
    status, _, payload = fuzzed.call("POST", path, raw=body, headers={"Content-Type": content_type})
    COUNTS["requests"] += 1
    assert status < 500, (status, body[:200], payload[:300])
    if status >= 400:
        error: Any = json.loads(payload)["error"]
        assert error["field"] and error["message"]


def test_the_process_survived_and_memory_stayed_flat(fuzzed: Sidecar) -> None:
    assert COUNTS["requests"] >= 1000
    assert fuzzed.json("GET", "/healthz")[0] == 200
    pid = fuzzed.process.pid
    assert pid is not None
    before = _rss_kib(pid)
    for _ in range(300):
        fuzzed.call("POST", "/v1/recommend", raw=b'{"user_id": 1, "candidates": ["nope"]}')
        fuzzed.call("POST", "/v1/recommend", raw=b"\xff" * 500)
    grown_mib = (_rss_kib(pid) - before) / 1024
    print(f"fuzz: {COUNTS['requests']} requests, RSS grew {grown_mib:.1f} MiB over 600 more")
    assert grown_mib < 20
