//! `warren shell SANDBOX`: an interactive terminal in a sandbox, over execd's PTY WebSocket. The
//! local terminal goes raw for the session (restored on exit, whatever happens); window resizes are
//! passed on; the exit code is the shell's. With stdin not a terminal (a pipe, a script) it feeds
//! stdin to the shell and ends it with Ctrl-D when stdin ends.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;
use std::process::ExitCode;

use nix::sys::termios::{self, SetArg, Termios};
use warren_sdk::{Client, PtyEvent, PtyOptions};

use crate::client::Explain;

#[derive(clap::Args)]
pub struct ShellArgs {
    sandbox: String,
    /// Attach to an existing terminal session (taking it over) instead of starting one.
    #[arg(long)]
    session: Option<String>,
    #[arg(long, short = 'w')]
    workdir: Option<String>,
    /// Run this instead of an interactive shell.
    #[arg(long, short = 'c')]
    command: Option<String>,
}

/// Puts the terminal in raw mode and puts it back when dropped.
struct RawMode {
    saved: Termios,
}

impl RawMode {
    fn enter() -> anyhow::Result<Self> {
        let stdin = std::io::stdin();
        let saved = termios::tcgetattr(stdin.as_fd())?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw)?;
        Ok(Self { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.saved);
    }
}

fn window_size() -> Option<(u16, u16)> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one winsize struct that lives for the call.
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_col > 0).then_some((ws.ws_col, ws.ws_row))
}

pub async fn run(args: ShellArgs, client: &Client) -> anyhow::Result<ExitCode> {
    let sb = client
        .connect(&args.sandbox)
        .await
        .explain(&format!("sandbox {}", args.sandbox))?;
    let (id, created) = match &args.session {
        Some(s) => (s.clone(), false),
        None => (
            sb.create_pty(args.workdir.as_deref(), args.command.as_deref())
                .await
                .explain("starting a terminal")?,
            true,
        ),
    };
    let opts = PtyOptions {
        pipe: false,
        since: (!created).then_some(0),
        takeover: !created,
    };
    let (mut writer, mut reader) = sb
        .attach_pty(&id, &opts)
        .await
        .explain("opening the terminal")?
        .split();

    let interactive = std::io::stdin().is_terminal();
    let _raw = if interactive {
        Some(RawMode::enter()?)
    } else {
        None
    };
    if let Some((cols, rows)) = window_size() {
        writer
            .resize(cols, rows)
            .await
            .explain("resizing the terminal")?;
    }

    // stdin is read on a thread of its own (blocking reads), forwarded through a channel.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Option<Vec<u8>>>(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 4096];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = tx.blocking_send(None);
                    return;
                }
                Ok(n) => {
                    if tx.blocking_send(Some(buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())?;
    let mut stdin_open = true;
    let code = loop {
        tokio::select! {
            ev = reader.next() => match ev {
                Some(Ok(PtyEvent::Output(b) | PtyEvent::Stderr(b))) => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&b)?;
                    out.flush()?;
                }
                Some(Ok(PtyEvent::Replay { data, .. })) => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&data)?;
                    out.flush()?;
                }
                Some(Ok(PtyEvent::Exit(code))) => break code,
                Some(Ok(PtyEvent::TakenOver)) => {
                    drop(_raw);
                    anyhow::bail!("another client took this terminal over (session {id})");
                }
                Some(Ok(PtyEvent::Control(_))) => {}
                Some(Err(e)) => {
                    drop(_raw);
                    return Err(e).explain("the terminal");
                }
                None => {
                    drop(_raw);
                    anyhow::bail!("the terminal closed without an exit code; the sandbox may have ended");
                }
            },
            input = rx.recv(), if stdin_open => match input {
                Some(Some(data)) => writer.write(&data).await.explain("the terminal")?,
                // End of input: Ctrl-D, which a shell at its prompt takes as "exit".
                _ => {
                    stdin_open = false;
                    writer.write(&[0x04]).await.explain("the terminal")?;
                }
            },
            _ = winch.recv() => {
                if let Some((cols, rows)) = window_size() {
                    writer.resize(cols, rows).await.explain("resizing the terminal")?;
                }
            }
        }
    };
    drop(_raw);
    if created {
        let _ = sb.delete_pty(&id).await;
    }
    Ok(ExitCode::from(
        u8::try_from(code.clamp(0, 255)).unwrap_or(1),
    ))
}
