"""The chart through an outside scanner: checkov (``--framework kubernetes``, the version
``charts/install-checkov.sh`` pins, in its own virtual environment) on every values file the chart
tests render finds nothing outside ``charts/kvshard/checkov-skips.yaml``, and every skip there is
still needed and says why."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, REPO, VALUES_CASES, Manifest

INSTALL_CHECKOV = REPO / "charts" / "install-checkov.sh"
SKIPS = CHART / "checkov-skips.yaml"
# What the chart's etcd must pass (never skipped): TLS to clients (cert and key) with client-certificate
# auth, no auto-generated certificates, TLS between members (checkov's peer-client-cert-auth check looks
# only at bare Pods named etcd; the chart's flag is checked in test_chart_security.py).
ETCD_TLS_CHECKS = {"CKV_K8S_116", "CKV_K8S_117", "CKV_K8S_118", "CKV_K8S_119"}


@dataclasses.dataclass(frozen=True)
class Finding:
    case: str
    check_id: str
    name: str
    resource: str


@dataclasses.dataclass(frozen=True)
class Scan:
    failed: list[Finding]
    passed: list[Finding]


def _install() -> Path:
    result = subprocess.run(["bash", str(INSTALL_CHECKOV)], capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip()[-2000:])
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def checkov_bin() -> Path:
    """checkov from the user cache (installed by ``charts/install-checkov.sh`` if missing); without
    it the test skips locally but fails in CI, where ``make tools`` installs it."""
    try:
        return _install()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        if os.environ.get("CI"):
            pytest.fail(f"checkov unavailable: {error}")
        pytest.skip(f"checkov unavailable (charts/install-checkov.sh could not install it): {error}")


def _checkov(binary: Path, path: Path) -> tuple[list[Finding], list[Finding]]:
    """(failed, passed) checks of one rendered file."""
    result = subprocess.run([str(binary), "-f", str(path), "--framework", "kubernetes", "--compact", "--output",
                             "json"], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip(), result.stderr[-2000:]
    report: Any = json.loads(result.stdout)
    report = report[0] if isinstance(report, list) else report
    assert report["summary"]["parsing_errors"] == 0, report["summary"]

    def findings(kind: str) -> list[Finding]:
        return [Finding(path.stem, c["check_id"], c["check_name"], c["resource"]) for c in report["results"][kind]]

    return findings("failed_checks"), findings("passed_checks")


@pytest.fixture(scope="session")
def scan(checkov_bin: Path, rendered: dict[str, list[Manifest]], tmp_path_factory: pytest.TempPathFactory) -> Scan:
    """checkov over every values case's render, one run per case: its graph checks (a NetworkPolicy
    for every pod) join objects across all the files of a run, so two cases must never share one."""
    folder = tmp_path_factory.mktemp("checkov")
    scan = Scan(failed=[], passed=[])
    for case, objects in rendered.items():
        path = folder / f"{case}.yaml"
        path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
        failed, passed = _checkov(checkov_bin, path)
        scan.failed.extend(failed)
        scan.passed.extend(passed)
    return scan


def _skips() -> list[dict[str, Any]]:
    return list(yaml.safe_load(SKIPS.read_text())["skips"])


def _covers(skip: dict[str, Any], finding: Finding) -> bool:
    return (skip["id"] == finding.check_id and finding.case in skip.get("cases", VALUES_CASES)
            and any(re.search(r, finding.resource) for r in skip.get("resources", [".*"])))


def test_checkov_finds_nothing_outside_the_skip_list(scan: Scan) -> None:
    skips = _skips()
    unexplained = [f for f in scan.failed if not any(_covers(s, f) for s in skips)]
    assert unexplained == [], "\n".join(f"{f.case}: {f.check_id} {f.name} on {f.resource}" for f in unexplained)
    for case in VALUES_CASES:  # the counts, shown with -s
        passed = sum(f.case == case for f in scan.passed)
        skipped = Counter(f.check_id for f in scan.failed if f.case == case)
        print(f"checkov {case}: {passed} passed, 0 failed, {sum(skipped.values())} on the skip list {dict(skipped)}")
    assert {f.case for f in scan.passed} == set(VALUES_CASES), "every values file was scanned"


def test_every_skip_says_why_and_is_still_needed(scan: Scan) -> None:
    for skip in _skips():
        assert re.fullmatch(r"CKV2?_K8S_[0-9]+", skip["id"]), skip
        assert len(skip.get("reason", "")) >= 80, f"{skip['id']}: say why the chart keeps failing it"
        assert set(skip.get("cases", [])) <= set(VALUES_CASES), skip["id"]
        assert any(_covers(skip, f) for f in scan.failed), f"{skip['id']} is skipped but nothing fails it: remove it"
        assert {f.name for f in scan.failed if f.check_id == skip["id"]} == {skip["name"]}, skip["id"]


def test_etcd_tls_and_network_policy_checks_pass_and_are_never_skipped(scan: Scan) -> None:
    assert not ETCD_TLS_CHECKS & {s["id"] for s in _skips()}
    assert "CKV2_K8S_6" not in {s["id"] for s in _skips() if "cases" not in s}, "NetworkPolicies: never everywhere"
    for case in ("default", "monitoring-off", "kind"):  # the bundled etcd
        etcd = {f.check_id for f in scan.passed if f.case == case and f.resource.endswith("-etcd")}
        assert ETCD_TLS_CHECKS <= etcd, (case, ETCD_TLS_CHECKS - etcd)
    for case in ("default", "external-etcd", "kind"):
        pods = {f.resource.split(".")[2] for f in scan.passed if f.case == case and f.check_id == "CKV2_K8S_6"}
        assert pods == {"kvs-kvshard-operator", "kvs-kvshard-router", "kvs-kvshard-engine", "kvs-kvshard-etcd"} - (
            {"kvs-kvshard-etcd"} if case == "external-etcd" else set()), case
    pods = {f.resource.split(".")[2] for f in scan.passed if f.case == "gateway-api" and f.check_id == "CKV2_K8S_6"}
    assert "kvs-kvshard-epp" in pods, "the endpoint picker's pods have their NetworkPolicy"
