// The credential vault and a port-scoped egress rule through the official TypeScript SDK
// (npm @alibaba-group/opensandbox 0.1.11, which has `sandbox.credentialVault` and passes rule fields
// it does not model). The SDK calls the egress surface (port 18080), whose codes are the reference
// sidecar's: a stale revision is 409, a POST replaces the vault, a deleted vault reads as empty.
// Run by tests/e2e/test_egress.py against a server on the fake internet.
// Usage: node vault.mjs DOMAIN API_KEY IMAGE FETCH_COMMAND SECRET ADDRESS
import { ConnectionConfig, Sandbox } from "@alibaba-group/opensandbox";
const [domain, apiKey, image, fetch, secret, address] = process.argv.slice(2);
const config = new ConnectionConfig({ domain, apiKey });
const fail = (why) => { throw new Error(why); };
const status = async (promise) => {
  try { await promise; return 0; } catch (e) { return e.statusCode ?? -1; }
};
const sandbox = await Sandbox.create({
  connectionConfig: config, image, timeoutSeconds: 600,
  networkPolicy: { defaultAction: "deny", egress: [
    { action: "allow", target: "allowed.test" },
    { action: "allow", target: address, ports: [443] },
  ] },
  credentialProxy: { enabled: true },
});
try {
  const vault = sandbox.credentialVault;
  const state = await vault.create({
    credentials: [{ name: "api", source: { value: secret } }],
    bindings: [{ name: "ts", match: { hosts: ["allowed.test"], paths: ["/v1/*"] },
                 auth: { type: "bearer", credential: "api" } }],
  });
  if (state.revision !== 1) fail(`revision ${state.revision}`);
  if (JSON.stringify(state).includes(secret)) fail("the secret came back in the vault's state");
  const run = await sandbox.commands.run(`${fetch} https://allowed.test/v1/from-ts`);
  const out = run.logs.stdout.map((m) => m.text).join("");
  if (!out.includes("auth=Bearer [REDACTED]")) fail(`not injected (or not redacted): ${out} ${JSON.stringify(run.error)}`);
  const creds = await vault.listCredentials();
  const binding = await vault.getBinding("ts");
  if (creds.map((c) => c.name).join() !== "api" || binding.name !== "ts") fail("listing");
  const patched = await vault.patch({ expectedRevision: 1,
    credentials: { add: [{ name: "other", source: { value: secret + "-2" } }] } });
  if (patched.revision !== 2) fail(`patched revision ${patched.revision}`);
  const stale = await status(vault.patch({ expectedRevision: 1, bindings: { delete: ["ts"] } }));
  const again = await status(vault.create({ credentials: [], bindings: [] }));
  // Port-scoped rules read back exactly, ports and all; a patch merges on (target, ports).
  await sandbox.patchEgressRules([{ action: "deny", target: address, ports: [8443] }]);
  const policy = await sandbox.getEgressPolicy();
  const ports = policy.egress.filter((r) => r.target === address).map((r) => `${r.action}:${JSON.stringify(r.ports)}`);
  if (ports.sort().join() !== "allow:[443],deny:[8443]") fail(`rules read back as ${JSON.stringify(policy.egress)}`);
  await vault.delete();
  const after = await vault.get();
  if ((after.bindings ?? []).length || (after.credentials ?? []).length) fail(`after delete: ${JSON.stringify(after)}`);
  console.log(JSON.stringify({ id: sandbox.id, stale, again }));
} finally {
  await sandbox.kill();
  await sandbox.close();
}
