"""Warren deployed: the container image (deploy/Dockerfile, built by scripts/build-image from this
repository with nothing fetched) run on the test Docker daemon, driven by the official SDK — with
the native runtime (privileged), and unprivileged with the Kubernetes runtime against the test
cluster of tests/e2e/fakekube.py; and the Kubernetes manifests (deploy/kubernetes/native and
/pods), rendered as kustomize would and validated offline against Kubernetes' own schemas
(kubernetes-validate bundles them). No Kubernetes API server can run on this machine: the
manifests are checked, not applied."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import tomllib
import yaml

import warren_e2e as W

DEPLOY = W.REPO_ROOT / "deploy" / "kubernetes"
MODES = ["native", "pods"]
K8S_VERSION = "1.31.0"
# Kinds whose objects live in a namespace (the ones the manifests use).
NAMESPACED = {"ServiceAccount", "Service", "StatefulSet", "Secret", "Role", "RoleBinding",
              "Deployment", "ConfigMap"}


def _render(mode: str, folder: Path | None = None) -> list[dict]:
    """deploy/kubernetes as `kubectl kustomize` renders it, for the fields its kustomization uses
    (resources, namespace, labels without selectors, images); any other field fails the test, so
    this stays the renderer of exactly what is there. `folder`: a copy of a mode's manifests."""
    folder = folder or DEPLOY / mode
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "namespace", "labels", "resources", "images"}, k
    docs = []
    for name in k["resources"]:
        docs += [d for d in yaml.safe_load_all((folder / name).read_text()) if d]
    for d in docs:
        meta = d.setdefault("metadata", {})
        if d["kind"] in NAMESPACED:
            meta["namespace"] = k["namespace"]
        for group in k.get("labels", []):
            assert group.get("includeSelectors") is False
            meta.setdefault("labels", {}).update(group["pairs"])
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for img in k.get("images", []):
                if c["image"] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img['newTag']}"
    return docs


@pytest.mark.parametrize("mode", MODES)
def test_every_manifest_is_listed_and_valid_against_the_kubernetes_schema(mode):
    import kubernetes_validate
    assert sorted(p.name for p in DEPLOY.iterdir()) == MODES
    listed = set(yaml.safe_load((DEPLOY / mode / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in (DEPLOY / mode).glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, f"manifests not in the kustomization, or listed but missing: {listed ^ on_disk}"
    docs = _render(mode)
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    # The validator is strict: a misspelt field or a wrong type is refused.
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    bad = copy.deepcopy(sts)
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(sts)
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("mode", MODES)
def test_the_manifests_fit_together(mode):
    docs = {d["kind"]: d for d in _render(mode)}
    sts, svc, sa = docs["StatefulSet"], docs["Service"], docs["ServiceAccount"]
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items(), "the Service selects no Warren pod"
    (c,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = {e["name"]: e for e in c["env"]}
    assert env["WARREN_LISTEN"]["value"].endswith(f":{ports['http']}")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, c[probe]
    # The API key comes from a Secret, never from the manifests.
    assert env["WARREN_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "warren-api-key", "key": "api-key"}
    assert "warren-api-key" in (DEPLOY / mode / "kustomization.yaml").read_text()  # how to make it is said
    mount = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mount[env["WARREN_DATA_DIR"]["value"]] == "data"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert pod["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    assert c["image"] == "warren:latest"
    if mode == "native":
        # Sandboxes run on the node: privileged; no Kubernetes API is called, so no token.
        assert c["securityContext"] == {"privileged": True}
        assert sa["automountServiceAccountToken"] is False
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert "Role" not in docs
        return
    # A Pod per sandbox: Warren unprivileged, its Role what the runtime calls, in its namespace.
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    role, binding, cm = docs["Role"], docs["RoleBinding"], docs["ConfigMap"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == sts["metadata"]["namespace"]
    assert "ClusterRole" not in docs and "ClusterRoleBinding" not in docs
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {("", "pods"): {"create", "get", "list", "watch", "patch", "delete"},
                     ("networking.k8s.io", "networkpolicies"): {"create", "get", "patch", "delete"},
                     ("", "secrets"): {"create", "get", "list", "patch", "delete"},
                     ("coordination.k8s.io", "leases"): {"create", "get", "patch"}}, rules
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"]}]
    config = tomllib.loads(cm["data"]["warren.toml"])
    assert config["runtime"]["kind"] == "kubernetes"
    assert config["kubernetes"]["execd_image"] == c["image"]
    assert c["args"] == ["serve", "--config", "/etc/warren/warren.toml"]
    assert mount["/etc/warren"] == "config"


@pytest.mark.parametrize("sidecar", [False, True], ids=["plain", "egress-sidecar"])
def test_the_real_cluster_run_applies_the_pods_manifests_in_a_namespace_of_its_own(tmp_path, sidecar):
    """scripts/test-on-cluster applies deploy/kubernetes/pods with its own namespace, images and
    config: what it would apply is valid and says so (no cluster is needed to render it)."""
    import kubernetes_validate
    out = tmp_path / "manifests"
    subprocess.run([str(W.REPO_ROOT / "scripts" / "test-on-cluster"), "--render", str(out),
                    *(["--egress-sidecar"] if sidecar else [])], check=True, capture_output=True, timeout=60)
    docs = _render("pods", out)
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    namespaces = {d["metadata"]["namespace"] for d in docs if d["kind"] in NAMESPACED}
    (ns,) = namespaces
    assert ns.startswith("warren-e2e-"), ns
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"warren:{ns.removeprefix('warren-')}", image
    config = tomllib.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["warren.toml"])
    assert config["kubernetes"]["execd_image"] == image
    assert config["kubernetes"].get("egress_sidecar", False) is sidecar
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["metadata"]["namespace"] == ns


def _docker(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def image():
    """The image, built once by scripts/build-image (removed after the module)."""
    if not any(r.startswith("docker") for r in W.oci_runtimes()):
        pytest.skip("the image is tested on the Docker runtimes' daemon (WARREN_E2E_OCI_RUNTIMES has none)")
    if not os.environ.get("DOCKER_HOST") or not shutil.which("docker"):
        pytest.fail("the container image test needs the test Docker daemon (DOCKER_HOST)", pytrace=False)
    tag = f"warren-e2e:{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, WARREN_PROFILE=os.environ.get("WARREN_PROFILE", "debug"))
    built = subprocess.run([str(W.REPO_ROOT / "scripts" / "build-image"), tag], env=env,
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    yield tag
    _docker("rmi", "-f", tag, check=False)


def _wait_healthy(base: str, name: str) -> None:
    def healthy():
        try:
            return httpx.get(f"{base}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        W.wait_until(healthy, 60, interval=0.5, message="Warren in its container to answer /health")
    except AssertionError:
        raise AssertionError(_docker("logs", "--tail", "40", name, check=False).stderr)


@pytest.fixture(scope="module")
def warren_container(image):
    tag = image
    volume = f"warren-e2e-data-{uuid.uuid4().hex[:8]}"
    key = "wk-" + uuid.uuid4().hex
    name = f"warren-e2e-{uuid.uuid4().hex[:8]}"
    port = W.free_port()
    # What `--privileged` grants, spelt out: runc cannot grant it here, since this machine's
    # capability bounding set lacks CAP_SYS_RESOURCE. The test daemon has no bridge network
    # (scripts/start-dockerd), so the container shares the host's and listens on loopback only.
    privileged = ["--cap-add", "ALL", "--cap-drop", "SYS_RESOURCE",
                  "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
                  "--security-opt", "systempaths=unconfined", "--device-cgroup-rule", "a *:* rwm",
                  "-v", "/sys/fs/cgroup:/sys/fs/cgroup", "-v", "/dev:/dev"]
    try:
        _docker("run", "-d", "--name", name, *privileged, "--network", "host",
                "-v", f"{volume}:/var/lib/warren", "-e", f"WARREN_API_KEY={key}",
                "-e", f"WARREN_LISTEN=127.0.0.1:{port}", tag)
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, name)
        yield base, key, name
    finally:
        _docker("rm", "-f", name, check=False)
        _docker("volume", "rm", "-f", volume, check=False)


def test_the_image_serves_sandboxes_to_the_official_sdk(warren_container):
    from opensandbox import SandboxSync
    from opensandbox.config import ConnectionConfigSync
    base, key, name = warren_container
    health = httpx.get(f"{base}/health", timeout=10).json()
    assert health["runtime"]["name"] == "native/embedded", health
    # The API is authenticated, with the key the container was given.
    assert httpx.get(f"{base}/v1/sandboxes", timeout=10).status_code == 401
    config = ConnectionConfigSync(domain=base.removeprefix("http://"), api_key=key,
                                  request_timeout=timedelta(seconds=60))
    sbx = SandboxSync.create("host", connection_config=config, timeout=timedelta(minutes=5),
                             ready_timeout=timedelta(seconds=60))
    try:
        code, out, _ = W.sh(sbx, "echo hello from $(hostname); id -u; ls /usr/local/bin")
        assert code == 0, out
        lines = out.split("\n")
        assert lines[0].startswith("hello from "), out
        assert "warren" in lines, out
        sbx.files.write_file("/tmp/in-container.txt", "round trip")
        assert sbx.files.read_file("/tmp/in-container.txt") == "round trip"
    finally:
        sbx.kill()
        sbx.close()
    # Deleted inside the container: nothing of it is left there.
    left = _docker("exec", name, "/bin/ls", "/var/lib/warren/sandboxes", check=False).stdout.split()
    assert sbx.id not in left, left


def test_the_egress_sidecar_runs_from_the_image_with_net_admin_alone(image):
    """What the Kubernetes runtime puts beside a sandbox with `egress_sidecar`: `warren
    egress-sidecar` from this image, with only NET_ADMIN, in a network namespace of its own (here
    `--network none`), installs its rules with the image's own nft and answers on its control
    port only once they are in."""
    name = f"warren-e2e-egress-{uuid.uuid4().hex[:8]}"
    verifier = hashlib.sha256(b"credential").hexdigest()
    try:
        _docker("run", "-d", "--name", name, "--network", "none", "--cap-drop", "ALL", "--cap-add", "NET_ADMIN",
                "--security-opt", "no-new-privileges", image, "egress-sidecar", "--listen", "127.0.0.1:44774",
                "--access-token-sha256", verifier, "--inbound-port", "44772",
                "--policy", json.dumps({"defaultAction": "deny", "egress": [{"action": "allow", "target": "pypi.org"}]}),
                "--dns-upstream", "127.0.0.1:53")

        def serving():
            logs = _docker("logs", name, check=False)
            return "rules in, serving" in logs.stdout + logs.stderr
        try:
            W.wait_until(serving, 30, interval=0.2, message="the sidecar to install its rules")
        except AssertionError:
            raise AssertionError(_docker("logs", name, check=False).stderr[-3000:])
        table = _docker("exec", name, "nft", "list", "table", "inet", "warren_egress").stdout
        # Answers leave by the exemption from execd's port only; the control port's carry the mark.
        assert "udp dport 53 redirect to" in table and "ct direction reply tcp sport 44772 accept" in table, table
        assert _docker("inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true"
    finally:
        _docker("rm", "-f", name, check=False)


def test_the_image_runs_unprivileged_with_a_pod_per_sandbox(image, work_root):
    """deploy/kubernetes/pods's shape: Warren with no capability at all, the Kubernetes runtime
    against the test cluster (on loopback), its sandbox a Pod whose execd it reaches over the Pod
    network."""
    from fakekube import FakeKube
    from opensandbox import SandboxSync
    from opensandbox.config import ConnectionConfigSync
    cluster = FakeKube(W.warren_bin().with_name("warren-execd"), subnet_prefix="10.248")
    name = f"warren-e2e-k8s-{uuid.uuid4().hex[:8]}"
    volume = f"{name}-data"
    key = "wk-" + uuid.uuid4().hex
    port = W.free_port()
    config = work_root / f"{name}.toml"
    config.write_text(
        '[runtime]\nkind = "kubernetes"\n'
        f'[kubernetes]\napi_server = "{cluster.url}"\nnamespace = "warren"\ninstance = "warren-0"\n'
        f'execd_image = "{image}"\n')
    try:
        _docker("run", "-d", "--name", name, "--network", "host", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "-v", f"{config}:/etc/warren/warren.toml:ro",
                "-v", f"{volume}:/var/lib/warren", "-e", f"WARREN_API_KEY={key}",
                "-e", f"WARREN_LISTEN=127.0.0.1:{port}", image, "serve", "--config", "/etc/warren/warren.toml")
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, name)
        assert httpx.get(f"{base}/health", timeout=10).json()["runtime"]["kind"] == "kubernetes"
        status = _docker("inspect", "--format", "{{.State.Pid}}", name).stdout.strip()
        caps = Path(f"/proc/{status}/status").read_text()
        assert "CapEff:\t0000000000000000" in caps, caps
        sdk = ConnectionConfigSync(domain=f"127.0.0.1:{port}", api_key=key, request_timeout=timedelta(seconds=60))
        sbx = SandboxSync.create("registry.invalid/agent:1", connection_config=sdk,
                                 timeout=timedelta(minutes=5), ready_timeout=timedelta(seconds=60))
        try:
            assert cluster.get("pods", "warren", f"warren-{sbx.id}")["spec"]["initContainers"][0]["image"] == image
            code, out, _ = W.sh(sbx, "echo from a pod")
            assert (code, out.strip()) == (0, "from a pod"), out
        finally:
            sbx.kill()
            sbx.close()
        W.wait_until(lambda: cluster.get("pods", "warren", f"warren-{sbx.id}") is None, 15,
                     message="the Pod to be deleted")
        assert cluster.rejected == [], cluster.rejected
    finally:
        _docker("rm", "-f", name, check=False)
        _docker("volume", "rm", "-f", volume, check=False)
        cluster.close()
