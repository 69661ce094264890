"""OpenTelemetry traces: with an OTLP endpoint in its environment, `warren serve` exports its spans
over OTLP/HTTP to a receiver this test starts on loopback. A create through the official SDK and a
command through the endpoint proxy arrive as spans: the request's own (its `id` the answer's
`X-Request-Id`), the create and its phases under it, and the proxied call. JSON logs carry the same
request id. Traces are the server's, not the runtime's: one runtime (the embedded one) is enough."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import warren_e2e as W


class Receiver:
    """An OTLP/HTTP receiver (JSON encoding) that keeps every span it is sent."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                assert self.path == "/v1/traces", self.path
                doc = json.loads(body)
                with outer.lock:
                    for rs in doc.get("resourceSpans", []):
                        resource = {a["key"]: a["value"] for a in rs.get("resource", {}).get("attributes", [])}
                        for ss in rs.get("scopeSpans", []):
                            for span in ss.get("spans", []):
                                span["_resource"] = resource
                                outer.spans.append(span)
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["name"] == name]

    def close(self):
        self.http.shutdown()


def attrs(span: dict) -> dict:
    def value(v: dict):
        return next(iter(v.values())) if v else None
    return {a["key"]: value(a["value"]) for a in span.get("attributes", [])}


@pytest.fixture(scope="module")
def traced(work_root):
    rx = Receiver()
    s = W.WarrenServer("embedded", work_root, f"traces-{uuid.uuid4().hex[:6]}")
    s.extra_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rx.port}",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_BSP_SCHEDULE_DELAY": "100",
                   "OTEL_SERVICE_NAME": "warren-e2e", "WARREN_LOG_FORMAT": "json",
                   "WARREN_LOG": "warren=info,warren_server=debug,warn"}
    s.check_binary()
    s.start()
    yield s, rx
    s.stop()
    rx.close()


def test_a_create_and_a_proxied_command_arrive_as_linked_spans(traced):
    srv, rx = traced
    from opensandbox import SandboxSync
    sbx = SandboxSync.create("host", connection_config=srv.sdk_config(), timeout=timedelta(minutes=10),
                             ready_timeout=timedelta(seconds=60))
    W.track_sandbox(sbx.id)
    try:
        assert W.sh(sbx, "echo traced")[0] == 0
        with srv.client() as c:
            r = c.get(f"/v1/sandboxes/{sbx.id}")
            request_id = r.headers["x-request-id"]
        # A signed URL: its token opens the port, so no log line or span may carry it.
        signed = sbx.get_signed_endpoint(8080, int(time.time()) + 600)
        token = signed.endpoint.split("/signed/", 1)[1].split("/", 1)[0]
        assert len(token) > 20, signed.endpoint
        httpx.get(f"http://{signed.endpoint}/some/page", timeout=30)
    finally:
        sbx.kill()

    creates = W.wait_until(lambda: [s for s in rx.named("sandbox.create")
                                    if attrs(s).get("sandbox_id") == sbx.id], 30,
                           message="the create's span at the receiver")
    create = creates[0]
    assert create["_resource"]["service.name"] == {"stringValue": "warren-e2e"}
    # Its phases are its children, in its trace.
    phases = {s["name"]: s for s in rx.spans if s.get("parentSpanId") == create["spanId"]}
    assert {"create.image", "create.start"} <= set(phases), sorted(phases)
    assert all(p["traceId"] == create["traceId"] for p in phases.values())
    # Under the request that made it: POST /v1/sandboxes, with its request id.
    request = next(s for s in rx.named("request") if s["spanId"] == create["parentSpanId"])
    a = attrs(request)
    assert a["method"] == "POST" and a["path"] == "/v1/sandboxes" and a["status"] in (202, "202"), a
    assert a["id"]
    # The command went through the proxy: a span with the sandbox and the port.
    proxied = W.wait_until(lambda: [s for s in rx.named("proxy") if attrs(s).get("sandbox_id") == sbx.id
                                    and attrs(s).get("path") == "/command"], 30,
                           message="the proxied command's span")
    assert attrs(proxied[0])["port"] in (44772, "44772")
    # The answer's X-Request-Id names its span.
    W.wait_until(lambda: any(attrs(s).get("id") == request_id for s in rx.named("request")), 30,
                 message="the GET's request span")

    W.wait_until(lambda: any(attrs(s).get("path") == "/signed/-" for s in rx.named("request")),
                 30, message="the signed request's span, its token left out")
    with rx.lock:
        assert token not in json.dumps(rx.spans), "a signed URL's token was exported in a span"
    assert token not in srv.log_path.read_text(), "a signed URL's token was logged"

    # JSON logs: one object per line; a line logged inside a request lists its span, with its id.
    lines = [json.loads(l) for l in srv.log_path.read_text().splitlines() if l.startswith("{")]
    assert lines, "no JSON log lines"
    assert any(sp.get("name") == "request" and sp.get("id") for l in lines for sp in l.get("spans", [])), \
        lines[-5:]


def test_without_an_endpoint_nothing_is_exported_and_logs_are_text(server):
    """The default: no OTLP layer at all (its cost is nothing); the suite's other servers run so."""
    text = server.log_path.read_text()
    assert text and not text.lstrip().startswith("{"), text[:200]
