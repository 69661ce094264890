"""Warren's Prometheus metrics: `/metrics` answers only an admin key on the API's listener, and
alone without a key on `[metrics] listen`; a real Prometheus (Debian's) scrapes that listener and
its query API returns what Warren counted of sandboxes the official SDK made and deleted. Metrics
are the server's, not the runtime's: one runtime (the embedded one) is enough."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid
from datetime import timedelta

import httpx
import pytest

import warren_e2e as W

KEY = "OPEN-SANDBOX-API-KEY"


@pytest.fixture(scope="module")
def srv(work_root):
    s = W.WarrenServer("embedded", work_root, f"metrics-{uuid.uuid4().hex[:6]}")
    s.metrics_port = W.free_port()
    s.more_config = f'[metrics]\nlisten = "127.0.0.1:{s.metrics_port}"\n'
    s.check_binary()
    s.start()
    yield s
    s.stop()


def _scrape(srv, key: str | None) -> httpx.Response:
    headers = {KEY: key} if key else {}
    return httpx.get(f"{srv.base_url}/v1/metrics", headers=headers, timeout=30)


def _value(text: str, series: str) -> float:
    """The sample of `series` (name and labels as rendered) in an exposition, 0 when absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _sandbox_made_and_deleted(srv) -> str:
    from opensandbox import SandboxSync
    from opensandbox.config import ConnectionConfigSync
    cfg = ConnectionConfigSync(domain=srv.domain, api_key=srv.api_key,
                               request_timeout=timedelta(seconds=60))
    sbx = SandboxSync.create("host", connection_config=cfg, timeout=timedelta(minutes=10),
                             ready_timeout=timedelta(seconds=60))
    W.track_sandbox(sbx.id)
    try:
        out = sbx.commands.run("echo counted")
        assert "counted" in "".join(m.text for m in out.logs.stdout), out
    finally:
        sbx.kill()
    return sbx.id


def test_metrics_answer_an_admin_key_only_and_count_creates_and_ends(srv):
    assert _scrape(srv, None).status_code == 401
    r = httpx.post(f"{srv.base_url}/v1/admin/keys", headers={KEY: srv.api_key}, timeout=30,
                   json={"tenant": "metrics-tenant", "role": "full", "name": "e2e"})
    assert r.status_code == 201, r.text
    # Metrics count every tenant's sandboxes: a tenant's own key may not read them.
    refused = _scrape(srv, r.json()["key"])
    assert refused.status_code == 403, refused.text
    before = _scrape(srv, srv.api_key)
    assert before.status_code == 200, before.text
    assert before.headers["content-type"].startswith("text/plain"), before.headers
    created = _value(before.text, 'warren_sandbox_creates_total{result="ok",code=""}')
    ended = _value(before.text, 'warren_sandbox_ends_total{state="Terminated",reason="user_delete"}')
    sid = _sandbox_made_and_deleted(srv)
    after = _scrape(srv, srv.api_key).text
    assert _value(after, 'warren_sandbox_creates_total{result="ok",code=""}') == created + 1, after
    assert _value(after, 'warren_sandbox_ends_total{state="Terminated",reason="user_delete"}') \
        == ended + 1, after
    # Every create phase was timed, and the state gauges were read at the scrape.
    for phase in ("admission", "image", "queue", "start", "total"):
        assert f'warren_sandbox_create_seconds_count{{phase="{phase}"}}' in after, (phase, after)
    assert re.search(r'^warren_sandboxes\{state="Running",runtime="[^"]+"\} \d', after, re.M), after
    # No sandbox id is a label.
    assert sid not in after
    # The listener of its own serves the same, without a key, and nothing else.
    own = f"http://127.0.0.1:{srv.metrics_port}"
    plain = httpx.get(f"{own}/metrics", timeout=30)
    assert plain.status_code == 200 and "warren_sandbox_creates_total" in plain.text, plain.text
    assert httpx.get(f"{own}/v1/sandboxes", timeout=30).status_code == 404


def test_a_failed_create_is_counted_by_its_code(srv):
    before = _scrape(srv, srv.api_key).text
    r = httpx.post(f"{srv.base_url}/v1/sandboxes", headers={KEY: srv.api_key}, timeout=60,
                   json={"image": {"uri": f"no-such-image-{uuid.uuid4().hex[:8]}:1"},
                         "timeout": 60, "resourceLimits": {"cpu": "500m", "memory": "256Mi"},
                         "entrypoint": ["sleep", "1"]})
    assert r.status_code == 404, r.text
    code = r.json()["code"]
    series = f'warren_sandbox_creates_total{{result="failed",code="{code}"}}'
    after = _scrape(srv, srv.api_key).text
    assert _value(after, series) == _value(before, series) + 1, (series, after)


def test_a_real_prometheus_scrapes_what_warren_counted(srv, tmp_path):
    prometheus = shutil.which("prometheus")
    assert prometheus, "Debian's prometheus is one of the suite's packages (scripts/install-deps)"
    _sandbox_made_and_deleted(srv)
    port = W.free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: warren\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{srv.metrics_port}']\n")
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        api = f"http://127.0.0.1:{port}/api/v1/query"
        query = 'sum(warren_sandbox_creates_total{job="warren",result="ok"})'
        value, deadline = None, time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                body = httpx.get(api, params={"query": query}, timeout=5).json()
            except (httpx.HTTPError, ValueError):
                body = None
            if body and body.get("status") == "success" and body["data"]["result"]:
                value = float(body["data"]["result"][0]["value"][1])
                if value >= 1:
                    break
            time.sleep(1)
        assert value is not None and value >= 1, (value, (tmp_path / "prometheus.log").read_text())
        up = httpx.get(api, params={"query": 'up{job="warren"}'}, timeout=5).json()
        assert up["data"]["result"][0]["value"][1] == "1", up
        # A histogram Prometheus can take quantiles of, by phase.
        q = httpx.get(api, params={"query": 'histogram_quantile(0.5, sum by (le) '
                                            '(warren_sandbox_create_seconds_bucket{phase="total"}))'},
                      timeout=5).json()
        assert q["status"] == "success" and q["data"]["result"], q
        assert float(q["data"]["result"][0]["value"][1]) > 0, q
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_metrics_off_answer_404(work_root):
    s = W.WarrenServer("embedded", work_root, f"metrics-off-{uuid.uuid4().hex[:6]}")
    s.more_config = "[metrics]\nenabled = false\n"
    s.check_binary()
    s.start()
    try:
        r = httpx.get(f"{s.base_url}/v1/metrics", headers={KEY: s.api_key}, timeout=30)
        assert r.status_code == 404, r.text
        # The control: the same server answers the API.
        assert httpx.get(f"{s.base_url}/v1/health", timeout=30).status_code == 200
    finally:
        s.stop()
