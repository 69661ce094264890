"""Checks of the Kubernetes runtime that hold on any cluster, real or not: what `scripts/test-on-cluster`
runs against a real one (kind, k3s, any, through `tests/cluster`), and `test_kubernetes.py` runs
against the test cluster (`fakekube`), so the suite is known to pass before anyone runs it for real.

A check needs only what a real cluster gives a test from outside: Warren's API (a port-forward),
the Kubernetes API over plain HTTP (`kubectl proxy`, or the test cluster's own address), the
namespace Warren's sandboxes live in, and a sandbox image with `sh` and `python3`. It asks
nothing of the cluster that Warren does not (no Pod IP reached from outside, no node access)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import httpx

import warren_e2e as W

APP_PORT = 8768


@dataclass
class Target:
    base_url: str   # Warren's API, http://host:port
    api_key: str
    kube: str       # the Kubernetes API over plain HTTP
    namespace: str  # where Warren's sandbox Pods are
    image: str      # a sandbox image with sh and python3
    ready_seconds: float = 60  # a real cluster may pull the image first

    def sdk_config(self):
        from opensandbox.config import ConnectionConfigSync
        return ConnectionConfigSync(domain=self.base_url.split("://", 1)[1], api_key=self.api_key,
                                    protocol=self.base_url.split("://", 1)[0],
                                    request_timeout=timedelta(seconds=max(60, self.ready_seconds)))

    def create(self, **kw):
        from opensandbox import SandboxSync
        sbx = SandboxSync.create(self.image, connection_config=self.sdk_config(), timeout=timedelta(minutes=10),
                                 ready_timeout=timedelta(seconds=self.ready_seconds), **kw)
        W.track_sandbox(sbx.id)
        return sbx

    def api(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, self.base_url + path, headers={"OPEN-SANDBOX-API-KEY": self.api_key},
                             timeout=60, **kw)

    def kube_get(self, resource: str, name: str) -> dict | None:
        group = "/apis/networking.k8s.io/v1" if resource == "networkpolicies" else "/api/v1"
        r = httpx.get(f"{self.kube}{group}/namespaces/{self.namespace}/{resource}/{name}", timeout=30)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def pod(self, sandbox_id: str) -> dict | None:
        return self.kube_get("pods", f"warren-{sandbox_id}")

    def delete_pod(self, sandbox_id: str) -> None:
        r = httpx.delete(f"{self.kube}/api/v1/namespaces/{self.namespace}/pods/warren-{sandbox_id}", timeout=30)
        assert r.status_code in (200, 202), r.text

    def state(self, sandbox_id: str) -> dict | None:
        r = self.api("GET", f"/v1/sandboxes/{sandbox_id}")
        return r.json()["status"] if r.status_code == 200 else None


def _kill(sbx) -> None:
    try:
        sbx.kill()
    except Exception:  # noqa: BLE001 - already gone
        pass
    sbx.close()


def a_sandbox_is_a_pod_the_sdk_drives(t: Target) -> None:
    """Create, commands, files, background logs, the endpoint proxy, delete: the Pod follows."""
    sbx = t.create(env={"AGENT": "cluster"}, metadata={"suite": "cluster"})
    try:
        pod = t.pod(sbx.id)
        assert pod is not None, "no Pod for the sandbox"
        assert pod["metadata"]["labels"]["io.warren.sandbox"] == sbx.id
        assert pod["spec"]["automountServiceAccountToken"] is False
        code, out, err = W.sh(sbx, "echo $AGENT; python3 -c 'print(6 * 7)'")
        assert (code, out) == (0, "cluster\n42\n"), (code, out, err)
        W.files_logs_and_proxy_work(sbx, "a Pod", APP_PORT)
    finally:
        _kill(sbx)
    W.wait_until(lambda: t.pod(sbx.id) is None, 60, interval=0.5, message="the Pod to be deleted")
    assert t.api("GET", f"/v1/sandboxes/{sbx.id}").status_code == 404


def a_pod_deleted_behind_warren_s_back_ends_its_sandbox(t: Target) -> None:
    sbx = t.create()
    try:
        t.delete_pod(sbx.id)
        st = W.wait_until(lambda: (s := t.state(sbx.id)) and s["state"] in ("Terminated", "Failed") and s,
                          60, interval=0.5, message="the deleted Pod's sandbox to end")
        assert "removed outside Warren" in st.get("message", ""), st
    finally:
        _kill(sbx)


def an_address_policy_is_a_network_policy_of_the_sandbox_s_own(t: Target) -> None:
    """Owned by the Pod, changed live, gone with it. (Whether the cluster's network plugin
    enforces it is the plugin's part.)"""
    from opensandbox.models.sandboxes import NetworkPolicy, NetworkRule
    sbx = t.create(network_policy=NetworkPolicy.model_validate(
        {"defaultAction": "deny", "egress": [{"action": "allow", "target": "192.0.2.0/24"}]}))
    name = f"warren-{sbx.id}-egress"
    try:
        np = t.kube_get("networkpolicies", name)
        assert np is not None, "no NetworkPolicy for the sandbox"
        assert np["metadata"]["ownerReferences"][0]["uid"] == t.pod(sbx.id)["metadata"]["uid"]
        blocks = [to["ipBlock"]["cidr"] for to in np["spec"]["egress"][0]["to"]]
        # With the egress sidecar the cluster lets the Pod out and the sidecar decides.
        assert blocks in (["192.0.2.0/24"], ["0.0.0.0/0", "::/0"]), blocks
        sbx.patch_egress_rules([NetworkRule(action="allow", target="198.51.100.7")])
        if blocks == ["192.0.2.0/24"]:
            np = t.kube_get("networkpolicies", name)
            assert {"ipBlock": {"cidr": "198.51.100.7/32"}} in np["spec"]["egress"][0]["to"], np["spec"]
        r = t.api("PUT", f"/v1/sandboxes/{sbx.id}/networkpolicy", json={"defaultAction": "deny", "egress": []})
        assert r.status_code == 200, r.text
        assert t.kube_get("networkpolicies", name) is None
    finally:
        _kill(sbx)


def renew_moves_the_expiry_the_record_keeps(t: Target) -> None:
    sbx = t.create()
    try:
        before = W.parse_time(t.api("GET", f"/v1/sandboxes/{sbx.id}").json()["expiresAt"])
        sbx.renew(timedelta(minutes=30))
        after = W.parse_time(t.api("GET", f"/v1/sandboxes/{sbx.id}").json()["expiresAt"])
        assert after - before > timedelta(minutes=15), (before, after)
    finally:
        _kill(sbx)


CHECKS = [
    a_sandbox_is_a_pod_the_sdk_drives,
    a_pod_deleted_behind_warren_s_back_ends_its_sandbox,
    an_address_policy_is_a_network_policy_of_the_sandbox_s_own,
    renew_moves_the_expiry_the_record_keeps,
]
