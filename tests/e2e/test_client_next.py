"""The newest official Python client, `opensandbox==1.1.2.dev20261020` (a pre-release, in a venv of its
own: scripts/install-deps), against Warren: port-scoped egress rules, the credential vault on the
lifecycle API (the path its template sandboxes take), `get_diagnostic_context`, and the structured
`lifecycle` fields. The suite's own process runs the published 1.1.1 client, so each test here runs
a script with the other venv's python and checks what it prints.

What it checks does not depend on the runtime (the server's routes and policy code): it runs once, on
the first runtime with a network link (egressPolicy: the vault and port-scoped rules are enforced
there) and Warren's image store (its scripts create on the `host` image); port enforcement itself is
tested on every runtime in test_egress.py."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

import warren_e2e as W

NEXT_PYTHON = Path(os.environ.get("WARREN_NEXT_VENV", W.REPO_ROOT / ".ci" / "cache" / "venv-next")) / "bin" / "python"

PRELUDE = """
import json, os, sys
from datetime import timedelta
from opensandbox import SandboxSync
from opensandbox.config import ConnectionConfigSync
from opensandbox.exceptions import SandboxException
config = ConnectionConfigSync(domain=os.environ["WARREN_DOMAIN"], api_key=os.environ["WARREN_API_KEY"],
                              request_timeout=timedelta(seconds=120))
out = {}
def done():
    print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def next_server(server):
    server.run_once("the newest client's calls: the server's routes, the same on every runtime",
                    egressPolicy=True, imageSource="store")
    if not NEXT_PYTHON.exists():
        pytest.fail(f"the 1.1.2 client's venv is missing ({NEXT_PYTHON}): run scripts/install-deps")
    version = subprocess.run([NEXT_PYTHON, "-c", "import importlib.metadata as m; print(m.version('opensandbox'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == "1.1.2.dev20261020", version
    return server


def run_next(srv, script: str) -> dict:
    """Runs `script` (after PRELUDE) with the 1.1.2 client; returns what it put in `out`."""
    env = dict(os.environ, WARREN_DOMAIN=srv.domain, WARREN_API_KEY=srv.api_key)
    r = subprocess.run([NEXT_PYTHON, "-c", PRELUDE + textwrap.dedent(script) + "\ndone()\n"],
                       capture_output=True, text=True, env=env, timeout=300)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    for sid in result.get("sandboxes", []):
        W.track_sandbox(sid)
    return result


def test_port_scoped_rules_through_the_newest_client(next_server):
    """The client's own models send `ports` and a target-less rule; Warren keeps both exactly, merges
    on (target, ports), and refuses a domain with ports (the client refuses it first)."""
    out = run_next(next_server, """
        from opensandbox.models.sandboxes import NetworkPolicy, NetworkRule
        sbx = SandboxSync.create("host", connection_config=config,
            network_policy=NetworkPolicy(default_action="deny", egress=[
                NetworkRule(action="allow", target="203.0.113.7", ports=[443, 8443]),
                NetworkRule(action="deny", ports=[25])]))
        out["sandboxes"] = [sbx.id]
        try:
            p = sbx.get_egress_policy()
            out["created"] = [[r.action, r.target, r.ports] for r in p.egress]
            sbx.patch_egress_rules([NetworkRule(action="deny", target="203.0.113.7", ports=[8443, 443]),
                                    NetworkRule(action="allow", target="203.0.113.7", ports=[80])])
            p = sbx.get_egress_policy()
            out["patched"] = [[r.action, r.target, r.ports] for r in p.egress]
            sbx.delete_egress_rules([""])
            out["deleted"] = [[r.action, r.target, r.ports] for r in sbx.get_egress_policy().egress]
            try:
                NetworkRule(action="allow", target="pypi.org", ports=[443])
                out["client_refused"] = False
            except Exception:
                out["client_refused"] = True
        finally:
            sbx.kill()
    """)
    assert out["created"] == [["allow", "203.0.113.7", [443, 8443]], ["deny", None, [25]]], out
    assert out["patched"] == [["deny", "203.0.113.7", [8443, 443]], ["allow", "203.0.113.7", [80]],
                              ["deny", None, [25]]], out
    assert out["deleted"] == [["deny", "203.0.113.7", [8443, 443]], ["allow", "203.0.113.7", [80]]], out
    assert out["client_refused"] is True


def test_the_vault_on_the_lifecycle_api_through_the_newest_client(next_server):
    """The client's lifecycle vault adapter (what `create_from_template` sandboxes use) against
    `/sandboxes/{id}/credential-vault`: the first create starts the credential proxy of a sandbox
    made without it (its CA enters the sandbox's trust), a second create is 409, a stale revision
    412, reads show names and revisions only, and delete keeps the network policy. A sandbox that
    reaches no network gets a 409 that says so, and nothing is started."""
    secret = "sk-next-" + os.urandom(8).hex()
    out = run_next(next_server, f"""
        from opensandbox.models.sandboxes import (NetworkPolicy, NetworkRule, Credential, CredentialBinding,
            CredentialMatch, CredentialAuth, InlineCredentialSource)
        from opensandbox.sync.adapters.factory import AdapterFactorySync
        factory = AdapterFactorySync(config)
        sbx = SandboxSync.create("host", connection_config=config,
            network_policy=NetworkPolicy(default_action="deny", egress=[NetworkRule(action="allow", target="203.0.113.7")]))
        bare = SandboxSync.create("host", connection_config=config)
        out["sandboxes"] = [sbx.id, bare.id]
        def status(call):
            try:
                call()
                return 0
            except SandboxException as e:
                return getattr(e, "status_code", None) or str(e)
        try:
            vault = factory.create_network_policy_service(sbx.id)
            out["before"] = vault.get().revision
            creds = [Credential(name="api", source=InlineCredentialSource(value="{secret}"))]
            binds = [CredentialBinding(name="b", match=CredentialMatch(hosts=["api.example.test"]),
                                       auth=CredentialAuth(type="bearer", credential="api"))]
            state = vault.create(credentials=creds, bindings=binds)
            out["created"] = [state.revision, [c.name for c in state.credentials], [b.name for b in state.bindings]]
            out["again"] = status(lambda: vault.create(credentials=creds, bindings=binds))
            out["stale"] = status(lambda: vault.patch(expected_revision=99, credentials={{"delete": ["api"]}}))
            out["listed"] = [c.name for c in vault.list_credentials()] + [b.name for b in vault.list_bindings()]
            out["one"] = vault.get_credential("api").name
            out["missing"] = status(lambda: vault.get_credential("nope"))
            state = vault.patch(expected_revision=state.revision, credentials={{"replace": [
                {{"name": "api", "source": {{"type": "inline", "value": "{secret}-2"}}}}]}})
            out["patched"] = state.revision
            out["dump"] = json.dumps(vault.get().model_dump(mode="json"))
            ex = sbx.commands.run("cat /opt/opensandbox/ca-bundle.crt | grep -c 'BEGIN CERTIFICATE'")
            out["ca_certs"] = "".join(m.text for m in ex.logs.stdout).strip()
            vault.delete()
            out["after_delete"] = vault.get().revision
            out["policy_kept"] = [r.target for r in sbx.get_egress_policy().egress]
            bare_vault = factory.create_network_policy_service(bare.id)
            out["bare"] = status(lambda: bare_vault.create(credentials=creds, bindings=binds))
            out["bare_get"] = bare_vault.get().revision
        finally:
            sbx.kill()
            bare.kill()
    """)
    assert out["before"] == 0, out
    assert out["created"] == [1, ["api"], ["b"]], out
    assert out["again"] == 409 and out["stale"] == 412 and out["missing"] == 404, out
    assert out["listed"] == ["api", "b"] and out["one"] == "api", out
    assert out["patched"] == 2, out
    assert secret not in out["dump"], "a secret in a read"
    assert int(out["ca_certs"]) >= 1, "the credential proxy's CA is in the sandbox's trust"
    assert out["after_delete"] == 0 and out["policy_kept"] == ["203.0.113.7"], out
    assert out["bare"] == 409 and out["bare_get"] == 0, out
    assert secret not in next_server.log_path.read_text(), "a secret reached the server's log"


def test_diagnostic_context_and_lifecycle_fields_through_the_newest_client(next_server, api):
    """`get_diagnostic_context` answers the client's model; `lifecycle.renewalPolicy` is renew on
    access (kept as the extension it succeeds; a disagreeing pair is refused, with nothing
    created); the client's idle policy and preStart hook are served."""
    before = {s["id"] for s in api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"]}
    out = run_next(next_server, """
        from opensandbox.models.sandboxes import SandboxLifecycle, RenewalPolicy, IdlePolicy, LifecycleHook
        sbx = SandboxSync.create("host", connection_config=config,
                                 lifecycle=SandboxLifecycle(renewal_policy=RenewalPolicy(extend_seconds=900)))
        out["sandboxes"] = [sbx.id]
        try:
            import httpx
            rec = httpx.get(f"http://{os.environ['WARREN_DOMAIN']}/v1/sandboxes/{sbx.id}",
                            headers={"OPEN-SANDBOX-API-KEY": os.environ["WARREN_API_KEY"]}).json()
            out["extensions"] = rec.get("extensions")
            ctx = sbx.get_diagnostic_context()
            out["ctx"] = [ctx.sandbox_id == sbx.id, ctx.backend_type, dict(ctx.backend_identifiers), str(ctx.state)]
        finally:
            sbx.kill()
        refused = {}
        for name, lc, ext in [
                ("idle", SandboxLifecycle(idle_policy=IdlePolicy(idle_timeout_seconds=60, on_idle="pause")), {}),
                ("hook", SandboxLifecycle(pre_start=LifecycleHook(command=["true"])), {}),
                ("disagree", SandboxLifecycle(renewal_policy=RenewalPolicy(extend_seconds=900)),
                 {"access.renew.extend.seconds": "600"})]:
            try:
                s = SandboxSync.create("host", connection_config=config, lifecycle=lc, extensions=ext)
                out["sandboxes"].append(s.id)
                s.kill()
                refused[name] = "created"
            except SandboxException as e:
                refused[name] = str(e)
        out["refused"] = refused
    """)
    same_id, backend, identifiers, state = out["ctx"]
    assert same_id and backend == "native" and identifiers == {"runtime": "native/embedded"}, out["ctx"]
    assert "Running" in state or "running" in state.lower(), state
    assert (out["extensions"] or {}).get("access.renew.extend.seconds") == "900", out["extensions"]
    refused = out["refused"]
    assert refused["idle"] == "created", "the client's idle policy is served"
    assert refused["hook"] == "created", "the client's preStart hook is served"
    assert "disagree" in refused["disagree"], refused
    after = {s["id"] for s in api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"]}
    assert after <= before, f"a refused create left {after - before}"


def test_a_sandbox_cannot_make_the_newest_client_replay_its_requests(next_server, api):
    """The 1.1.2 clients resend a request, POSTs included, when an answer is a 503 carrying
    `OpenSandbox-Wake: expired` (the gateway's "parked, never forwarded"). A sandbox's own server
    answering that through the endpoint proxy would have them resend what it already took: Warren
    drops the header from every answer it relays."""
    import httpx
    from opensandbox import SandboxSync
    from opensandbox.models.execd import RunCommandOpts
    sbx = SandboxSync.create("host", connection_config=next_server.sdk_config())
    W.track_sandbox(sbx.id)
    server = ("import http.server as h\n"
              "class H(h.BaseHTTPRequestHandler):\n"
              "    def do_POST(self):\n"
              "        self.send_response(503); self.send_header('OpenSandbox-Wake', 'expired')\n"
              "        self.send_header('Retry-After', '1'); self.send_header('Content-Length', '0'); self.end_headers()\n"
              "    do_GET = do_POST\n"
              "h.HTTPServer(('127.0.0.1', 8089), H).serve_forever()\n")
    try:
        sbx.files.write_file("/tmp/wake.py", server)
        sbx.commands.run("python3 /tmp/wake.py", opts=RunCommandOpts(background=True))
        ep = api.get(f"/v1/sandboxes/{sbx.id}/endpoints/8089").json()

        def answered():
            try:
                return httpx.post(f"http://{ep['endpoint']}/job", headers=ep["headers"], timeout=5).status_code == 503
            except httpx.HTTPError:
                return False
        W.wait_until(answered, 30, interval=0.1, message="the sandbox's server")
        r = httpx.post(f"http://{ep['endpoint']}/job", headers=ep["headers"], timeout=5)
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", r.headers
        assert "opensandbox-wake" not in {k.lower() for k in r.headers}, r.headers
    finally:
        sbx.kill()


def test_the_newest_client_replays_a_request_warren_parked_until_the_sandbox_wakes(next_server, api):
    """A paused sandbox whose idle policy does not wake on access answers the gateway's "parked,
    never forwarded" (503, `OpenSandbox-Wake: expired`, `Retry-After`); the 1.1.2 client resends
    such a request until the sandbox is resumed, then gets its answer: a file read, and a POST with
    a body it can send again (making a folder). Parked means parked: the POST took effect once.
    (The client sends a command's SSE POST outside its retries, so that one fails at once.)"""
    out = run_next(next_server, """
        import threading, time, httpx
        from opensandbox.models.sandboxes import SandboxLifecycle, IdlePolicy
        sbx = SandboxSync.create("host", connection_config=config,
                                 lifecycle=SandboxLifecycle(idle_policy=IdlePolicy(wake_on_access=False)))
        out["sandboxes"] = [sbx.id]
        base = f"http://{os.environ['WARREN_DOMAIN']}/v1/sandboxes/{sbx.id}"
        key = {"OPEN-SANDBOX-API-KEY": os.environ["WARREN_API_KEY"]}
        try:
            sbx.files.write_file("/tmp/before", "written before the pause")
            sbx.pause()
            # What the gateway answers a paused sandbox's request, as the client meets it.
            execd = sbx.get_endpoint(44772)
            r = httpx.post(f"http://{execd.endpoint}/command", headers=dict(execd.headers or {}),
                           json={"command": "true"}, timeout=10)
            out["parked"] = [r.status_code, r.headers.get("OpenSandbox-Wake"), r.headers.get("Retry-After")]
            threading.Timer(3.0, lambda: httpx.post(base + "/resume", headers=key, timeout=30)).start()
            started = time.monotonic()
            out["read"] = sbx.files.read_file("/tmp/before")
            out["waited"] = time.monotonic() - started
            sbx.pause()
            threading.Timer(2.0, lambda: httpx.post(base + "/resume", headers=key, timeout=30)).start()
            from opensandbox.models.filesystem import WriteEntry
            sbx.files.create_directories([WriteEntry(path="/tmp/made-while-parked", mode=755)])
            ex = sbx.commands.run("ls -d /tmp/made-while-parked")
            out["made"] = "".join(m.text for m in ex.logs.stdout)
        finally:
            sbx.kill()
    """)
    status, marker, retry_after = out["parked"]
    assert (status, marker) == (503, "expired") and retry_after, out["parked"]
    assert out["read"] == "written before the pause", out
    assert out["waited"] >= 2.5, "the client was answered before the sandbox was resumed"
    assert out["made"] == "/tmp/made-while-parked", out


def test_set_env_values_read_back_whole(next_server):
    """The 1.1.2 client's `commands.set_env` appends `KEY='value'` (or the double-quoted form for a
    value holding a `'`) to the env file: a value of several lines, quotes, tabs and `$` reads back
    whole in the next command (the file was read a line at a time)."""
    out = run_next(next_server, r"""
        sbx = SandboxSync.create("host", connection_config=config)
        out["sandboxes"] = [sbx.id]
        values = {"PLAIN": "one", "LINES": "first\nsecond\n  third", "QUOTED": "it's \"x\"\t$HOME\nnext"}
        try:
            for k, v in values.items():
                sbx.commands.set_env(k, v)
            got = {}
            for k in values:
                ex = sbx.commands.run(f"python3 -c 'import os,json; print(json.dumps(os.environ.get(\"{k}\")))'")
                got[k] = json.loads("".join(m.text for m in ex.logs.stdout))
            out["same"] = got == values
            out["got"] = got
        finally:
            sbx.kill()
    """)
    assert out["same"], out["got"]


def test_a_desktop_and_a_browser_through_the_newest_client(next_server):
    """The 1.1.2 client asks for a desktop and a browser with its own `extensions`; the sandbox it
    gets is Running with both up, and its endpoints reach execd's desktop routes and DevTools."""
    out = run_next(next_server, """
        import httpx
        sbx = SandboxSync.create("host", connection_config=config,
                                 extensions={"desktop": "800x600", "browser": "true"})
        out["sandboxes"] = [sbx.id]
        try:
            execd = sbx.get_endpoint(44772)
            r = httpx.get(f"http://{execd.endpoint}/desktop", headers=execd.headers or {})
            out["desktop"] = r.json()
            shot = httpx.get(f"http://{execd.endpoint}/desktop/screenshot", headers=execd.headers or {})
            out["png"] = [shot.headers["content-type"], shot.content[:8].hex()]
            cdp = sbx.get_endpoint(9222)
            version = httpx.get(f"http://{cdp.endpoint}/json/version", headers=cdp.headers or {}).json()
            out["ws"] = version["webSocketDebuggerUrl"]
            out["cdp"] = cdp.endpoint
            out["display"] = sbx.commands.run("echo $DISPLAY").logs.stdout[0].text
        finally:
            sbx.kill()
    """)
    assert out["desktop"]["width"] == 800 and out["desktop"]["height"] == 600, out
    assert out["png"] == ["image/png", "89504e470d0a1a0a"], out
    assert out["ws"].startswith(f"ws://{out['cdp']}/devtools/browser/"), out
    assert out["display"].strip() == ":0", out
