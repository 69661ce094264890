//! `warren image`: the local image store — pull from registries, import archives, list, remove,
//! prune. Works on the data dir directly, whether or not a server runs on it (the store locks).

use std::collections::HashMap;
use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use clap::Subcommand;
use warren_image::{ImageRecord, ImageStore};
use warren_registry::{Credentials, LayerInfo, PullProgress, Puller, RegistriesConfig};

use crate::human_bytes;
use crate::output::{self, Format, OutputArgs};

#[derive(Subcommand)]
pub enum ImageCommand {
    /// Pull NAME from its registry (Docker Hub for names without a registry host).
    Pull {
        name: String,
        /// Server config file whose [registries] settings (mirrors, insecure, ca_file,
        /// credentials) apply [env: WARREN_CONFIG]
        #[arg(long)]
        config: Option<PathBuf>,
        /// Registry user name (the password comes from stdin with --password-stdin).
        #[arg(long, requires = "password_stdin")]
        username: Option<String>,
        #[arg(long)]
        password_stdin: bool,
        /// Allow plain HTTP to this registry host (repeatable).
        #[arg(long = "insecure-registry", value_name = "HOST")]
        insecure: Vec<String>,
        /// No progress bars.
        #[arg(long, short)]
        quiet: bool,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Import a rootfs folder, a rootfs tarball, a `docker save` tarball or an OCI layout as NAME.
    Import { name: String, path: PathBuf },
    /// List images.
    Ls {
        /// Print JSON instead of a table (same as -o json).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Remove an image name (its layers go once nothing uses them).
    Rm { names: Vec<String> },
    /// Remove every image no sandbox is using, and staging left by dead processes.
    Prune {
        /// Only show what would be removed.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        out: OutputArgs,
    },
}

pub fn run(command: ImageCommand, data_dir: &Path) -> anyhow::Result<ExitCode> {
    warren_local::prepare_data_dir(data_dir)
        .with_context(|| format!("preparing data dir {}", data_dir.display()))?;
    let store = ImageStore::open(data_dir)
        .with_context(|| format!("opening the image store in {}", data_dir.display()))?;
    match command {
        ImageCommand::Pull {
            name,
            config,
            username,
            password_stdin,
            insecure,
            quiet,
            out,
        } => {
            let mut registries = registries_from(config)?;
            for host in insecure {
                registries.hosts.entry(host).or_default().insecure = true;
            }
            let auth = match username {
                Some(username) => Some(Credentials {
                    username,
                    password: read_password(password_stdin)?,
                }),
                None => None,
            };
            let format = out.output.unwrap_or_default();
            let bars = (!quiet && std::io::stderr().is_terminal()).then(Bars::new);
            // One image: the cap on pulls at once does not come into it.
            let puller = Puller::new(warren_registry::Client::new(registries), Arc::new(store), 1);
            let rt = tokio::runtime::Runtime::new()?;
            let progress = bars.clone().map(|b| Arc::new(b) as Arc<dyn PullProgress>);
            let record = rt
                .block_on(puller.pull(&name, auth, progress))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if let Some(b) = bars {
                b.clear();
            }
            output::emit(format, &record, |r| {
                let mut t = output::Table::new(&["NAME", "ID", "DIGEST", "LAYERS", "SIZE"]);
                t.row(table_row(r, true));
                t
            })?;
        }
        ImageCommand::Import { name, path } => {
            let rec = store
                .import(&name, &path)
                .with_context(|| format!("importing {} as {name}", path.display()))?;
            println!(
                "{} {} ({} layers, {})",
                rec.name,
                rec.id,
                rec.layers.len(),
                human_bytes(rec.size_bytes)
            );
        }
        ImageCommand::Ls { json, out } => {
            let images = store.list()?;
            let format = if json {
                Format::Json
            } else {
                out.output.unwrap_or_default()
            };
            output::emit(format, &images, |images| {
                let mut t = output::Table::new(&["NAME", "ID", "DIGEST", "LAYERS", "SIZE"]);
                for i in images {
                    t.row(table_row(i, false));
                }
                t
            })?;
        }
        ImageCommand::Rm { names } => {
            for n in names {
                store.remove(&n).with_context(|| format!("removing {n}"))?;
                println!("removed {n}");
            }
        }
        ImageCommand::Prune { dry_run, out } => {
            let pruned = store.prune(dry_run)?;
            output::emit(out.output.unwrap_or_default(), &pruned, |p| {
                let mut t = output::Table::new(&["REMOVED"]);
                for n in &p.removed {
                    t.row(vec![n.clone()]);
                }
                let verb = if dry_run {
                    "would reclaim"
                } else {
                    "reclaimed"
                };
                t.row(vec![format!("{verb} {}", human_bytes(p.reclaimed_bytes))]);
                t
            })?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn table_row(i: &ImageRecord, full_digest: bool) -> Vec<String> {
    let short = |d: &str| -> String { d.trim_start_matches("sha256:").chars().take(12).collect() };
    let digest = match &i.digest {
        Some(d) if full_digest => d.clone(),
        Some(d) => short(d),
        None => "-".into(),
    };
    vec![
        i.name.clone(),
        if i.builtin {
            "builtin".into()
        } else {
            short(&i.id)
        },
        digest,
        i.layers.len().to_string(),
        human_bytes(i.size_bytes),
    ]
}

/// `[registries]` of a server config file (`--config`, else `WARREN_CONFIG`), or none.
fn registries_from(config: Option<PathBuf>) -> anyhow::Result<RegistriesConfig> {
    let path = config
        .or_else(|| warren_env::var_os(warren_env::EnvVars::WARREN_CONFIG).map(PathBuf::from));
    let Some(path) = path else {
        return Ok(RegistriesConfig::default());
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading config {}", path.display()))?;
    let file: warren_server::config::FileConfig =
        toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))?;
    crate::runtimes::check_sections(&file.docker, &file.kubernetes, Some(&path))?;
    Ok(file.registries)
}

fn read_password(from_stdin: bool) -> anyhow::Result<String> {
    anyhow::ensure!(from_stdin, "--username needs --password-stdin");
    let mut password = String::new();
    std::io::stdin()
        .read_to_string(&mut password)
        .context("reading the password from stdin")?;
    let password = password.trim_end_matches(['\n', '\r']).to_owned();
    anyhow::ensure!(!password.is_empty(), "empty password on stdin");
    Ok(password)
}

/// One progress bar per layer to fetch (on stderr, only on a terminal).
#[derive(Clone)]
struct Bars {
    multi: indicatif::MultiProgress,
    bars: Arc<Mutex<HashMap<usize, indicatif::ProgressBar>>>,
}

impl Bars {
    fn new() -> Self {
        Bars {
            multi: indicatif::MultiProgress::new(),
            bars: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    fn clear(&self) {
        let _ = self.multi.clear();
    }
}

impl PullProgress for Bars {
    fn started(&self, image: &str, layers: &[LayerInfo]) {
        let _ = self.multi.println(format!(
            "pulling {image}: {} layers, {} to fetch",
            layers.len(),
            layers.iter().filter(|l| !l.cached).count()
        ));
        let style = indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .map(|s| s.progress_chars("=> "))
        .ok();
        let mut bars = self.bars.lock().unwrap_or_else(|p| p.into_inner());
        for (i, layer) in layers.iter().enumerate().filter(|(_, l)| !l.cached) {
            let bar = self.multi.add(indicatif::ProgressBar::new(layer.size));
            if let Some(style) = style.clone() {
                bar.set_style(style);
            }
            let short: String = layer
                .digest
                .trim_start_matches("sha256:")
                .chars()
                .take(12)
                .collect();
            bar.set_message(short);
            bars.insert(i, bar);
        }
    }

    fn advanced(&self, index: usize, bytes: u64) {
        if let Some(bar) = self
            .bars
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&index)
        {
            bar.inc(bytes);
        }
    }

    fn finished(&self, index: usize) {
        if let Some(bar) = self
            .bars
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&index)
        {
            bar.finish();
        }
    }
}
