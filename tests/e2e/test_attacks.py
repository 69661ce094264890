"""Attacks on the isolation boundary, tried as an attacker would: from inside a sandbox
through execd's own files API and plain commands, and from outside with nothing but what the API
hands out (an endpoint for one port). Each test checks the host objects behind the boundary — bytes,
mode, owner — before and after, on every runtime the suite runs."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import httpx
import pytest

import warren_e2e as W

sh = W.sh
EXECD = 44772
EGRESS = 18080


def _fingerprint(path: Path) -> tuple:
    st = os.stat(path)
    if not path.is_file():
        return (st.st_mode, st.st_uid, st.st_gid)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return (st.st_mode, st.st_uid, st.st_gid, st.st_size, digest)


def _host_objects(server, sid: str) -> dict[str, Path]:
    """The host files a sandbox's PID 1 was born holding: the server's binary (the embedded
    runtime's PID 1 is a fork of it; the OCI runtimes bind the same file as execd) and, on the
    native runtimes, the per-sandbox log its stdout and stderr started on."""
    out = {"warren binary": server.bin.resolve(), "host /dev/null": Path("/dev/null")}
    log = server.data_dir / "sandboxes" / sid / "sandbox.log"
    if log.exists():
        out["sandbox log"] = log
    return out


def test_execd_files_api_cannot_reach_host_objects_through_proc(server, api, make_sandbox, any_image):
    """Every files route pointed at PID 1's magic links (execd is PID 1: on the native runtime its
    executable is the host's `warren`, its stdout the host's log) is refused, and nothing behind
    them changes."""
    sbx = make_sandbox(any_image)
    objects = _host_objects(server, sbx.id)
    before = {k: _fingerprint(p) for k, p in objects.items()}
    base = f"/sandboxes/{sbx.id}/proxy/{EXECD}"
    magic = ["/proc/1/exe", "/proc/1/fd/1", "/proc/1/fd/2", "/proc/self/exe", "/proc/1/root/proc/1/exe"]
    for p in magic + ["/proc/1/maps", "/proc/1/map_files"]:
        r = api.get(f"{base}/files/info", params={"path": p})
        assert r.status_code in (403, 404), f"info {p}: {r.status_code} {r.text[:200]}"
        r = api.get(f"{base}/files/download", params={"path": p})
        assert r.status_code in (403, 404), f"download {p}: {r.status_code} {r.text[:200]}"
    for p in magic:
        r = api.post(f"{base}/files/permissions", json={p: {"mode": 4777}})
        assert r.status_code in (403, 404), f"chmod {p}: {r.status_code} {r.text[:200]}"
        r = api.post(f"{base}/files/permissions", json={p: {"owner": "nobody", "group": "nogroup"}})
        assert r.status_code in (400, 403, 404), f"chown {p}: {r.status_code} {r.text[:200]}"
        r = api.post(f"{base}/files/replace", json={p: {"old": "ELF", "new": "FLE"}})
        # (gVisor, without openat2, refuses the write open of the read-only execd file first: 500)
        assert r.status_code in (403, 404, 500), f"replace {p}: {r.status_code} {r.text[:200]}"
        files = {"metadata": (None, f'{{"path": "{p}"}}', "application/json"),
                 "file": ("x", b"A" * (1 << 20), "application/octet-stream")}
        r = api.post(f"{base}/files/upload", files=files)
        assert r.status_code in (403, 404, 500), f"upload {p}: {r.status_code} {r.text[:200]}"
    r = api.post(f"{base}/files/upload",
                 files={"metadata": (None, '{"path": "/proc/1/cwd/../proc/1/fd/1"}', "application/json"),
                        "file": ("x", b"B" * 4096, "application/octet-stream")})
    assert r.status_code != 200, r.text[:200]
    r = api.post(f"{base}/directories", json={"/proc/1/root/../proc/1/fd/9/x": {}})
    assert r.status_code != 200, r.text[:200]
    r = api.get(f"{base}/directories/list", params={"path": "/proc/1/fd"})
    assert r.status_code in (403, 404), r.text[:200]
    # The message says why.
    r = api.get(f"{base}/files/info", params={"path": "/proc/1/exe"})
    assert "magic link" in r.json()["message"] or "own /proc" in r.json()["message"], r.text
    # Ordinary files, and other processes' /proc entries that are not links, are still served.
    r = api.get(f"{base}/files/info", params={"path": "/proc/cpuinfo"})
    assert r.status_code == 200, r.text[:200]
    for root in ("/", "/tmp/.."):
        r = api.get(f"{base}/directories/list", params={"path": root})
        assert r.status_code == 200 and any(e["path"].endswith("/tmp") for e in r.json()), (root, r.text[:300])
    assert {k: _fingerprint(p) for k, p in objects.items()} == before


def test_commands_inside_cannot_change_host_objects_through_proc(server, make_sandbox, any_image):
    """The same through plain commands as sandbox root: chmod, chown, cat, dd at /proc/1/*, and at
    the entrypoint's own stdout (a process the sandbox may trace)."""
    sbx = make_sandbox(any_image)
    objects = _host_objects(server, sbx.id)
    before = {k: _fingerprint(p) for k, p in objects.items()}
    links = ["/proc/1/exe", "/proc/1/fd/0", "/proc/1/fd/1", "/proc/1/fd/2", "/proc/1/root/proc/1/exe"]
    script = "; ".join([
        *(f"chmod 4777 {p} 2>/dev/null && echo CHMOD-OK {p}" for p in links),
        *(f"chown 65534:65534 {p} 2>/dev/null && echo CHOWN-OK {p}" for p in links),
        "head -c 4 /proc/1/exe 2>/dev/null | grep -q ELF && echo READ-OK",
        "for m in /proc/1/map_files/*; do head -c 4 $m 2>/dev/null | grep -q ELF && echo MAPFILE-OK $m; done",
        "dd if=/dev/zero of=/proc/1/fd/1 bs=64k count=16 2>/dev/null && echo DD1-OK",
        "dd if=/dev/zero of=/proc/1/fd/2 bs=64k count=16 2>/dev/null && echo DD2-OK",
        # The entrypoint (tail) is an ordinary, traceable process: its stdout is reachable. It must
        # not be a host file.
        "for c in /proc/[0-9]*/comm; do "
        "  [ \"$(cat $c 2>/dev/null)\" = tail ] || continue; p=${c%/comm}; "
        "  dd if=/dev/zero of=$p/fd/1 bs=64k count=32 2>/dev/null; "
        "  dd if=/dev/zero of=$p/fd/2 bs=64k count=32 2>/dev/null; "
        "done; true",
    ])
    code, out, err = sh(sbx, script)
    # What PID 1's stdio leads to now is the sandbox's own (its /dev/null, the pipe into execd's
    # ring), so writes there may succeed; its executable is the host's and must stay out of reach.
    for what in ("CHMOD-OK /proc/1/exe", "CHOWN-OK /proc/1/exe", "CHMOD-OK /proc/1/root/proc/1/exe",
                 "MAPFILE-OK"):
        assert what not in out, f"{what}: {out}"
    if not server.gvisor:
        # gVisor's /proc/1/exe is its own copy of execd's file, read through its gofer.
        assert "READ-OK" not in out, out
    assert {k: _fingerprint(p) for k, p in objects.items()} == before, \
        "a host object behind /proc changed"


def test_entrypoint_output_stays_in_the_sandbox_and_is_bounded(server, api, raw_sandbox, test_image):
    """An entrypoint that prints without end grows no host file: its output goes to a ring in
    execd's memory (GET /logs through execd's endpoint), which keeps the newest 1 MiB."""
    body = raw_sandbox(test_image, entrypoint=[
        "sh", "-c", "echo first-line; head -c 8000000 /dev/zero | tr '\\0' x; echo; echo last-line; "
                    "exec tail -f /dev/null"])
    sid = body["id"]
    log = server.data_dir / "sandboxes" / sid / "sandbox.log"
    ep = api.get(f"/v1/sandboxes/{sid}/endpoints/{EXECD}").json()
    url = f"http://{ep['endpoint']}/logs"
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(url, headers=ep["headers"], timeout=10)
        assert r.status_code == 200, r.text[:200]
        if b"last-line" in r.content:
            break
        assert time.monotonic() < deadline, f"the entrypoint's output never reached /logs ({len(r.content)} bytes)"
        time.sleep(0.2)
    assert len(r.content) <= 1 << 20, len(r.content)
    assert b"first-line" not in r.content, "the ring kept more than its cap"
    assert int(r.headers["x-warren-dropped-bytes"]) >= 8_000_000 - (1 << 20)
    if log.exists():
        assert log.stat().st_size < 64 * 1024, f"the host log grew to {log.stat().st_size} bytes"


# ---- tokens: each port its own, nothing one computes yields another --------------------------

def _endpoint(api, sid: str, port: int) -> dict:
    r = api.get(f"/v1/sandboxes/{sid}/endpoints/{port}")
    assert r.status_code == 200, r.text[:300]
    return r.json()


def _proxy_url(ep: dict, port: int, path: str) -> str:
    base = ep["endpoint"].rsplit("/proxy/", 1)[0]
    return f"http://{base}/proxy/{port}/{path}"


def test_a_port_token_opens_only_that_port(server, api, raw_sandbox):
    sid = raw_sandbox()["id"]
    app, execd, egress = (_endpoint(api, sid, p) for p in (8000, EXECD, EGRESS))
    tok = {p: ep["headers"]["X-Warren-Sandbox-Token"] for p, ep in ((8000, app), (EXECD, execd), (EGRESS, egress))}
    assert len(set(tok.values())) == 3, tok
    # each token opens its own port...
    assert httpx.get(_proxy_url(execd, EXECD, "ping"), headers=execd["headers"], timeout=10).status_code == 200
    assert httpx.get(_proxy_url(egress, EGRESS, "healthz"), headers=egress["headers"], timeout=10).status_code == 200
    r = httpx.get(_proxy_url(app, 8000, ""), headers=app["headers"], timeout=10)
    assert r.status_code != 401, r.text[:200]  # nothing listens on 8000: a 502, not a refusal
    # ...and no other: an application port's preview URL runs no command and changes no policy.
    for port, path in ((EXECD, "ping"), (EGRESS, "policy"), (8001, "")):
        r = httpx.get(_proxy_url(app, port, path), headers=app["headers"], timeout=10)
        W.assert_error_body(r, codes=[401])
    r = httpx.post(_proxy_url(app, EXECD, "command"), headers=app["headers"], json={"command": "id"}, timeout=10)
    assert r.status_code == 401
    r = httpx.patch(_proxy_url(app, EGRESS, "policy"), headers=app["headers"],
                    json=[{"action": "allow", "target": "*"}], timeout=10)
    assert r.status_code == 401
    for port in (8000, EGRESS):
        r = httpx.get(_proxy_url(execd, port, ""), headers=execd["headers"], timeout=10)
        assert r.status_code == 401, f"execd's token opened port {port}"
    r = httpx.get(_proxy_url(egress, EXECD, "ping"), headers=egress["headers"], timeout=10)
    assert r.status_code == 401
    # The egress surface's second header carries its own token only.
    r = httpx.get(_proxy_url(egress, EGRESS, "healthz"),
                  headers={"OPENSANDBOX-EGRESS-AUTH": tok[8000]}, timeout=10)
    assert r.status_code == 401


def test_no_token_can_be_computed_from_another(server, api, raw_sandbox):
    """The old egress token was sha256("warren-egress:" + the application ports' token)."""
    sid = raw_sandbox()["id"]
    app = _endpoint(api, sid, 8000)
    t = app["headers"]["X-Warren-Sandbox-Token"]
    guesses = [hashlib.sha256(f"warren-egress:{t}".encode()).hexdigest(),
               hashlib.sha256(t.encode()).hexdigest(), t, t.upper()]
    for g in guesses:
        for name in ("X-Warren-Sandbox-Token", "OPENSANDBOX-EGRESS-AUTH"):
            r = httpx.put(_proxy_url(app, EGRESS, "policy"), headers={name: g},
                          json={"defaultAction": "allow"}, timeout=10)
            assert r.status_code == 401, (name, g, r.status_code, r.text[:200])
            r = httpx.get(_proxy_url(app, EXECD, "ping"), headers={name: g}, timeout=10)
            assert r.status_code == 401


def test_tokens_die_with_their_sandbox_and_do_not_open_others(server, api, raw_sandbox):
    a, b = raw_sandbox()["id"], raw_sandbox()["id"]
    ep_a = _endpoint(api, a, EXECD)
    ep_b = _endpoint(api, b, EXECD)
    r = httpx.get(_proxy_url(ep_b, EXECD, "ping"), headers=ep_a["headers"], timeout=10)
    assert r.status_code == 401
    assert api.delete(f"/v1/sandboxes/{a}").status_code in (200, 204)
    r = httpx.get(_proxy_url(ep_a, EXECD, "ping"), headers=ep_a["headers"], timeout=10)
    assert r.status_code in (401, 404, 409), r.status_code
    assert httpx.get(_proxy_url(ep_b, EXECD, "ping"), headers=ep_b["headers"], timeout=10).status_code == 200


def test_the_proxy_tells_nothing_without_credentials(server, api, raw_sandbox):
    """Without a key or a token, a sandbox that exists and one that does not answer alike (401);
    with the key, a missing one is a 404."""
    sid = raw_sandbox()["id"]
    base = server.base_url
    for path in (f"/sandboxes/{sid}/proxy/{EXECD}/ping", "/sandboxes/no-such-sandbox/proxy/44772/ping",
                 f"/sandboxes/{sid}/proxy/8000/", "/sandboxes/no-such-sandbox/proxy/8000/"):
        for headers in ({}, {"X-Warren-Sandbox-Token": "0" * 64}):
            r = httpx.get(f"{base}{path}", headers=headers, timeout=10)
            W.assert_error_body(r, codes=[401])
    r = api.get("/sandboxes/no-such-sandbox/proxy/44772/ping")
    W.assert_error_body(r, codes=[404])


# ---- storage: nothing a sandbox writes lands outside its ephemeral-storage --------------------

def test_no_host_folder_takes_writes_past_the_storage_limit(server, raw_sandbox, api, test_image):
    """With `ephemeral-storage: 64Mi` the root file system stops at the limit, and nothing else
    takes the rest: not the socket folder (gone on the embedded runtime and runc), not PID 1's or the
    entrypoint's output (a ring in memory), not the host log."""
    server.require("diskBound", "ephemeral-storage bounds the root file system (refused elsewhere)")
    body = raw_sandbox(test_image, resourceLimits={"cpu": "1", "memory": "1Gi", "ephemeral-storage": "64Mi"})
    sid = body["id"]
    folder = server.data_dir / "sandboxes" / sid
    ep = api.get(f"/v1/sandboxes/{sid}/endpoints/{EXECD}").json()
    base = f"http://{ep['endpoint']}"

    def run(cmd: str) -> str:
        r = httpx.post(f"{base}/command", headers=ep["headers"], json={"command": cmd}, timeout=120)
        assert r.status_code == 200, r.text[:200]
        return r.text

    def host_bytes() -> int:
        total = 0
        for root, dirs, files in os.walk(folder):
            # the sandbox's disk (an image file) and its mount are what the limit bounds
            dirs[:] = [d for d in dirs if d not in ("disk", "rootfs", "upper", "work")]
            for f in files:
                p = Path(root) / f
                if not p.is_symlink() and f != "disk.img":
                    total += p.stat().st_blocks * 512
        return total

    before = host_bytes()
    run("dd if=/dev/zero of=/.warren/run/fill bs=1M count=100; "
        "dd if=/dev/zero of=/proc/1/fd/1 bs=1M count=50; "
        "for c in /proc/[0-9]*/comm; do [ \"$(cat $c)\" = tail ] && dd if=/dev/zero of=${c%/comm}/fd/1 bs=1M count=50; done; "
        "dd if=/dev/zero of=/fill bs=1M count=100; true")
    grown = host_bytes() - before
    assert grown < 4 << 20, f"{grown} bytes landed in the sandbox's host folder outside its disk"


def test_the_socket_folder_is_no_host_storage(server, raw_sandbox, api, test_image):
    """Where execd binds its socket inside the sandbox (gVisor, Docker), `/.warren/run` is writable:
    it is a tmpfs of its own, so a write there stops at 64 KiB instead of filling the host's disk
    (a host folder took 100 MiB before). The embedded runtime and runc have no such folder."""
    sid = raw_sandbox(test_image)["id"]
    run_dir = server.data_dir / "sandboxes" / sid / "run"
    ep = api.get(f"/v1/sandboxes/{sid}/endpoints/{EXECD}").json()
    base = f"http://{ep['endpoint']}"

    def run(cmd: str) -> str:
        r = httpx.post(f"{base}/command", headers=ep["headers"], json={"command": cmd}, timeout=120)
        assert r.status_code == 200, r.text[:200]
        lines = (l.strip().removeprefix("data:").strip() for l in r.text.splitlines())
        events = [json.loads(l) for l in lines if l]
        return "".join(e.get("text", "") for e in events if e.get("type") == "stdout")

    out = run("dd if=/dev/zero of=/.warren/run/fill bs=1M count=8 2>/dev/null; "
              "stat -c %s /.warren/run/fill 2>/dev/null || echo none")
    if not server.execd_socket_handed_over:
        assert os.path.ismount(run_dir), "the socket folder is a mount of its own"
        assert os.statvfs(run_dir).f_blocks * os.statvfs(run_dir).f_frsize <= 64 << 10
        # gVisor refuses to make a plain file there at all
        assert out.split()[-1] == "none" or int(out.split()[-1]) <= 64 << 10, out
    else:
        # `/.warren` is read-only (embedded) or a folder of the sandbox's root (runc), whose writes
        # are the root's: never the host's socket folder.
        assert not (run_dir / "fill").exists()
    # execd's socket is still there to be reached
    assert "alive" in run("rm -f /.warren/run/fill; echo alive")


# What sandbox code reads of every process it can list: the links and files of /proc/<pid>/ that
# lead to the host when the process holds anything of it.
_PROC_PROBE = r"""
import json, os, sys
skip = {os.getpid(), os.getppid(), 1}
out = {}
for pid in os.listdir('/proc'):
    if not pid.isdigit() or int(pid) in skip:
        continue
    p = f'/proc/{pid}'
    try:
        entry = {'comm': open(f'{p}/comm').read().strip()}
    except OSError:
        continue
    for link in ('exe', 'cwd', 'root'):
        try:
            entry[link] = os.readlink(f'{p}/{link}')
        except OSError as e:
            entry[link] = f'ERR {e.errno}'
    for f in ('environ', 'maps'):
        try:
            entry[f] = len(open(f'{p}/{f}', 'rb').read())
        except OSError as e:
            entry[f] = f'ERR {e.errno}'
    # (host root's ids, without user namespaces, may list a non-dumpable process's fd numbers;
    # what each leads to is the question)
    try:
        links = [os.readlink(f'{p}/fd/{n}') for n in os.listdir(f'{p}/fd')]
        entry['fd_links'] = links
    except OSError as e:
        entry['fd_links'] = f'ERR {e.errno}'
    try:
        with open(f'{p}/exe', 'rb') as f:
            entry['exe_bytes'] = len(f.read(4))
    except OSError as e:
        entry['exe_bytes'] = f'ERR {e.errno}'
    try:
        os.chmod(f'{p}/exe', 0o4755)
        entry['chmod'] = 'OK'
    except OSError as e:
        entry['chmod'] = f'ERR {e.errno}'
    out[pid] = entry
print(json.dumps(out))
"""


def _listing(sbx) -> dict:
    from opensandbox.models.filesystem import WriteEntry
    sbx.files.write_files([WriteEntry(path="/tmp/proc-probe.py", data=_PROC_PROBE, mode=644)])
    code, out, err = sh(sbx, "python3 /tmp/proc-probe.py")
    assert code == 0, err
    return json.loads(out)


def _workers_reveal_nothing(server, api, sbx_id: str, sdk_sbx, paths: list[str]) -> None:
    """Keeps a files worker alive per path in `paths` (slow downloads of a large file, as another
    identity) and checks, as sandbox root, that nothing of the host shows through theirs."""
    objects = _host_objects(server, sbx_id)
    before = {k: _fingerprint(p) for k, p in objects.items()}
    idle = _listing(sdk_sbx)
    with httpx.Client(base_url=api.base_url, headers=api.headers, timeout=60) as c:
        streams = [c.stream("GET", p) for p in paths]
        held, readers = [], []
        try:
            for s in streams:
                r = s.__enter__()
                held.append(s)
                assert r.status_code == 200, r.read()[:300]
                # The worker is serving; the reader is kept (a dropped one closes the response).
                readers.append(r.iter_raw(1024))
                next(readers[-1])
            during = _listing(sdk_sbx)
        finally:
            for s in held:
                s.__exit__(None, None, None)
    # (the probe's own shell may differ between the two listings)
    workers = {pid: e for pid, e in during.items()
               if pid not in idle and e["comm"] not in ("sh", "bash", "dash", "python3")}
    assert len(workers) >= len(paths), f"no worker showed up: {during}"
    # (gVisor's Sentry is the sandbox's kernel: the worker's environment and maps it shows are the
    # sandbox's own — the sandbox's variables, execd's in-sandbox file — not the host's)
    checked = ("exe", "cwd", "root", "exe_bytes", "chmod") + (
        () if server.gvisor else ("environ", "maps", "fd_links"))
    for pid, e in workers.items():
        if server.gvisor and not str(e["fd_links"]).startswith("ERR"):
            # what its descriptors lead to must be the sandbox's own
            foreign = [l for l in e["fd_links"]
                       if l not in ("/dev/null", "/tmp/big")
                       and not l.startswith(("socket:", "anon_inode:", "pipe:"))]
            assert not foreign, f"worker {pid}: descriptors on {foreign}"
        for what in checked:
            assert str(e[what]).startswith("ERR"), f"worker {pid} {e['comm']}: /proc/{pid}/{what} = {e[what]}"
    assert {k: _fingerprint(p) for k, p in objects.items()} == before, "a host object changed"


def _big_file(sbx, path: str) -> None:
    # sparse: more than every buffer between the worker and the client holds, on no disk
    code, _, err = sh(sbx, f"truncate -s 4G {path} && chmod 644 {path}")
    assert code == 0, err


def test_files_workers_hold_nothing_of_the_host(server, api, make_sandbox, test_image):
    """A files worker (`files_with_identity`), kept alive by a slow download,
    shows sandbox root nothing through /proc/<worker>/ — not the binary it runs (the host's
    `warren` when it was exec'd from /proc/self/exe), its environment, descriptors, maps, cwd or
    root — and cannot be made to change the binary's mode."""
    sbx = make_sandbox(test_image)
    _big_file(sbx, "/tmp/big")
    base = f"/sandboxes/{sbx.id}/proxy/{EXECD}/v1/filesystem"
    _workers_reveal_nothing(server, api, sbx.id, sbx, [
        f"{base}/0/0/files/download?path=/tmp/big",
        f"{base}/41001/41000/files/download?path=/tmp/big",
    ])


def test_files_workers_hold_nothing_of_the_host_without_user_namespaces(server, work_root, test_image):
    """The same where sandbox root is host root's ids (`user_namespaces = false`): there the old
    worker's /proc/<pid>/exe let sandbox root chmod the running host binary."""
    if not server.embedded:
        pytest.skip("the embedded runtime runs execd from the host's binary; elsewhere execd is a "
                    "read-only bind (checked with user namespaces by the test above)")
    import uuid
    from opensandbox import SandboxSync
    srv = W.WarrenServer(server.runtime, work_root, f"nouserns-{uuid.uuid4().hex[:6]}")
    srv.runtime_config = "user_namespaces = false\n"
    # A secret of a host service in /etc that no list names (a cluster's admin config, say),
    # readable by host root only: the `host` image hides it even from sandbox root with host
    # root's ids.
    secret_dir = Path(f"/etc/warren-e2e-{uuid.uuid4().hex[:6]}")
    secret_dir.mkdir(mode=0o755)
    (secret_dir / "admin.conf").write_text("token: hunter2\n")
    os.chmod(secret_dir / "admin.conf", 0o600)
    (secret_dir / "public.conf").write_text("public\n")
    os.chmod(secret_dir / "public.conf", 0o644)
    try:
        srv.start()
    except BaseException:
        import shutil
        shutil.rmtree(secret_dir)
        raise
    try:
        host_sbx = SandboxSync.create(srv.sandbox_image("host"), connection_config=srv.sdk_config())
        W.track_sandbox(host_sbx.id)
        code, out, err = sh(host_sbx, f"cat {secret_dir}/public.conf; cat {secret_dir}/admin.conf; true")
        assert "public" in out and "hunter2" not in out, (out, err)
        host_sbx.kill()
        srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
        from opensandbox import SandboxSync
        sbx = SandboxSync.create(W.TEST_IMAGE_NAME, connection_config=srv.sdk_config())
        W.track_sandbox(sbx.id)
        _big_file(sbx, "/tmp/big")
        base = f"/sandboxes/{sbx.id}/proxy/{EXECD}/v1/filesystem"
        with srv.client() as api:
            _workers_reveal_nothing(srv, api, sbx.id, sbx, [
                f"{base}/0/0/files/download?path=/tmp/big",
                f"{base}/41001/41000/files/download?path=/tmp/big",
            ])
    finally:
        import shutil
        shutil.rmtree(secret_dir, ignore_errors=True)
        srv.delete_all_sandboxes()
        srv.stop()
