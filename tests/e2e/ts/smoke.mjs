// Smoke test of the official TypeScript SDK (npm @alibaba-group/opensandbox) against Warren:
// create, run a command, write and read a file, kill. Run by tests/e2e/test_official_clients.py
// from a folder where the SDK is installed (scripts/install-deps puts it in .ci/cache/ts-sdk).
// Usage: node smoke.mjs DOMAIN API_KEY IMAGE [isolation]
// With `isolation` (a runtime that offers isolated sessions), a second sandbox created with
// extensions {"bootstrap.execd.isolation": "enable"} runs code in a session.
import { ConnectionConfig, Sandbox } from "@alibaba-group/opensandbox";
const [domain, apiKey, image, isolation] = process.argv.slice(2);
const config = new ConnectionConfig({ domain, apiKey });
const sandbox = await Sandbox.create({ connectionConfig: config, image, timeoutSeconds: 600 });
try {
  const run = await sandbox.commands.run("echo hello-from-ts");
  const out = run.logs.stdout.map((m) => m.text).join("");
  if (!out.includes("hello-from-ts")) throw new Error(`unexpected stdout: ${JSON.stringify(out)}`);
  // framed as the reference frames it: a line per event, a blank line as "\n", the last line
  // without its terminator
  const lines = (await sandbox.commands.run("printf 'a\\nb\\n\\nc'")).logs.stdout.map((m) => m.text);
  if (JSON.stringify(lines) !== JSON.stringify(["a", "b", "\n", "c"]))
    throw new Error(`unexpected framing: ${JSON.stringify(lines)}`);
  // isolation: unavailable in Warren's sandboxes, and said so in a shape the SDK reads
  const caps = await sandbox.isolation.capabilities();
  if (caps.available !== false || !caps.message || caps.commit_supported !== false || caps.diff_supported !== false)
    throw new Error(`unexpected isolation capabilities: ${JSON.stringify(caps)}`);
  await sandbox.files.writeFiles([{ path: "/tmp/ts.txt", data: "written by ts", mode: 644 }]);
  const content = await sandbox.files.readFile("/tmp/ts.txt");
  if (content !== "written by ts") throw new Error(`unexpected file: ${JSON.stringify(content)}`);
  let isolated = null;
  if (isolation === "isolation") {
    const iso = await Sandbox.create({
      connectionConfig: config, image, timeoutSeconds: 600,
      extensions: { "bootstrap.execd.isolation": "enable" },
    });
    try {
      const caps = await iso.isolation.capabilities();
      if (caps.available !== true) throw new Error(`isolation unavailable: ${JSON.stringify(caps)}`);
      isolated = await iso.isolation.withSession({ workspace: { path: "/workspace" } }, async (s) => {
        await s.run("echo from-ts > /workspace/ts-session");
        const ex = await s.run("cat /workspace/ts-session; echo $$");
        return ex.logs.stdout.map((m) => m.text);
      });
      const outside = await iso.commands.run("test -e /workspace/ts-session && echo leaked || echo apart");
      if (outside.logs.stdout.map((m) => m.text).join("") !== "apart")
        throw new Error("a session's overlay write reached the sandbox");
    } finally {
      await iso.kill();
      await iso.close();
    }
  }
  const info = await sandbox.getInfo();
  console.log(JSON.stringify({ id: sandbox.id, state: info.status.state, stdout: out, content, isolated }));
} finally {
  await sandbox.kill();
  await sandbox.close();
}
