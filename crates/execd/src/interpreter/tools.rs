//! Languages driven through their own tools where the image has no Jupyter kernel for them: Java
//! with the JDK's JShell (`jshell`), Go with `go build` per cell (`gorun`). What they share: where
//! the tools are found, what starting one needs, interrupts, and error events.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use warren_api::execd::{EventKind, ExecError, StreamEvent};

use crate::metrics::Sources;
use crate::reaper::Reaper;
use crate::sse;

/// A language's own tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tool {
    /// `java` of a JDK (one with the `jdk.jshell` module: it has `jshell` beside it).
    Java(PathBuf),
    /// `go` of a Go toolchain.
    Go(PathBuf),
}

impl Tool {
    /// The tool for `language` (normalised) in the image, searched in `path` (the sandbox's
    /// `PATH`), `$JAVA_HOME/bin` and `$GOROOT/bin`, then where Debian puts them.
    pub fn find(language: &str, env: &std::collections::BTreeMap<String, String>) -> Option<Tool> {
        let mut dirs: Vec<PathBuf> = env
            .get("PATH")
            .map(|p| std::env::split_paths(p).collect())
            .unwrap_or_default();
        match language {
            "java" => {
                dirs.extend(env.get("JAVA_HOME").map(|h| Path::new(h).join("bin")));
                dirs.push("/usr/lib/jvm/default-java/bin".into());
                // A JRE has `java` but not the compiler and JShell a context needs.
                dirs.iter()
                    .find(|d| is_executable(&d.join("jshell")) && is_executable(&d.join("java")))
                    .map(|d| Tool::Java(d.join("java")))
            }
            "go" => {
                dirs.extend(env.get("GOROOT").map(|h| Path::new(h).join("bin")));
                dirs.push("/usr/lib/go/bin".into());
                dirs.push("/usr/local/go/bin".into());
                dirs.iter()
                    .map(|d| d.join("go"))
                    .find(|p| is_executable(p))
                    .map(Tool::Go)
            }
            _ => None,
        }
    }

    pub fn program(&self) -> &Path {
        match self {
            Tool::Java(p) | Tool::Go(p) => p,
        }
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// What starting a tool's context needs.
pub struct ToolLaunch<'a> {
    pub program: &'a Path,
    pub cwd: &'a Path,
    /// Where the context keeps its files (private to execd's user).
    pub runtime_dir: &'a Path,
    pub id: &'a str,
    pub reaper: &'a Reaper,
    pub sources: &'a Sources,
}

impl ToolLaunch<'_> {
    /// The context's own folder (`<runtime dir>/<kind>-<id>`), made private.
    pub fn folder(&self, kind: &str) -> Result<PathBuf, String> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = self.runtime_dir.join(format!("{kind}-{}", self.id));
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| format!("making {}: {e}", dir.display()))?;
        Ok(dir)
    }
}

/// The error event of a failed run.
pub fn failure(ename: &str, evalue: &str, traceback: Vec<String>) -> StreamEvent {
    StreamEvent {
        error: Some(ExecError {
            ename: ename.to_string(),
            evalue: evalue.to_string(),
            traceback,
        }),
        ..sse::event(EventKind::Error, None)
    }
}

/// How long an interrupt may show no effect before it is sent again, and how many times.
const AGAIN: Duration = Duration::from_secs(1);
const RESENDS: u32 = 10;

/// Interrupts a run when asked (`DELETE /code`) or when its client goes away, and again while it
/// goes on, as the Jupyter path does.
pub struct Interrupter<F: Fn()> {
    asks: watch::Receiver<u64>,
    send: F,
    sent: Option<Instant>,
    resends: u32,
    client_gone: bool,
}

impl<F: Fn()> Interrupter<F> {
    /// `asks` counts interrupt requests; those from before the run are not for it.
    pub fn new(mut asks: watch::Receiver<u64>, send: F) -> Self {
        asks.mark_unchanged();
        Self {
            asks,
            send,
            sent: None,
            resends: 0,
            client_gone: false,
        }
    }

    pub fn interrupted(&self) -> bool {
        self.sent.is_some()
    }

    /// Waits for a reason to interrupt, interrupts, and returns: the caller's `select!` goes on.
    /// Never returns when there is none.
    pub async fn wait(&mut self, client: &CancellationToken) {
        let resend_at = self
            .sent
            .filter(|_| self.resends < RESENDS)
            .map(|at| at + AGAIN);
        let resend = async move {
            match resend_at {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Ok(()) = self.asks.changed() => {}
            () = client.cancelled(), if !self.client_gone => self.client_gone = true,
            () = resend => self.resends += 1,
        }
        self.sent = Some(Instant::now());
        (self.send)();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_are_found_where_the_image_has_them() {
        let dir = tempfile::tempdir().expect("dir");
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).expect("bin");
        let make = |name: &str| {
            use std::os::unix::fs::PermissionsExt;
            let p = bin.join(name);
            std::fs::write(&p, "#!/bin/sh\n").expect("write");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        };
        let env: std::collections::BTreeMap<String, String> =
            [("PATH".to_string(), bin.display().to_string())].into();
        // Not the JDK's /usr/lib/jvm/default-java of the machine the test runs on: nothing here.
        let only_here =
            |lang| Tool::find(lang, &env).filter(|t| t.program().starts_with(dir.path()));
        make("java");
        assert_eq!(only_here("java"), None, "a JRE is not enough");
        make("jshell");
        assert_eq!(only_here("java"), Some(Tool::Java(bin.join("java"))));
        make("go");
        assert_eq!(only_here("go"), Some(Tool::Go(bin.join("go"))));
        assert_eq!(Tool::find("cobol", &env), None);
    }
}
