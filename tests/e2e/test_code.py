"""The code interpreter: code contexts on real Jupyter kernels (python3-ipykernel in the
debootstrap image), driven with the official `opensandbox-code-interpreter==1.1.1` SDK, plus raw
checks of the event stream where the SDK keeps only `text` of a result."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
from datetime import timedelta

import httpx
import pytest
from opensandbox.exceptions import SandboxException
from opensandbox.models.execd_sync import ExecutionHandlersSync

import warren_e2e as W
from conftest import SandboxFactory, require_jupyter_rootfs


@pytest.fixture(scope="module")
def code_sandbox(server):
    """One sandbox on the Jupyter image shared by the module's tests, with its interpreter."""
    from code_interpreter import CodeInterpreterSync
    server.import_image(W.JUPYTER_IMAGE_NAME, require_jupyter_rootfs())
    f = SandboxFactory(server)
    sbx = f(W.JUPYTER_IMAGE_NAME)
    # The SDK's strict health check (a TCP connect to $JUPYTER_PORT inside the sandbox) must pass.
    ci = CodeInterpreterSync.create(sbx, ready_timeout=timedelta(seconds=30))
    yield sbx, ci
    f.cleanup()


@pytest.fixture
def ci(code_sandbox):
    return code_sandbox[1]


def texts(execution) -> list[str]:
    return [r.text for r in execution.result]


def stdout(execution) -> str:
    return "".join(m.text for m in execution.logs.stdout)


def raw_run(sbx, body: dict) -> tuple[int, list[dict]]:
    """POST /code through the sandbox's execd endpoint; returns (status, events)."""
    ep = sbx.get_endpoint(44772)
    events = []
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", f"http://{ep.endpoint}/code", headers=ep.headers, json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, [r.json()]
            for line in r.iter_lines():
                line = line.strip()
                if line:
                    events.append(json.loads(line))
    return 200, events


def execd(sbx, method: str, path: str, **kw) -> httpx.Response:
    ep = sbx.get_endpoint(44772)
    return httpx.request(method, f"http://{ep.endpoint}{path}", headers=ep.headers, timeout=60, **kw)


def kernel_count(sbx) -> int:
    code, out, _ = W.sh(sbx, "ps -eo args | grep -c '[i]pykernel_launcher' || true")
    return int(out.strip() or 0)


# --- state, isolation, contexts ---------------------------------------------------------------------

def test_state_persists_within_a_context(ci):
    ctx = ci.codes.create_context("python")
    assert ctx.id and ctx.language == "python"
    first = ci.codes.run("x = 41\nprint('set')", context=ctx)
    assert first.error is None and stdout(first) == "set\n"
    second = ci.codes.run("x + 1", context=ctx)
    assert second.error is None
    assert texts(second) == ["42"]
    assert second.execution_count == first.execution_count + 1
    assert second.id == ctx.id, "the init event names the context"
    ci.codes.delete_context(ctx.id)


def test_contexts_do_not_share_state(ci):
    a = ci.codes.create_context("python")
    b = ci.codes.create_context("python")
    assert a.id != b.id
    assert ci.codes.run("secret = 'only-in-a'", context=a).error is None
    seen = ci.codes.run("secret", context=b)
    assert seen.error is not None and seen.error.name == "NameError"
    assert texts(ci.codes.run("secret", context=a)) == ["'only-in-a'"]
    for c in (a, b):
        ci.codes.delete_context(c.id)


def test_default_context_per_language(ci):
    first = ci.codes.run("default_state = 7")
    assert first.error is None
    again = ci.codes.run("default_state * 6")
    assert texts(again) == ["42"], "runs without a context share the language's default context"
    assert again.id == first.id


def test_list_get_delete_contexts(code_sandbox):
    sbx, ci = code_sandbox
    before = kernel_count(sbx)
    a = ci.codes.create_context("python")
    b = ci.codes.create_context("python")
    assert kernel_count(sbx) == before + 2
    ids = {c.id for c in ci.codes.list_contexts("python")}
    assert {a.id, b.id} <= ids
    assert ci.codes.get_context(a.id).id == a.id
    ci.codes.delete_context(a.id)
    with pytest.raises(SandboxException):
        ci.codes.get_context(a.id)
    assert kernel_count(sbx) == before + 1, "deleting a context ends its kernel process"
    ci.codes.delete_contexts("python")
    assert ci.codes.list_contexts("python") == []
    assert kernel_count(sbx) == 0
    r = execd(sbx, "GET", f"/code/contexts/{b.id}")
    assert r.status_code == 404 and r.json()["code"] == "CONTEXT_NOT_FOUND"


def test_concurrent_runs_on_different_contexts(ci):
    ctxs = [ci.codes.create_context("python") for _ in range(3)]
    spans: dict[int, tuple[float, float]] = {}

    def work(i, ctx):
        ex = ci.codes.run("import time\nt0 = time.time(); time.sleep(1.5); print(t0, time.time())",
                          context=ctx)
        start, end = map(float, stdout(ex).split())
        spans[i] = (start, end)

    threads = [threading.Thread(target=work, args=(i, c)) for i, c in enumerate(ctxs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(spans) == 3
    # every pair of executions overlapped in time: they ran in parallel, not one after another
    latest_start = max(s for s, _ in spans.values())
    earliest_end = min(e for _, e in spans.values())
    assert latest_start < earliest_end, spans
    for c in ctxs:
        ci.codes.delete_context(c.id)


def test_bash_kernel_when_the_image_has_one(ci):
    """The image also carries bash_kernel (PyPI): a bash context keeps shell state between runs."""
    ctx = ci.codes.create_context("bash")
    assert ctx.language == "bash"
    assert ci.codes.run("GREETING=hello; cd /tmp", context=ctx).error is None
    ex = ci.codes.run("echo $GREETING from $(pwd)", context=ctx)
    assert ex.error is None and stdout(ex) == "hello from /tmp\n"
    failed = ci.codes.run("false", context=ctx)
    assert failed.error is not None and failed.error.value == "1"
    assert stdout(ci.codes.run("echo default", language="bash")) == "default\n"
    ci.codes.delete_contexts("bash")


# --- rich results on the wire -------------------------------------------------------------------------

def test_matplotlib_figure_arrives_as_png(code_sandbox):
    sbx, _ = code_sandbox
    status, events = raw_run(sbx, {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()",
                                   "context": {"language": "python"}})
    assert status == 200
    results = [e["results"] for e in events if e["type"] == "result"]
    pngs = [r["image/png"] for r in results if "image/png" in r]
    assert pngs, events
    assert base64.b64decode(pngs[0])[:8] == b"\x89PNG\r\n\x1a\n"
    assert all("text/plain" not in r for r in results), "text/plain is renamed to text"
    assert events[-1]["type"] == "execution_complete"
    assert all(isinstance(e["timestamp"], int) for e in events)


def test_html_table_and_json_results(code_sandbox):
    sbx, _ = code_sandbox
    code = ("from IPython.display import HTML, JSON, display\n"
            "display(HTML('<table><tr><th>n</th></tr><tr><td>1</td></tr></table>'))\n"
            "display(JSON({'answer': 42}))\n"
            "'plain'")
    status, events = raw_run(sbx, {"code": code})
    assert status == 200
    results = [e["results"] for e in events if e["type"] == "result"]
    assert any("<table>" in r.get("text/html", "") for r in results), results
    assert any(r.get("application/json") == {"answer": 42} for r in results), results
    assert results[-1]["text"] == "'plain'"
    kinds = [e["type"] for e in events]
    assert kinds[0] == "init" and "execution_count" in kinds and kinds[-1] == "execution_complete"


def test_stream_order_and_stderr(ci):
    out, err = [], []
    ex = ci.codes.run("import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')",
                      handlers=ExecutionHandlersSync(on_stdout=lambda m: out.append(m.text),
                                                     on_stderr=lambda m: err.append(m.text)))
    assert ex.error is None
    assert "".join(out) == "a\nc\n"
    assert "".join(err) == "b\n"


# --- failures --------------------------------------------------------------------------------------------

def test_exception_comes_back_with_traceback(ci):
    ex = ci.codes.run("def f():\n    return 1 / 0\nf()")
    assert ex.error is not None
    assert ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    assert any("ZeroDivisionError" in line for line in ex.error.traceback)
    assert ex.complete is None, "error is terminal: no execution_complete after it"


def test_interrupt_runaway_loop_keeps_context(ci):
    ctx = ci.codes.create_context("python")
    assert ci.codes.run("kept = 'still here'", context=ctx).error is None
    started = threading.Event()
    holder = {}

    def on_init(init):
        holder["id"] = init.id
        started.set()

    def loop():
        holder["ex"] = ci.codes.run("while True: pass", context=ctx,
                                    handlers=ExecutionHandlersSync(on_init=on_init))

    t = threading.Thread(target=loop)
    t.start()
    assert started.wait(30)
    time.sleep(0.5)
    ci.codes.interrupt(holder["id"])
    t.join(30)
    assert not t.is_alive(), "interrupt ended the execution"
    assert holder["ex"].error is not None and holder["ex"].error.name == "KeyboardInterrupt"
    assert texts(ci.codes.run("kept", context=ctx)) == ["'still here'"], "the context survives"
    ci.codes.delete_context(ctx.id)


@pytest.mark.timeout(600)
def test_interrupt_at_every_moment_ends_the_run(ci):
    """An interrupt lands before the kernel starts executing (right after `init`), while it runs,
    and after its last output; many times. Every run must end with a terminal event (the SDK's
    `run` returns) and the next run on the context must succeed. An interrupt that landed while
    the kernel was between messages used to be lost (ipykernel ignores SIGINT outside an
    execution): the stream then sent only pings and the context answered 409 for good."""
    ctx = ci.codes.create_context("python")
    codes = ["while True: pass",
             "print('go', flush=True)\nwhile True: pass",
             "import time\nfor i in range(3):\n    print(i, flush=True)\ntime.sleep(600)"]
    delays = [0, 0, 0.005, 0.02, 0.05, 0.1, 0.3, "output"]
    try:
        for round_ in range(3):
            for code in codes:
                for delay in delays:
                    started, printed = threading.Event(), threading.Event()
                    holder = {}

                    def on_init(init):
                        holder["id"] = init.id
                        started.set()

                    def run():
                        holder["ex"] = ci.codes.run(code, context=ctx, handlers=ExecutionHandlersSync(
                            on_init=on_init, on_stdout=lambda m: printed.set()))

                    t = threading.Thread(target=run, daemon=True)
                    t.start()
                    assert started.wait(30)
                    if delay == "output":
                        # after the last output; a loop that prints nothing is caught mid-run
                        assert printed.wait(30) if "print" in code else not time.sleep(0.2)
                    else:
                        time.sleep(delay)
                    ci.codes.interrupt(holder["id"])
                    t.join(30)
                    where = f"round {round_}, code {code!r}, interrupt after {delay}"
                    assert not t.is_alive(), f"the run never ended ({where})"
                    ex = holder["ex"]
                    assert ex.error is not None and ex.error.name == "KeyboardInterrupt", (where, ex.error)
                    after = ci.codes.run("40 + 2", context=ctx)
                    assert after.error is None and texts(after) == ["42"], (where, after.error)
    finally:
        ci.codes.delete_context(ctx.id)


def test_busy_context_is_refused_not_queued(code_sandbox):
    sbx, ci = code_sandbox
    ctx = ci.codes.create_context("python")
    t = threading.Thread(target=lambda: ci.codes.run("import time; time.sleep(3)", context=ctx))
    t.start()
    try:
        body = {"code": "1", "context": {"id": ctx.id, "language": "python"}}
        deadline = time.time() + 10
        while True:
            status, events = raw_run(sbx, body)
            if status == 409 or time.time() > deadline:
                break
            time.sleep(0.1)
        assert status == 409, events
        assert events[0]["code"] == "CONTEXT_BUSY" and ctx.id in events[0]["message"]
    finally:
        t.join(30)
    ci.codes.delete_context(ctx.id)


def test_kernel_death_is_an_error_and_context_can_be_recreated(ci):
    ctx = ci.codes.create_context("python")
    died = ci.codes.run("import os; os._exit(3)", context=ctx)
    assert died.error is not None and died.error.name == "KernelDied"
    assert "exited with code 3" in died.error.value
    again = ci.codes.run("1", context=ctx)
    assert again.error is not None and again.error.name == "KernelDied", "a dead context stays dead"
    ci.codes.delete_context(ctx.id)
    fresh = ci.codes.create_context("python")
    assert texts(ci.codes.run("2 + 2", context=fresh)) == ["4"]
    ci.codes.delete_context(fresh.id)
    # the default context is replaced transparently once its kernel died
    assert ci.codes.run("import os; os._exit(1)").error.name == "KernelDied"
    assert texts(ci.codes.run("'back'")) == ["'back'"]


def test_out_of_memory_kernel_is_reported(server, make_sandbox):
    from code_interpreter import CodeInterpreterSync
    server.import_image(W.JUPYTER_IMAGE_NAME, require_jupyter_rootfs())
    sbx = make_sandbox(W.JUPYTER_IMAGE_NAME, resource={"cpu": "1", "memory": "256Mi"})
    ci = CodeInterpreterSync.create(sbx)
    ctx = ci.codes.create_context("python")
    hog = "hog = b'x' * (1024 ** 3)"
    if server.gvisor:
        # Under gVisor the memory cgroup holds the whole sandbox (its user-space kernel included), so
        # the host's OOM killer ends the sandbox itself: the run is cut off and the sandbox is Failed.
        try:
            ex = ci.codes.run(hog, context=ctx)
            assert ex.error is not None
        except SandboxException:
            pass
        assert W.wait_until(lambda: sbx.get_info().status.state == "Failed", timeout=30)
        return
    ex = ci.codes.run(hog, context=ctx)
    assert ex.error is not None and ex.error.name == "KernelDied", ex.error
    assert "out of memory" in ex.error.value, ex.error.value
    fresh = ci.codes.create_context("python")
    assert texts(ci.codes.run("'alive'", context=fresh)) == ["'alive'"]


# --- bad input and images without kernels ------------------------------------------------------------

def test_bad_requests(code_sandbox):
    sbx, _ = code_sandbox
    assert raw_run(sbx, {"code": "  "})[0] == 400
    status, body = raw_run(sbx, {"code": "1", "context": {"id": "nope", "language": "python"}})
    assert status == 404 and body[0]["code"] == "CONTEXT_NOT_FOUND"
    r = execd(sbx, "POST", "/code/context", json={"language": "cobol"})
    assert r.status_code == 400 and r.json()["code"] == "NOT_SUPPORTED"
    assert "cobol" in r.json()["message"] and "python3" in r.json()["message"]
    r = execd(sbx, "POST", "/code/context", json={"language": "python", "cwd": "/no/such/dir"})
    assert r.status_code == 400
    assert execd(sbx, "DELETE", "/code").status_code == 400
    assert execd(sbx, "DELETE", "/code", params={"id": "nope"}).status_code == 404


def test_image_without_kernels_fails_health_check_clearly(make_sandbox, test_image):
    # (the debootstrap image: no kernel, no JDK, no Go; the `host` image has the host's JDK and Go,
    # which test_code_tools drives)
    from code_interpreter import CodeInterpreterSync
    sbx = make_sandbox(test_image)
    ci = CodeInterpreterSync.create(sbx, skip_health_check=True)
    assert not ci.is_healthy(), "nothing may listen on the Jupyter port when no kernel can start"
    r = execd(sbx, "POST", "/code/context", json={"language": "python"})
    assert r.status_code == 400 and r.json()["code"] == "NOT_SUPPORTED"
    assert "python3-ipykernel" in r.json()["message"]


def test_deleting_the_sandbox_ends_its_kernels(server, make_sandbox):
    from code_interpreter import CodeInterpreterSync
    server.import_image(W.JUPYTER_IMAGE_NAME, require_jupyter_rootfs())
    sbx = make_sandbox(W.JUPYTER_IMAGE_NAME)
    ci = CodeInterpreterSync.create(sbx)
    ctx = ci.codes.create_context("python")
    assert ci.codes.run("1", context=ctx).error is None
    marker = f"kernel-{ctx.id}.json"
    if not server.gvisor:  # gVisor's processes are not host processes
        assert W.pids_with_cmdline(marker), "the kernel runs"
    sbx.kill()
    assert W.wait_until(lambda: not W.pids_with_cmdline(marker), timeout=20)


# --- the CLI verb -------------------------------------------------------------------------------------

def test_cli_code_run(server, code_sandbox, tmp_path):
    sbx, _ = code_sandbox
    base = [str(W.warren_bin()), "code", "run", sbx.id, "--domain", server.domain, "--api-key", server.api_key]
    ok = subprocess.run(base + ["import matplotlib.pyplot as plt\nplt.plot([1])\nplt.show()\nprint('hi')\n6 * 7",
                                "--save-results", str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "hi\n" in ok.stdout and "42" in ok.stdout
    pngs = list(tmp_path.glob("result-*.png"))
    assert pngs and pngs[0].read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run(base + ["-"], input="raise ValueError('boom')", capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1
    assert "ValueError" in bad.stderr and "boom" in bad.stderr
    missing = subprocess.run(base[:3] + ["no-such-sandbox"] + base[4:] + ["1"], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode != 0 and "no-such-sandbox" in missing.stderr
