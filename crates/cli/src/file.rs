//! `warren file …`: files and directories in a running sandbox, mirroring `osb file`. Uploads and
//! downloads stream, with a progress bar on a terminal.

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use futures::StreamExt;
use warren_sdk::{Client, FileInfo, Ownership, Sandbox};

use crate::client::Explain;
use crate::output::{emit, Format, Table};

#[derive(clap::Subcommand)]
pub enum FileCommand {
    /// Print a file.
    Cat { id: String, path: String },
    /// Write a file from --content or stdin.
    Write {
        id: String,
        path: String,
        #[arg(long)]
        content: Option<String>,
        #[command(flatten)]
        owner: OwnerArgs,
    },
    /// Upload a local file.
    Upload {
        id: String,
        local: PathBuf,
        remote: String,
        #[command(flatten)]
        owner: OwnerArgs,
    },
    /// Download a file.
    Download {
        id: String,
        remote: String,
        local: PathBuf,
    },
    /// Metadata of paths.
    Info {
        id: String,
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// List a directory.
    Ls {
        id: String,
        path: String,
        #[arg(long, default_value_t = 1)]
        depth: u32,
    },
    /// Delete files.
    Rm {
        id: String,
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Delete a directory and everything under it.
    Rmdir { id: String, path: String },
    /// Create a directory and its parents.
    Mkdir {
        id: String,
        path: String,
        #[command(flatten)]
        owner: OwnerArgs,
    },
    /// Move or rename.
    Mv {
        id: String,
        src: String,
        dest: String,
    },
    /// Change mode and/or owner.
    Chmod {
        id: String,
        path: String,
        #[command(flatten)]
        owner: OwnerArgs,
    },
    /// Replace every occurrence of --old with --new in a file.
    Replace {
        id: String,
        path: String,
        #[arg(long)]
        old: String,
        #[arg(long)]
        new: String,
    },
    /// Find files under a path by glob.
    Search {
        id: String,
        path: String,
        #[arg(long, default_value = "**")]
        pattern: String,
    },
}

#[derive(clap::Args, Debug, Clone)]
pub struct OwnerArgs {
    /// Permission, octal (644).
    #[arg(long)]
    mode: Option<String>,
    #[arg(long)]
    owner: Option<String>,
    #[arg(long)]
    group: Option<String>,
}

impl OwnerArgs {
    fn ownership(&self) -> anyhow::Result<Ownership> {
        let mode = self
            .mode
            .as_deref()
            .map(|m| {
                u32::from_str_radix(m.trim_start_matches("0o"), 8)
                    .ok()
                    .filter(|m| *m <= 0o7777)
                    .with_context(|| format!("--mode {m:?} is not an octal permission like 644"))
            })
            .transpose()?;
        Ok(Ownership {
            mode,
            owner: self.owner.clone(),
            group: self.group.clone(),
        })
    }
}

fn info_table(items: &[FileInfo]) -> Table {
    let mut t = Table::new(&["PATH", "TYPE", "SIZE", "MODE", "OWNER", "MODIFIED"]);
    for f in items {
        t.row(vec![
            f.path.clone(),
            f.kind.clone(),
            f.size.to_string(),
            format!("{:04}", f.mode),
            format!("{}:{}", f.owner, f.group),
            f.modified_at.clone(),
        ]);
    }
    t
}

/// A byte progress bar on stderr when it is a terminal; hidden otherwise.
fn progress(total: Option<u64>, what: &str) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = match total {
        Some(n) => indicatif::ProgressBar::new(n),
        None => indicatif::ProgressBar::new_spinner(),
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_string());
    bar
}

async fn connect(client: &Client, id: &str) -> anyhow::Result<Sandbox> {
    client.connect(id).await.explain(&format!("sandbox {id}"))
}

pub async fn run(
    command: FileCommand,
    client: &Client,
    format: Format,
) -> anyhow::Result<ExitCode> {
    match command {
        FileCommand::Cat { id, path } => {
            let sb = connect(client, &id).await?;
            let mut s = sb.download(&path, None).await.explain(&path)?;
            let mut out = std::io::stdout().lock();
            while let Some(chunk) = s.next().await {
                out.write_all(&chunk.explain(&path)?)?;
            }
            out.flush()?;
        }
        FileCommand::Write {
            id,
            path,
            content,
            owner,
        } => {
            let sb = connect(client, &id).await?;
            let data = match content {
                Some(c) => c.into_bytes(),
                None => {
                    let mut buf = Vec::new();
                    std::io::stdin()
                        .read_to_end(&mut buf)
                        .context("reading stdin")?;
                    buf
                }
            };
            let n = data.len();
            let body = futures::stream::once(async move { Ok(bytes::Bytes::from(data)) });
            sb.upload_stream(&path, body, &owner.ownership()?)
                .await
                .explain(&format!("writing {path}"))?;
            eprintln!("wrote {n} bytes to {path}");
        }
        FileCommand::Upload {
            id,
            local,
            remote,
            owner,
        } => {
            let owner = owner.ownership()?;
            let size = std::fs::metadata(&local)
                .with_context(|| format!("reading {}", local.display()))?
                .len();
            let sb = connect(client, &id).await?;
            let bar = progress(Some(size), "upload");
            let file = tokio::fs::File::open(&local)
                .await
                .with_context(|| format!("opening {}", local.display()))?;
            let reader = tokio_util_reader(file, bar.clone());
            sb.upload_stream(&remote, reader, &owner)
                .await
                .explain(&format!("uploading to {remote}"))?;
            bar.finish_and_clear();
            eprintln!("uploaded {} ({size} bytes) to {remote}", local.display());
        }
        FileCommand::Download { id, remote, local } => {
            let sb = connect(client, &id).await?;
            let size = sb.stat(&remote).await.explain(&remote)?.size;
            let bar = progress(Some(size), "download");
            let mut s = sb.download(&remote, None).await.explain(&remote)?;
            let tmp = local.with_extension("warren-part");
            let mut f = std::fs::File::create(&tmp)
                .with_context(|| format!("creating {}", tmp.display()))?;
            let mut n = 0u64;
            let result = async {
                while let Some(chunk) = s.next().await {
                    let chunk = chunk.explain(&format!("downloading {remote}"))?;
                    f.write_all(&chunk)?;
                    n += chunk.len() as u64;
                    bar.set_position(n);
                }
                anyhow::Ok(())
            }
            .await;
            bar.finish_and_clear();
            if let Err(e) = result {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            std::fs::rename(&tmp, &local)
                .with_context(|| format!("writing {}", local.display()))?;
            eprintln!("downloaded {remote} ({n} bytes) to {}", local.display());
        }
        FileCommand::Info { id, paths } => {
            let sb = connect(client, &id).await?;
            let mut items = Vec::new();
            for p in &paths {
                items.push(sb.stat(p).await.explain(p)?);
            }
            emit(format, &items, |i| info_table(i))?;
        }
        FileCommand::Ls { id, path, depth } => {
            let sb = connect(client, &id).await?;
            let items = sb.list_dir(&path, depth).await.explain(&path)?;
            emit(format, &items, |i| info_table(i))?;
        }
        FileCommand::Rm { id, paths } => {
            let sb = connect(client, &id).await?;
            let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
            sb.remove_files(&refs).await.explain("deleting files")?;
        }
        FileCommand::Rmdir { id, path } => {
            let sb = connect(client, &id).await?;
            sb.remove_dir(&path).await.explain(&path)?;
        }
        FileCommand::Mkdir { id, path, owner } => {
            let sb = connect(client, &id).await?;
            sb.mkdir(&path, &owner.ownership()?).await.explain(&path)?;
        }
        FileCommand::Mv { id, src, dest } => {
            let sb = connect(client, &id).await?;
            sb.mv(&src, &dest)
                .await
                .explain(&format!("moving {src} to {dest}"))?;
        }
        FileCommand::Chmod { id, path, owner } => {
            let sb = connect(client, &id).await?;
            sb.chmod(&path, &owner.ownership()?).await.explain(&path)?;
        }
        FileCommand::Replace { id, path, old, new } => {
            let sb = connect(client, &id).await?;
            let n = sb.replace(&path, &old, &new).await.explain(&path)?;
            emit(
                format,
                &serde_json::json!({ "path": path, "replacedCount": n }),
                |_| Table::pairs(vec![("PATH", path.clone()), ("REPLACED", n.to_string())]),
            )?;
        }
        FileCommand::Search { id, path, pattern } => {
            let sb = connect(client, &id).await?;
            let items = sb.search(&path, &pattern).await.explain(&path)?;
            emit(format, &items, |i| info_table(i))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A file as a byte stream that moves a progress bar as it is read.
fn tokio_util_reader(
    file: tokio::fs::File,
    bar: indicatif::ProgressBar,
) -> impl futures::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static {
    tokio_util::io::ReaderStream::with_capacity(file, 256 * 1024).inspect(move |c| {
        if let Ok(c) = c {
            bar.inc(c.len() as u64);
        }
    })
}
