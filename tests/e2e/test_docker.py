"""The Docker runtime, beyond the shared suite: how the containers are set up, a container
removed behind Warren's back, leftovers of a crash removed at start, a Docker daemon that stops
and comes back (503s meanwhile, running sandboxes keep working), and volumes staged so that the
daemon never resolves a path a sandbox can change. Runs where /health's runtime.kind is "docker"."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

import warren_e2e as W

sh = W.sh
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def docker_only(server):
    if server.kind != "docker":
        pytest.skip("Docker runtime only (runtime.kind docker)")


def inspect(sandbox_id: str) -> dict | None:
    r = subprocess.run(["docker", "inspect", f"warren-{sandbox_id}"], capture_output=True, text=True)
    return json.loads(r.stdout)[0] if r.returncode == 0 else None


def test_container_setup(server, make_sandbox):
    sbx = make_sandbox("host", resource={"cpu": "500m", "memory": "256Mi"})
    c = inspect(sbx.id)
    assert c is not None
    assert c["Config"]["Labels"]["io.warren.sandbox"] == sbx.id
    assert c["Config"]["Labels"]["io.warren.owner"] == str(server.data_dir)
    h = c["HostConfig"]
    assert h["NetworkMode"] == "none"
    assert h["CapDrop"] == ["ALL"] and "CAP_SYS_ADMIN" not in h["CapAdd"]
    assert "no-new-privileges" in h["SecurityOpt"]
    assert h["NanoCpus"] == 500_000_000 and h["Memory"] == 256 * 1024 * 1024
    assert h["MemorySwap"] == h["Memory"], "no swap beyond the memory limit"
    assert h["PidsLimit"] > 0
    assert h["Runtime"] == ("runsc" if server.gvisor else "runc")
    execd = [m for m in c["Mounts"] if m["Destination"] == "/.warren/execd"]
    assert execd and execd[0]["Type"] == "bind" and not execd[0]["RW"], \
        "execd is bind-mounted read-only, not copied"
    assert c["Path"] == "/.warren/execd", "execd is the container's first process"
    # the sandbox cannot see the host's API key or data dir, and has loopback only
    code, out, _ = sh(sbx, "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
    assert code == 0 and out.split() == ["lo"], out
    assert sh(sbx, f"test -e {server.data_dir}")[0] != 0


def test_container_removed_behind_warrens_back_is_terminated(server, make_sandbox):
    sbx = make_sandbox("host")
    res = subprocess.run(["docker", "rm", "-f", f"warren-{sbx.id}"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    with server.client() as c:
        def ended():
            st = c.get(f"/v1/sandboxes/{sbx.id}").json()["status"]
            return st if st["state"] not in ("Running", "Pending") else None
        st = W.wait_until(ended, 20, message="the sandbox to notice its container is gone")
    assert st["state"] == "Terminated", st
    assert "outside Warren" in (st.get("message") or ""), st
    assert not (server.data_dir / "sandboxes" / sbx.id).exists(), "its host folder is cleaned up"


def test_leftover_containers_are_removed_at_start(fresh_server):
    """A crash between `docker create` and the record: the next start removes what it has no record of."""
    srv = fresh_server
    srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
    name = f"warren-orphan-{uuid.uuid4().hex[:8]}"
    res = subprocess.run(["docker", "create", "--name", name, "--label", f"io.warren.owner={srv.data_dir}",
                          "--label", "io.warren.sandbox=orphan", W.TEST_IMAGE_NAME, "true"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    other = f"not-warrens-{uuid.uuid4().hex[:8]}"
    subprocess.run(["docker", "create", "--name", other, W.TEST_IMAGE_NAME, "true"], check=True,
                   capture_output=True)
    try:
        srv.stop()
        srv.start()
        assert subprocess.run(["docker", "inspect", name], capture_output=True).returncode != 0
        assert subprocess.run(["docker", "inspect", other], capture_output=True).returncode == 0, \
            "containers that are not this server's are left alone"
    finally:
        subprocess.run(["docker", "rm", "-f", name, other], capture_output=True)


def _dockerd_pid() -> int:
    return int(Path(os.environ["WARREN_E2E_OWN_DOCKERD"]).read_text().strip())


@pytest.mark.timeout(240)
def test_daemon_stopped_gives_503_and_recovers(server, make_sandbox, api):
    if not os.environ.get("WARREN_E2E_OWN_DOCKERD"):
        pytest.skip("needs the test daemon of scripts/start-dockerd (WARREN_E2E_OWN_DOCKERD)")
    sbx = make_sandbox("host")
    pid = _dockerd_pid()
    os.kill(pid, signal.SIGTERM)
    try:
        W.wait_until(lambda: W.proc_state(pid) in (None, "Z"), 60, message="dockerd to stop")
        r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host")))
        W.assert_error_body(r, codes=[503])
        assert r.json()["code"] == "RUNTIME::UNAVAILABLE"
        assert "Docker daemon" in r.json()["message"] and "cannot be reached" in r.json()["message"]
        # the running sandbox keeps working: execd is reached without the daemon (live-restore)
        code, out, _ = sh(sbx, "echo still-here")
        assert code == 0 and out == "still-here\n"
        d = api.delete(f"/v1/sandboxes/{sbx.id}")
        W.assert_error_body(d, codes=[503])
        assert api.get(f"/v1/sandboxes/{sbx.id}").json()["status"]["state"] == "Running", \
            "a delete that could not reach the daemon changes nothing"
    finally:
        subprocess.run([str(REPO / "scripts" / "start-dockerd")], check=True, capture_output=True)
    # back: creates work again, and the old sandbox is still there and deletable
    again = make_sandbox("host")
    assert sh(again, "echo back")[1] == "back\n"
    assert sh(sbx, "echo survived")[1] == "survived\n"
    assert api.delete(f"/v1/sandboxes/{sbx.id}").status_code == 204
    time.sleep(0.2)
    assert inspect(sbx.id) is None


# --- volumes are staged: the daemon never gets a path a sandbox can change ----------------------------

def _staged(server, sandbox_id: str) -> list[str]:
    """Mount points of the sandbox's staged volumes in this mount namespace (the daemon's)."""
    prefix = f"{server.data_dir}/binds/{sandbox_id}/"
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(prefix)]


def _bind_source(sandbox_id: str, target: str) -> str:
    c = inspect(sandbox_id)
    assert c is not None
    return next(m["Source"] for m in c["Mounts"] if m["Destination"] == target)


def _docker_sees(image: str, source: str) -> str:
    """What a container started now with `source` bound sees there: the daemon resolves the
    path again, following links, as it did when the sandbox started."""
    r = subprocess.run(["docker", "run", "--rm", "--network", "none",
                        "--mount", f"type=bind,source={source},target=/x,readonly",
                        "--entrypoint", "/bin/sh", image, "-c", "cat /x/* 2>&1; true"],
                       capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


@pytest.mark.parametrize("kind", ["pvc", "host"])
def test_a_volume_swapped_for_a_link_after_the_check_is_not_what_docker_mounts(
        server, api, make_sandbox, tmp_path, kind):
    """The attack: sandbox A has a volume mounted writable; sandbox B mounts a folder of it (a
    `subPath`). Warren checks the folder, then the daemon resolves the path it was given when B
    starts: A swapping the folder for a link to a host folder in between handed B that host folder
    (`/`, read-write, as root). Made deterministic: A swaps the folder right after B's create, and
    a container started then with B's bind source shows what B's start would have resolved — the
    folder Warren opened (its marker), never the host folder. A link there from the start is
    refused, and deleting B leaves no staged mount or folder."""
    if kind == "host":
        root = server.host_volumes / f"swap-{uuid.uuid4().hex[:8]}"
        root.mkdir(parents=True)
        whole = {"name": "v", "host": {"path": str(root)}, "mountPath": "/v"}
        part = lambda sub: {"name": "v", "host": {"path": str(root)}, "subPath": sub, "mountPath": "/data"}  # noqa: E731
    else:
        claim = f"e2e-swap-{uuid.uuid4().hex[:8]}"
        whole = {"name": "v", "pvc": {"claimName": claim}, "mountPath": "/v"}
        part = lambda sub: {"name": "v", "pvc": {"claimName": claim}, "subPath": sub, "mountPath": "/data"}  # noqa: E731
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "secret.txt").write_text("host secret\n")
    image = server.sandbox_image("host")
    try:
        from opensandbox.models.sandboxes import PVC, Host, Volume
        vol = (Volume(name="v", host=Host(path=str(root)), mount_path="/v") if kind == "host"
               else Volume(name="v", pvc=PVC(claim_name=claim), mount_path="/v"))
        a = make_sandbox("host", volumes=[vol])
        code, out, err = sh(a, f"mkdir /v/sub && echo opened > /v/sub/marker && ln -s {decoy} /v/link && echo ok")
        assert code == 0, (out, err)

        # A link from the start: refused, nothing made, nothing staged.
        binds = server.data_dir / "binds"
        listed = lambda: ({i["id"] for i in api.get("/v1/sandboxes").json()["items"]},  # noqa: E731
                          {p.name for p in binds.iterdir()} if binds.exists() else set())
        before = listed()
        assert (a.id in before[1]) == (kind == "host"), "a host volume is staged too"
        r = api.post("/v1/sandboxes", json=W.create_body(image, volumes=[part("link")]))
        W.assert_error_body(r, codes=[400, 403])
        assert listed() == before

        r = api.post("/v1/sandboxes", json=W.create_body(image, volumes=[part("sub")]))
        assert r.status_code == 202, r.text
        b = r.json()["id"]
        W.track_sandbox(b)
        source = _bind_source(b, "/data")
        assert source.startswith(f"{server.data_dir}/binds/{b}/"), source
        assert _staged(server, b) == [source]
        st = os.stat(server.data_dir / "binds" / b)
        assert st.st_uid == 0 and st.st_mode & 0o077 == 0, "only root enters the staging folders"

        # A swaps the folder for the link, right after Warren's check.
        code, out, err = sh(a, "mv /v/sub /v/sub.real && mv /v/link /v/sub && echo swapped")
        assert code == 0, (out, err)
        seen = _docker_sees(image, source)
        assert "opened" in seen and "host secret" not in seen, seen
        # ... and B has the folder Warren opened
        body = api.post(f"/sandboxes/{b}/proxy/44772/command",
                        json={"command": "cat /data/*"}, timeout=30).text
        assert "opened" in body and "host secret" not in body, body[:500]

        assert api.delete(f"/v1/sandboxes/{b}").status_code == 204
        W.wait_until(lambda: inspect(b) is None, 20, message="the container to go")
        assert _staged(server, b) == [], "a staged mount is left"
        assert not (server.data_dir / "binds" / b).exists(), "a staging folder is left"
        assert sorted(p.name for p in decoy.iterdir()) == ["secret.txt"]
        a.kill()
        W.wait_until(lambda: inspect(a.id) is None, 20, message="the container to go")
        assert _staged(server, a.id) == [] and not (binds / a.id).exists()
    finally:
        if kind == "pvc":
            subprocess.run(["docker", "volume", "rm", "-f", claim], capture_output=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


def test_staged_volumes_of_sandboxes_gone_are_removed_at_start(fresh_server):
    """A crash leaves staged mounts of sandboxes the next start has no record of: it removes them."""
    srv = fresh_server
    leftover = srv.data_dir / "binds" / "crashed-sandbox" / "0"
    leftover.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "e2e-staged", str(leftover)], check=True)
    try:
        srv.stop()
        srv.start()
        W.wait_until(lambda: not leftover.parent.exists(), 20, message="the leftover to be removed")
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        assert str(leftover) not in mounts
    finally:
        subprocess.run(["umount", "-l", str(leftover)], capture_output=True)


# --- pulls from a registry with image.auth ------------------------------------------------------------

@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """Debian's docker-registry on loopback with basic auth, holding the test image as
    127.0.0.1:PORT/e2e/bookworm:v1 (and not on the daemon any more, so a create must pull it)."""
    if not shutil.which("docker-registry") or not shutil.which("htpasswd"):
        if W.allow_skip():
            pytest.skip("docker-registry / htpasswd not installed")
        pytest.fail("docker-registry and htpasswd (apache2-utils) are needed; scripts/install-deps installs them")
    d = tmp_path_factory.mktemp("registry")
    port = W.free_port()
    user, password = "e2e", uuid.uuid4().hex
    htpasswd = subprocess.run(["htpasswd", "-Bbn", user, password], capture_output=True, text=True, check=True)
    (d / "htpasswd").write_text(htpasswd.stdout)
    (d / "config.yml").write_text(
        "version: 0.1\n"
        f"storage:\n  filesystem:\n    rootdirectory: {d / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
        f"auth:\n  htpasswd:\n    realm: e2e\n    path: {d / 'htpasswd'}\n")
    log = open(d / "registry.log", "wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(d / "config.yml")], stdout=log, stderr=log,
                            start_new_session=True)
    try:
        import httpx
        W.wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/v2/").status_code == 401, 20,
                     message="the registry to answer")
        ref = f"127.0.0.1:{port}/e2e/bookworm:v1"
        env = dict(os.environ, DOCKER_CONFIG=str(d / "docker-config"))  # keep the login out of ~/.docker
        W.docker_import(W.TEST_IMAGE_NAME, W.test_rootfs())
        for cmd in (["docker", "login", "-u", user, "--password-stdin", f"127.0.0.1:{port}"],
                    ["docker", "tag", W.TEST_IMAGE_NAME, ref], ["docker", "push", ref], ["docker", "rmi", ref]):
            r = subprocess.run(cmd, input=password, capture_output=True, text=True, env=env)
            assert r.returncode == 0, f"{cmd}: {r.stderr}"
        yield {"ref": ref, "user": user, "password": password, "log": d / "registry.log"}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def serve_pulling(server, work_root, more_config: str):
    """A server of the same runtime that may pull (the shared one never does)."""
    srv = W.WarrenServer(server.runtime, work_root, f"{server.runtime}-pull-{uuid.uuid4().hex[:6]}")
    srv.docker_pull = True
    srv.more_config = more_config
    srv.start()
    yield srv
    srv.delete_all_sandboxes()
    srv.stop()


@pytest.fixture
def pulling_server(server, work_root, registry):
    """It pulls from the test registry, on loopback: a private address, which the daemon is sent to
    only for a registry configured under [registries]."""
    yield from serve_pulling(server, work_root, f'[registries."{registry["ref"].split("/")[0]}"]\n')


@pytest.fixture
def unconfigured_pulling_server(server, work_root):
    yield from serve_pulling(server, work_root, "")


def test_the_daemon_is_not_sent_to_a_private_registry_nobody_configured(unconfigured_pulling_server, registry):
    """A create naming HOST:PORT/repo makes the daemon connect there: an unconfigured registry must be
    public, and the answer is the same for an open port (the registry) and a closed one."""
    srv = unconfigured_pulling_server
    open_host = registry["ref"].split("/")[0]
    closed_host = f"127.0.0.1:{W.free_port()}"
    answers = []
    seen_before = registry["log"].stat().st_size
    with srv.client() as c:
        for ref in (registry["ref"], f"{closed_host}/e2e/bookworm:v1", "169.254.169.254/latest/meta:v1"):
            r = c.post("/v1/sandboxes", json=W.create_body(ref))
            W.assert_error_body(r, codes=[404])
            assert r.json()["code"] == "SANDBOX::IMAGE_NOT_FOUND", r.text
            assert "not public" in r.json()["message"], r.text
            answers.append(r.json()["message"])
        assert answers[0].replace(open_host, "R") == answers[1].replace(closed_host, "R")
        assert c.get("/v1/sandboxes").json()["items"] == [], "nothing half-made"
    # the registry was never asked
    log = registry["log"].read_bytes()[seen_before:].decode(errors="replace")
    assert "/v2/" not in log, log[-2000:]


def test_create_pulls_with_image_auth(pulling_server, registry):
    srv = pulling_server
    with srv.client() as c:
        body = W.create_body(registry["ref"])
        r = c.post("/v1/sandboxes", json=body)
        W.assert_error_body(r, codes=[404])
        assert r.json()["code"] == "SANDBOX::IMAGE_NOT_FOUND"
        assert registry["ref"] in r.json()["message"]
        body["image"]["auth"] = {"username": registry["user"], "password": "wrong"}
        W.assert_error_body(c.post("/v1/sandboxes", json=body), codes=[404])
        body["image"]["auth"]["password"] = registry["password"]
        r = c.post("/v1/sandboxes", json=body)
        assert r.status_code == 202, r.text
        W.track_sandbox(r.json()["id"])
        assert registry["password"] not in r.text
    from opensandbox import SandboxSync
    sbx = SandboxSync.connect(r.json()["id"], connection_config=srv.sdk_config())
    assert W.sh(sbx, "cat /etc/debian_version")[0] == 0
    sbx.kill()
