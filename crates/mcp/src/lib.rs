//! `warren mcp`: an MCP server (on the official Rust SDK, `rmcp`) that gives an agent sandboxes,
//! commands, files and code as tools. Tool names and parameters follow `opensandbox-mcp`, so agents
//! configured for it work unchanged. Over stdio by default, or streamable HTTP on a loopback port.
//!
//! A failing call (unknown sandbox, a command that cannot start, a server that is down) is a tool
//! error (`isError: true` with the reason), never a protocol error or a crash of this server.
//!
//! Why one file: 21 of opensandbox-mcp's tools, each a short call of the SDK beside its argument
//! struct, in one `#[tool_router]` block (one router per block) sharing `try_tool!` and the result
//! shapes; the desktop tools, a feature of their own, have their router in `desktop`.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::{tool, tool_handler, tool_router, ErrorData, ServerHandler, ServiceExt};
use schemars::JsonSchema;
use serde::Deserialize;
use warren_sdk::{
    Client, CodeTarget, CreateSandboxRequest, ImageSpec, ListQuery, Ownership, RunCommandRequest,
    Sandbox, SandboxState,
};

#[derive(clap::Args)]
pub struct McpArgs {
    /// stdio (default) or streamable-http.
    #[arg(long, default_value = "stdio", value_parser = ["stdio", "streamable-http"])]
    transport: String,
    /// Address for streamable HTTP; loopback only (the endpoint has no authentication of its own).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8765)]
    port: u16,
}

type ToolResult = Result<CallToolResult, ErrorData>;

/// A JSON result, as structured content (and its text, for clients that read only text).
fn ok_json(v: impl serde::Serialize) -> ToolResult {
    Ok(CallToolResult::structured(
        serde_json::to_value(&v).unwrap_or_default(),
    ))
}

fn ok_text(t: impl Into<String>) -> ToolResult {
    Ok(CallToolResult::success(vec![ContentBlock::text(t)]))
}

/// A failed call as a tool error the model can read and act on.
fn tool_error(what: &str, e: impl std::fmt::Display) -> ToolResult {
    Ok(CallToolResult::error(vec![ContentBlock::text(format!(
        "{what}: {e}"
    ))]))
}

macro_rules! try_tool {
    ($what:expr, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(err) => return tool_error(&$what, err),
        }
    };
}

// After the macro, so the desktop tools can use it.
mod desktop;

#[derive(Deserialize, JsonSchema)]
pub struct CreateArgs {
    /// Image to run (an imported name such as `python:3.12`, or `host`).
    pub image: String,
    /// Seconds until the sandbox is deleted (default 600; 0 = never).
    #[serde(default)]
    pub timeout_seconds: Option<i64>,
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    /// Resource limits such as {"cpu": "1", "memory": "2Gi"}.
    #[serde(default)]
    pub resource: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default)]
    pub network_policy: Option<serde_json::Value>,
    #[serde(default)]
    pub extensions: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, JsonSchema)]
pub struct SandboxIdArgs {
    pub sandbox_id: String,
}

#[derive(Deserialize, JsonSchema)]
pub struct ListArgs {
    /// Only these states (Running, Paused, …).
    #[serde(default)]
    pub states: Option<Vec<String>>,
    /// Only sandboxes with all of these metadata pairs.
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, JsonSchema)]
pub struct RenewArgs {
    pub sandbox_id: String,
    pub timeout_seconds: u64,
}

#[derive(Deserialize, JsonSchema)]
pub struct EndpointArgs {
    pub sandbox_id: String,
    pub port: u16,
}

#[derive(Deserialize, JsonSchema)]
pub struct CommandArgs {
    pub sandbox_id: String,
    /// A bash command line.
    pub command: String,
    /// Start it and return its execution id at once.
    #[serde(default)]
    pub background: bool,
    #[serde(default)]
    pub working_directory: Option<String>,
    /// Seconds before the command is killed.
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, JsonSchema)]
pub struct ExecutionArgs {
    pub sandbox_id: String,
    pub execution_id: String,
}

#[derive(Deserialize, JsonSchema)]
pub struct FileReadArgs {
    pub sandbox_id: String,
    pub path: String,
    /// `utf-8` (default) or `base64`.
    #[serde(default)]
    pub encoding: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
pub struct FileWriteArgs {
    pub sandbox_id: String,
    pub path: String,
    pub content: String,
    /// `utf-8` (default) or `base64`.
    #[serde(default)]
    pub encoding: Option<String>,
    /// Octal permission, e.g. 644.
    #[serde(default)]
    pub mode: Option<u32>,
    #[serde(default)]
    pub owner: Option<String>,
    #[serde(default)]
    pub group: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
pub struct PathsArgs {
    pub sandbox_id: String,
    pub paths: Vec<String>,
}

#[derive(Deserialize, JsonSchema)]
pub struct SearchArgs {
    pub sandbox_id: String,
    pub path: String,
    /// Glob, e.g. `**/*.py`.
    #[serde(default)]
    pub pattern: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
pub struct MoveEntry {
    pub src: String,
    pub dest: String,
}

#[derive(Deserialize, JsonSchema)]
pub struct MoveArgs {
    pub sandbox_id: String,
    pub entries: Vec<MoveEntry>,
}

#[derive(Deserialize, JsonSchema)]
pub struct ReplaceEntry {
    pub path: String,
    pub old: String,
    pub new: String,
}

#[derive(Deserialize, JsonSchema)]
pub struct ReplaceArgs {
    pub sandbox_id: String,
    pub entries: Vec<ReplaceEntry>,
}

#[derive(Deserialize, JsonSchema)]
pub struct CodeArgs {
    pub sandbox_id: String,
    pub code: String,
    /// `python` (default), `bash`, … — a kernel for it must be installed in the image.
    #[serde(default)]
    pub language: Option<String>,
    /// Run in this context (keeps state between runs) instead of the language's default one.
    #[serde(default)]
    pub context_id: Option<String>,
}

#[derive(Clone)]
pub struct WarrenMcp {
    client: Client,
    tool_router: ToolRouter<Self>,
}

impl WarrenMcp {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            tool_router: Self::tool_router() + Self::desktop_router(),
        }
    }

    async fn sandbox(&self, id: &str) -> Result<Sandbox, String> {
        self.client
            .connect(id)
            .await
            .map_err(|e| format!("sandbox {id}: {e}"))
    }

    /// The tools, as the server lists them (for the snapshot test).
    #[cfg(test)]
    pub fn tools(&self) -> Vec<rmcp::model::Tool> {
        self.tool_router.list_all()
    }
}

fn parse_state(s: &str) -> Option<SandboxState> {
    SandboxState::ALL
        .into_iter()
        .find(|st| st.as_str().eq_ignore_ascii_case(s))
}

#[tool_router]
impl WarrenMcp {
    #[tool(
        description = "Create a sandbox: an isolated machine to run commands and code in. Returns its id and state."
    )]
    async fn sandbox_create(&self, Parameters(a): Parameters<CreateArgs>) -> ToolResult {
        let req = CreateSandboxRequest {
            image: Some(ImageSpec {
                uri: a.image,
                auth: None,
            }),
            timeout: match a.timeout_seconds {
                Some(0) => None,
                Some(t) => Some(t),
                None => Some(600),
            },
            env: a.env,
            metadata: a.metadata,
            resource_limits: a.resource,
            entrypoint: a.entrypoint,
            network_policy: a.network_policy,
            extensions: a.extensions,
            ..Default::default()
        };
        let sb = try_tool!("creating the sandbox", self.client.create(&req).await);
        // `sandbox_id` first, as opensandbox-mcp answers; then the whole sandbox.
        let mut body = serde_json::json!({ "sandbox_id": sb.id() });
        if let (Some(obj), Ok(serde_json::Value::Object(info))) =
            (body.as_object_mut(), serde_json::to_value(sb.info()))
        {
            obj.extend(info);
        }
        ok_json(body)
    }

    #[tool(description = "Delete a sandbox and everything in it.")]
    async fn sandbox_kill(&self, Parameters(a): Parameters<SandboxIdArgs>) -> ToolResult {
        try_tool!(
            format!("deleting sandbox {}", a.sandbox_id),
            self.client.delete(&a.sandbox_id).await
        );
        ok_text(format!("deleted {}", a.sandbox_id))
    }

    #[tool(description = "A sandbox's state, image, expiry and metadata.")]
    async fn sandbox_get_info(&self, Parameters(a): Parameters<SandboxIdArgs>) -> ToolResult {
        let s = try_tool!(
            format!("sandbox {}", a.sandbox_id),
            self.client.get(&a.sandbox_id).await
        );
        ok_json(s)
    }

    #[tool(description = "List sandboxes, optionally by state and metadata.")]
    async fn sandbox_list(&self, Parameters(a): Parameters<ListArgs>) -> ToolResult {
        let mut states = Vec::new();
        for s in a.states.unwrap_or_default() {
            match parse_state(&s) {
                Some(st) => states.push(st),
                None => return tool_error("listing sandboxes", format!("unknown state {s:?}")),
            }
        }
        let q = ListQuery {
            states,
            metadata: a.metadata.unwrap_or_default(),
            page: 1,
            page_size: 200,
        };
        let list = try_tool!("listing sandboxes", self.client.list(&q).await);
        ok_json(serde_json::json!({ "sandboxes": list.items }))
    }

    #[tool(description = "Move a sandbox's expiry to now + timeout_seconds.")]
    async fn sandbox_renew(&self, Parameters(a): Parameters<RenewArgs>) -> ToolResult {
        let at = try_tool!(
            format!("renewing sandbox {}", a.sandbox_id),
            self.client
                .renew(&a.sandbox_id, Duration::from_secs(a.timeout_seconds))
                .await
        );
        ok_json(serde_json::json!({ "sandbox_id": a.sandbox_id, "expires_at": at }))
    }

    #[tool(description = "CPU and memory use of a sandbox.")]
    async fn sandbox_get_metrics(&self, Parameters(a): Parameters<SandboxIdArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let m = try_tool!("reading metrics", sb.metrics().await);
        ok_json(m)
    }

    #[tool(description = "Whether the sandbox answers (its daemon is up).")]
    async fn sandbox_healthcheck(&self, Parameters(a): Parameters<SandboxIdArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        ok_json(serde_json::json!({ "sandbox_id": a.sandbox_id, "healthy": sb.ping().await }))
    }

    #[tool(
        description = "How to reach a port inside the sandbox from outside: a URL and the headers to send."
    )]
    async fn sandbox_get_endpoint(&self, Parameters(a): Parameters<EndpointArgs>) -> ToolResult {
        let ep = try_tool!(
            format!("sandbox {}", a.sandbox_id),
            self.client.endpoint(&a.sandbox_id, a.port).await
        );
        ok_json(ep)
    }

    #[tool(
        description = "Run a bash command in a sandbox. Returns stdout, stderr and the exit code, or the execution id with background=true."
    )]
    async fn command_run(&self, Parameters(a): Parameters<CommandArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let req = RunCommandRequest {
            command: Some(a.command),
            cwd: a.working_directory,
            background: a.background,
            timeout: a.timeout_seconds.map(|s| (s * 1000.0).max(1.0) as u64),
            envs: a.env,
            ..Default::default()
        };
        if a.background {
            let id = try_tool!("starting the command", sb.spawn(&req).await);
            return ok_json(serde_json::json!({ "execution_id": id }));
        }
        let out = try_tool!(
            "running the command",
            match sb.stream(&req).await {
                Ok(s) => s.collect_output().await,
                Err(e) => Err(e),
            }
        );
        let failed_to_start = out
            .error
            .as_ref()
            .is_some_and(|e| e.evalue.trim().parse::<i32>().is_err());
        let body = serde_json::json!({
            "stdout": out.stdout,
            "stderr": out.stderr,
            "exit_code": out.exit_code,
            "error": out.error.as_ref().map(|e| format!("{}: {}", e.ename, e.evalue)),
        });
        if failed_to_start {
            return tool_error("running the command", body);
        }
        ok_json(body)
    }

    #[tool(description = "Whether a background command is still running, and its exit code.")]
    async fn command_status(&self, Parameters(a): Parameters<ExecutionArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let st = try_tool!(
            format!("command {}", a.execution_id),
            sb.status(&a.execution_id).await
        );
        ok_json(st)
    }

    #[tool(description = "Output of a background command so far.")]
    async fn command_logs(&self, Parameters(a): Parameters<ExecutionArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let logs = try_tool!(
            format!("command {}", a.execution_id),
            sb.logs(&a.execution_id, None).await
        );
        ok_text(logs.text)
    }

    #[tool(description = "Interrupt a running command (its whole process group).")]
    async fn command_interrupt(&self, Parameters(a): Parameters<ExecutionArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        try_tool!(
            format!("interrupting {}", a.execution_id),
            sb.interrupt(&a.execution_id).await
        );
        ok_text(format!("interrupted {}", a.execution_id))
    }

    #[tool(description = "Read a file from a sandbox (utf-8 text, or base64 for binary).")]
    async fn file_read(&self, Parameters(a): Parameters<FileReadArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let bytes = try_tool!(format!("reading {}", a.path), sb.read(&a.path).await);
        match a.encoding.as_deref().unwrap_or("utf-8") {
            "base64" => ok_text(base64::engine::general_purpose::STANDARD.encode(&bytes)),
            _ => match String::from_utf8(bytes.to_vec()) {
                Ok(t) => ok_text(t),
                Err(_) => tool_error(
                    &format!("reading {}", a.path),
                    "the file is not UTF-8 text; read it with encoding=base64",
                ),
            },
        }
    }

    #[tool(description = "Write a file in a sandbox (parent folders are created).")]
    async fn file_write(&self, Parameters(a): Parameters<FileWriteArgs>) -> ToolResult {
        let data = match a.encoding.as_deref().unwrap_or("utf-8") {
            "base64" => try_tool!(
                "decoding content",
                base64::engine::general_purpose::STANDARD.decode(a.content.as_bytes())
            ),
            _ => a.content.into_bytes(),
        };
        let mode = match a.mode {
            Some(m) => Some(try_tool!(
                "mode",
                u32::from_str_radix(&m.to_string(), 8)
                    .map_err(|_| format!("{m} is not an octal permission like 644"))
            )),
            None => None,
        };
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let n = data.len();
        let body = futures::stream::once(async move { Ok(bytes::Bytes::from(data)) });
        let owner = Ownership {
            mode,
            owner: a.owner,
            group: a.group,
        };
        try_tool!(
            format!("writing {}", a.path),
            sb.upload_stream(&a.path, body, &owner).await
        );
        ok_text(format!("wrote {n} bytes to {}", a.path))
    }

    #[tool(description = "Delete files in a sandbox.")]
    async fn file_delete(&self, Parameters(a): Parameters<PathsArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let refs: Vec<&str> = a.paths.iter().map(String::as_str).collect();
        try_tool!("deleting files", sb.remove_files(&refs).await);
        ok_text(format!("deleted {}", a.paths.join(", ")))
    }

    #[tool(description = "Find files under a folder by glob pattern.")]
    async fn file_search(&self, Parameters(a): Parameters<SearchArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let found = try_tool!(
            format!("searching {}", a.path),
            sb.search(&a.path, a.pattern.as_deref().unwrap_or("**"))
                .await
        );
        ok_json(serde_json::json!({ "files": found }))
    }

    #[tool(description = "Create folders (and their parents) in a sandbox.")]
    async fn file_create_directories(&self, Parameters(a): Parameters<PathsArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        for p in &a.paths {
            try_tool!(
                format!("creating {p}"),
                sb.mkdir(p, &Ownership::default()).await
            );
        }
        ok_text(format!("created {}", a.paths.join(", ")))
    }

    #[tool(description = "Delete folders and everything in them.")]
    async fn file_delete_directories(&self, Parameters(a): Parameters<PathsArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        for p in &a.paths {
            try_tool!(format!("deleting {p}"), sb.remove_dir(p).await);
        }
        ok_text(format!("deleted {}", a.paths.join(", ")))
    }

    #[tool(description = "Move or rename files and folders.")]
    async fn file_move(&self, Parameters(a): Parameters<MoveArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        for e in &a.entries {
            try_tool!(
                format!("moving {} to {}", e.src, e.dest),
                sb.mv(&e.src, &e.dest).await
            );
        }
        ok_text(format!("moved {} entries", a.entries.len()))
    }

    #[tool(
        description = "Replace text in files: every occurrence of old becomes new. Returns the counts."
    )]
    async fn file_replace_contents(&self, Parameters(a): Parameters<ReplaceArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let mut counts = BTreeMap::new();
        for e in &a.entries {
            let n = try_tool!(
                format!("replacing in {}", e.path),
                sb.replace(&e.path, &e.old, &e.new).await
            );
            counts.insert(e.path.clone(), n);
        }
        ok_json(counts)
    }

    #[tool(
        description = "Run code in a Jupyter kernel inside the sandbox; state persists between runs of one context. Returns stdout, stderr, results and any error."
    )]
    async fn code_run(&self, Parameters(a): Parameters<CodeArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let target = match a.context_id {
            Some(id) => CodeTarget::Context(id),
            None => CodeTarget::Language(a.language.unwrap_or_else(|| "python".into())),
        };
        let out = try_tool!("running the code", sb.run_code(&a.code, &target).await);
        let body = serde_json::json!({
            "stdout": out.stdout,
            "stderr": out.stderr,
            "results": out.results,
            "error": out.error,
            "context_id": out.id,
        });
        if out.error.is_some() {
            return tool_error("the code raised an error", body);
        }
        ok_json(body)
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for WarrenMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("warren", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Warren sandboxes: create one with sandbox_create, run commands with command_run, \
                 move files with file_read/file_write, run code with code_run, and delete it with \
                 sandbox_kill when done. A sandbox created with extensions {\"desktop\": \"true\"} \
                 has a desktop: see it with desktop_screenshot and drive it with desktop_click, \
                 desktop_type, desktop_key and desktop_scroll.",
            )
    }
}

pub async fn run(args: McpArgs, client: Client) -> anyhow::Result<()> {
    let server = WarrenMcp::new(client);
    match args.transport.as_str() {
        "stdio" => {
            let running = server
                .serve(rmcp::transport::stdio())
                .await
                .map_err(|e| anyhow::anyhow!("starting the MCP server: {e}"))?;
            running
                .waiting()
                .await
                .map_err(|e| anyhow::anyhow!("MCP server: {e}"))?;
        }
        _ => {
            use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
            use rmcp::transport::streamable_http_server::{
                StreamableHttpServerConfig, StreamableHttpService,
            };
            let ip: std::net::IpAddr = args
                .host
                .parse()
                .map_err(|_| anyhow::anyhow!("--host {} is not an IP address", args.host))?;
            if !ip.is_loopback() {
                anyhow::bail!(
                    "--host {ip}: the MCP endpoint has no authentication of its own, so it only \
                     listens on loopback (hint: put an authenticating proxy in front for remote use)"
                );
            }
            let service = StreamableHttpService::new(
                move || Ok(server.clone()),
                LocalSessionManager::default().into(),
                StreamableHttpServerConfig::default(),
            );
            let app = axum::Router::new().nest_service("/mcp", service);
            let listener = tokio::net::TcpListener::bind((ip, args.port)).await?;
            eprintln!(
                "warren: MCP over streamable HTTP at http://{}/mcp",
                listener.local_addr()?
            );
            axum::serve(listener, app).await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tool list (names, descriptions, parameter schemas) is the MCP server's public surface:
    /// changes to it show up here (insta: `INSTA_UPDATE=always` or `cargo insta review` accepts
    /// them).
    #[test]
    fn tool_list_matches_snapshot() {
        let server = WarrenMcp::new(Client::new(warren_sdk::Config::new("127.0.0.1:1")));
        let mut tools = server.tools();
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        let text = serde_json::to_string_pretty(&tools).expect("tools json") + "\n";
        insta::with_settings!({
            snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/tests/snapshots"),
            prepend_module_to_snapshot => false,
            omit_expression => true,
        }, {
            insta::assert_snapshot!("mcp-tools", text);
        });
        assert_eq!(tools.len(), 31);
    }
}
