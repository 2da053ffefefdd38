"""``kvshard up`` and ``kvshard down``: the local cluster from the command line.

``up`` runs in the foreground like ``docker compose up``: it starts the cluster, prints every
process with its URL, pid and log, records them in ``<run>/cluster.json`` and stops everything
on Ctrl-C or SIGTERM. ``down`` is for another terminal (or a script): it asks the ``up`` process
to stop, waits, and then kills any process group that ``cluster.json`` still lists — the safety
net for an ``up`` that was itself killed with SIGKILL. Each process is checked by its kernel
start time, so a pid the system has since given to something else is never signalled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from kvshard.processes import ProcessStartError
from kvshard_local import settings as local_settings
from kvshard_local.cluster import ClusterStartError, LocalCluster
from kvshard_local.run_folder import STATE_FILE, ClusterAlreadyRunningError, ProcessInfo, process_start_time

SCALE_REQUEST = "scale-request.json"
SCALE_ANSWER = "scale-answer.json"

log = logging.getLogger(__name__)


def table(rows: Sequence[ProcessInfo]) -> str:
    """The processes as an aligned text table."""
    head = ("NAME", "PID", "URL", "LOG")
    cells = [head, *((r.name, str(r.pid), r.url or "-", r.log) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in cells)


def state(cluster: LocalCluster) -> dict[str, Any]:
    """What ``cluster.json`` holds: the ``up`` process, the URLs, every process."""
    return {
        "up_pid": os.getpid(), "up_start_time": process_start_time(os.getpid()),
        "run_dir": str(cluster.run_dir), "namespace": cluster.namespace, "cacheshard": cluster.name,
        "urls": {"router": cluster.router_url, "prometheus": cluster.prometheus_url,
                 "kube": cluster.kube_url, "etcd": cluster.etcd_endpoint,
                 "operator_metrics": cluster.operator_metrics_url, "sidecars": cluster.sidecar_urls},
        "kubeconfig": str(cluster.kubeconfig),
        "etcd_tls": _etcd_tls_files(cluster),
        "processes": [dataclasses.asdict(p) for p in cluster.processes()],
    }


def _etcd_tls_files(cluster: LocalCluster) -> dict[str, str]:
    """The etcd CA and client certificate files (for etcdctl and your own clients), {} before start."""
    c = cluster.etcd_certificates
    return {} if c is None else {"ca": str(c.ca), "cert": str(c.client_cert), "key": str(c.client_key)}



def _write_state(state_file: Path, cluster: LocalCluster) -> None:
    """Replace ``cluster.json`` whole: `down`, `scale` and tests read it while `up` runs, and must never
    see it empty or half written."""
    partial = state_file.with_name(state_file.name + ".partial")
    partial.write_text(json.dumps(state(cluster), indent=2))
    partial.replace(state_file)

def up(args: argparse.Namespace) -> int:
    """``kvshard up``: run the cluster until Ctrl-C/SIGTERM."""
    try:
        cluster = LocalCluster(local_settings.from_args(args))
    except ValueError as exc:  # SettingsError included: a bad flag, env variable or CacheShard file
        print(f"kvshard up: {exc}", file=sys.stderr)
        return 2
    settings = cluster.settings
    try:
        cluster.acquire()
    except ClusterAlreadyRunningError as exc:
        print(f"kvshard up: {exc}", flush=True)
        return 1

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # interrupts a start or wait in progress; handled below

    previous = signal.signal(signal.SIGTERM, on_signal)
    state_file = cluster.run_dir / STATE_FILE
    code = 0
    try:
        _write_state(state_file, cluster)  # `down` works while starting, too
        cluster.start()
        _write_state(state_file, cluster)
        print(table(cluster.processes()), flush=True)
        if not args.no_wait:
            cluster.wait_ready(settings.start_timeout_seconds, progress=lambda line: print(line, flush=True))
        _write_state(state_file, cluster)  # a sidecar may have restarted meanwhile
        print(f"\nlocal cluster up in {cluster.run_dir}\n  router      {cluster.router_url}\n"
              f"  prometheus  {cluster.prometheus_url}\n  kubeconfig  {cluster.kubeconfig}\n"
              f"  etcd        {cluster.etcd_endpoint} (TLS: {' '.join(cluster.etcd_client_flags)})\n"
              f"Ctrl-C or `kvshard down --dir {cluster.run_dir}` stops it.", flush=True)
        while True:
            time.sleep(1.0)
            cluster.check_alive()
            if serve_scale_request(cluster):
                _write_state(state_file, cluster)
    except KeyboardInterrupt:
        print("stopping the local cluster…", flush=True)
    except (ClusterStartError, ProcessStartError, TimeoutError) as exc:
        print(f"kvshard up: {exc}", flush=True)
        code = 1
    finally:
        # a second Ctrl-C or SIGTERM must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            cluster.stop()
            state_file.unlink(missing_ok=True)
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, interrupt)
    print("local cluster stopped", flush=True)
    return code


def serve_scale_request(cluster: LocalCluster) -> bool:
    """Apply a ``kvshard scale`` request left in the run folder, if any; answer it beside it."""
    request = cluster.run_dir / SCALE_REQUEST
    try:
        asked = json.loads(request.read_text())
    except FileNotFoundError:
        return False
    except json.JSONDecodeError:
        return False  # being written; next second
    request.unlink(missing_ok=True)
    answer: dict[str, Any] = {"id": asked.get("id")}
    try:
        change = cluster.scale(int(asked["pods"]))
        answer.update(pods=list(change.after), added=list(change.added), removed=list(change.removed),
                      seconds=round(change.seconds, 1), drains=change.drains)
    except (ValueError, KeyError, RuntimeError, ProcessStartError) as exc:
        answer["error"] = str(exc)
    (cluster.run_dir / SCALE_ANSWER).write_text(json.dumps(answer, indent=2))
    return True


def scale(args: argparse.Namespace) -> int:
    """``kvshard scale --pods N``: ask the running ``kvshard up`` to scale and wait for its answer."""
    if args.pods < 1:
        print("kvshard scale: --pods must be >= 1", file=sys.stderr)
        return 2
    run_dir = local_settings.from_args(argparse.Namespace(dir=args.dir)).run_dir
    try:
        recorded = json.loads((run_dir / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        print(f"kvshard scale: no local cluster runs in {run_dir} (start one with `kvshard up`)")
        return 1
    if not _alive(int(recorded["up_pid"]), recorded.get("up_start_time")):
        print(f"kvshard scale: the kvshard up of {run_dir} is not running")
        return 1
    ident = f"{os.getpid()}-{time.time_ns()}"
    (run_dir / SCALE_ANSWER).unlink(missing_ok=True)
    pending = run_dir / (SCALE_REQUEST + ".tmp")
    pending.write_text(json.dumps({"id": ident, "pods": args.pods}))
    pending.replace(run_dir / SCALE_REQUEST)  # atomic: `up` never reads half a request
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            answer = json.loads((run_dir / SCALE_ANSWER).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.5)
            continue
        if answer.get("id") != ident:
            time.sleep(0.5)
            continue
        if "error" in answer:
            print(f"kvshard scale: {answer['error']}")
            return 1
        print(f"pods: {', '.join(answer['pods'])} (added: {', '.join(answer['added']) or '-'}; removed: "
              f"{', '.join(answer['removed']) or '-'}) in {answer['seconds']} s")
        for pod, drained in answer["drains"].items():
            print(f"  {pod} drained: {json.dumps(drained)}")
        return 0
    print(f"kvshard scale: no answer from kvshard up within {args.timeout:.0f} s")
    return 1


def _alive(pid: int, start_time: int | None) -> bool:
    return start_time is not None and process_start_time(pid) == start_time


def down(args: argparse.Namespace) -> int:
    """``kvshard down``: stop the ``kvshard up`` of a run folder, then anything it left."""
    run_dir = local_settings.from_args(argparse.Namespace(dir=args.dir)).run_dir
    state_file = run_dir / STATE_FILE
    try:
        recorded = json.loads(state_file.read_text())
    except FileNotFoundError:
        print(f"kvshard down: no local cluster runs in {run_dir} (no {STATE_FILE})")
        return 0
    except json.JSONDecodeError as exc:
        print(f"kvshard down: {state_file} is not valid JSON ({exc}); remove it by hand")
        return 1
    up_pid, up_started = int(recorded["up_pid"]), recorded.get("up_start_time")
    if _alive(up_pid, up_started):
        print(f"stopping kvshard up (pid {up_pid})…", flush=True)
        os.kill(up_pid, signal.SIGTERM)
        deadline = time.monotonic() + args.timeout
        while _alive(up_pid, up_started) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(up_pid, up_started):
            print(f"kvshard up (pid {up_pid}) did not stop in {args.timeout:.0f} s; killing it", flush=True)
            os.kill(up_pid, signal.SIGKILL)
    else:
        print(f"kvshard up (pid {up_pid}) is not running; cleaning up what it left", flush=True)
    killed = []
    for row in recorded.get("processes", []):
        pid = int(row["pid"])
        if not _alive(pid, row.get("start_time")):
            continue
        try:
            if row.get("group"):
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            killed.append(f"{row['name']} (pid {pid})")
        except (ProcessLookupError, PermissionError):
            pass
    if killed:
        print("killed left-over processes: " + ", ".join(killed))
    state_file.unlink(missing_ok=True)
    names = ", ".join(str(r["name"]) for r in recorded.get("processes", []))
    print(f"local cluster in {run_dir} stopped ({names})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshard_local.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    local_settings.add_up_arguments(sub.add_parser("up"))
    local_settings.add_down_arguments(sub.add_parser("down"))
    local_settings.add_scale_arguments(sub.add_parser("scale"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"up": up, "down": down, "scale": scale}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
