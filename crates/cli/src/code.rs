//! `warren code …`: run code in a sandbox's code contexts (Jupyter kernels inside the sandbox).
//!
//! `warren code run SANDBOX [CODE | -]` prints the kernel's stdout and stderr as they come, each
//! result's text (rich results are named, or saved with `--save-results DIR`), and the traceback of an
//! exception; it exits 0 when the code ran to completion and 1 otherwise.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use base64::Engine;
use futures::StreamExt;
use warren_api::execd::{EventKind, StreamEvent};
use warren_sdk::CodeTarget;

use crate::client::{Explain, ServerArgs};

#[derive(clap::Subcommand)]
pub enum CodeCommand {
    /// Run code in a sandbox (in its default context for the language, or in --context).
    Run(RunCodeArgs),
}

#[derive(clap::Args)]
pub struct RunCodeArgs {
    /// The sandbox's id.
    sandbox: String,
    /// The code; `-` or nothing reads it from stdin.
    code: Option<String>,
    /// Language of the default context to use (python, bash, javascript, …).
    #[arg(long, short = 'l', default_value = "python")]
    language: String,
    /// Run in this context (from `POST /code/context`) instead of the language's default one.
    #[arg(long)]
    context: Option<String>,
    /// Write rich results (image/png, text/html, …) into this folder as result-N.EXT.
    #[arg(long, value_name = "DIR")]
    save_results: Option<PathBuf>,
    /// Print the raw event stream as JSON lines instead.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    server: ServerArgs,
}

pub async fn run(cmd: CodeCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        CodeCommand::Run(args) => run_code(args).await,
    }
}

async fn run_code(args: RunCodeArgs) -> anyhow::Result<ExitCode> {
    let code = match args.code.as_deref() {
        None | Some("-") => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the code from stdin")?;
            s
        }
        Some(c) => c.to_string(),
    };
    if code.trim().is_empty() {
        bail!("no code to run");
    }
    if let Some(dir) = &args.save_results {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let client = args.server.client()?;
    let what = "running the code";
    let sandbox = client
        .connect(&args.sandbox)
        .await
        .explain(&format!("sandbox {}", args.sandbox))?;
    let target = match &args.context {
        Some(id) => CodeTarget::Context(id.clone()),
        None => CodeTarget::Language(args.language.clone()),
    };
    let mut events = sandbox.stream_code(&code, &target).await.explain(what)?;
    let mut outcome = Outcome::default();
    while let Some(ev) = events.next().await {
        let ev = ev.explain(what)?;
        if args.json {
            println!("{}", serde_json::to_string(&ev).unwrap_or_default());
        }
        outcome.on_event(&ev, !args.json, args.save_results.as_deref());
    }
    if let Some(e) = outcome.save_error {
        bail!(e);
    }
    match (outcome.failed, outcome.completed) {
        (false, true) => Ok(ExitCode::SUCCESS),
        (true, _) => Ok(ExitCode::from(1)),
        (false, false) => bail!("the execution's output ended without a result"),
    }
}

#[derive(Default)]
struct Outcome {
    completed: bool,
    failed: bool,
    results: usize,
    save_error: Option<String>,
}

impl Outcome {
    fn on_event(&mut self, ev: &StreamEvent, print: bool, save: Option<&std::path::Path>) {
        let text = ev.text.as_deref().unwrap_or_default();
        match ev.kind {
            EventKind::Stdout if print => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(text.as_bytes());
                let _ = out.flush();
            }
            EventKind::Stderr if print => {
                let _ = std::io::stderr().lock().write_all(text.as_bytes());
            }
            EventKind::Result => {
                self.results += 1;
                let results = ev.results.clone().unwrap_or_default();
                if print {
                    if let Some(t) = results.get("text").and_then(|v| v.as_str()) {
                        println!("{t}");
                    }
                    let rich: Vec<&str> = results
                        .keys()
                        .map(String::as_str)
                        .filter(|k| *k != "text")
                        .collect();
                    if !rich.is_empty() && save.is_none() {
                        eprintln!("[result {} also has {}]", self.results, rich.join(", "));
                    }
                }
                if let Some(dir) = save {
                    if let Err(e) = save_results(dir, self.results, &results) {
                        self.save_error.get_or_insert(e.to_string());
                    }
                }
            }
            EventKind::Error => {
                self.failed = true;
                if print {
                    if let Some(e) = &ev.error {
                        if e.traceback.is_empty() {
                            eprintln!("{}: {}", e.ename, e.evalue);
                        }
                        for line in &e.traceback {
                            eprintln!("{line}");
                        }
                    }
                }
            }
            EventKind::ExecutionComplete => self.completed = true,
            _ => {}
        }
    }
}

/// Writes each rich MIME part of a result: base64 ones (images, PDFs) decoded, JSON pretty-printed,
/// text as it is.
fn save_results(
    dir: &std::path::Path,
    n: usize,
    results: &std::collections::BTreeMap<String, serde_json::Value>,
) -> anyhow::Result<()> {
    for (mime, value) in results {
        let (ext, bytes): (&str, Vec<u8>) = match mime.as_str() {
            "text" => continue,
            "image/png" | "image/jpeg" | "image/gif" | "application/pdf" => {
                let b64: String = value
                    .as_str()
                    .unwrap_or_default()
                    .split_whitespace()
                    .collect();
                let ext = mime.rsplit('/').next().unwrap_or("bin");
                let data = base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .with_context(|| format!("result {n}: {mime} is not base64"))?;
                (ext, data)
            }
            "application/json" => ("json", serde_json::to_vec_pretty(value)?),
            "text/html" => ("html", text_of(value).into_bytes()),
            "image/svg+xml" => ("svg", text_of(value).into_bytes()),
            "text/markdown" => ("md", text_of(value).into_bytes()),
            "text/latex" => ("tex", text_of(value).into_bytes()),
            _ => ("txt", text_of(value).into_bytes()),
        };
        let path = dir.join(format!("result-{n}.{ext}"));
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("[result {n}: {mime} saved to {}]", path.display());
    }
    Ok(())
}

/// Jupyter sends multi-line text either as one string or as a list of lines.
fn text_of(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(a) => a.iter().filter_map(|l| l.as_str()).collect(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn saves_decoded_png_and_html() {
        let dir = tempfile::tempdir().expect("tmp");
        let png = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\nrest");
        let results = [
            ("text".to_string(), json!("<Figure>")),
            ("image/png".to_string(), json!(format!("{png}\n"))),
            ("text/html".to_string(), json!(["<table>", "</table>"])),
        ]
        .into_iter()
        .collect();
        save_results(dir.path(), 2, &results).expect("save");
        assert_eq!(
            std::fs::read(dir.path().join("result-2.png")).expect("png"),
            b"\x89PNG\r\n\x1a\nrest"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("result-2.html")).expect("html"),
            "<table></table>"
        );
        assert!(!dir.path().join("result-2.txt").exists());
    }
}
