//! `warren desktop …`: look at and drive a sandbox's desktop (one made with
//! `extensions.desktop`) from the shell, as an agent does through the API.
//!
//! `warren desktop screenshot ID > shot.png`, `click ID X Y [--button right] [--double]`,
//! `move ID X Y`, `scroll ID [--dy N] [--dx N]`, `type ID TEXT`, `key ID CHORD...`,
//! `windows ID`, `launch ID COMMAND`, `open ID URL`, `record ID`, `stop-recording ID`.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{bail, Context};
use warren_api::desktop::{KeyboardAction, Launch, MouseAction, MouseButton};
use warren_sdk::{Client, Region};

use warren_api::desktop::{Launched, Point, Recording, RecordingStart, Window};
use warren_sdk::Sandbox;

use crate::client::Explain;
use crate::output::{emit, Format, Table};

#[derive(clap::Subcommand)]
pub enum DesktopCommand {
    /// Write a PNG of the screen (or a region of it) to stdout, or to --out.
    Screenshot {
        sandbox: String,
        #[arg(long)]
        x: Option<i32>,
        #[arg(long)]
        y: Option<i32>,
        #[arg(long)]
        width: Option<u32>,
        #[arg(long)]
        height: Option<u32>,
        /// Scale down: above 0, at most 1.
        #[arg(long)]
        scale: Option<f64>,
        /// Write the PNG to this file instead.
        #[arg(long = "out", value_name = "FILE")]
        file: Option<std::path::PathBuf>,
    },
    /// Click at (X, Y).
    Click {
        sandbox: String,
        x: i32,
        y: i32,
        #[arg(long, value_enum, default_value = "left")]
        button: Button,
        #[arg(long)]
        double: bool,
    },
    /// Move the pointer to (X, Y).
    Move { sandbox: String, x: i32, y: i32 },
    /// Turn the wheel where the pointer is: positive down (or right).
    Scroll {
        sandbox: String,
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        dy: i32,
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        dx: i32,
    },
    /// Type text (any Unicode).
    Type { sandbox: String, text: String },
    /// Press key chords in turn: `Return`, `ctrl+c`, `alt+F4`.
    Key {
        sandbox: String,
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// The top-level windows.
    Windows { sandbox: String },
    /// Start a program on the desktop (run by the shell).
    Launch { sandbox: String, command: String },
    /// Open a URL in the image's browser.
    Open { sandbox: String, url: String },
    /// Start recording the screen as a timeline of screenshots in a folder of the sandbox.
    Record {
        sandbox: String,
        /// The folder (default: a new one under /tmp).
        #[arg(long)]
        dir: Option<String>,
        /// Looks at the screen this often a second (1 to 10).
        #[arg(long, default_value_t = 2)]
        fps: u32,
        #[arg(long, default_value_t = 600)]
        max_seconds: u64,
    },
    /// Stop the recording; say where its frames are.
    StopRecording { sandbox: String },
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Button {
    Left,
    Middle,
    Right,
}

pub async fn run(cmd: DesktopCommand, client: &Client, format: Format) -> anyhow::Result<ExitCode> {
    match cmd {
        DesktopCommand::Screenshot {
            sandbox,
            x,
            y,
            width,
            height,
            scale,
            file,
        } => {
            let sbx = connect(client, &sandbox).await?;
            let png = sbx
                .screenshot(&Region {
                    x,
                    y,
                    width,
                    height,
                    scale,
                })
                .await?;
            match file {
                Some(path) => std::fs::write(&path, png)
                    .with_context(|| format!("writing {}", path.display()))?,
                None => {
                    if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                        bail!("a PNG is not for a terminal: redirect stdout (> shot.png) or give --out");
                    }
                    std::io::stdout().write_all(&png)?;
                }
            }
        }
        DesktopCommand::Click {
            sandbox,
            x,
            y,
            button,
            double,
        } => {
            let button = match button {
                Button::Left => MouseButton::Left,
                Button::Middle => MouseButton::Middle,
                Button::Right => MouseButton::Right,
            };
            let count = if double { 2 } else { 1 };
            let at = connect(client, &sandbox)
                .await?
                .mouse(&MouseAction::Click {
                    x: Some(x),
                    y: Some(y),
                    button,
                    count,
                })
                .await?;
            point(&at, format)?;
        }
        DesktopCommand::Move { sandbox, x, y } => {
            point(
                &connect(client, &sandbox)
                    .await?
                    .mouse(&MouseAction::Move { x, y })
                    .await?,
                format,
            )?;
        }
        DesktopCommand::Scroll { sandbox, dy, dx } => {
            let action = MouseAction::Scroll {
                x: None,
                y: None,
                dx,
                dy,
            };
            point(
                &connect(client, &sandbox).await?.mouse(&action).await?,
                format,
            )?;
        }
        DesktopCommand::Type { sandbox, text } => {
            connect(client, &sandbox)
                .await?
                .keyboard(&KeyboardAction::Type { text })
                .await?;
        }
        DesktopCommand::Key { sandbox, keys } => {
            connect(client, &sandbox)
                .await?
                .keyboard(&KeyboardAction::Key { keys })
                .await?;
        }
        DesktopCommand::Windows { sandbox } => {
            windows(&connect(client, &sandbox).await?.windows().await?, format)?;
        }
        DesktopCommand::Launch { sandbox, command } => {
            let launch = Launch {
                command: Some(command),
                url: None,
            };
            launched(
                &connect(client, &sandbox).await?.launch(&launch).await?,
                format,
            )?;
        }
        DesktopCommand::Open { sandbox, url } => {
            let launch = Launch {
                command: None,
                url: Some(url),
            };
            launched(
                &connect(client, &sandbox).await?.launch(&launch).await?,
                format,
            )?;
        }
        DesktopCommand::Record {
            sandbox,
            dir,
            fps,
            max_seconds,
        } => {
            let start = RecordingStart {
                dir,
                fps,
                scale: None,
                max_seconds,
            };
            recording(
                &connect(client, &sandbox)
                    .await?
                    .start_recording(&start)
                    .await?,
                format,
            )?;
        }
        DesktopCommand::StopRecording { sandbox } => {
            recording(
                &connect(client, &sandbox).await?.stop_recording().await?,
                format,
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn recording(r: &Recording, format: Format) -> anyhow::Result<()> {
    emit(format, r, |r| {
        Table::pairs(vec![
            ("DIR", r.dir.clone()),
            ("RUNNING", r.running.to_string()),
            ("FRAMES", r.frames.to_string()),
            ("DURATION", format!("{} ms", r.duration_ms)),
            ("ENDED", r.ended.clone().unwrap_or_else(|| "-".into())),
        ])
    })
}

async fn connect(client: &Client, id: &str) -> anyhow::Result<Sandbox> {
    client.connect(id).await.explain(&format!("sandbox {id}"))
}

fn point(at: &Point, format: Format) -> anyhow::Result<()> {
    emit(format, at, |p| {
        Table::pairs(vec![("X", p.x.to_string()), ("Y", p.y.to_string())])
    })
}

fn launched(l: &Launched, format: Format) -> anyhow::Result<()> {
    emit(format, l, |l| {
        Table::pairs(vec![("PID", l.pid.to_string())])
    })
}

fn windows(list: &Vec<Window>, format: Format) -> anyhow::Result<()> {
    emit(format, list, |list| {
        let mut t = Table::new(&["ID", "FOCUSED", "GEOMETRY", "TITLE"]);
        for w in list {
            t.row(vec![
                w.id.to_string(),
                if w.focused { "*".into() } else { String::new() },
                format!("{}x{}+{}+{}", w.width, w.height, w.x, w.y),
                w.title.clone(),
            ]);
        }
        t
    })
}
