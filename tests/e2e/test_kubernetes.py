"""The Kubernetes runtime (`[runtime] kind = "kubernetes"`), driven by the official SDK.

No Kubernetes API server can run on this machine: the cluster here is `fakekube.FakeKube`, an API
server for the subset Warren uses (which validates every object Warren sends against Kubernetes
1.31's schema, strictly) and a test kubelet that runs each Pod's sandbox container as a process in
a network namespace of its own with its own address. So these tests check what Warren asks of a
cluster and how it follows what the cluster does — the Pod it makes, execd reached over the Pod
network with its credential, a Pod deleted or evicted behind Warren's back, a restart that finds its
Pods again, a watch that lost its history — not a container runtime's isolation, which the kubelet
here does not provide. The checks that hold on any cluster are in `cluster_suite`, which runs here
and, with `scripts/test-on-cluster`, against a real cluster (docs/kubernetes.md)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import signal
import subprocess
import time
import uuid
from datetime import datetime, timedelta, timezone

import httpx
import pytest

import cluster_suite
import warren_e2e as W
from fakekube import FakeKube

NS = "sandboxes"
IMAGE = "registry.invalid/agent-image:1"  # the test kubelet runs no image; never pulled
APP_PORT = 8767


@pytest.fixture(scope="module")
def cluster():
    execd = W.warren_bin().with_name("warren-execd")
    fake = FakeKube(execd)
    yield fake
    fake.close()


def _server(work_root, cluster, **extra) -> W.WarrenServer:
    srv = W.WarrenServer("kubernetes", work_root, f"k8s-{uuid.uuid4().hex[:6]}",
                         api_key=extra.get("api_key"))
    runtime_class = extra.get("runtime_class")
    host_paths = extra.get("host_paths")
    shared_key = extra.get("shared_key")
    srv.more_config = (
        "[kubernetes]\n"
        f'api_server = "{cluster.url}"\n'
        f'namespace = "{NS}"\n'
        f'instance = "{extra.get("instance", srv.name)}"\n'
        + (f'shared_key_file = "{shared_key}"\n' if shared_key else "")
        + 'execd_image = "warren:e2e"\n'
        + (f'runtime_class = "{runtime_class}"\n' if runtime_class else "")
        + 'node_selector = { "warren.io/sandboxes" = "true" }\n'
        + (f"allowed_host_paths = {json.dumps(host_paths)}\n" if host_paths else "")
        + (f"lease_seconds = {extra['lease_seconds']}\n" if "lease_seconds" in extra else "")
        + extra.get("tail", "")
    )
    srv.check_binary()
    srv.start()
    return srv


@pytest.fixture(scope="module")
def k8s(work_root, cluster):
    srv = _server(work_root, cluster, runtime_class="gvisor")
    yield srv
    srv.stop()


def _create(srv, **kw):
    return W.sdk_sandbox(srv, IMAGE, **kw)


def _pod(cluster, sid):
    return cluster.get("pods", NS, f"warren-{sid}")


def _state(srv, sid):
    with srv.client() as c:
        r = c.get(f"/v1/sandboxes/{sid}")
    return r.json()["status"] if r.status_code == 200 else None


def test_health_reports_kubernetes_and_what_it_cannot_do(k8s):
    info = httpx.get(f"{k8s.base_url}/health", timeout=10).json()["runtime"]
    assert info["kind"] == "kubernetes" and info["name"] == "kubernetes/gvisor", info
    caps = info["capabilities"]
    assert caps["execdTransport"] == "tcp" and caps["pause"] is False and caps["snapshots"] is False, caps
    # No link, but address rules are the cluster's to enforce (a NetworkPolicy per sandbox).
    assert caps["egressPolicy"] is False and caps["egressAddresses"] is True, caps
    # Rules naming hosts need the egress sidecar, which this server does not run.
    assert caps["egressNames"] is False, caps
    # No node folder is allowed by default.
    assert caps["hostVolumes"] == "none", caps
    with k8s.client() as c:
        r = c.post("/v1/sandboxes", json=W.create_body(IMAGE, volumes=[
            {"name": "v", "host": {"path": "/srv"}, "mountPath": "/mnt/x"}]))
    W.assert_error_body(r, codes=[501])


def test_a_sandbox_is_a_pod_and_the_sdk_drives_it_over_the_pod_network(k8s, cluster):
    _create(k8s).kill()  # the instance's NetworkPolicy is made by its first create
    before = dict(cluster.requests)
    sbx = _create(k8s, env={"AGENT": "k8s"}, metadata={"team": "e2e"})
    # A create costs the API server one write and no read: the instance's one watch says the rest.
    asked = {k: v - before.get(k, 0) for k, v in cluster.requests.items() if v != before.get(k, 0)}
    assert asked == {"POST pods": 1}, asked
    assert cluster.creates["networkpolicies"] == 1
    try:
        pod = _pod(cluster, sbx.id)
        assert pod is not None, "no Pod for the sandbox"
        spec = pod["spec"]
        assert pod["metadata"]["labels"]["io.warren.sandbox"] == sbx.id
        assert pod["metadata"]["labels"]["io.warren.owner"] == k8s.name
        assert spec["runtimeClassName"] == "gvisor"
        assert spec["nodeSelector"] == {"warren.io/sandboxes": "true"}
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
        assert spec["initContainers"][0]["image"] == "warren:e2e"
        (c,) = spec["containers"]
        assert c["image"] == IMAGE
        assert "MKNOD" not in c["securityContext"]["capabilities"]["add"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        # The Pod carries execd's verifier, never the credential the server sends.
        credential = W.execd_credential(k8s, sbx.id)
        assert credential not in json.dumps(pod)
        assert hashlib.sha256(credential.encode()).hexdigest() in c["command"]

        # Commands run in the Pod's network namespace, at the Pod's address.
        code, out, _ = W.sh(sbx, "echo $AGENT; ls /sys/class/net")
        assert code == 0, out
        lines = out.split("\n")
        assert lines[0] == "k8s", out
        assert any(line.startswith("wkp") for line in lines), out
        W.files_logs_and_proxy_work(sbx, "the Pod", APP_PORT)

        # execd's port on the Pod network opens only with the credential.
        ip = cluster.pod_ip(NS, f"warren-{sbx.id}")
        for headers in ({}, {"X-EXECD-ACCESS-TOKEN": hashlib.sha256(credential.encode()).hexdigest()}):
            r = httpx.post(f"http://{ip}:44772/command", json={"command": "touch /tmp/k8s-pwned"},
                           headers=headers, timeout=10)
            assert r.status_code == 401, r.text
        assert httpx.get(f"http://{ip}:44772/ping", headers={"X-EXECD-ACCESS-TOKEN": credential},
                         timeout=10).status_code == 200
    finally:
        sbx.kill()
        sbx.close()
    # Deleted: the Pod is gone from the cluster.
    W.wait_until(lambda: _pod(cluster, sbx.id) is None, 15, message="the Pod to be deleted")
    assert cluster.rejected == [], cluster.rejected


def test_a_create_s_registry_credentials_are_a_secret_its_pod_owns(k8s, cluster):
    image = "registry.example.test:5000/team/agent:1"
    password = "pw-" + uuid.uuid4().hex
    sids = []
    for _ in range(2):
        body = W.create_body(image)
        body["image"]["auth"] = {"username": "agent", "password": password}
        with k8s.client() as c:
            r = c.post("/v1/sandboxes", json=body)
        assert r.status_code == 202, r.text
        assert password not in r.text
        sids.append(r.json()["id"])
        W.track_sandbox(sids[-1])
    deleted, gone_behind = sids
    for sid in sids:
        W.wait_until(lambda: (_state(k8s, sid) or {}).get("state") == "Running", 30,
                     message="the sandbox pulling with its own credentials to run")
        pod = _pod(cluster, sid)
        name = f"warren-{sid}-pull"
        assert {"name": name} in pod["spec"]["imagePullSecrets"], pod["spec"].get("imagePullSecrets")
        assert password not in json.dumps(pod)
        secret = cluster.get("secrets", NS, name)
        assert secret is not None and secret["type"] == "kubernetes.io/dockerconfigjson"
        (owner,) = secret["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Pod", pod["metadata"]["name"], pod["metadata"]["uid"])
        # The kubelet found the credentials for that registry when it pulled.
        pulled = [a for img, a in cluster.pulls if img == image]
        assert any(a.get("registry.example.test:5000", {}).get("password") == password for a in pulled), pulled
    # Never in Warren's own files or log.
    assert password not in (k8s.data_dir / "state" / "sandboxes.jsonl").read_text()
    assert password not in k8s.log_path.read_text(errors="replace")
    # Deleted through Warren: the Secret goes with the Pod.
    with k8s.client() as c:
        assert c.delete(f"/v1/sandboxes/{deleted}").status_code == 204
    W.wait_until(lambda: cluster.get("secrets", NS, f"warren-{deleted}-pull") is None, 15,
                 message="the deleted sandbox's pull Secret to be removed")
    # A Pod deleted behind Warren's back takes its Secret with it (the cluster's garbage collector).
    cluster.remove_pod(NS, f"warren-{gone_behind}")
    assert f"warren-{gone_behind}-pull" in cluster.gc_deleted
    assert cluster.get("secrets", NS, f"warren-{gone_behind}-pull") is None
    W.wait_until(lambda: (s := _state(k8s, gone_behind)) is None or s["state"] in ("Terminated", "Failed"), 15,
                 message="the sandbox of the removed Pod to end")
    assert cluster.rejected == [], cluster.rejected


def test_a_warm_pool_of_pods_serves_creates_without_a_pod_write(k8s, cluster):
    """Warm pools work on Kubernetes as elsewhere: the pool's Pods are made ahead, a create from it
    costs the cluster no write on its path (the refill makes the next Pod afterwards). Claims are
    the server's own: each replica has its pool (see crates/README.md, "Claim contention")."""
    name = f"k8s-{uuid.uuid4().hex[:8]}"
    template = W.create_body(IMAGE)
    template["env"] = {"E2E_POOL": name}
    spec = {"name": name, "template": template,
            "capacitySpec": {"bufferMin": 1, "bufferMax": 2, "poolMin": 0, "poolMax": 3}}
    with k8s.client() as c:
        assert c.post("/v1/pools", json=spec).status_code == 201
        try:
            W.wait_until(lambda: c.get(f"/v1/pools/{name}").json()["status"]["available"] >= 2, 60,
                         message="two warm Pods")
            warm = {p["metadata"]["labels"]["io.warren.sandbox"] for p in cluster.list("pods", NS)}
            posts = cluster.requests.get("POST pods", 0)
            sbx = _create(k8s, extensions={"poolRef": name})
            try:
                assert cluster.requests.get("POST pods", 0) - posts <= 1  # at most the refill's
                assert sbx.id in warm, "the sandbox was not one of the warm Pods"
                code, out, _ = W.sh(sbx, "echo $E2E_POOL")
                assert (code, out.strip()) == (0, name), out
            finally:
                _kill(sbx)
            W.wait_until(lambda: _pod(cluster, sbx.id) is None, 15, message="the claimed Pod to be deleted")
        finally:
            assert c.delete(f"/v1/pools/{name}").status_code in (204, 404)
    # The pool's warm Pods go with it.
    W.wait_until(lambda: not [p for p in cluster.list("pods", NS) if p["spec"]["containers"][0].get("env")
                              and {"name": "E2E_POOL", "value": name} in p["spec"]["containers"][0]["env"]],
                 30, message="the pool's Pods to be removed")


def test_node_folders_are_mounted_only_from_allowed_ones(work_root, cluster):
    """`host` volumes are the node's folders here: checked by name against [kubernetes]
    allowed_host_paths, the allowed folder itself the hostPath and the rest a subPath (which the
    kubelet resolves without following a symlink out of the folder, one a sandbox could plant)."""
    srv = _server(work_root, cluster, host_paths=["/srv/warren-e2e"])
    try:
        caps = httpx.get(f"{srv.base_url}/health", timeout=10).json()["runtime"]["capabilities"]
        assert caps["hostVolumes"] == "node", caps
        body = W.create_body(IMAGE, volumes=[{"name": "v", "host": {"path": "/srv/warren-e2e/team"},
                                              "subPath": "a", "mountPath": "/data", "readOnly": True}])
        with srv.client() as c:
            r = c.post("/v1/sandboxes", json=body)
            assert r.status_code == 202, r.text
            sid = r.json()["id"]
            W.track_sandbox(sid)
            for path, sub, status in (("/srv/warren-e2e-other", None, 403), ("/etc", None, 403),
                                      ("/srv/warren-e2e/../../etc", None, 400), ("/srv/warren-e2e", "../x", 400)):
                bad = W.create_body(IMAGE, volumes=[{"name": "v", "host": {"path": path}, "mountPath": "/data",
                                                     **({"subPath": sub} if sub else {})}])
                W.assert_error_body(c.post("/v1/sandboxes", json=bad), codes=[status])
        W.wait_until(lambda: (_state(srv, sid) or {}).get("state") == "Running", 30, message="the sandbox to run")
        pod = _pod(cluster, sid)
        vol = next(v for v in pod["spec"]["volumes"] if "hostPath" in v)
        assert vol["hostPath"] == {"path": "/srv/warren-e2e", "type": "Directory"}, vol
        (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == vol["name"]]
        assert (mount["mountPath"], mount["subPath"], mount["readOnly"]) == ("/data", "team/a", True), mount
        assert cluster.rejected == [], cluster.rejected
        with srv.client() as c:
            assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    finally:
        srv.stop()


def test_commands_start_in_the_image_s_working_directory(k8s, cluster):
    """Warren does not read images the cluster pulls: execd, started where the image says, takes
    that as the sandbox's working directory."""
    image = "registry.invalid/workdir-image:1"
    cluster.image_workdirs[image] = "/tmp"
    sbx = W.sdk_sandbox(k8s, image)
    try:
        code, out, _ = W.sh(sbx, "pwd")
        assert (code, out.strip()) == (0, "/tmp"), out
    finally:
        _kill(sbx)


def test_a_policy_that_lets_addresses_out_is_a_network_policy_of_the_sandbox_s_own(k8s, cluster):
    """The fake cluster does not enforce NetworkPolicies (no network plugin): this checks the
    policy Warren asks for, which the API server's schema accepts, and its life with the sandbox.
    That the blocks allow exactly what the rules do is checked address by address in the runtime's
    unit tests (`egress::tests`)."""
    from opensandbox.models.sandboxes import NetworkPolicy, NetworkRule
    policy = NetworkPolicy.model_validate({"defaultAction": "deny", "egress": [
        {"action": "deny", "target": "10.1.2.0/24"},
        {"action": "allow", "target": "10.1.0.0/16"},
        {"action": "allow", "target": "192.0.2.7"}]})
    sbx = _create(k8s, network_policy=policy)
    try:
        name = f"warren-{sbx.id}-egress"
        np = cluster.get("networkpolicies", NS, name)
        assert np is not None, "no NetworkPolicy for the sandbox"
        assert np["spec"]["podSelector"]["matchLabels"] == {"io.warren.sandbox": sbx.id, "io.warren.owner": k8s.name}
        assert np["spec"]["policyTypes"] == ["Egress"]
        assert np["spec"]["egress"] == [{"to": [
            {"ipBlock": {"cidr": "10.1.0.0/16", "except": ["10.1.2.0/24"]}},
            {"ipBlock": {"cidr": "192.0.2.7/32"}}]}], np["spec"]
        pod = _pod(cluster, sbx.id)
        assert np["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
        assert sbx.get_egress_policy().default_action == "deny"

        # Changed live: the sandbox's own policy follows; one that lets nothing out goes.
        sbx.patch_egress_rules([NetworkRule(action="allow", target="198.51.100.0/24")])
        np = cluster.get("networkpolicies", NS, name)
        assert {"ipBlock": {"cidr": "198.51.100.0/24"}} in np["spec"]["egress"][0]["to"], np["spec"]
        # A host name needs the egress sidecar, which this server does not run: refused, and the
        # policy in force is unchanged.
        with k8s.client() as c:
            r = c.patch(f"/v1/sandboxes/{sbx.id}/networkpolicy", json=[{"action": "allow", "target": "pypi.org"}])
        W.assert_error_body(r, codes=[400])
        assert "pypi.org" in r.json()["message"] and "addresses" in r.json()["message"], r.text
        assert cluster.get("networkpolicies", NS, name)["spec"] == np["spec"]
        with k8s.client() as c:
            r = c.put(f"/v1/sandboxes/{sbx.id}/networkpolicy", json={"defaultAction": "deny", "egress": []})
            assert r.status_code == 200, r.text
        assert cluster.get("networkpolicies", NS, name) is None
        with k8s.client() as c:
            r = c.put(f"/v1/sandboxes/{sbx.id}/networkpolicy", json={"defaultAction": "allow", "egress": [
                {"action": "deny", "target": "169.254.169.254"}]})
            assert r.status_code == 200, r.text
        assert cluster.get("networkpolicies", NS, name)["spec"]["egress"] == [{"to": [
            {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}},
            {"ipBlock": {"cidr": "::/0"}}]}]
    finally:
        sbx.kill()
        sbx.close()
    # Owned by the Pod: gone with it.
    W.wait_until(lambda: cluster.get("networkpolicies", NS, name) is None, 15, message="the policy to go")

    # A create whose policy names a host is refused, with nothing made.
    pods = len(cluster.list("pods", NS))
    with k8s.client() as c:
        r = c.post("/v1/sandboxes", json=W.create_body(IMAGE, networkPolicy={
            "defaultAction": "deny", "egress": [{"action": "allow", "target": "*.pypi.org"}]}))
    W.assert_error_body(r, codes=[400])
    # So is one limited to ports: a NetworkPolicy here would open every port of the address.
    with k8s.client() as c:
        r = c.post("/v1/sandboxes", json=W.create_body(IMAGE, networkPolicy={
            "defaultAction": "deny", "egress": [{"action": "allow", "target": "203.0.113.7", "ports": [443]}]}))
    W.assert_error_body(r, codes=[400])
    assert "ports" in r.json()["message"], r.json()
    assert len(cluster.list("pods", NS)) == pods
    assert cluster.rejected == [], cluster.rejected


@pytest.fixture(scope="module")
def little_internet():
    """What sandboxes behind an egress sidecar may reach, or not: `.test` names answered by a DNS
    server of the test's, and HTTP servers on port 80, all at addresses on this host's loopback
    device (a Pod's namespace routes to them through its host end; nothing leaves this host)."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from fakenet import dns_answer, free_net

    prefix = free_net("198.18", start=128)
    zone = {"allowed.test": f"{prefix}.2", "other.test": f"{prefix}.3", "api.wild.test": f"{prefix}.4"}
    dns_ip = f"{prefix}.53"
    added: list[str] = []
    servers: list[ThreadingHTTPServer] = []
    names: list[str] = []

    class Hello(BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"hello from {self.connection.getsockname()[0]}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stop = threading.Event()
    try:
        for a in [*zone.values(), dns_ip]:
            subprocess.run(["ip", "addr", "add", f"{a}/32", "dev", "lo"], check=True, capture_output=True)
            added.append(a)
        for a in zone.values():
            srv = ThreadingHTTPServer((a, 80), Hello)
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            servers.append(srv)
        dns.bind((dns_ip, 53))
        dns.settimeout(0.2)

        def serve_dns():
            while not stop.is_set():
                try:
                    q, addr = dns.recvfrom(4096)
                except OSError:
                    continue
                dns.sendto(dns_answer(q, names, zone), addr)

        threading.Thread(target=serve_dns, daemon=True).start()
        yield SimpleNamespace(prefix=prefix, zone=zone, dns=f"{dns_ip}:53", names=names)
    finally:
        stop.set()
        dns.close()
        for srv in servers:
            srv.shutdown()
            srv.server_close()
        for a in added:
            subprocess.run(["ip", "addr", "del", f"{a}/32", "dev", "lo"], capture_output=True)


FETCH = """python3 - <<'EOF'
import urllib.request
try:
    print(urllib.request.urlopen('http://{target}/', timeout=5).read().decode().strip())
except Exception as e:
    print('FAILED', type(e).__name__, e)
EOF"""


def test_the_egress_sidecar_enforces_rules_naming_hosts_beside_the_sandbox(work_root, little_internet):
    """With `egress_sidecar`, rules naming hosts work on Kubernetes: Warren's container beside the
    sandbox holds the policy in the Pod's network namespace and answers its DNS. Here the kubelet
    runs that container (`warren egress-sidecar` from this build) before the sandbox's, each with
    the capabilities the Pod spec gives it, so the sandbox's processes try to undo the rules with
    exactly what a cluster would leave them."""
    from opensandbox.models.sandboxes import NetworkPolicy, NetworkRule
    net = little_internet
    cluster = FakeKube(W.warren_bin().with_name("warren-execd"), subnet_prefix="10.247",
                       warren_path=W.warren_bin(), routes=[f"{net.prefix}.0/24"])
    srv = _server(work_root, cluster, tail=f'egress_sidecar = true\negress_dns_upstream = "{net.dns}"\n')
    sbx = None
    try:
        caps = httpx.get(f"{srv.base_url}/health", timeout=10).json()["runtime"]["capabilities"]
        assert caps["egressAddresses"] is True and caps["egressNames"] is True, caps
        sbx = _create(srv, network_policy=NetworkPolicy.model_validate(
            {"defaultAction": "deny", "egress": [{"action": "allow", "target": "allowed.test"}]}))
        pod = _pod(cluster, sbx.id)
        sidecar = pod["spec"]["initContainers"][1]
        assert sidecar["name"] == "warren-egress" and sidecar["restartPolicy"] == "Always", sidecar
        assert "NET_RAW" not in pod["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
        # The cluster lets the Pod out; the sidecar decides where to.
        np = cluster.get("networkpolicies", NS, f"warren-{sbx.id}-egress")
        assert {"ipBlock": {"cidr": "0.0.0.0/0"}} in np["spec"]["egress"][0]["to"], np["spec"]

        def fetch(target):
            code, out, _ = W.sh(sbx, FETCH.format(target=target))
            return out.strip()

        assert fetch("allowed.test") == f"hello from {net.zone['allowed.test']}"
        # A name no rule allows gets no answer, and never reaches the upstream; its address is shut.
        assert fetch("other.test").startswith("FAILED"), fetch("other.test")
        assert "other.test" not in net.names, net.names
        assert fetch(net.zone["other.test"]).startswith("FAILED")

        # What the sandbox's processes have cannot undo the rules: no NET_ADMIN to change them, no
        # NET_RAW to put the sidecar's mark on a socket (or send raw packets).
        code, out, _ = W.sh(sbx, "nft flush ruleset 2>&1; echo rc=$?")
        assert "rc=0" not in out, out
        code, out, _ = W.sh(sbx, """python3 - <<'EOF'
import socket
for what, make in [("mark", lambda: socket.socket().setsockopt(socket.SOL_SOCKET, 36, 0x57524e)),
                   ("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP))]:
    try:
        make()
        print(what, "ALLOWED")
    except PermissionError:
        print(what, "refused")
EOF""")
        assert out.strip().split("\n") == ["mark refused", "raw refused"], out
        assert fetch(net.zone["other.test"]).startswith("FAILED")
        # The control port opens only with execd's credential: not without one, nor with its
        # verifier (which the sidecar's command line shows), from the Pod or from outside it.
        ip = cluster.pod_ip(NS, f"warren-{sbx.id}")
        credential = W.execd_credential(srv, sbx.id)
        verifier = hashlib.sha256(credential.encode()).hexdigest()
        wide_open = json.dumps({"defaultAction": "allow", "egress": []})
        for headers in ({}, {"X-EXECD-ACCESS-TOKEN": verifier}):
            r = httpx.put(f"http://{ip}:44774/policy", content=wide_open, headers=headers, timeout=10)
            assert r.status_code == 401, r.text
        code, out, _ = W.sh(sbx, f"""python3 - <<'EOF'
import urllib.request
req = urllib.request.Request('http://127.0.0.1:44774/policy', data=b'{wide_open}', method='PUT',
                             headers={{'X-EXECD-ACCESS-TOKEN': '{verifier}'}})
try:
    urllib.request.urlopen(req, timeout=5)
    print('OPENED')
except urllib.error.HTTPError as e:
    print(e.code)
EOF""")
        assert out.strip() == "401", out
        assert fetch(net.zone["other.test"]).startswith("FAILED")

        # Changed live through the SDK: a wildcard opens its names; a policy that lets nothing out
        # shuts what was learned before, at once.
        sbx.patch_egress_rules([NetworkRule(action="allow", target="*.wild.test")])
        assert fetch("api.wild.test") == f"hello from {net.zone['api.wild.test']}"
        # Rules limited to TCP ports hold beside the sandbox too: an address opened on port 80
        # alone answers there; a port-scoped deny beats the wildcard's allow on its port.
        with srv.client() as c:
            r = c.patch(f"/v1/sandboxes/{sbx.id}/networkpolicy", json=[
                {"action": "allow", "target": net.zone["other.test"], "ports": [80]},
                {"action": "deny", "target": net.zone["api.wild.test"], "ports": [80]}])
            assert r.status_code == 200, r.text
        assert fetch(net.zone["other.test"]) == f"hello from {net.zone['other.test']}"
        assert fetch("api.wild.test").startswith("FAILED")
        policy_none = {"defaultAction": "deny", "egress": []}
        with srv.client() as c:
            r = c.put(f"/v1/sandboxes/{sbx.id}/networkpolicy", json=policy_none)
            assert r.status_code == 200, r.text
        assert cluster.get("networkpolicies", NS, f"warren-{sbx.id}-egress") is None
        assert fetch(net.zone["allowed.test"]).startswith("FAILED")
        assert fetch("allowed.test").startswith("FAILED")

        # While the sidecar is down, the sandbox may take its port, but nothing it answers there
        # leaves the Pod (the sidecar's own answers carry its mark): no caller reaches it, and
        # Warren's next change, which carries the credential, is never sent to it.
        pod_name = f"warren-{sbx.id}"
        (old,) = cluster.sidecar_pids(pod_name)
        cluster.kill_sidecar(pod_name, restart=False)
        from opensandbox.models.execd import RunCommandOpts
        squatter = sbx.commands.run(
            "exec python3 -c \"import http.server as h; h.HTTPServer(('0.0.0.0', 44774), "
            "h.BaseHTTPRequestHandler).serve_forever()\"", opts=RunCommandOpts(background=True))
        code, out, _ = W.sh(sbx, "for i in $(seq 50); do python3 -c \"import socket; "
                                 "socket.create_connection(('127.0.0.1', 44774), 1)\" 2>/dev/null && echo up && break; "
                                 "sleep 0.1; done")
        assert out.strip() == "up", out
        with pytest.raises(httpx.TransportError):
            httpx.put(f"http://{ip}:44774/policy", content=wide_open, timeout=3)
        with srv.client() as c:
            r = c.put(f"/v1/sandboxes/{sbx.id}/networkpolicy", json=policy_none)
        W.assert_error_body(r, codes=[500, 502, 503])
        sbx.commands.interrupt(squatter.id)
        # A sidecar that dies is started again by the kubelet, with the policy last put in force,
        # not the wider one of its command line.
        cluster.release_sidecar(pod_name)
        W.wait_until(lambda: (pids := cluster.sidecar_pids(pod_name)) and pids != [old], 15,
                     message="the sidecar to be started again")
        W.wait_until(lambda: httpx.put(f"http://{ip}:44774/policy", timeout=2).status_code == 401, 15,
                     message="the restarted sidecar to listen")
        assert fetch("allowed.test").startswith("FAILED")
        assert fetch(net.zone["allowed.test"]).startswith("FAILED")
        assert cluster.rejected == [], cluster.rejected
    finally:
        if sbx is not None:
            sbx.kill()
            sbx.close()
        srv.stop()
        cluster.close()


@pytest.mark.parametrize("check", cluster_suite.CHECKS, ids=lambda c: c.__name__)
def test_the_real_cluster_suite_passes_on_the_test_cluster(k8s, cluster, check):
    """`cluster_suite` is what `scripts/test-on-cluster` runs against a real cluster: here it runs
    against the test cluster, with only what it has there (Warren's API, the cluster's API over
    HTTP, a namespace, an image)."""
    check(cluster_suite.Target(base_url=k8s.base_url, api_key=k8s.api_key, kube=cluster.url,
                               namespace=NS, image=IMAGE))
    assert cluster.rejected == [], cluster.rejected


def test_pause_and_snapshots_are_refused_clearly(k8s, cluster):
    sbx = _create(k8s)
    try:
        with k8s.client() as c:
            r = c.post(f"/v1/sandboxes/{sbx.id}/pause")
            W.assert_error_body(r, codes=[501])
            assert "Kubernetes" in r.json()["message"], r.text
            W.assert_error_body(c.post(f"/v1/sandboxes/{sbx.id}/snapshots", json={"name": "s"}), codes=[400, 501])
            # The built-in host image is the native runtime's.
            r = c.post("/v1/sandboxes", json=W.create_body("host"))
            W.assert_error_body(r, codes=[400, 501])
        assert _state(k8s, sbx.id)["state"] == "Running"
    finally:
        sbx.kill()
        sbx.close()


def test_a_pod_deleted_or_evicted_behind_warrens_back_ends_its_sandbox(k8s, cluster):
    gone = _create(k8s)
    evicted = _create(k8s)
    try:
        cluster.remove_pod(NS, f"warren-{gone.id}")
        cluster.evict(NS, f"warren-{evicted.id}")
        st = W.wait_until(lambda: (s := _state(k8s, gone.id)) and s["state"] in ("Terminated", "Failed") and s,
                          15, message="the deleted Pod's sandbox to end")
        assert "removed outside Warren" in st.get("message", ""), st
        st = W.wait_until(lambda: (s := _state(k8s, evicted.id)) and s["state"] in ("Terminated", "Failed") and s,
                          15, message="the evicted Pod's sandbox to end")
        assert st["state"] == "Failed" and "Evicted" in st.get("message", ""), st
        # The evicted Pod, which the cluster keeps, is removed with its sandbox's end.
        W.wait_until(lambda: _pod(cluster, evicted.id) is None, 15, message="the evicted Pod to be removed")
    finally:
        for s in (gone, evicted):
            _kill(s)


def test_a_watch_that_lost_its_history_lists_again(k8s, cluster):
    sbx = _create(k8s)
    try:
        # The Pod is evicted while Warren's watch is down, and the history it would resume from
        # is compacted away: only a new list (after the 410) shows the eviction.
        cluster.compact_while(lambda: cluster.evict(NS, f"warren-{sbx.id}"))
        st = W.wait_until(lambda: (s := _state(k8s, sbx.id)) and s["state"] == "Failed" and s, 20,
                          message="the eviction to be seen after the relist")
        assert "Evicted" in st.get("message", ""), st
    finally:
        _kill(sbx)


def test_bookmarks_keep_a_quiet_watch_current_through_a_compaction(k8s, cluster):
    """At 100,000 Pods a relist is the costliest call Warren makes. Its watch selects only its own
    Pods, which may be quiet while the rest of the namespace is busy; the API server's bookmarks
    move the watch's version on, so that a compaction does not leave it too old to resume."""
    sbx = _create(k8s)
    try:
        cluster.bookmark_every = 0.2
        marks = cluster.bookmarks_sent
        with httpx.Client(base_url=cluster.url) as c:
            for i in range(5):  # another app's objects change; Warren's Pods do not
                other = {"apiVersion": "v1", "kind": "Secret",
                         "metadata": {"name": f"other-app-{uuid.uuid4().hex[:8]}-{i}"}, "data": {}}
                assert c.post(f"/api/v1/namespaces/{NS}/secrets", json=other).status_code == 201
        W.wait_until(lambda: cluster.bookmarks_sent > marks, 10, message="a bookmark for Warren's watch")
        time.sleep(0.5)  # for Warren to take the bookmark in
        lists = cluster.requests.get("LIST pods", 0)
        cluster.compact_while(lambda: None)
        # The watch resumed where the bookmark left it: it still follows the Pods, with no new list.
        cluster.evict(NS, f"warren-{sbx.id}")
        W.wait_until(lambda: (s := _state(k8s, sbx.id)) and s["state"] == "Failed", 20,
                     message="the eviction to be seen by the resumed watch")
        assert cluster.requests.get("LIST pods", 0) == lists, "the watch listed again"
    finally:
        cluster.bookmark_every = None
        _kill(sbx)


def _kill(sbx) -> None:
    """Deletes a sandbox that may have ended already."""
    try:
        sbx.kill()
    except Exception:  # noqa: BLE001 - an ended sandbox is not found
        pass
    sbx.close()


def test_a_restarted_server_finds_its_pods_and_removes_pods_it_has_no_record_of(work_root, cluster):
    from opensandbox import SandboxSync
    srv = _server(work_root, cluster)
    try:
        kept = _create(srv)
        kept.files.write_file("/tmp/k8s-before-restart.txt", "before")
        lost = _create(srv)
        kept.close()
        lost.close()
        srv.kill9()
        # Meanwhile: one Pod deleted, and a stray Pod of this instance that no record names.
        cluster.remove_pod(NS, f"warren-{lost.id}")
        stray = json.loads(json.dumps(_pod(cluster, kept.id)))
        stray["metadata"] = {"name": "warren-stray-" + uuid.uuid4().hex[:8],
                             "labels": {**stray["metadata"]["labels"], "io.warren.sandbox": "stray"}}
        stray.pop("status", None)
        # and a pull Secret of a create cut off before its Pod
        stray_secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
                        "metadata": {"name": "warren-cut-off-pull",
                                     "labels": {"io.warren.owner": srv.name, "io.warren.sandbox": "cut-off"}},
                        "data": {".dockerconfigjson": "e30="}}
        with httpx.Client(base_url=cluster.url) as c:
            assert c.post(f"/api/v1/namespaces/{NS}/pods", json=stray).status_code == 201
            assert c.post(f"/api/v1/namespaces/{NS}/secrets", json=stray_secret).status_code == 201
        # Lists come in pages of one Pod: Warren must read them all to know what is there.
        cluster.max_page = 1
        srv.start()
        again = SandboxSync.connect(kept.id, connection_config=srv.sdk_config())
        try:
            code, out, _ = W.sh(again, "cat /tmp/k8s-before-restart.txt")
            assert (code, out.strip()) == (0, "before"), out
        finally:
            again.kill()
            again.close()
        st = W.wait_until(lambda: (s := _state(srv, lost.id)) is None or s["state"] in ("Terminated", "Failed"),
                          15, message="the lost Pod's sandbox to be marked")
        W.wait_until(lambda: cluster.get("pods", NS, stray["metadata"]["name"]) is None, 15,
                     message="the stray Pod to be removed")
        W.wait_until(lambda: cluster.get("secrets", NS, "warren-cut-off-pull") is None, 15,
                     message="the stray pull Secret to be removed")
        assert st is not None
        assert cluster.requests.get("LIST pods", 0) > 2
    finally:
        cluster.max_page = 0
        srv.stop()


# --- Replicas: one service, the records on the Pods ([kubernetes] shared_key_file) ---------------

def _replica(work_root, cluster, service):
    """A replica of `service` (same instance label, key, API key and config as its others)."""
    return _server(work_root, cluster, instance=service["instance"], shared_key=service["key_file"],
                   api_key=service["api_key"], **service.get("config", {}))


@pytest.fixture
def service(work_root):
    key_file = work_root / f"shared-key-{uuid.uuid4().hex[:6]}"
    key_file.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    key_file.chmod(0o600)
    return {"instance": f"svc-{uuid.uuid4().hex[:6]}", "key_file": key_file,
            "api_key": "wk-" + uuid.uuid4().hex}


def _shared_credential(service, sid):
    """execd's credential for a replicated sandbox: of its secret, derived from the shared key."""
    key = service["key_file"].read_bytes().strip()
    secret = hmac.new(key, b"warren-sandbox-secret-v1:" + sid.encode(), hashlib.sha256).hexdigest()
    return secret, hmac.new(secret.encode(), b"warren-execd-v1", hashlib.sha256).hexdigest()


def _get(srv, sid):
    with srv.client() as c:
        r = c.get(f"/v1/sandboxes/{sid}")
    return r.json() if r.status_code == 200 else r.status_code


def test_replicas_serve_one_set_of_sandboxes_from_the_records_on_their_pods(work_root, cluster, service):
    from opensandbox import SandboxSync
    a = _replica(work_root, cluster, service)
    b = _replica(work_root, cluster, service)
    try:
        before = dict(cluster.requests)
        sbx = _create(a, metadata={"team": "e2e"})
        asked = {k: v - before.get(k, 0) for k, v in cluster.requests.items() if v != before.get(k, 0)}
        # The record goes with the Pod: still one write per create.
        assert asked.get("POST pods") == 1 and not any(k.startswith("PATCH") for k in asked), asked
        pod = _pod(cluster, sbx.id)
        record = json.loads(pod["metadata"]["annotations"]["io.warren.record"])
        assert record["id"] == sbx.id and record["metadata"] == {"team": "e2e"}, record
        # No secret is stored: not the sandbox's, not execd's credential, not the key.
        secret, credential = _shared_credential(service, sbx.id)
        dumped = json.dumps(pod)
        assert "token" not in record and secret not in dumped and credential not in dumped
        assert service["key_file"].read_text().strip() not in dumped
        assert not (a.data_dir / "state" / "sandboxes.jsonl").exists() or \
            sbx.id not in (a.data_dir / "state" / "sandboxes.jsonl").read_text()
        assert httpx.get(f"http://{cluster.pod_ip(NS, pod['metadata']['name'])}:44772/ping",
                         headers={"X-EXECD-ACCESS-TOKEN": credential}, timeout=10).status_code == 200

        # The other replica knows it, reaches its execd, opens its endpoints.
        W.wait_until(lambda: isinstance(_get(b, sbx.id), dict), 10, message="replica b to see the sandbox")
        assert _get(b, sbx.id)["metadata"] == {"team": "e2e"}
        via_b = SandboxSync.connect(sbx.id, connection_config=b.sdk_config())
        code, out, _ = W.sh(via_b, "hostname")
        assert code == 0, out
        W.files_logs_and_proxy_work(via_b, "replica b", APP_PORT)
        with a.client() as c:
            token_a = c.get(f"/v1/sandboxes/{sbx.id}/endpoints/{APP_PORT}").json()
        with b.client() as c:
            assert c.get(f"/v1/sandboxes/{sbx.id}/endpoints/{APP_PORT}").json()["headers"] == token_a["headers"]
            listed = c.get("/v1/sandboxes", params={"metadata": "team=e2e"}).json()["items"]
        assert [s["id"] for s in listed] == [sbx.id], listed

        # A renew through b is a's too, and a metadata patch through a is b's; each one write.
        at = (datetime.now(timezone.utc) + timedelta(hours=2)).replace(microsecond=0)
        before = dict(cluster.requests)
        with b.client() as c:
            r = c.post(f"/v1/sandboxes/{sbx.id}/renew-expiration", json={"expiresAt": at.isoformat()})
            assert r.status_code == 200, r.text
        assert cluster.requests.get("PATCH pods", 0) - before.get("PATCH pods", 0) == 1
        W.wait_until(lambda: _get(a, sbx.id)["expiresAt"].startswith(at.strftime("%Y-%m-%dT%H:%M:%S")), 10,
                     message="replica a to take the renewal")
        with a.client() as c:
            r = c.patch(f"/v1/sandboxes/{sbx.id}/metadata", json={"stage": "two"})
            assert r.status_code == 200, r.text
        W.wait_until(lambda: _get(b, sbx.id)["metadata"] == {"team": "e2e", "stage": "two"}, 10,
                     message="replica b to take the metadata")

        # A delete through b: gone from a as well, at once rather than kept as ended.
        via_b.kill()
        via_b.close()
        W.wait_until(lambda: _get(a, sbx.id) == 404, 10, message="replica a to forget the deleted sandbox")
        assert _pod(cluster, sbx.id) is None
        with a.client() as c:
            assert c.get("/v1/sandboxes", params={"metadata": "team=e2e"}).json()["items"] == []

        # Pools are not offered across replicas yet, and say so.
        with a.client() as c:
            r = c.post("/v1/pools", json={"name": "p", "template": W.create_body(IMAGE),
                                          "capacitySpec": {"bufferMin": 1, "bufferMax": 1, "poolMin": 0, "poolMax": 2}})
        W.assert_error_body(r, codes=[501])
        assert "replicas" in r.json()["message"], r.text
    finally:
        # Each replica's stop would delete every sandbox of the service: only the last one does.
        a.terminate()
        b.stop()
    assert cluster.rejected == [], cluster.rejected


def test_replicas_share_their_tenants_keys_and_a_revocation_reaches_every_one(work_root, cluster, service):
    """The key store of replicas is one Secret of the instance (compare-and-swap writes, read by
    every replica each second): a key made through one replica works on the others, its tenant's
    sandboxes are its own on all of them, and a key revoked through one stops on all."""
    a = _replica(work_root, cluster, service)
    b = _replica(work_root, cluster, service)
    sid = None
    try:
        def admin(srv, method, path, **kw):
            with srv.client() as c:
                return c.request(method, f"/v1{path}", **kw)

        def as_key(srv, key, method, path, **kw):
            with srv.client(api_key=key) as c:
                return c.request(method, f"/v1{path}", **kw)

        r = admin(a, "POST", "/admin/keys", json={"tenant": "acme", "role": "full"})
        assert r.status_code == 201, r.text
        acme, acme_id = r.json()["key"], r.json()["id"]
        r = admin(b, "POST", "/admin/keys", json={"tenant": "globex", "role": "full"})
        assert r.status_code == 201, r.text
        globex = r.json()["key"]
        # Both keys are in the instance's Secret, as digests: never a key's text.
        secret = cluster.get("secrets", NS, f"warren-{service['instance']}-keys")
        stored = base64.b64decode(secret["data"]["document"]).decode()
        assert acme_id in stored and acme.rsplit("_", 1)[1] not in stored and globex.rsplit("_", 1)[1] not in stored
        # Made on a, works on b (and the other way round) within a second or so.
        for srv, key in ((b, acme), (a, globex)):
            W.wait_until(lambda: as_key(srv, key, "GET", "/sandboxes").status_code == 200, 10,
                         message="the key to reach the other replica")
        # A sandbox of acme's, made through b: acme's on a too, missing for globex on either.
        r = as_key(b, acme, "POST", "/sandboxes", json=W.create_body(IMAGE))
        assert r.status_code == 202, r.text
        sid = r.json()["id"]
        W.track_sandbox(sid)
        W.wait_until(lambda: as_key(a, acme, "GET", f"/sandboxes/{sid}").status_code == 200, 10,
                     message="replica a to see acme's sandbox")
        for srv in (a, b):
            W.assert_error_body(as_key(srv, globex, "GET", f"/sandboxes/{sid}"), codes=[404])
            assert [x["id"] for x in as_key(srv, acme, "GET", "/sandboxes").json()["items"]] == [sid]
        # Revoked through b: refused on a too.
        assert admin(b, "DELETE", f"/admin/keys/{acme_id}").status_code in (200, 204)
        W.wait_until(lambda: as_key(a, acme, "GET", "/sandboxes").status_code == 401, 10,
                     message="the revocation to reach replica a")
        assert as_key(b, acme, "GET", "/sandboxes").status_code == 401
        assert as_key(a, globex, "GET", "/sandboxes").status_code == 200
        # `warren key` would edit a file a replica does not read: it refuses, and says where.
        out = subprocess.run([str(a.bin), "key", "ls", "--data-dir", str(a.data_dir)],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode != 0 and "admin API" in out.stderr, out
        # A URL one replica signed opens on the other (the signing key derives from the shared one).
        with a.client() as c:
            r = c.get(f"/v1/sandboxes/{sid}/endpoints/{APP_PORT}", params={"expires": str(int(time.time()) + 60)})
        assert r.status_code == 200, r.text
        token = r.json()["endpoint"].split("/signed/", 1)[1]
        r = httpx.get(f"{b.base_url}/signed/{token}/", timeout=30)
        assert r.status_code not in (401, 404), (r.status_code, r.text)
    finally:
        if sid:
            admin(a, "DELETE", f"/sandboxes/{sid}")
        a.terminate()
        b.stop()
    assert cluster.rejected == [], cluster.rejected


def test_replicas_expire_end_and_adopt_sandboxes_whoever_made_them(work_root, cluster, service):
    from opensandbox import SandboxSync
    a = _replica(work_root, cluster, service)
    b = _replica(work_root, cluster, service)
    c_ = None
    try:
        def create(srv):
            with srv.client() as c:
                r = c.post("/v1/sandboxes", json=W.create_body(IMAGE, timeout=600))
            assert r.status_code in (200, 202), r.text
            sid = r.json()["id"]
            W.track_sandbox(sid)
            W.wait_until(lambda: _get(srv, sid)["status"]["state"] == "Running", 60, message="running")
            W.wait_until(lambda: isinstance(_get(b, sid), dict) and isinstance(_get(a, sid), dict), 10,
                         message="both replicas to know it")
            return sid

        def renew(srv, sid, seconds):
            at = (datetime.now(timezone.utc) + timedelta(seconds=seconds)).isoformat()
            with srv.client() as c:
                r = c.post(f"/v1/sandboxes/{sid}/renew-expiration", json={"expiresAt": at})
            assert r.status_code == 200, r.text

        short, renewed = create(a), create(a)
        renew(b, short, 3)       # through b: expires within seconds, whichever replica sees it first
        renew(a, renewed, 4)     # then renewed through b for longer: a must not expire it
        renew(b, renewed, 600)
        W.wait_until(lambda: _pod(cluster, short) is None, 20, message="the expired sandbox's Pod to go")
        for srv in (a, b):
            st = W.wait_until(lambda: (g := _get(srv, short)) == 404 or g["status"]["state"] == "Terminated" and g,
                              10, message="the expiry to show")
            assert st == 404 or st["status"]["reason"] == "ttl_expiry", st
        time.sleep(3)
        assert _get(a, renewed)["status"]["state"] == "Running", _get(a, renewed)

        # A Pod removed behind Warren's back ends on every replica, with the same reason.
        cluster.remove_pod(NS, f"warren-{renewed}")
        for srv in (a, b):
            st = W.wait_until(lambda: (g := _get(srv, renewed)) and g["status"]["state"] == "Terminated" and g,
                              15, message="the removed Pod's sandbox to end")
            assert "removed outside Warren" in st["status"].get("message", ""), st

        # A replica that comes later, with an empty data dir, serves what the others made.
        kept = create(b)
        b.kill9()
        c_ = _replica(work_root, cluster, service)
        via_c = SandboxSync.connect(kept, connection_config=c_.sdk_config())
        code, out, _ = W.sh(via_c, "echo adopted")
        assert (code, out.strip()) == (0, "adopted"), out
        via_c.close()
        # Another replica's create whose Pod fails: Pending here while it starts, then no record.
        doomed = str(uuid.uuid4())
        pod = json.loads(json.dumps(_pod(cluster, kept)))
        record = json.loads(pod["metadata"]["annotations"]["io.warren.record"])
        record.update(id=doomed, state="Pending")
        pod["metadata"] = {"name": f"warren-{doomed}",
                           "labels": {**pod["metadata"]["labels"], "io.warren.sandbox": doomed},
                           "annotations": {"io.warren.record": json.dumps(record)}}
        pod["spec"]["initContainers"][0]["command"] = ["cp", "/nowhere", "/nothing"]
        pod.pop("status", None)
        with httpx.Client(base_url=cluster.url) as c:
            assert c.post(f"/api/v1/namespaces/{NS}/pods", json=pod).status_code == 201
        W.wait_until(lambda: (_pod(cluster, doomed) or {}).get("status", {}).get("phase") == "Failed", 15,
                     message="the doomed Pod to fail")
        W.wait_until(lambda: _get(c_, doomed) == 404, 10, message="the failed create to leave no record")
        with c_.client() as c:
            assert doomed not in {s["id"] for s in c.get("/v1/sandboxes").json()["items"]}
        cluster.remove_pod(NS, f"warren-{doomed}")
    finally:
        a.terminate()
        b.terminate()
        if c_ is not None:
            c_.stop()
    assert cluster.rejected == [], cluster.rejected


POOL_TOML = """
[[pools]]
name = "shared"
template = { image = { uri = "%s" }, entrypoint = ["tail", "-f", "/dev/null"], resourceLimits = { cpu = "1", memory = "1Gi" } }
capacitySpec = { bufferMin = 2, bufferMax = 2, poolMin = 0, poolMax = 20 }
maxWaitSeconds = 5
""" % IMAGE


def _warm_pods(cluster, pool="shared"):
    """The Pods whose record says they are warm sandboxes of `pool`."""
    out = []
    for p in cluster.list("pods", NS):
        raw = (p["metadata"].get("annotations") or {}).get("io.warren.record")
        if raw and json.loads(raw).get("warm_pool") == pool and not p["metadata"].get("deletionTimestamp"):
            out.append(p["metadata"]["name"])
    return sorted(out)


def _available(srv, pool="shared"):
    with srv.client() as c:
        return c.get(f"/v1/pools/{pool}").json()["status"]["available"]


def test_replicas_share_a_pool_one_makes_it_and_no_sandbox_is_claimed_twice(work_root, cluster, service):
    """A pool from the config, on every replica: the holder of the replicas' Lease makes the warm
    Pods, every replica claims them, each claim a compare-and-swap on the Pod's resourceVersion."""
    service["config"] = {"lease_seconds": 2, "tail": POOL_TOML}
    a = _replica(work_root, cluster, service)
    # a takes the Lease before b starts: a makes the pool's Pods, until it goes.
    W.wait_until(lambda: cluster.get("leases", NS, f"warren-{service['instance']}"), 10, message="the Lease")
    b = _replica(work_root, cluster, service)
    made, warm = [], []
    try:
        W.wait_until(lambda: len(_warm_pods(cluster)) == 2 and _available(a) == 2 and _available(b) == 2, 30,
                     message="two warm Pods, known to both replicas")
        time.sleep(2)
        assert len(_warm_pods(cluster)) == 2, "more warm Pods than the pool wants: both replicas made them"
        # Pools come from the config when sandboxes are shared; one replica's API cannot make one.
        with b.client() as c:
            r = c.post("/v1/pools", json={"name": "mine", "template": W.create_body(IMAGE),
                                          "capacitySpec": {"bufferMin": 1, "bufferMax": 1, "poolMin": 0, "poolMax": 1}})
        W.assert_error_body(r, codes=[501])

        # Claims through both replicas at once: each gets a sandbox of its own.
        def claim(srv):
            with srv.client() as c:
                r = c.post("/v1/sandboxes", json=W.create_body(IMAGE, extensions={"poolRef": "shared"}))
            assert r.status_code in (200, 202), r.text
            W.track_sandbox(r.json()["id"])
            return r.json()["id"]
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(4) as ex:
            made = list(ex.map(claim, [a, b, a, b]))
        assert len(set(made)) == 4, made
        for sid in made:
            record = json.loads(_pod(cluster, sid)["metadata"]["annotations"]["io.warren.record"])
            assert record.get("pool_ref") == "shared" and "warm_pool" not in record, record
            for srv in (a, b):
                W.wait_until(lambda: isinstance(_get(srv, sid), dict), 10, message="both replicas to list it")

        # The compare-and-swap: with the replicas' watches held back, another claims both warm
        # Pods behind them. Their lists still say warm; their claims must lose, not take them again.
        W.wait_until(lambda: len(_warm_pods(cluster)) == 2 and _available(b) == 2, 30, message="the pool refilled")
        warm = _warm_pods(cluster)
        cluster.delivering = False
        try:
            with httpx.Client(base_url=cluster.url) as c:
                for name in warm:
                    pod = c.get(f"/api/v1/namespaces/{NS}/pods/{name}").json()
                    record = json.loads(pod["metadata"]["annotations"]["io.warren.record"])
                    record.pop("warm_pool")
                    record.update(pool_ref="shared", metadata={"claimed-by": "elsewhere"})
                    r = c.patch(f"/api/v1/namespaces/{NS}/pods/{name}",
                                json={"metadata": {"annotations": {"io.warren.record": json.dumps(record)}}},
                                headers={"Content-Type": "application/merge-patch+json"})
                    assert r.status_code == 200, r.text
            with b.client() as c:
                r = c.post("/v1/sandboxes", json=W.create_body(IMAGE, extensions={"poolRef": "shared"}))
            W.assert_error_body(r, codes=[429])
            for name in warm:
                record = json.loads(cluster.get("pods", NS, name)["metadata"]["annotations"]["io.warren.record"])
                assert record["metadata"] == {"claimed-by": "elsewhere"}, f"{name} was claimed twice: {record}"
        finally:
            cluster.delivering = True
        # Told at last, the replicas refill the pool and serve from it again.
        W.wait_until(lambda: len(_warm_pods(cluster)) == 2, 30, message="the pool refilled after the claims")
        made.append(claim(b))

        # The maker goes: the other takes the Lease over and makes the pool's Pods from then on.
        a.kill9()
        made.append(claim(b))
        W.wait_until(lambda: len(_warm_pods(cluster)) == 2, 30, message="the pool refilled by the other replica")
    finally:
        for srv in (a, b):
            srv.terminate()
        for name in warm + _warm_pods(cluster) + [f"warren-{sid}" for sid in made]:
            cluster.remove_pod(NS, name)
    assert cluster.rejected == [], cluster.rejected


def test_the_deployment_s_role_grants_every_call_warren_made(cluster):
    """Last in this module: every kind of request Warren sent the test cluster in the tests above
    is one deploy/kubernetes/pods/role.yaml allows (the Role is what the runtime calls)."""
    import yaml
    role = yaml.safe_load((W.REPO_ROOT / "deploy" / "kubernetes" / "pods" / "role.yaml").read_text())
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    verbs = {"POST": "create", "GET": "get", "LIST": "list", "WATCH": "watch", "PATCH": "patch", "DELETE": "delete"}
    made = {(key.split()[1], verbs[key.split()[0]]) for key in cluster.requests}
    assert ("pods", "patch") in made and ("networkpolicies", "delete") in made, made
    assert made <= granted, f"calls the Role does not grant: {made - granted}"
