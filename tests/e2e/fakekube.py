"""A stand-in for a Kubernetes cluster, for the Kubernetes runtime's end-to-end tests: no API server
can run on this machine, so this is one — the subset Warren uses — with a test kubelet behind it.

API server (HTTP on loopback): Pods, NetworkPolicies, Secrets and Leases in namespaces; create (every object is
validated strictly against Kubernetes 1.31's schema first, as admission would, and refused 422 if
it does not fit), get, list and watch with equality label selectors and resource versions (a watch
from a version older than the oldest event kept is answered with the 410 `ERROR` event the real
server sends), delete (a graceful delete marks the Pod, the kubelet stops it, then it is removed).

Kubelet: each created Pod gets a network namespace of its own with an address on a veth link to the
host (10.249.N.2, the host side 10.249.N.1), where it "runs": the init container is checked to copy
execd where the sandbox container starts it from, and that container's command runs as a process in
the Pod's network namespace, with execd's binary from this build in place of the copied one. Native
sidecars (init containers with `restartPolicy: Always`, Warren's egress sidecar) start first, with
`warren` from this build in place of the image's, and the sandbox container starts once their
start-up probe (a TCP port) answers; a sidecar that ends is started again. Each container gets the capabilities its `securityContext`
asks for (a bounding set, with `setpriv`, and no new privileges), so a sandbox's processes lack
what the Pod spec takes away; `emptyDir` mounts of a sidecar are folders of its Pod's own. What a
container runtime adds beyond that (the image's root file system, cgroups, seccomp, its own PID
and mount namespaces) is not simulated: commands run on this host's file system. A Pod's namespace
routes only to its host end and to the networks a test names (`routes`). The Pod's status follows
the sandbox's process: Running with its IP once started, Succeeded or Failed with the exit code
when it ends.

Tests can also act as the cluster would behind Warren's back: delete a Pod, evict it, compact the
event history.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

K8S_VERSION = "1.31.0"
EXECD_IN_POD = "/.warren/bin/warren-execd"
WARREN_IN_IMAGE = "/usr/local/bin/warren"


def _bounding_set(container: dict) -> list[str]:
    """`setpriv` arguments giving a container the capabilities its securityContext keeps (all but
    the dropped ones, plus the added; `drop: [ALL]` keeps only the added) and no new privileges."""
    caps = container.get("securityContext", {}).get("capabilities", {})
    drop = [c.lower() for c in caps.get("drop", [])]
    add = [c.lower() for c in caps.get("add", [])]
    if not drop and not add:
        return []
    spec = "-all" if "all" in drop else "+all," + ",".join(f"-{c}" for c in drop)
    spec += "".join(f",+{c}" for c in add)
    return ["setpriv", "--no-new-privs", f"--bounding-set={spec}", f"--inh-caps={spec}", "--"]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}


def _merge_patch(target, patch):
    """RFC 7386: objects merge key by key, null removes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    if not isinstance(target, dict):
        target = {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = _merge_patch(target.get(k), v)
    return target


def _matches(obj: dict, selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels", {}) or {}
    for term in selector.split(","):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


class _Server(ThreadingHTTPServer):
    # Many clients at once (a scale simulation): the default backlog of 5 resets connections.
    request_queue_size = 1024


class FakeKube:
    def __init__(self, execd_path: Path | None, subnet_prefix: str = "10.249",
                 simulate_ip: str | None = None, validate: bool = True,
                 warren_path: Path | None = None, routes: list[str] | None = None):
        """`simulate_ip`: the kubelet runs nothing; every Pod is Running at once at that address
        (for scale simulations, with one listener standing in for every execd). `validate`: check
        objects against the schema (off to measure Warren rather than the validator).
        `warren_path`: the `warren` binary sidecars run. `routes`: networks (CIDR) every Pod's
        namespace routes to through its host end (nothing else is routed)."""
        import kubernetes_validate  # noqa: F401 - fail early without it
        self.execd_path = execd_path
        self.warren_path = warren_path
        self.routes = list(routes or [])
        self.simulate_ip = simulate_ip
        self.validate = validate
        self.requests: dict[str, int] = {}  # "GET pods", "WATCH pods", "POST pods", …
        self.subnet_prefix = subnet_prefix
        self.lock = threading.Condition()
        self.objects: dict[tuple[str, str, str], dict] = {}   # (resource, namespace, name)
        self.events: list[tuple[int, str, str, str, dict]] = []  # rv, type, resource, ns, object
        self.rv = 100
        self.oldest_rv = 0  # watches from before this are told 410
        self.generation = 0  # watches open at a compaction end
        self.holding = False  # new watches wait meanwhile
        self.delivering = True  # False: open watches send nothing until it is True again
        self.creates: dict[str, int] = {}   # resource -> number of creates (API writes)
        self.writes = 0
        self.rejected: list[str] = []
        self.gc_deleted: list[str] = []  # objects the "garbage collector" removed with their Pod
        self.max_page = 0  # the most items a list page holds (0: what the client asks)
        # The kubelet runs no image; an image's WORKDIR, where its container starts, is given here.
        self.image_workdirs: dict[str, str] = {}
        self.snapshots: dict[str, tuple[str, list]] = {}  # continue token -> (version, items left)
        # A watch with bookmarks on that had nothing to send this long gets one (the API server
        # sends them about once a minute); None: never.
        self.bookmark_every: float | None = None
        self.bookmarks_sent = 0
        self.pulls: list[tuple[str, dict]] = []  # (image, the registry credentials the kubelet found)
        self.pods: dict[str, dict] = {}   # pod name -> kubelet's record (process, netns, index)
        self.next_index = 1
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    # ---- store -----------------------------------------------------------------------------

    def _bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _record(self, kind: str, resource: str, ns: str, obj: dict) -> None:
        """Stores obj with a new version and tells watchers. Holding the lock."""
        obj["metadata"]["resourceVersion"] = self._bump()
        if kind == "DELETED":
            self.objects.pop((resource, ns, obj["metadata"]["name"]), None)
        else:
            self.objects[(resource, ns, obj["metadata"]["name"])] = obj
        self.writes += 1
        self.events.append((self.rv, kind, resource, ns, json.loads(json.dumps(obj))))
        self.lock.notify_all()

    def get(self, resource: str, ns: str, name: str) -> dict | None:
        with self.lock:
            o = self.objects.get((resource, ns, name))
            return json.loads(json.dumps(o)) if o else None

    def list(self, resource: str, ns: str, selector: str | None = None) -> list[dict]:
        with self.lock:
            return [json.loads(json.dumps(o)) for (r, n, _), o in self.objects.items()
                    if r == resource and n == ns and _matches(o, selector)]

    def compact_while(self, change) -> None:
        """Ends the open watches, holds new ones while `change()` runs, then forgets the event
        history as etcd's compaction does: a watch resumed from before the change is answered
        410, and only a new list shows what changed."""
        with self.lock:
            self.generation += 1
            self.holding = True
            self.lock.notify_all()
        try:
            change()
        finally:
            with self.lock:
                self.events.clear()
                self.snapshots.clear()  # continue tokens expire with the history
                self.oldest_rv = self.rv
                self.holding = False
                self.lock.notify_all()

    def update_pod(self, ns: str, name: str, change) -> None:
        with self.lock:
            pod = self.objects.get(("pods", ns, name))
            if pod is None:
                return
            pod = json.loads(json.dumps(pod))
            change(pod)
            self._record("MODIFIED", "pods", ns, pod)

    # ---- HTTP ------------------------------------------------------------------------------

    def _handler(self):
        fake = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                u = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(u.query).items()}
                kind = "WATCH" if q.get("watch") in ("1", "true") else self.command
                segments = u.path.strip("/").split("/")
                at = segments.index("namespaces") + 2 if "namespaces" in segments else len(segments) - 1
                resource = segments[at] if at < len(segments) else "?"
                if kind == "GET" and at == len(segments) - 1:
                    kind = "LIST"
                with fake.lock:
                    key = f"{kind} {resource}"
                    fake.requests[key] = fake.requests.get(key, 0) + 1
                parts = u.path.strip("/").split("/")
                # /api/v1/namespaces/NS/pods[/NAME] or /apis/networking.k8s.io/v1/namespaces/NS/networkpolicies[/NAME]
                if parts[:2] == ["api", "v1"]:
                    rest = parts[2:]
                elif parts[:3] in (["apis", "networking.k8s.io", "v1"], ["apis", "coordination.k8s.io", "v1"]):
                    rest = parts[3:]
                else:
                    return None
                if len(rest) < 3 or rest[0] != "namespaces":
                    return None
                ns, resource = rest[1], rest[2]
                name = rest[3] if len(rest) > 3 else None
                if resource not in ("pods", "networkpolicies", "persistentvolumeclaims", "secrets", "leases"):
                    return None
                return ns, resource, name, q

            def _body(self) -> dict:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}")

            def do_GET(self):
                r = self._route()
                if r is None:
                    return self._send(404, _status(404, "NotFound", "no such route"))
                ns, resource, name, q = r
                if name:
                    o = fake.get(resource, ns, name)
                    if o is None:
                        return self._send(404, _status(404, "NotFound", f'{resource} "{name}" not found'))
                    return self._send(200, o)
                if q.get("watch") in ("1", "true"):
                    return self._watch(ns, resource, q)
                # Paged as the API server pages: `limit` (capped by `max_page`, as a server may
                # answer fewer), then `continue` tokens that read on in the first page's snapshot.
                limit = int(q.get("limit") or 0)
                if fake.max_page:
                    limit = min(limit, fake.max_page) if limit else fake.max_page
                with fake.lock:
                    token = q.get("continue")
                    if token:
                        if token not in fake.snapshots:
                            return self._send(410, _status(410, "Expired", "the continue token has expired"))
                        rv, rest = fake.snapshots.pop(token)
                    else:
                        rv, rest = str(fake.rv), fake.list(resource, ns, q.get("labelSelector"))
                    items, rest = (rest[:limit], rest[limit:]) if limit else (rest, [])
                    meta = {"resourceVersion": rv}
                    if rest:
                        meta["continue"] = uuid.uuid4().hex
                        fake.snapshots[meta["continue"]] = (rv, rest)
                return self._send(200, {"kind": "List", "apiVersion": "v1", "metadata": meta, "items": items})

            def _watch(self, ns, resource, q):
                since = int(q.get("resourceVersion") or 0)
                selector = q.get("labelSelector")
                bookmarks = q.get("allowWatchBookmarks") in ("1", "true")
                last_sent = time.monotonic()
                deadline = time.monotonic() + float(q.get("timeoutSeconds") or 60)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(obj):
                    data = (json.dumps(obj) + "\n").encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                with fake.lock:
                    fake.lock.wait_for(lambda: not fake.holding, timeout=30)
                generation = fake.generation
                try:
                    if since < fake.oldest_rv:
                        chunk({"type": "ERROR", "object": _status(410, "Expired", "too old resource version")})
                    else:
                        while time.monotonic() < deadline and not fake.closed and fake.generation == generation:
                            with fake.lock:
                                if not fake.delivering:
                                    fake.lock.wait(0.05)
                                    continue
                                batch = [e for e in fake.events if e[0] > since and e[2] == resource
                                         and e[3] == ns and _matches(e[4], selector)]
                                if not batch:
                                    if (bookmarks and fake.bookmark_every and fake.rv > since
                                            and time.monotonic() - last_sent >= fake.bookmark_every):
                                        # Nothing for this watch lately: where the store is now,
                                        # so that a resumed watch starts from there.
                                        since, last_sent = fake.rv, time.monotonic()
                                        mark = {"kind": "Pod", "apiVersion": "v1",
                                                "metadata": {"resourceVersion": str(since)}}
                                        fake.bookmarks_sent += 1
                                        batch = [(since, "BOOKMARK", resource, ns, mark)]
                                    else:
                                        fake.lock.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                                        continue
                            for rv, kind, _, _, obj in batch:
                                chunk({"type": kind, "object": obj})
                                since, last_sent = rv, time.monotonic()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_POST(self):
                r = self._route()
                if r is None or r[2]:
                    return self._send(404, _status(404, "NotFound", "no such route"))
                ns, resource, _, _ = r
                obj = self._body()
                problem = fake.admit(obj)
                if problem:
                    fake.rejected.append(problem)
                    return self._send(422, _status(422, "Invalid", problem))
                name = obj["metadata"]["name"]
                with fake.lock:
                    if (resource, ns, name) in fake.objects:
                        return self._send(409, _status(409, "AlreadyExists", f'{resource} "{name}" already exists'))
                    obj["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
                    if resource == "pods":
                        obj["status"] = {"phase": "Pending"}
                    fake.creates[resource] = fake.creates.get(resource, 0) + 1
                    fake._record("ADDED", resource, ns, obj)
                    out = json.loads(json.dumps(obj))
                if resource == "pods":
                    threading.Thread(target=fake._run_pod, args=(ns, name), daemon=True).start()
                return self._send(201, out)

            def do_PATCH(self):
                """JSON merge patch (RFC 7386); a `metadata.resourceVersion` in it is a
                precondition, answered 409 Conflict when the object has moved on, as the API server
                does."""
                r = self._route()
                if r is None or not r[2]:
                    return self._send(404, _status(404, "NotFound", "no such route"))
                ns, resource, name, _ = r
                if self.headers.get("Content-Type", "").split(";")[0] != "application/merge-patch+json":
                    self._body()
                    return self._send(415, _status(415, "UnsupportedMediaType", "only merge patches here"))
                patch = self._body()
                with fake.lock:
                    o = fake.objects.get((resource, ns, name))
                    if o is None:
                        return self._send(404, _status(404, "NotFound", f'{resource} "{name}" not found'))
                    want = (patch.get("metadata") or {}).get("resourceVersion")
                    if want is not None and want != o["metadata"]["resourceVersion"]:
                        return self._send(409, _status(409, "Conflict", "the object has been modified"))
                    merged = _merge_patch(json.loads(json.dumps(o)), patch)
                    for fixed in ("name", "namespace", "uid", "creationTimestamp"):
                        merged["metadata"][fixed] = o["metadata"][fixed]
                    problem = fake.admit(merged)
                    if problem:
                        fake.rejected.append(problem)
                        return self._send(422, _status(422, "Invalid", problem))
                    fake._record("MODIFIED", resource, ns, merged)
                    out = json.loads(json.dumps(merged))
                return self._send(200, out)

            def do_DELETE(self):
                r = self._route()
                if r is None or not r[2]:
                    return self._send(404, _status(404, "NotFound", "no such route"))
                ns, resource, name, _ = r
                self._body()
                o = fake.get(resource, ns, name)
                if o is None:
                    return self._send(404, _status(404, "NotFound", f'{resource} "{name}" not found'))
                if resource == "pods":
                    fake.update_pod(ns, name, lambda p: p["metadata"].__setitem__("deletionTimestamp", _now()))
                    threading.Thread(target=fake.remove_pod, args=(ns, name), daemon=True).start()
                else:
                    with fake.lock:
                        fake._record("DELETED", resource, ns, o)
                return self._send(200, o)

        return H

    def admit(self, obj: dict) -> str | None:
        """Strict schema validation, as the API server's decoding does."""
        if not self.validate:
            return None
        import kubernetes_validate
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            return f"{obj.get('kind')}: {e}"
        except Exception as e:  # noqa: BLE001 - an object that is not one at all
            return f"not a Kubernetes object: {e}"
        return None

    # ---- kubelet ---------------------------------------------------------------------------

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def _run_pod(self, ns: str, name: str) -> None:
        pod = self.get("pods", ns, name)
        if pod is None:
            return
        if self.simulate_ip:
            main = pod["spec"]["containers"][0]
            self.update_pod(ns, name, lambda p: p["status"].update(
                phase="Running", podIP=self.simulate_ip, containerStatuses=[
                    {"name": main["name"], "ready": True, "restartCount": 0, "image": main["image"],
                     "imageID": "", "state": {"running": {"startedAt": _now()}}}]))
            return
        spec = pod["spec"]
        # The image is "pulled" with the Pod's pull Secrets, which must exist by now (a real
        # kubelet would back off and try again later).
        auths: dict = {}
        for ref in spec.get("imagePullSecrets", []):
            secret = self.get("secrets", ns, ref["name"])
            if secret is None:
                self.update_pod(ns, name, lambda p: p["status"].update(
                    phase="Pending", reason="ErrImagePull",
                    message=f'secret "{ref["name"]}" not found'))
                return
            if secret.get("type") == "kubernetes.io/dockerconfigjson":
                auths.update(json.loads(base64.b64decode(secret["data"][".dockerconfigjson"]))["auths"])
        with self.lock:
            self.pulls.append((spec["containers"][0]["image"], auths))
        init, *sidecars = spec.get("initContainers", [])
        (main,) = spec["containers"]
        if any(c.get("restartPolicy") != "Always" for c in sidecars):
            self.update_pod(ns, name, lambda p: p["status"].update(
                phase="Failed", reason="CreateContainerError", message="only one init container runs to completion here"))
            return
        mounts = {m["name"]: m["mountPath"] for m in main.get("volumeMounts", [])}
        init_mounts = {m["name"]: m["mountPath"] for m in init.get("volumeMounts", [])}
        # The init container must put execd where the sandbox container starts it from.
        ok = (init["command"][0] == "cp" and init["command"][2] == main["command"][0] == EXECD_IN_POD
              and any(EXECD_IN_POD.startswith(p + "/") and init_mounts.get(n) == p for n, p in mounts.items()))
        if not ok:
            self.update_pod(ns, name, lambda p: p["status"].update(
                phase="Failed", reason="CreateContainerError", message="execd is not where it is started from"))
            return
        with self.lock:
            index = self.next_index
            self.next_index += 1
        netns = f"wk8s-{os.getpid()}-{index}"
        host_if, pod_if = f"wkh{index}x{os.getpid() % 1000}", f"wkp{index}x{os.getpid() % 1000}"
        third = index % 250 + 1
        host_ip, pod_ip = f"{self.subnet_prefix}.{third}.1", f"{self.subnet_prefix}.{third}.2"
        record = {"netns": netns, "host_if": host_if, "proc": None, "stopped": False, "sidecars": [],
                  "dirs": None}
        with self.lock:
            self.pods[name] = record
        try:
            self._ip("netns", "add", netns)
            self._ip("link", "add", host_if, "type", "veth", "peer", "name", pod_if)
            self._ip("link", "set", pod_if, "netns", netns)
            self._ip("addr", "add", f"{host_ip}/24", "dev", host_if)
            self._ip("link", "set", host_if, "up")
            self._ip("-n", netns, "addr", "add", f"{pod_ip}/24", "dev", pod_if)
            self._ip("-n", netns, "link", "set", pod_if, "up")
            self._ip("-n", netns, "link", "set", "lo", "up")
            if self.routes:
                for route in self.routes:
                    self._ip("-n", netns, "route", "add", route, "via", host_ip)
                # Anything else is routable (as in a cluster, so a DNS query to resolv.conf's server
                # is sent, and redirected by an egress sidecar) but goes nowhere: to a veth whose
                # other end, in the Pod too, has no address and forwards nothing.
                self._ip("-n", netns, "link", "add", "nowhere", "type", "veth", "peer", "name", "nowhere-end")
                for dev in ("nowhere", "nowhere-end"):
                    self._ip("-n", netns, "link", "set", dev, "up")
                self._ip("-n", netns, "route", "add", "default", "dev", "nowhere")
            for sidecar in sidecars:
                self._start_sidecar(record, spec, sidecar, pod_ip)
            env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
                   "HOSTNAME": spec.get("hostname", name)}
            env.update({e["name"]: e["value"] for e in main.get("env", [])})
            argv = ["ip", "netns", "exec", netns, *_bounding_set(main), str(self.execd_path),
                    *main["command"][1:], *main.get("args", [])]
            with self.lock:
                if record["stopped"]:
                    raise RuntimeError("deleted while starting")
                cwd = main.get("workingDir") or self.image_workdirs.get(main["image"], "/")
                record["proc"] = subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True,
                                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL)
            self.update_pod(ns, name, lambda p: p["status"].update(
                phase="Running", podIP=pod_ip, podIPs=[{"ip": pod_ip}], hostIP="127.0.0.1",
                containerStatuses=[{"name": main["name"], "ready": True, "restartCount": 0,
                                    "image": main["image"], "imageID": "", "state": {"running": {"startedAt": _now()}}}]))
            code = record["proc"].wait()
            if not record["stopped"]:
                self.update_pod(ns, name, lambda p: p["status"].update(
                    phase="Succeeded" if code == 0 else "Failed",
                    containerStatuses=[{"name": main["name"], "ready": False, "restartCount": 0,
                                        "image": main["image"], "imageID": "",
                                        "state": {"terminated": {"exitCode": code if code >= 0 else 128 - code,
                                                                 "reason": "Completed" if code == 0 else "Error"}}}]))
        except Exception as e:  # noqa: BLE001 - the Pod fails, as a kubelet would report it
            if not record["stopped"]:
                self.update_pod(ns, name, lambda p: p["status"].update(phase="Failed", reason="KubeletError",
                                                                       message=str(e)))

    def _start_sidecar(self, record: dict, spec: dict, c: dict, pod_ip: str) -> None:
        """Starts a native sidecar and waits for its start-up probe (a TCP port) to answer, as the
        kubelet does before it starts the Pod's containers."""
        import socket
        import tempfile
        if c["command"][0] != WARREN_IN_IMAGE or self.warren_path is None:
            raise RuntimeError(f"sidecar {c['name']}: only {WARREN_IN_IMAGE} runs here")
        if record["dirs"] is None:
            record["dirs"] = tempfile.mkdtemp(prefix="wk8s-pod-")
        empty = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        args = [*c["command"][1:], *c.get("args", [])]
        for m in c.get("volumeMounts", []):
            if m["name"] not in empty:
                raise RuntimeError(f"sidecar {c['name']}: only emptyDir volumes are simulated")
            folder = os.path.join(record["dirs"], m["name"])
            os.makedirs(folder, exist_ok=True)
            args = [a.replace(m["mountPath"], folder) for a in args]
        argv = ["ip", "netns", "exec", record["netns"], *_bounding_set(c), str(self.warren_path), *args]
        log = os.path.join(record["dirs"], f"{c['name']}.log")

        def launch() -> subprocess.Popen:
            with self.lock:
                if record["stopped"]:
                    raise RuntimeError("deleted while starting")
                proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=open(log, "ab"))
                record["sidecars"].append(proc)
                return proc

        proc = launch()
        port = c["startupProbe"]["tcpSocket"]["port"]
        deadline = time.time() + c["startupProbe"].get("failureThreshold", 3) * c["startupProbe"].get("periodSeconds", 10)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sidecar {c['name']} exited with {proc.returncode}: {open(log).read()[-2000:]}")
            try:
                socket.create_connection((pod_ip, port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"sidecar {c['name']}: start-up probe failed")
                time.sleep(0.05)

        def keep_running(proc: subprocess.Popen) -> None:
            # restartPolicy: Always — the kubelet starts a sidecar that ended again, Pod running
            # (not while a test holds it down: `kill_sidecar`).
            while True:
                proc.wait()
                time.sleep(0.2)  # the kubelet's back-off, shortened
                while record.get("hold") and not record["stopped"]:
                    time.sleep(0.05)
                try:
                    proc = launch()
                except RuntimeError:
                    return
                record["restarts"] = record.get("restarts", 0) + 1

        threading.Thread(target=keep_running, args=(proc,), daemon=True).start()

    def kill_sidecar(self, name: str, restart: bool = True) -> None:
        """Kills the Pod's running sidecars; with `restart` False they stay down until
        `release_sidecar` (a kubelet in its back-off)."""
        with self.lock:
            record = self.pods[name]
            record["hold"] = not restart
            procs = [p for p in record["sidecars"] if p.poll() is None]
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def release_sidecar(self, name: str) -> None:
        with self.lock:
            self.pods[name]["hold"] = False

    def sidecar_pids(self, name: str) -> list[int]:
        """The Pod's running sidecar processes (their `ip netns exec` wrappers' pids)."""
        with self.lock:
            record = self.pods.get(name) or {}
            return [p.pid for p in record.get("sidecars", []) if p.poll() is None]

    def _kill(self, record: dict) -> None:
        import shutil
        for proc in [record.get("proc"), *record.get("sidecars", [])]:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        if record.get("dirs"):
            shutil.rmtree(record["dirs"], ignore_errors=True)
        subprocess.run(["ip", "link", "del", record["host_if"]], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", record["netns"]], capture_output=True, timeout=10)

    def _stop_containers(self, name: str) -> None:
        """Stops the Pod's process and removes its network namespace (once)."""
        with self.lock:
            record = self.pods.pop(name, None)
            if record:
                record["stopped"] = True
        if record:
            self._kill(record)

    def remove_pod(self, ns: str, name: str) -> None:
        """Stops the Pod and removes it (a delete, or one behind Warren's back), and, as the
        garbage collector does, the objects it owns."""
        self._stop_containers(name)
        with self.lock:
            pod = self.objects.get(("pods", ns, name))
            if pod is not None:
                self._record("DELETED", "pods", ns, json.loads(json.dumps(pod)))
                uid = pod["metadata"]["uid"]
                owned = [(r, n, o) for (r, n, _), o in self.objects.items()
                         if n == ns and any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences", []))]
                for r, n, o in owned:
                    self.gc_deleted.append(o["metadata"]["name"])
                    self._record("DELETED", r, n, json.loads(json.dumps(o)))

    def evict(self, ns: str, name: str) -> None:
        """The kubelet evicts the Pod (node pressure): its containers stop, it stays Failed."""
        self._stop_containers(name)
        self.update_pod(ns, name, lambda p: p["status"].update(
            phase="Failed", reason="Evicted", message="The node was low on resource: memory."))

    def pod_ip(self, ns: str, name: str) -> str | None:
        pod = self.get("pods", ns, name)
        return pod and pod.get("status", {}).get("podIP")

    def close(self) -> None:
        self.closed = True
        with self.lock:
            records = list(self.pods.values())
            self.pods.clear()
            self.lock.notify_all()
        for r in records:
            r["stopped"] = True
            self._kill(r)
        self.server.shutdown()
        self.server.server_close()
