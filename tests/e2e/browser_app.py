"""A web app the browser tests run inside a sandbox (python3, stdlib only): a page at `/` whose
script loads `/app.js` (an absolute path: found only when the app is served at `/`), opens a
WebSocket at `ws` (relative to the page) and reports what came back by fetching `report?r=…`;
`/ws` echoes one message; `/report` appends its `r` to /tmp/reports for the test to read.

Usage: python3 browser_app.py PORT
"""

import asyncio
import base64
import hashlib
import sys
import urllib.parse

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

PAGE = b"""<!doctype html>
<html><head><title>warren browser test</title></head><body><div id="out">loading</div>
<script src="/app.js"></script>
<script>
const report = (r) => fetch('report?r=' + encodeURIComponent(r));
const u = new URL('ws', location.href);
u.protocol = location.protocol === 'https:' ? 'wss:' : 'ws:';
const ws = new WebSocket(u.href);
ws.onopen = () => ws.send('ping');
ws.onmessage = (e) => report(e.data + '|abs=' + (window.fromAbsolute || 'no') + '|path=' + location.pathname);
ws.onerror = () => report('ws-error|path=' + location.pathname);
</script></body></html>
"""


async def read_frame(reader: asyncio.StreamReader) -> str:
    b0, b1 = await reader.readexactly(2)
    length = b1 & 0x7F
    if length == 126:
        length = int.from_bytes(await reader.readexactly(2), "big")
    elif length == 127:
        length = int.from_bytes(await reader.readexactly(8), "big")
    mask = await reader.readexactly(4) if b1 & 0x80 else b"\0\0\0\0"
    data = await reader.readexactly(length)
    return bytes(c ^ mask[i % 4] for i, c in enumerate(data)).decode()


def frame(text: str) -> bytes:
    data = text.encode()
    assert len(data) < 126
    return bytes([0x81, len(data)]) + data


def answer(writer: asyncio.StreamWriter, status: str, body: bytes, ctype: str) -> None:
    writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + body)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        lines = head.split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip()
                   for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
        path, _, query = target.partition("?")
        if path.endswith("/ws") and headers.get("upgrade", "").lower() == "websocket":
            accept = base64.b64encode(
                hashlib.sha1((headers["sec-websocket-key"] + GUID).encode()).digest()).decode()
            writer.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                          f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n").encode())
            message = await read_frame(reader)
            writer.write(frame(f"echo:{message}"))
            await writer.drain()
            await asyncio.sleep(1)
        elif path.endswith("/report"):
            r = urllib.parse.parse_qs(query).get("r", [""])[0]
            with open("/tmp/reports", "a") as f:
                f.write(r + "\n")
            answer(writer, "200 OK", b"ok", "text/plain")
        elif path.endswith("/setcookie"):
            body = b"cookies set"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Set-Cookie: wide=1; Domain=localhost; Path=/\r\nSet-Cookie: narrow=2; Path=/\r\n"
                         b"Service-Worker-Allowed: /\r\n"
                         + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        elif path == "/app.js":
            answer(writer, "200 OK", b"window.fromAbsolute = 'yes';", "text/javascript")
        elif path in ("/", "/index.html") or path.endswith("/"):
            answer(writer, "200 OK", PAGE, "text/html")
        else:
            answer(writer, "404 Not Found", f"app: no {method} {path}".encode(), "text/plain")
        await writer.drain()
    except Exception as e:  # noqa: BLE001 (a test app: say what broke, keep serving)
        print("error:", repr(e), file=sys.stderr, flush=True)
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()


asyncio.run(main())
