"""Time-to-first-token of the late-interaction scorer on a GPU: no cache vs prefix cache vs kvshard.

Why it exists. The CPU benchmarks cannot say what kvshard saves on the hardware it is meant for. This
script is self-contained (standard library, torch and transformers only: no kvshard, no vLLM, no
downloads) so it can be copied to a bare GPU machine and run as is, on a Llama-3-8B-shaped model with
random weights (timing only). One recommendation is ``prefix`` (system text + H history items + header,
p = 40 + H * n tokens) followed by K candidates of n tokens; a candidate's score is log P(readout) at the
``" ["`` token after its item, from the causal prompt ``prefix + item + " ["``. Three ways to serve it:

* ``full``    — no cache: the K prompts prefilled in full, K * (p + n + 1) tokens (vLLM without prefix caching);
* ``apc``     — prefix cache: the prefix once, then the K candidates' n + 1 tokens in one batch over its KV;
* ``kvshard`` — the prefix once, each item's body (all but its last ``interaction`` tokens) taken from a
  store of items prefilled alone (built before the clock starts, as a block store holds them), its keys
  RoPE-rotated by p at request time, and only ``interaction`` + 1 tokens per candidate computed.

``full`` and ``apc`` compute the plain causal model (every item token reads the prefix); ``kvshard`` computes
the late-interaction model (item-body tokens read only their own item). ``--check`` verifies both on the
first grid point: ``apc`` against ``full`` and ``kvshard`` against a reference — one masked forward pass of
the K prompts under the late mask (float32: 1e-4 on log-probabilities; bf16: the difference is reported).
Note: transformers has no shared paged prefix, so ``apc`` and ``kvshard`` copy the prefix KV per candidate.

Run from the repository root:  python bench/gpu/late_scorer_gpu.py --json /tmp/gpu.json [--check]
CPU smoke run:                  python bench/gpu/late_scorer_gpu.py --tiny --device cpu --check --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

MODES = ("full", "apc", "kvshard")
SYSTEM_TOKENS = 40  # system text + "Candidates:" header around the history
LABEL_TOKEN = 510  # stands in for " [" (the label opening read at each candidate)
READOUT_TOKEN = 9891  # stands in for " yes" (modulo the vocabulary)
FULL_BATCH_TOKENS = 32768  # ``full`` prefills its K prompts in batches of at most this many tokens
FLOAT32_TOLERANCE = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
Model = Any  # a LlamaForCausalLM (transformers' own annotations differ between versions)
CAUSAL_LM: Any = LlamaForCausalLM
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [batch, kv_heads, tokens, head_dim]


def llama_config(tiny: bool) -> LlamaConfig:
    """Llama-3-8B's shape (or a tiny one with the same llama3 RoPE scaling for CPU smoke runs)."""
    shape: dict[str, Any] = (
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 1000} if tiny else
        {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 128256})
    # rope_theta / rope_scaling: the spelling older transformers need and 5.x still accepts
    shape.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), max_position_embeddings=131072,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaConfig(**shape)


def build_model(config: LlamaConfig, device: torch.device, dtype: torch.dtype) -> Model:
    """Random weights made on the device (built on ``meta``, then filled): no 8B-parameter CPU init. The
    noise is N(0, 1/hidden): small, yet large enough that a tiny model's scores depend on positions and
    masks, so ``--check`` would catch a wrong rotation or mask."""
    with torch.device("meta"):
        model: Model = CAUSAL_LM(config)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, config.hidden_size ** -0.5, generator=gen)
    # to_empty left the rotary buffers uninitialised: a fresh module computes inv_freq (float32, llama3-scaled)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config).to(device)
    model.eval()
    return model


@dataclass(frozen=True)
class Request:
    """One recommendation's token ids: the prefix [p] and K candidate items [K, n]."""

    prefix: torch.Tensor
    items: torch.Tensor

    @property
    def p(self) -> int:
        return int(self.prefix.shape[0])

    @property
    def k(self) -> int:
        return int(self.items.shape[0])

    @property
    def n(self) -> int:
        return int(self.items.shape[1])

    def label(self) -> torch.Tensor:
        return torch.full((self.k, 1), LABEL_TOKEN, dtype=torch.long, device=self.items.device)

    def prompts(self) -> torch.Tensor:
        """The K causal prompts ``prefix + item + " ["``, [K, p + n + 1]."""
        return torch.cat([self.prefix.expand(self.k, -1), self.items, self.label()], dim=1)


def make_request(vocab: int, history: int, k: int, n: int, device: torch.device) -> Request:
    gen = torch.Generator().manual_seed(1000 * k + n)
    ids = torch.randint(0, vocab, (SYSTEM_TOKENS + history * n + k * n,), generator=gen).to(device)
    p = SYSTEM_TOKENS + history * n
    return Request(ids[:p], ids[p:].reshape(k, n))


def scores_of(model: Model, last_hidden: torch.Tensor) -> torch.Tensor:
    """log P(readout) from the hidden state at each candidate's label opening, [K] float32."""
    logits = model.lm_head(last_hidden).float()
    scores: torch.Tensor = torch.log_softmax(logits, dim=-1)[:, READOUT_TOKEN % logits.shape[-1]]
    return scores


def layer_kv(cache: Any) -> KV:
    """Per-layer keys and values of a DynamicCache (``layers`` in recent transformers, lists before)."""
    if isinstance(cache, tuple):  # the legacy format
        return [(keys, values) for keys, values, *_ in cache]
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def cache_of(kv: KV) -> DynamicCache:
    cache = DynamicCache()
    for index, (keys, values) in enumerate(kv):
        cache.update(keys, values, index)
    return cache


def run_full(model: Model, req: Request) -> torch.Tensor:
    """No cache: every candidate's whole prompt prefilled causally, in batches of FULL_BATCH_TOKENS."""
    prompts = req.prompts()
    step = max(1, FULL_BATCH_TOKENS // prompts.shape[1])
    last = [model.model(input_ids=prompts[i:i + step], use_cache=False).last_hidden_state[:, -1]
            for i in range(0, req.k, step)]
    return scores_of(model, torch.cat(last))


def prefix_kv(model: Model, req: Request) -> KV:
    return layer_kv(model.model(input_ids=req.prefix[None], use_cache=True).past_key_values)


def run_apc(model: Model, req: Request) -> torch.Tensor:
    """Prefix cache: the prefix once, then each candidate's n + 1 tokens in one batch over its KV."""
    kv = [(k.expand(req.k, -1, -1, -1), v.expand(req.k, -1, -1, -1)) for k, v in prefix_kv(model, req)]
    ids = torch.cat([req.items, req.label()], dim=1)
    positions = torch.arange(req.p, req.p + req.n + 1, device=ids.device).expand(req.k, -1)
    out = model.model(input_ids=ids, position_ids=positions, past_key_values=cache_of(kv), use_cache=True)
    return scores_of(model, out.last_hidden_state[:, -1])


def item_store(model: Model, req: Request, interaction: int) -> KV:
    """What a block store holds: each item prefilled alone at positions 0..n-1, its body's KV."""
    body = req.n - interaction
    kv = layer_kv(model.model(input_ids=req.items, use_cache=True).past_key_values)
    return [(k[:, :, :body].contiguous(), v[:, :, :body].contiguous()) for k, v in kv]


def rotate_keys(keys: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move RoPE keys by ``shift`` positions, R(p + j) = R(p) R(j) (rotate_half layout: dims i and i + d/2);
    angles in float64, the rotation in float32."""
    angles = shift * inv_freq.to(torch.float64)
    cos = torch.cat([angles.cos(), angles.cos()]).to(torch.float32)
    sin = torch.cat([angles.sin(), angles.sin()]).to(torch.float32)
    x = keys.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(keys.dtype)


def run_kvshard(model: Model, req: Request, store: KV, interaction: int) -> torch.Tensor:
    """The prefix once, cached item bodies rotated by p, and only interaction + 1 tokens per candidate."""
    inv_freq = model.model.rotary_emb.inv_freq
    kv = [(torch.cat([k.expand(req.k, -1, -1, -1), rotate_keys(bk, req.p, inv_freq)], dim=2),
           torch.cat([v.expand(req.k, -1, -1, -1), bv], dim=2))
          for (k, v), (bk, bv) in zip(prefix_kv(model, req), store, strict=True)]
    ids = torch.cat([req.items[:, req.n - interaction:], req.label()], dim=1)
    start = req.p + req.n - interaction
    positions = torch.arange(start, req.p + req.n + 1, device=ids.device).expand(req.k, -1)
    out = model.model(input_ids=ids, position_ids=positions, past_key_values=cache_of(kv), use_cache=True)
    return scores_of(model, out.last_hidden_state[:, -1])


def run_reference(model: Model, req: Request, interaction: int) -> torch.Tensor:
    """The late model in one masked pass over the K prompts: item-body rows do not see the prefix."""
    prompts = req.prompts()
    length = prompts.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool, device=prompts.device).tril()
    allowed[req.p:req.p + req.n - interaction, :req.p] = False
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(length, length, dtype=dtype, device=prompts.device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None].expand(req.k, 1, -1, -1)
    hidden = model.model(input_ids=prompts, attention_mask=mask, use_cache=False).last_hidden_state
    return scores_of(model, hidden[:, -1])


def tokens_computed(mode: str, req: Request, interaction: int) -> int:
    return {"full": req.k * (req.p + req.n + 1), "apc": req.p + req.k * (req.n + 1),
            "kvshard": req.p + req.k * (interaction + 1)}[mode]


def timed(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int,
          repeats: int) -> tuple[float, torch.Tensor]:
    """Median wall time (ms) of ``fn`` until its scores exist, after ``warmup`` untimed runs."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    scores = fn()
    for _ in range(max(0, warmup - 1)):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        scores = fn()
        sync()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times), scores


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Measures the time to first token (until all K candidate scores exist) of one late-"
                    "interaction recommendation served three ways: 'full' (no cache: K whole prompts), 'apc' "
                    "(prefix cache: prefix once + K*(n+1) tokens) and 'kvshard' (prefix once + cached item "
                    "bodies RoPE-rotated by p + K*(interaction+1) tokens), on a Llama-3-8B-shaped model with "
                    "random weights. Prints median TTFT, tokens computed, the ratios apc/kvshard and "
                    "full/kvshard, and peak GPU memory.",
        epilog="Example: python bench/gpu/late_scorer_gpu.py --json /tmp/gpu.json --check")
    parser.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 (float32 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (2 layers, hidden 64) for CPU smoke runs")
    parser.add_argument("--candidates", type=int, nargs="+", default=[20, 100], help="K values (default: 20 100)")
    parser.add_argument("--item-tokens", type=int, nargs="+", default=[12, 60], help="n values (default: 12 60)")
    parser.add_argument("--history", type=int, default=30, help="history items, each n tokens (default: 30)")
    parser.add_argument("--interaction", type=int, default=4, help="item tokens that read the prefix (default: 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per mode (default: 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per mode, median reported (default: 5)")
    parser.add_argument("--check", action="store_true",
                        help="on the first grid point, check apc == full (causal) and kvshard == one masked pass "
                             "of the late model (float32: fail above 1e-4; bf16: report the difference)")
    parser.add_argument("--json", type=Path, help="write one row per grid point x mode to this JSON file")
    args = parser.parse_args(argv)
    if any(n <= args.interaction for n in args.item_tokens):
        parser.error("every --item-tokens value must exceed --interaction")
    return args


def check_row(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    diff = float((got - want).abs().max())
    ok = dtype != torch.float32 or diff <= FLOAT32_TOLERANCE
    verdict = ("PASS" if ok else "FAIL") if dtype == torch.float32 else "reported only (not float32)"
    print(f"check {name}: max |diff| of log P(readout) = {diff:.3g}  [{verdict}]")
    return ok, diff


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype: torch.dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    shape = "tiny-llama" if args.tiny else "llama3-8b"
    dtype_name = str(dtype).removeprefix("torch.")
    model = build_model(llama_config(args.tiny), device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    print(f"{shape} ({sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters, random), {dtype_name}, "
          f"{name}; torch {torch.__version__}; interaction {args.interaction}")
    rows: list[dict[str, Any]] = []
    ok = True
    header = (f"{'K':>4} {'n':>3} {'H':>3} {'p':>5} | {'full ms':>9} {'apc ms':>8} {'kvshard ms':>10} | "
              f"{'apc/kv':>6} {'full/kv':>7} | tokens full / apc / kvshard")
    lines = []
    with torch.inference_mode():
        for index, (k, n) in enumerate((k, n) for k in args.candidates for n in args.item_tokens):
            req = make_request(model.config.vocab_size, args.history, k, n, device)
            store = item_store(model, req, args.interaction)  # before the clock: a block store's contents
            runs: dict[str, Callable[[], torch.Tensor]] = {
                "full": partial(run_full, model, req), "apc": partial(run_apc, model, req),
                "kvshard": partial(run_kvshard, model, req, store, args.interaction)}
            results = {mode: timed(runs[mode], device, args.warmup, args.repeats) for mode in MODES}
            checks: dict[str, dict[str, Any]] = {}
            if args.check and index == 0:
                print(f"checks at K={k}, n={n}, H={args.history}:")
                passed, diff = check_row("apc vs full (both plain causal)", results["apc"][1],
                                         results["full"][1], dtype)
                checks["apc"] = {"check_against": "full", "check_max_abs_diff": diff, "check_passed": passed}
                reference = run_reference(model, req, args.interaction)
                late_ok, late_diff = check_row("kvshard vs late-masked reference (one masked pass)",
                                               results["kvshard"][1], reference, dtype)
                checks["kvshard"] = {"check_against": "late-mask reference", "check_max_abs_diff": late_diff,
                                     "check_passed": late_ok}
                ok = ok and passed and late_ok
            ms = {mode: results[mode][0] for mode in MODES}
            tokens = {mode: tokens_computed(mode, req, args.interaction) for mode in MODES}
            lines.append(f"{k:>4} {n:>3} {args.history:>3} {req.p:>5} | {ms['full']:>9.1f} {ms['apc']:>8.1f} "
                         f"{ms['kvshard']:>10.1f} | {ms['apc'] / ms['kvshard']:>6.2f} "
                         f"{ms['full'] / ms['kvshard']:>7.2f} | {tokens['full']} / {tokens['apc']} / "
                         f"{tokens['kvshard']}")
            for mode in MODES:
                rows.append({"mode": mode, "candidates": k, "item_tokens": n, "history": args.history,
                             "ttft_ms": ms[mode], "tokens_computed": tokens[mode], "device": name,
                             "dtype": dtype_name, "shape": shape, "prefix_tokens": req.p,
                             "interaction": args.interaction, "repeats": args.repeats, **checks.get(mode, {})})
    print("\nmedian TTFT (ms) until all K scores exist; p = prefix tokens; ratios = TTFT / kvshard TTFT")
    print(header)
    print("\n".join(lines))
    if device.type == "cuda":
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved(device) / 2**30:.1f} GiB reserved")
    else:
        print("peak GPU memory: n/a (not a CUDA device)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}")
    if not ok:
        print("CHECK FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
