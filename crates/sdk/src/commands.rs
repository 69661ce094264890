//! Commands (`/command`) and persistent bash sessions (`/session`).

use serde::Deserialize;
use warren_api::execd::{CommandStatus, RunCommandRequest};

use crate::client::{json, send};
use crate::error::{Error, Result};
use crate::sandbox::Sandbox;
use crate::stream::{EventStream, Framing, Output};

/// Output of a background command from a cursor on.
#[derive(Debug, Clone, PartialEq)]
pub struct Logs {
    pub text: String,
    /// Pass back as `cursor` to get only what came after.
    pub cursor: Option<u64>,
}

impl Sandbox {
    /// Runs `command` with bash in the sandbox and collects its output.
    pub async fn run(&self, command: &str) -> Result<Output> {
        self.stream(&RunCommandRequest {
            command: Some(command.to_string()),
            ..Default::default()
        })
        .await?
        .collect_output()
        .await
    }

    /// Starts a foreground command and returns its events as they happen.
    pub async fn stream(&self, req: &RunCommandRequest) -> Result<EventStream> {
        let (r, url) = self.execd(reqwest::Method::POST, "/command");
        Ok(EventStream::new(
            send(r.json(req), &url).await?,
            Framing::Lines,
        ))
    }

    /// Starts a background command; returns its id for [`Sandbox::status`], [`Sandbox::logs`] and
    /// [`Sandbox::interrupt`].
    pub async fn spawn(&self, req: &RunCommandRequest) -> Result<String> {
        let mut req = req.clone();
        req.background = true;
        let out = self.stream(&req).await?.collect_output().await?;
        out.id
            .ok_or_else(|| Error::Protocol("the background command's init event had no id".into()))
    }

    pub async fn status(&self, command_id: &str) -> Result<CommandStatus> {
        let (r, url) = self.execd_call(
            reqwest::Method::GET,
            &format!("/command/status/{command_id}"),
        );
        json(send(r, &url).await?).await
    }

    /// Combined output of a background command after byte `cursor` (from the start without one),
    /// as the command wrote it.
    pub async fn logs(&self, command_id: &str, cursor: Option<u64>) -> Result<Logs> {
        let (mut r, url) =
            self.execd_call(reqwest::Method::GET, &format!("/command/{command_id}/logs"));
        if let Some(c) = cursor {
            r = r.query(&[("cursor", c)]);
        }
        let resp = send(r, &url).await?;
        let cursor = resp
            .headers()
            .get("EXECD-COMMANDS-TAIL-CURSOR")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let text = resp.text().await.map_err(Error::Broken)?;
        Ok(Logs { text, cursor })
    }

    /// Interrupts a command: SIGTERM, then SIGKILL, to its whole process group.
    pub async fn interrupt(&self, command_id: &str) -> Result<()> {
        let (r, url) = self.execd_call(reqwest::Method::DELETE, "/command");
        send(r.query(&[("id", command_id)]), &url).await?;
        Ok(())
    }

    /// Starts a persistent bash whose state (cwd, variables) carries over between runs.
    pub async fn session(&self, cwd: Option<&str>) -> Result<Session> {
        #[derive(Deserialize)]
        struct Created {
            session_id: String,
        }
        let (r, url) = self.execd_call(reqwest::Method::POST, "/session");
        let created: Created =
            json(send(r.json(&serde_json::json!({ "cwd": cwd })), &url).await?).await?;
        Ok(Session {
            sandbox: self.clone(),
            id: created.session_id,
        })
    }
}

impl Sandbox {
    /// A handle on a session started earlier (by id), e.g. by another process.
    pub fn attach_session(&self, id: &str) -> Session {
        Session {
            sandbox: self.clone(),
            id: id.to_string(),
        }
    }
}

/// A persistent bash in a sandbox.
#[derive(Clone, Debug)]
pub struct Session {
    sandbox: Sandbox,
    id: String,
}

impl Session {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Runs `command` in the session and returns its events.
    pub async fn stream(&self, command: &str, timeout_ms: Option<u64>) -> Result<EventStream> {
        let (r, url) = self
            .sandbox
            .execd(reqwest::Method::POST, &format!("/session/{}/run", self.id));
        let body = serde_json::json!({ "command": command, "timeout": timeout_ms });
        Ok(EventStream::new(
            send(r.json(&body), &url).await?,
            Framing::Lines,
        ))
    }

    /// Runs `command` in the session and collects its output.
    pub async fn run(&self, command: &str) -> Result<Output> {
        self.stream(command, None).await?.collect_output().await
    }

    /// Ends the session's bash.
    pub async fn close(self) -> Result<()> {
        let (r, url) = self
            .sandbox
            .execd_call(reqwest::Method::DELETE, &format!("/session/{}", self.id));
        send(r, &url).await?;
        Ok(())
    }
}
