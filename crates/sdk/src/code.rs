//! Code contexts (`/code…`): Jupyter kernels whose state survives between runs.

use warren_api::execd::{CodeContext, CreateContextRequest, RunCodeContext, RunCodeRequest};

use crate::client::{json, send};
use crate::error::Result;
use crate::sandbox::Sandbox;
use crate::stream::{EventStream, Framing, Output};

/// Where a run goes: a context by id, or the default context of a language.
#[derive(Debug, Clone, PartialEq)]
pub enum CodeTarget {
    Context(String),
    Language(String),
}

impl Sandbox {
    /// Starts a kernel for `language` (`python`, `bash`, …) and returns its context.
    pub async fn create_context(&self, language: &str) -> Result<CodeContext> {
        let (r, url) = self.execd(reqwest::Method::POST, "/code/context");
        let body = CreateContextRequest {
            language: language.to_string(),
            cwd: None,
        };
        json(send(r.json(&body), &url).await?).await
    }

    /// Contexts, optionally of one language.
    pub async fn contexts(&self, language: Option<&str>) -> Result<Vec<CodeContext>> {
        let (mut r, url) = self.execd_call(reqwest::Method::GET, "/code/contexts");
        if let Some(l) = language {
            r = r.query(&[("language", l)]);
        }
        json(send(r, &url).await?).await
    }

    /// Shuts a context's kernel down.
    pub async fn delete_context(&self, id: &str) -> Result<()> {
        let (r, url) = self.execd_call(reqwest::Method::DELETE, &format!("/code/contexts/{id}"));
        send(r, &url).await?;
        Ok(())
    }

    /// Runs `code` and returns its events (stdout, stderr, results, the outcome).
    pub async fn stream_code(&self, code: &str, target: &CodeTarget) -> Result<EventStream> {
        let context = match target {
            CodeTarget::Context(id) => RunCodeContext {
                id: Some(id.clone()),
                language: None,
            },
            CodeTarget::Language(l) => RunCodeContext {
                id: None,
                language: Some(l.clone()),
            },
        };
        let body = RunCodeRequest {
            code: code.to_string(),
            context: Some(context),
        };
        let (r, url) = self.execd(reqwest::Method::POST, "/code");
        Ok(EventStream::new(
            send(r.json(&body), &url).await?,
            Framing::Raw,
        ))
    }

    /// Runs `code` and collects what it produced; an exception is in `error`, not an `Err`.
    pub async fn run_code(&self, code: &str, target: &CodeTarget) -> Result<Output> {
        self.stream_code(code, target).await?.collect_output().await
    }

    /// Interrupts the run in a context (SIGINT to its kernel).
    pub async fn interrupt_code(&self, context_id: &str) -> Result<()> {
        let (r, url) = self.execd_call(reqwest::Method::DELETE, "/code");
        send(r.query(&[("id", context_id)]), &url).await?;
        Ok(())
    }
}
