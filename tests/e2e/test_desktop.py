"""Desktops for GUI agents: a sandbox created with `extensions.desktop` is Running with its X
server answering (Xvfb, a window manager, VNC with noVNC), and execd's computer-use API drives it
over the X protocol — screenshots as PNG (whole, a region, scaled), the cursor, mouse moves,
clicks, drags and scrolls, key chords and Unicode text, windows listed and focused, programs
launched, waiting until the screen is still. A real xterm takes what is typed, a Tk button writes a
file, painted pixels read back exact. Bad input is a clear 4xx. The CLI and MCP tools drive it; a
real Chromium on the host opens its live view by a signed URL; a warm pool holds desktops.

The desktop is execd's, the same on every runtime: it runs once per image source, on the first
runtime of each — with Warren's image store, the host's Debian packages through the `host` image
(the embedded runtime); with an engine's, the desktop image (build-test-image's desktop variant, on
Docker). Client paths (CLI, MCP) run on the first runtime only."""

from __future__ import annotations

import json
import struct
import subprocess
import time
import uuid
import zlib

import pytest

import warren_e2e as W


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    return struct.unpack(">II", data[16:24])


def png_pixels(data: bytes) -> tuple[int, int, bytes]:
    """RGB rows of an 8-bit RGB PNG (filter bytes undone for the None/Sub/Up filters used here)."""
    w, h = png_size(data)
    chunks, i = [], 8
    while i < len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        if kind == b"IDAT":
            chunks.append(data[i + 8:i + 8 + n])
        i += 12 + n
    raw = zlib.decompress(b"".join(chunks))
    stride, out, prev = w * 3, bytearray(), bytearray(w * 3)
    for y in range(h):
        f, row = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            a = row[x - 3] if x >= 3 else 0
            b, c = prev[x], prev[x - 3] if x >= 3 else 0
            if f == 1:
                row[x] = (row[x] + a) & 255
            elif f == 2:
                row[x] = (row[x] + b) & 255
            elif f == 3:
                row[x] = (row[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                row[x] = (row[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out += row
        prev = row
    return w, h, bytes(out)


def desktop_image(server) -> str:
    """The host's own programs through the `host` image where images come from Warren's store; the
    desktop image where an engine brings them. Once per image source (see the module's docstring)."""
    server.run_once("the desktop is execd's, the same on every runtime: once per image source",
                    imageSource=server.caps.image_source)
    if server.caps.image_source == "store":
        return server.sandbox_image("host")
    rootfs = W.desktop_rootfs()
    if not (rootfs / "usr/bin/Xvfb").exists():
        pytest.fail(f"no desktop image at {rootfs} (scripts/build-test-image {rootfs} desktop)", pytrace=False)
    server.import_image(W.DESKTOP_IMAGE_NAME, rootfs)
    return W.DESKTOP_IMAGE_NAME


def client_only(server) -> None:
    server.run_once("a client's path (CLI, MCP), the same on every runtime")


@pytest.fixture(scope="module")
def desk(server):
    with server.client() as api:
        r = api.post("/v1/sandboxes", json=W.create_body(desktop_image(server),
                                                         extensions={"desktop": "1024x768"}))
        assert r.status_code == 202, r.text
        sid = r.json()["id"]
        W.track_sandbox(sid)
        st = W.wait_until(lambda: (s := api.get(f"/v1/sandboxes/{sid}").json()["status"])["state"]
                          in ("Running", "Failed") and s, 60, message="the desktop sandbox")
        assert st["state"] == "Running", st
        yield api, sid
        api.delete(f"/v1/sandboxes/{sid}")


def call(desk, method: str, path: str, **kw):
    api, sid = desk
    return api.request(method, f"/v1/sandboxes/{sid}/proxy/44772/desktop{path}", **kw)


def test_the_desktop_is_up_when_the_sandbox_is_running(desk):
    info = call(desk, "GET", "").json()
    assert info == {"display": ":0", "width": 1024, "height": 768, "vnc": True, "capture": "shm"}, info
    shot = call(desk, "GET", "/screenshot")
    assert shot.status_code == 200 and shot.headers["content-type"] == "image/png"
    assert png_size(shot.content) == (1024, 768)
    half = call(desk, "GET", "/screenshot", params={"scale": 0.5})
    assert png_size(half.content) == (512, 384)
    region = call(desk, "GET", "/screenshot", params={"x": 10, "y": 20, "width": 300, "height": 200})
    assert png_size(region.content) == (300, 200)
    # Commands find the display.
    api, sid = desk
    r = api.post(f"/v1/sandboxes/{sid}/proxy/44772/command", json={"command": "echo $DISPLAY"})
    assert ":0" in r.text


def test_an_agent_launches_types_into_and_finds_a_window(desk, server):
    title = "warren-e2e-xterm"
    r = call(desk, "POST", "/launch", json={"command": f"xterm -T {title} -geometry 80x20+50+50"})
    assert r.status_code == 200 and r.json()["pid"] > 0, r.text

    def window():
        return next((w for w in call(desk, "GET", "/windows").json() if w["title"] == title), None)
    win = W.wait_until(window, 20, interval=0.2, message="the xterm window")
    assert win["width"] > 100 and win["height"] > 100, win
    assert call(desk, "POST", f"/windows/{win['id']}/focus").status_code == 204
    W.wait_until(lambda: window()["focused"], 10, interval=0.2, message="the xterm focused")
    # What the agent types reaches the program: ASCII, shifted characters and Unicode.
    r = call(desk, "POST", "/keyboard", json={"action": "type", "text": "echo 'Typed: héllo €!' > /tmp/typed"})
    assert r.status_code == 204, r.text
    assert call(desk, "POST", "/keyboard", json={"action": "key", "keys": ["Return"]}).status_code == 204
    api, sid = desk

    def typed():
        r = api.get(f"/v1/sandboxes/{sid}/proxy/44772/files/download", params={"path": "/tmp/typed"})
        return r.status_code == 200 and r.text
    assert W.wait_until(typed, 10, interval=0.2, message="what was typed") == "Typed: héllo €!\n"
    # Characters no key has take turns on a few scratch keycodes: more of them than there are
    # scratch keycodes all arrive, in order, none lost to a key mapped again too soon.
    many = "".join(chr(c) for c in range(0x100, 0x130))  # Latin Extended-A: 48 letters
    r = call(desk, "POST", "/keyboard", json={"action": "type", "text": f"echo {many} > /tmp/many\n"})
    assert r.status_code == 204, r.text
    assert W.wait_until(lambda: (r := api.get(f"/v1/sandboxes/{sid}/proxy/44772/files/download",
                                               params={"path": "/tmp/many"})).status_code == 200 and r.text,
                        20, interval=0.2, message="the many characters") == many + "\n"
    # A chord: ctrl+u clears the line in the shell, so only what follows runs.
    call(desk, "POST", "/keyboard", json={"action": "type", "text": "echo wrong > /tmp/chord"})
    call(desk, "POST", "/keyboard", json={"action": "key", "keys": ["ctrl+u"]})
    call(desk, "POST", "/keyboard", json={"action": "type", "text": "echo right > /tmp/chord\n"})
    assert W.wait_until(lambda: (r := api.get(f"/v1/sandboxes/{sid}/proxy/44772/files/download",
                                               params={"path": "/tmp/chord"})).status_code == 200 and r.text,
                        10, interval=0.2, message="the chord") == "right\n"
    # The window shows on the screen: its pixels are not the bare background's.
    call(desk, "POST", "/wait", json={"still_ms": 300, "timeout_ms": 5000})
    w, h, px = png_pixels(call(desk, "GET", "/screenshot", params={
        "x": win["x"], "y": win["y"], "width": win["width"], "height": win["height"]}).content)
    assert len({px[i:i + 3] for i in range(0, len(px), 3)}) > 1, "the window's region is one colour"
    # The sandbox's timeline has what the agent did, in order: the launch, the typing, the keys.
    events = W.timeline(server, sid)
    launched = [e for e in events if e["kind"] == "desktop.launch"]
    assert any(e["command"] == f"xterm -T {title} -geometry 80x20+50+50" for e in launched), launched
    inputs = [(e.get("action"), e.get("text") or e.get("keys")) for e in events if e["kind"] == "desktop.input"]
    assert inputs[:2] == [("type", "echo 'Typed: héllo €!' > /tmp/typed"), ("key", ["Return"])], inputs
    assert ("key", ["ctrl+u"]) in inputs


def test_the_mouse_moves_clicks_drags_and_scrolls(desk):
    for body, at in (({"action": "move", "x": 100, "y": 120}, (100, 120)),
                     ({"action": "click", "x": 300, "y": 200, "button": "right"}, (300, 200)),
                     ({"action": "click", "x": 310, "y": 210, "count": 2}, (310, 210)),
                     ({"action": "drag", "from": {"x": 20, "y": 20}, "to": {"x": 400, "y": 300}}, (400, 300)),
                     ({"action": "scroll", "x": 500, "y": 400, "dy": 3}, (500, 400)),
                     ({"action": "scroll", "dx": -2}, (500, 400))):
        r = call(desk, "POST", "/mouse", json=body)
        assert r.status_code == 200 and (r.json()["x"], r.json()["y"]) == at, (body, r.text)
        if body.get("button") == "right":
            # A right click on the bare desktop opens the window manager's menu: closed before
            # the next click could pick one of its items.
            call(desk, "POST", "/keyboard", json={"action": "key", "keys": ["Escape"]})
    assert call(desk, "GET", "/cursor").json() == {"x": 500, "y": 400}


def test_waiting_until_the_screen_is_still(desk):
    r = call(desk, "POST", "/wait", json={"still_ms": 200, "timeout_ms": 5000})
    assert r.status_code == 200 and r.json()["still"] is True, r.text
    # A clock ticking on screen is never still: the wait says so at its timeout.
    pid = call(desk, "POST", "/launch", json={"command": "xterm -T ticking -geometry 20x2+600+10 -e "
                                                         "sh -c 'while :; do date +%N; sleep 0.05; done'"}).json()["pid"]
    time.sleep(1)
    r = call(desk, "POST", "/wait", json={"still_ms": 1000, "timeout_ms": 2000})
    assert r.status_code == 200 and r.json()["still"] is False and r.json()["waited_ms"] >= 2000, r.text
    # The clock goes (its process group: launch starts each program in one of its own).
    api, sid = desk
    api.post(f"/v1/sandboxes/{sid}/proxy/44772/command", json={"command": f"kill -- -{pid}"})
    r = call(desk, "POST", "/wait", json={"still_ms": 300, "timeout_ms": 5000})
    assert r.json()["still"] is True, r.text


def test_bad_input_is_a_clear_4xx(desk, server):
    for path, body in (("/mouse", {"action": "move", "x": 5000, "y": 10}),
                       ("/mouse", {"action": "click", "x": -1, "y": 10}),
                       ("/mouse", {"action": "click", "x": 10}),
                       ("/mouse", {"action": "teleport", "x": 1, "y": 1}),
                       ("/mouse", {"action": "click", "x": 1, "y": 1, "count": 9}),
                       ("/keyboard", {"action": "key", "keys": ["ctrl+hyperdrive"]}),
                       ("/keyboard", {"action": "key", "keys": []}),
                       ("/launch", {"url": "javascript:alert(1)"}),
                       ("/wait", {"still_ms": 0})):
        r = call(desk, "POST", path, json=body)
        assert r.status_code == 400 and r.json()["code"] and r.json()["message"], (path, body, r.text)
    # Widths that wrap a 32-bit sum, or a u16, are off the screen too; so is a wheel of i32::MIN.
    for path, body in (("/mouse", {"action": "scroll", "dx": -2**31}),
                       ("/mouse", {"action": "scroll", "dy": 2**31 - 1}),
                       ("/wait", {"still_ms": 10, "timeout_ms": 200_000})):
        r = call(desk, "POST", path, json=body)
        assert r.status_code == 400 and r.json()["code"] and r.json()["message"], (path, body, r.text)
    for params in ({"x": 2000}, {"scale": 2}, {"x": 1000, "width": 100}, {"x": 10, "width": 2**32 - 5},
                   {"width": 2**31 + 1280, "height": 800, "scale": 0.9}, {"width": 65536 + 100},
                   {"x": "abc"}, {"scale": "nan"}, {"colour": "red"}):
        r = call(desk, "GET", "/screenshot", params=params)
        assert r.status_code == 400 and r.json()["code"] and r.json()["message"], (params, r.text)
    assert call(desk, "POST", "/windows/123456/focus").status_code == 400
    r = call(desk, "POST", "/windows/abc/focus")
    assert r.status_code == 400 and r.json()["code"], r.text
    # Still up after all that.
    assert call(desk, "GET", "/cursor").status_code == 200
    with server.client() as api:
        # A sandbox without a desktop (its image has the programs; the create did not ask) says how
        # to get one.
        r = api.post("/v1/sandboxes", json=W.create_body(desktop_image(server)))
        sid = r.json()["id"]
        W.track_sandbox(sid)
        W.wait_until(lambda: api.get(f"/v1/sandboxes/{sid}").json()["status"]["state"] == "Running", 30)
        r = api.get(f"/v1/sandboxes/{sid}/proxy/44772/desktop/screenshot")
        assert r.status_code == 409 and r.json()["code"] == "DESKTOP_NOT_RUNNING", r.text
        assert "extensions.desktop" in r.json()["message"]
        api.delete(f"/v1/sandboxes/{sid}")
        # A size that is none is refused at create, nothing made.
        r = api.post("/v1/sandboxes", json=W.create_body(desktop_image(server),
                                                         extensions={"desktop": "99999x3"}))
        W.assert_error_body(r, codes=[400])
        assert "desktop" in r.json()["message"]


def test_the_cli_drives_the_desktop(desk, server, tmp_path):
    """`warren desktop screenshot ID > shot.png`, `launch`, `type`, `key`, `click`, `windows`."""
    client_only(server)
    api, sid = desk

    def cli(*args: str, text: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run([str(server.bin), "desktop", *args, "--domain", server.domain,
                              "--api-key", server.api_key], capture_output=True, text=text, timeout=60)
        assert res.returncode == 0, (args, res.stdout, res.stderr)
        return res
    shot = cli("screenshot", sid, "--scale", "0.25", text=False).stdout
    assert png_size(shot) == (256, 192)
    cli("screenshot", sid, "--width", "64", "--height", "32", "--out", str(tmp_path / "r.png"))
    assert png_size((tmp_path / "r.png").read_bytes()) == (64, 32)
    assert int(json.loads(cli("launch", sid, "xterm -T cli-xterm -geometry 60x10+200+300", "-o", "json").stdout)["pid"]) > 0
    win = W.wait_until(lambda: next((w for w in json.loads(cli("windows", sid, "-o", "json").stdout)
                                     if w["title"] == "cli-xterm"), None), 20, interval=0.3, message="the window")
    assert "cli-xterm" in cli("windows", sid).stdout
    at = json.loads(cli("click", sid, str(win["x"] + 20), str(win["y"] + 20), "-o", "json").stdout)
    assert at == {"x": win["x"] + 20, "y": win["y"] + 20}
    cli("type", sid, "echo from-the-cli > /tmp/cli-typed")
    cli("key", sid, "Return")
    got = W.wait_until(lambda: (r := api.get(f"/v1/sandboxes/{sid}/proxy/44772/files/download",
                                             params={"path": "/tmp/cli-typed"})).status_code == 200 and r.text,
                       10, interval=0.2, message="what the CLI typed")
    assert got == "from-the-cli\n"
    # An unknown key name fails with the server's message and a non-zero exit.
    bad = subprocess.run([str(server.bin), "desktop", "key", sid, "ctrl+hyperdrive", "--domain", server.domain,
                          "--api-key", server.api_key], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "hyperdrive" in bad.stderr, (bad.stdout, bad.stderr)


def test_mcp_computer_use_tools(desk, server):
    """`warren mcp`'s desktop tools, as the official MCP client calls them: a screenshot is an
    image the model sees; click, move, drag, scroll, type and key take computer-use shaped
    arguments; a bad key name is a tool error the model can read."""
    import asyncio
    import base64

    client_only(server)
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    api, sid = desk
    params = StdioServerParameters(command=str(server.bin),
                                   args=["mcp", "--domain", server.domain, "--api-key", server.api_key])

    async def run():
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()

            async def call(tool, **args):
                res = await s.call_tool(tool, dict(sandbox_id=sid, **args))
                assert not res.is_error, f"{tool}: {res.content}"
                return res

            shot = (await call("desktop_screenshot", scale=0.5)).content[0]
            assert shot.type == "image" and shot.mime_type == "image/png"
            assert png_size(base64.b64decode(shot.data)) == (512, 384)
            part = (await call("desktop_screenshot", region=[0, 0, 100, 50])).content[0]
            assert png_size(base64.b64decode(part.data)) == (100, 50)
            await call("desktop_launch", command="xterm -T mcp-xterm -geometry 60x10+100+400")

            async def window():
                ws = (await call("desktop_windows")).structured_content["windows"]
                return next((w for w in ws if w["title"] == "mcp-xterm"), None)
            for _ in range(100):
                if win := await window():
                    break
                await asyncio.sleep(0.2)
            assert win, "the xterm the MCP tool launched"
            at = (await call("desktop_click", coordinate=[win["x"] + 10, win["y"] + 10])).structured_content
            assert at == {"x": win["x"] + 10, "y": win["y"] + 10}
            await call("desktop_type", text="echo mcp-typed > /tmp/mcp-typed")
            await call("desktop_key", text="Return")
            assert (await call("desktop_move", coordinate=[5, 6])).structured_content == {"x": 5, "y": 6}
            got = (await call("desktop_drag", start_coordinate=[10, 10], coordinate=[40, 30])).structured_content
            assert got == {"x": 40, "y": 30}
            got = (await call("desktop_scroll", coordinate=[50, 60], scroll_direction="down")).structured_content
            assert got == {"x": 50, "y": 60}
            assert (await call("desktop_cursor_position")).structured_content == {"x": 50, "y": 60}
            bad = await s.call_tool("desktop_key", {"sandbox_id": sid, "text": "ctrl+hyperdrive"})
            assert bad.is_error and "hyperdrive" in bad.content[0].text, bad
            bad = await s.call_tool("desktop_click", {"sandbox_id": sid, "coordinate": [99999, 1]})
            assert bad.is_error, bad

    asyncio.run(run())
    got = W.wait_until(lambda: (r := api.get(f"/v1/sandboxes/{sid}/proxy/44772/files/download",
                                             params={"path": "/tmp/mcp-typed"})).status_code == 200 and r.text,
                       10, interval=0.2, message="what the MCP tool typed")
    assert got == "mcp-typed\n"


@pytest.fixture(scope="module")
def viewable(work_root, server):
    """A server whose endpoints are signed host names under `localhost:PORT` (Chromium resolves
    every `*.localhost` to loopback itself), and a desktop sandbox on it."""
    server.run_once("the live view is noVNC's behind Warren's proxy: once per image source",
                    imageSource=server.caps.image_source)
    s = W.WarrenServer(server.runtime, work_root, f"desktop-view-{uuid.uuid4().hex[:6]}")
    port = W.free_port()
    s.more_config = f'[endpoints]\ndomain = "localhost:{port}"\nmax_signed_seconds = 3600\n'
    s.check_binary()
    s.start(port=port)
    try:
        with s.client() as api:
            r = api.post("/v1/sandboxes", json=W.create_body(desktop_image(s),
                                                             extensions={"desktop": "1024x768"}))
            assert r.status_code == 202, r.text
            sid = r.json()["id"]
            W.track_sandbox(sid)
            W.wait_until(lambda: api.get(f"/v1/sandboxes/{sid}").json()["status"]["state"] == "Running", 60)
            yield s, api, sid
            api.delete(f"/v1/sandboxes/{sid}")
    finally:
        s.stop()


VIEW_COLOUR = (0x1E, 0x90, 0xFF)


def test_a_signed_url_opens_the_live_view_in_a_real_browser(viewable, tmp_path):
    """noVNC through a signed URL, in headless Chromium on the host with no header, cookie or key:
    the page shows the sandbox's desktop (a window the test made, in a colour it chose). The
    interactive link (port 6080) moves the sandbox's pointer; the view-only one (6081) cannot, even
    when the page is told it may: its VNC server takes no input."""
    from playwright.sync_api import sync_playwright

    srv, api, sid = viewable
    desk_call = lambda method, path, **kw: api.request(method, f"/v1/sandboxes/{sid}/proxy/44772/desktop{path}", **kw)  # noqa: E731
    hexcol = "#%02x%02x%02x" % VIEW_COLOUR
    desk_call("POST", "/launch", json={"command": f"xterm -T warren-live-view -bg '{hexcol}' -geometry 60x20+200+150"})
    W.wait_until(lambda: any(w["title"] == "warren-live-view" for w in desk_call("GET", "/windows").json()),
                 20, interval=0.2, message="the window to show")
    desk_call("POST", "/mouse", json={"action": "move", "x": 5, "y": 5})

    def signed(port: int) -> str:
        r = api.get(f"/v1/sandboxes/{sid}/endpoints/{port}", params={"expires": str(int(time.time()) + 600)})
        assert r.status_code == 200 and not r.json().get("headers"), r.text
        return r.json()["endpoint"]

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=W.chromium_binary(),
                                    args=["--no-sandbox", *W.CHROMIUM_LOOPBACK_FLAGS])
        try:
            for port, interactive in ((6080, True), (6081, False)):
                page = browser.new_context(viewport={"width": 1200, "height": 900}).new_page()
                # view_only=0 even for the view-only link: the page may try; the server refuses.
                page.goto(f"http://{signed(port)}/vnc.html?autoconnect=1&resize=off&view_only=0")
                canvas = page.locator("#noVNC_container canvas")
                canvas.wait_for(timeout=30_000)
                W.wait_until(lambda: (canvas.bounding_box() or {}).get("width") == 1024, 30, interval=0.2,
                             message="noVNC's canvas at the desktop's size")
                shot_path = tmp_path / f"view-{port}.png"

                def shows_the_window():
                    page.screenshot(path=str(shot_path))
                    w, h, px = png_pixels(shot_path.read_bytes())
                    near = sum(1 for i in range(0, len(px), 3)
                               if all(abs(px[i + k] - VIEW_COLOUR[k]) < 24 for k in range(3)))
                    return near > 60_000 and near  # the xterm is ~480x300 of that colour
                W.wait_until(shows_the_window, 30, interval=0.5,
                             message=f"the page ({port}) to show the window (screenshot: {shot_path})")
                box = canvas.bounding_box()
                page.mouse.click(box["x"] + 700, box["y"] + 600)
                time.sleep(1)
                at = desk_call("GET", "/cursor").json()
                if interactive:
                    assert at == {"x": 700, "y": 600}, at
                    desk_call("POST", "/mouse", json={"action": "move", "x": 5, "y": 5})
                else:
                    assert at == {"x": 5, "y": 5}, f"the view-only link moved the pointer: {at}"
                page.context.close()
        finally:
            browser.close()


TK_APP = r"""
import sys, tkinter as tk
root = tk.Tk()
root.title("warren-tk")
root.geometry("300x200+600+400")
tk.Frame(root, bg="#ff8000", width=300, height=100).pack(fill="x")
def clicked():
    open("/tmp/tk-clicked", "w").write("clicked\n")
tk.Button(root, text="Write", command=clicked).pack(fill="both", expand=True)
root.mainloop()
"""


def test_a_click_on_a_tk_button_and_known_pixels(desk):
    """A small Tk app: a click on its button writes a file; the colour it paints is exact in a
    screenshot of its region (Xvfb is 24-bit: what was drawn is what is read)."""
    api, sid = desk
    r = api.post(f"/v1/sandboxes/{sid}/proxy/44772/files/upload", files={
        "metadata": (None, '{"path": "/tmp/tk_app.py"}', "application/json"),
        "file": ("tk_app.py", TK_APP.encode(), "application/octet-stream")})
    assert r.status_code == 200, r.text
    call(desk, "POST", "/launch", json={"command": "python3 /tmp/tk_app.py"})
    win = W.wait_until(lambda: next((w for w in call(desk, "GET", "/windows").json() if w["title"] == "warren-tk"),
                                    None), 20, interval=0.2, message="the Tk window")
    call(desk, "POST", "/wait", json={"still_ms": 300, "timeout_ms": 5000})
    # The orange band: the window's top 100 pixels, exactly #ff8000 inside.
    shot = call(desk, "GET", "/screenshot", params={"x": win["x"] + 10, "y": win["y"] + 10,
                                                     "width": win["width"] - 20, "height": 80})
    w, h, px = png_pixels(shot.content)
    assert {px[i:i + 3] for i in range(0, len(px), 3)} == {bytes([0xFF, 0x80, 0x00])}, "not all orange"
    # The button: the window's lower half.
    r = call(desk, "POST", "/mouse", json={"action": "click", "x": win["x"] + win["width"] // 2,
                                            "y": win["y"] + 150})
    assert r.status_code == 200, r.text
    got = W.wait_until(lambda: (r := api.get(f"/v1/sandboxes/{sid}/proxy/44772/files/download",
                                             params={"path": "/tmp/tk-clicked"})).status_code == 200 and r.text,
                       10, interval=0.2, message="the button's file")
    assert got == "clicked\n"


def test_claim_a_desktop_from_a_warm_pool(server):
    """A pool whose template asks for a desktop holds sandboxes with the desktop up: a claim is
    Running with its display answering at once."""
    image = desktop_image(server)
    with server.client() as api:
        name = f"desk-{uuid.uuid4().hex[:8]}"
        template = W.create_body(image, extensions={"desktop": "800x600"})
        template["env"] = {"E2E_DESK_POOL": name}
        r = api.post("/v1/pools", json={"name": name, "template": template, "maxWaitSeconds": 10,
                                        "capacitySpec": {"bufferMin": 1, "bufferMax": 1, "poolMin": 0, "poolMax": 2}})
        assert r.status_code == 201, r.text
        try:
            W.wait_until(lambda: api.get(f"/v1/pools/{name}").json()["status"]["available"] >= 1, 120,
                         interval=0.2, message="a warm desktop")
            t0 = time.perf_counter()
            r = api.post("/v1/sandboxes", json={**template, "extensions": {"poolRef": name}})
            assert r.status_code == 202, r.text
            sid = r.json()["id"]
            W.track_sandbox(sid)
            shot = api.get(f"/v1/sandboxes/{sid}/proxy/44772/desktop/screenshot")
            first_ms = (time.perf_counter() - t0) * 1000
            assert shot.status_code == 200 and png_size(shot.content) == (800, 600), shot.text[:200]
            assert api.get(f"/v1/pools/{name}").json()["status"]["allocated"] == 1
            print(f"warm pool: claim to first screenshot {first_ms:.1f} ms")
            api.delete(f"/v1/sandboxes/{sid}")
        finally:
            api.delete(f"/v1/pools/{name}")


def test_recording_a_timeline_of_screenshots(desk, server):
    """A recording writes a PNG each time the screen changed and a timeline line for it; the files
    API reads both; a still screen adds nothing; it stops on request and says what it made."""
    api, sid = desk
    files = f"/v1/sandboxes/{sid}/proxy/44772/files/download"
    folder = f"/tmp/rec-{uuid.uuid4().hex[:6]}"
    r = call(desk, "POST", "/recording", json={"dir": folder, "fps": 5, "scale": 0.5})
    assert r.status_code == 201 and r.json()["running"] is True and r.json()["dir"] == folder, r.text
    # One at a time.
    r = call(desk, "POST", "/recording", json={"fps": 5})
    assert r.status_code == 409 and r.json()["code"] == "RECORDING_RUNNING", r.text
    time.sleep(1)
    still = call(desk, "GET", "/recording").json()["frames"]
    time.sleep(1)
    assert call(desk, "GET", "/recording").json()["frames"] == still, "a still screen made frames"
    call(desk, "POST", "/launch", json={"command": "xterm -T rec -geometry 40x10+10+10 -e "
                                                   "sh -c 'for i in 1 2 3 4 5 6; do echo $i; sleep 0.3; done; sleep 60'"})
    time.sleep(3)
    done = call(desk, "DELETE", "/recording")
    assert done.status_code == 200, done.text
    rec = done.json()
    assert rec["running"] is False and rec["frames"] >= still + 3 and rec["duration_ms"] >= 4000, rec
    lines = api.get(files, params={"path": f"{folder}/timeline.jsonl"}).text.splitlines()
    timeline = [json.loads(x) for x in lines]
    assert [f["frame"] for f in timeline] == list(range(1, rec["frames"] + 1)), timeline
    assert all(a["t_ms"] < b["t_ms"] for a, b in zip(timeline, timeline[1:])), timeline
    first, last = (api.get(files, params={"path": f"{folder}/{f['file']}"}).content for f in (timeline[0], timeline[-1]))
    assert png_size(first) == png_size(last) == (512, 384)
    assert first != last
    # Stopped is stopped: its status stays readable, nothing more is written.
    time.sleep(1)
    assert call(desk, "GET", "/recording").json() == rec
    for body in ({"fps": 0}, {"fps": 30}, {"max_seconds": 0}, {"scale": 3}, {"dir": "/proc/1/nope"}, {"speed": 1}):
        r = call(desk, "POST", "/recording", json=body)
        assert r.status_code == 400 and r.json()["message"], (body, r.text)
