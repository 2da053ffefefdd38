"""vLLM's prefix cache stays off in the chart: blocks the kvshard connector fills from blended KV must
never be reused by vLLM as exact prefix hits, whatever ``engine.vllm.extraArgs`` says (issue 16) —
unless the model is a block-trained scorer (``engine.model.scorer``), whose loads are all exact
(``test_a_block_trained_scorer_is_computed_by_vllm_from_the_pods_block_store``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from chart_helpers import VALUES_CASES, HelmError, Manifest, container, engine_pod, render


@pytest.mark.parametrize("case", [case for case in VALUES_CASES if case != "late-scorer"])
def test_vllm_runs_without_its_prefix_cache(rendered: dict[str, list[Manifest]], case: str) -> None:
    """Blocks the connector fills from blended KV must never become exact prefix hits (issue 16)."""
    args = container(engine_pod(rendered[case]), "vllm")["args"]
    assert "--no-enable-prefix-caching" in args
    after = args[args.index("--no-enable-prefix-caching") + 1:]
    assert not [a for a in after if a.replace("_", "-").startswith("--enable-prefix")], (
        "nothing after the flag turns it back on (vLLM's last flag wins)")


@pytest.mark.parametrize("arg", ["--enable-prefix-caching", "--enable-prefix-caching=true",
                                 "--enable-prefix-caching=True", "--enable_prefix_caching",
                                 "--enable-prefix", "--enable-pre"])
def test_extra_args_cannot_turn_the_prefix_cache_back_on(helm_bin: Path, arg: str) -> None:
    """Every spelling vLLM 0.32 parses as --enable-prefix-caching (underscores, ``=value``,
    argparse abbreviations) fails the render with the reason, rather than silently winning."""
    with pytest.raises(HelmError) as error:
        render(helm_bin, sets=["engine.vllm.extraArgs[0]=--enforce-eager", f"engine.vllm.extraArgs[1]={arg}"])
    message = str(error.value)
    assert f'engine.vllm.extraArgs: "{arg}" would turn vLLM\'s prefix caching back on' in message
    assert "--no-enable-prefix-caching" in message and "exact prefix hits" in message


@pytest.mark.parametrize("arg", ["--no-enable-prefix-caching", "--enable-prompt-embeds",
                                 "--enable-prefix-caching-is-not-a-flag", "--prefix-caching-hash-algo=sha256"])
def test_other_extra_args_render_after_the_charts_own(helm_bin: Path, arg: str) -> None:
    args = container(engine_pod(render(helm_bin, sets=[f"engine.vllm.extraArgs[0]={arg}"])), "vllm")["args"]
    assert args[-1] == arg and args.index("--no-enable-prefix-caching") < len(args) - 1
