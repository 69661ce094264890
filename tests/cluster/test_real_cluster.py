"""The Kubernetes runtime's cluster suite (`tests/e2e/cluster_suite.py`) against a real cluster:
`scripts/test-on-cluster` deploys Warren there and runs this with where to find it. Without those
variables every test here is skipped (the suite's checks run against the test cluster in
`tests/e2e/test_kubernetes.py` on every CI run)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

import cluster_suite  # noqa: E402

VARS = ["WARREN_CLUSTER_URL", "WARREN_CLUSTER_API_KEY", "WARREN_CLUSTER_KUBE", "WARREN_CLUSTER_NAMESPACE",
        "WARREN_CLUSTER_IMAGE"]


@pytest.fixture(scope="module")
def target() -> cluster_suite.Target:
    missing = [v for v in VARS if not os.environ.get(v)]
    if missing:
        pytest.skip(f"no cluster to test (run scripts/test-on-cluster; unset: {', '.join(missing)})")
    return cluster_suite.Target(
        base_url=os.environ["WARREN_CLUSTER_URL"], api_key=os.environ["WARREN_CLUSTER_API_KEY"],
        kube=os.environ["WARREN_CLUSTER_KUBE"], namespace=os.environ["WARREN_CLUSTER_NAMESPACE"],
        image=os.environ["WARREN_CLUSTER_IMAGE"], ready_seconds=180)


@pytest.mark.parametrize("check", cluster_suite.CHECKS, ids=lambda c: c.__name__)
def test_on_the_cluster(target, check):
    check(target)
