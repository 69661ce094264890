//! Building and spawning user processes: the shell, the environment (execd's own + the `EXECD_ENVS` file +
//! per-request vars), the working directory, uid/gid, a process group of their own, and turning the pipes
//! into non-blocking tokio readers. Everything goes through the [`Reaper`].

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::mpsc;

use crate::ids::Ids;
use crate::reaper::{Exit, Reaper, Spawned};

/// Environment variable naming the env file loaded for every command.
pub const EXECD_ENVS_VAR: &str = warren_env::EnvVars::EXECD_ENVS;
/// Where the env file lives when `EXECD_ENVS` is unset.
pub const DEFAULT_ENVS_FILE: &str = warren_env::DEFAULT_EXECD_ENVS;

/// What to run, already validated.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    pub program: Program,
    pub cwd: PathBuf,
    pub envs: BTreeMap<String, String>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// stdout and stderr share one pipe (background commands: one log, in the order written).
    pub combine_output: bool,
}

#[derive(Debug, Clone)]
pub enum Program {
    /// Run through the shell with `-c`.
    Shell(String),
    /// Exec directly.
    Argv(Vec<String>),
}

/// The shell used for `command` strings: bash when the image has it, else POSIX sh.
pub fn shell() -> &'static str {
    if Path::new("/bin/bash").exists() {
        "/bin/bash"
    } else {
        "/bin/sh"
    }
}

/// Parses an env file as the clients write it (`set_env` appends `KEY='value'`, or `KEY="value"` when
/// the value holds a `'`): blank lines, `#` comments and an optional `export ` prefix are tolerated;
/// a single-quoted value is taken as it is, newlines included, up to its closing quote; a
/// double-quoted one may span lines too, with `\\`, `\"`, `\n`, `\r`, `\t` and `\$` escapes;
/// an unquoted one is the rest of its line, trimmed. (It was read a line at a time: a multi-line
/// value came back as its first line.)
pub fn parse_env_file(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let trimmed = rest.trim_start();
        if trimmed.is_empty() {
            break;
        }
        let line_end = trimmed.find('\n').unwrap_or(trimmed.len());
        if trimmed.starts_with('#') {
            rest = &trimmed[line_end..];
            continue;
        }
        let entry = trimmed.strip_prefix("export ").unwrap_or(trimmed);
        let Some(eq) = entry[..entry.find('\n').unwrap_or(entry.len())].find('=') else {
            rest = &trimmed[line_end..];
            continue;
        };
        let key = entry[..eq].trim();
        let after = &entry[eq + 1..];
        let value_text = after.trim_start_matches([' ', '\t']);
        let (value, consumed) = match value_text.chars().next() {
            Some('\'') => match value_text[1..].find('\'') {
                Some(close) => (value_text[1..1 + close].to_string(), 1 + close + 1),
                None => unquoted(value_text),
            },
            Some('"') => double_quoted(value_text).unwrap_or_else(|| unquoted(value_text)),
            _ => unquoted(value_text),
        };
        let offset = value_text.as_ptr() as usize - rest.as_ptr() as usize + consumed;
        rest = &rest[offset..];
        // Whatever follows a closing quote on its line (a comment) is not the next entry.
        rest = &rest[rest.find('\n').unwrap_or(rest.len())..];
        if !key.is_empty() && !key.contains(char::is_whitespace) {
            out.push((key.to_string(), value));
        }
    }
    out
}

/// An unquoted value: the rest of its line, trimmed; and how much of `text` that took.
fn unquoted(text: &str) -> (String, usize) {
    let end = text.find('\n').unwrap_or(text.len());
    (text[..end].trim().to_string(), end)
}

/// A double-quoted value from its opening quote: its text with escapes applied, and how much of
/// `text` it took; `None` when it is never closed.
fn double_quoted(text: &str) -> Option<(String, usize)> {
    let mut value = String::new();
    let mut chars = text.char_indices().skip(1);
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((value, i + 1)),
            '\\' => match chars.next()?.1 {
                'n' => value.push('\n'),
                'r' => value.push('\r'),
                't' => value.push('\t'),
                other => value.push(other),
            },
            other => value.push(other),
        }
    }
    None
}

/// `text` with `$NAME` and `${NAME}` replaced by `env`'s values (an unknown name by nothing), as
/// a shell expands a working directory it is given: `$HOME/project`, `${WORKDIR}/src`. A `$` not
/// followed by a name stays as it is.
pub fn expand_vars(text: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let (name, used) = match after.strip_prefix('{') {
            Some(braced) => match braced.find('}') {
                Some(end) => (&braced[..end], end + 2),
                None => ("", 0),
            },
            None => {
                let end = after
                    .char_indices()
                    .find(|(j, c)| {
                        !(c.is_ascii_alphanumeric() || *c == '_') || (*j == 0 && c.is_ascii_digit())
                    })
                    .map_or(after.len(), |(j, _)| j);
                (&after[..end], end)
            }
        };
        let valid = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if valid {
            out.push_str(env.get(name).map_or("", String::as_str));
            rest = &after[used..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The environment of a new command: execd's, then the env file (re-read every time: the SDK's
/// `set_env` appends to it with a shell command), then the request's own vars.
pub fn command_env(extra: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut env = base_env();
    env.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

/// What every command starts from: execd's own environment and the env file's variables.
pub fn base_env() -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = warren_env::vars().collect();
    let file = warren_env::var(EXECD_ENVS_VAR).unwrap_or_else(|| DEFAULT_ENVS_FILE.to_string());
    // Commands must see where the file is: the SDK's `set_env` appends to "$EXECD_ENVS".
    env.insert(EXECD_ENVS_VAR.to_string(), file.clone());
    if let Ok(text) = std::fs::read_to_string(&file) {
        env.extend(parse_env_file(&text));
    }
    env
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("working directory {0} does not exist or is not a directory")]
    BadCwd(PathBuf),
    #[error("empty command")]
    Empty,
    #[error("failed to start {program}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to set up pipes")]
    Pipe(#[source] std::io::Error),
}

impl SpawnError {
    /// The message shown to the user: the error and its cause in one line.
    pub fn full_message(&self) -> String {
        let mut msg = self.to_string();
        let mut src = std::error::Error::source(self);
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        msg
    }
}

/// A running child with its pipes.
pub struct Running {
    pub pid: i32,
    pub exit: tokio::sync::oneshot::Receiver<Exit>,
    pub stdout: Option<pipe::Receiver>,
    pub stderr: Option<pipe::Receiver>,
    pub stdin: Option<pipe::Sender>,
}

/// How the child's stdin is wired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StdinMode {
    Null,
    Piped,
}

/// Spawns `spec` in a new process group (pgid == pid) with piped stdout/stderr.
pub fn spawn(reaper: &Reaper, spec: &ProcessSpec, stdin: StdinMode) -> Result<Running, SpawnError> {
    if !spec.cwd.is_dir() {
        return Err(SpawnError::BadCwd(spec.cwd.clone()));
    }
    // (posix_spawn runs nothing between fork and exec: under the floor, the general path)
    if let (Program::Shell(script), None, None) = (&spec.program, spec.uid, reaper.floor()) {
        return spawn_shell(reaper, spec, script, stdin);
    }
    let mut cmd = match &spec.program {
        Program::Shell(script) => {
            let mut c = Command::new(shell());
            c.arg("-c").arg(script);
            c
        }
        Program::Argv(argv) => {
            let (first, rest) = argv.split_first().ok_or(SpawnError::Empty)?;
            let mut c = Command::new(first);
            c.args(rest);
            c
        }
    };
    cmd.current_dir(&spec.cwd)
        .env_clear()
        .envs(command_env(&spec.envs))
        .stdin(match stdin {
            StdinMode::Null => Stdio::null(),
            StdinMode::Piped => Stdio::piped(),
        })
        .process_group(0);
    // With a shared pipe, the reading end is kept here and the writing ends live in `cmd` until it is
    // dropped right after the spawn (else EOF would never come).
    let combined_reader = if spec.combine_output {
        let (reader, writer) = std::io::pipe().map_err(SpawnError::Pipe)?;
        cmd.stdout(writer.try_clone().map_err(SpawnError::Pipe)?)
            .stderr(writer);
        Some(reader)
    } else {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        None
    };
    // Without an explicit gid, drop to the user's primary group rather than keeping root's (or,
    // without one, the gid execd has).
    let identity = spec.uid.map(|uid| crate::hardening::Identity {
        uid,
        gid: spec
            .gid
            .or_else(|| Ids::load().primary_gid(uid))
            .unwrap_or_else(|| nix::unistd::getgid().as_raw()),
    });
    let program = match &spec.program {
        Program::Shell(_) => shell().to_string(),
        Program::Argv(argv) => argv.first().cloned().unwrap_or_default(),
    };
    let Spawned { mut child, exit } = reaper
        .spawn_as(&mut cmd, crate::hardening::Role::UserCode, identity)
        .map_err(|source| SpawnError::Spawn { program, source })?;
    drop(cmd);
    let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
    let stdout = match combined_reader {
        Some(reader) => Some(reader.into()),
        None => child.stdout.take().map(Into::into),
    };
    running(
        pid,
        exit,
        stdout,
        child.stderr.take().map(Into::into),
        child.stdin.take().map(Into::into),
    )
}

/// Our ends of a started child's pipes, made non-blocking for tokio; if that fails, the child's
/// process group is killed.
pub(crate) fn running(
    pid: i32,
    exit: tokio::sync::oneshot::Receiver<Exit>,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    stdin: Option<OwnedFd>,
) -> Result<Running, SpawnError> {
    let stdout = stdout.map(pipe::Receiver::from_owned_fd).transpose();
    let stderr = stderr.map(pipe::Receiver::from_owned_fd).transpose();
    let stdin = stdin.map(pipe::Sender::from_owned_fd).transpose();
    match (stdout, stderr, stdin) {
        (Ok(stdout), Ok(stderr), Ok(stdin)) => Ok(Running {
            pid,
            exit,
            stdout,
            stderr,
            stdin,
        }),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            kill_group(pid, Signal::SIGKILL);
            Err(SpawnError::Pipe(e))
        }
    }
}

/// The common case — a shell command as execd's own user — started with `posix_spawn` (see
/// [`crate::spawn`]); what `spawn` does with `std::process::Command` otherwise.
fn spawn_shell(
    reaper: &Reaper,
    spec: &ProcessSpec,
    script: &str,
    stdin: StdinMode,
) -> Result<Running, SpawnError> {
    use std::os::fd::AsRawFd;
    let (out_r, out_w) = std::io::pipe().map_err(SpawnError::Pipe)?;
    let err = if spec.combine_output {
        None
    } else {
        Some(std::io::pipe().map_err(SpawnError::Pipe)?)
    };
    let input = match stdin {
        StdinMode::Null => None,
        StdinMode::Piped => Some(std::io::pipe().map_err(SpawnError::Pipe)?),
    };
    let env = command_env(&spec.envs);
    let program = shell();
    let stdio = crate::spawn::Stdio {
        stdin: input.as_ref().map_or(crate::spawn::Stdin::Null, |(r, _)| {
            crate::spawn::Stdin::Fd(r.as_raw_fd())
        }),
        stdout: Some(out_w.as_raw_fd()),
        stderr: Some(
            err.as_ref()
                .map_or(out_w.as_raw_fd(), |(_, w)| w.as_raw_fd()),
        ),
        new_group: true,
        extra: &[],
    };
    let argv = [program, "-c", script].map(std::ffi::OsStr::new);
    let (pid, exit) = reaper
        .start(|| {
            crate::spawn::spawn(
                Path::new(program),
                argv,
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                &spec.cwd,
                stdio,
            )
        })
        .map_err(|source| SpawnError::Spawn {
            program: program.to_string(),
            source,
        })?;
    // The child's ends close here: EOF on our ends must come when the child is done with them.
    drop(out_w);
    running(
        pid,
        exit,
        Some(out_r.into()),
        err.map(|(r, _)| r.into()),
        input.map(|(_, w)| w.into()),
    )
}

/// Signals the whole process group led by `pgid`; a group that is already gone is not an error.
pub fn kill_group(pgid: i32, sig: Signal) {
    if pgid <= 1 {
        return;
    }
    if let Err(e) = killpg(Pid::from_raw(pgid), sig) {
        if e != nix::errno::Errno::ESRCH {
            tracing::warn!(pgid, error = %e, "killpg failed");
        }
    }
}

/// Accumulates bytes and releases only complete UTF-8, so a multi-byte character split across two reads
/// is not turned into replacement characters.
#[derive(Default)]
pub struct Utf8Carry {
    pending: Vec<u8>,
}

impl Utf8Carry {
    /// Takes the next bytes of a stream; returns its text so far, holding back only a character
    /// still incomplete at the end. Invalid bytes become U+FFFD exactly as in a lossy decoding of the
    /// whole stream, wherever the stream was cut.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let keep = incomplete_tail(&self.pending);
        let rest = self.pending.split_off(self.pending.len() - keep);
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending = rest;
        out
    }

    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Bytes at the end of `b` that may still become a character: invalid sequences before them are
/// settled (a lossy decoding replaces them whatever follows), an incomplete one at the end is not.
fn incomplete_tail(b: &[u8]) -> usize {
    let mut start = 0;
    loop {
        match std::str::from_utf8(&b[start..]) {
            Ok(_) => return 0,
            Err(e) => match e.error_len() {
                None => return b.len() - start - e.valid_up_to(),
                Some(n) => start += e.valid_up_to() + n,
            },
        }
    }
}

/// Which stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Reads `pipe` to EOF, sending what each read brought as it is (the reader frames it: lines for
/// a foreground command's events, the log of a background one). Stops early if the receiver is gone.
pub async fn pump(mut pipe: pipe::Receiver, stream: Stream, tx: mpsc::Sender<(Stream, Vec<u8>)>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => {
                if tx.send((stream, buf[..n].to_vec())).await.is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
}

/// How long output is still collected after the main process exited: a background grandchild may hold the
/// pipe open forever, and the response must end when the command ends.
pub const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_file_parsing() {
        let parsed =
            parse_env_file("# c\n\nA=1\nexport B=two words\nC=\"q\"\nD='x=y'\n=bad\nnoequals\n");
        assert_eq!(
            parsed,
            vec![
                ("A".into(), "1".into()),
                ("B".into(), "two words".into()),
                ("C".into(), "q".into()),
                ("D".into(), "x=y".into()),
            ]
        );
    }

    #[test]
    fn working_directories_expand_variables() {
        let env: BTreeMap<String, String> = [("HOME", "/root"), ("W_DIR", "/srv/w")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(expand_vars("$HOME/project", &env), "/root/project");
        assert_eq!(expand_vars("${W_DIR}/src", &env), "/srv/w/src");
        assert_eq!(expand_vars("/a/$NOPE/b", &env), "/a//b");
        assert_eq!(
            expand_vars("/cost$5/${unclosed", &env),
            "/cost$5/${unclosed"
        );
        assert_eq!(expand_vars("/plain/path", &env), "/plain/path");
        assert_eq!(expand_vars("$", &env), "$");
    }

    #[test]
    fn multi_line_values_read_back_whole() {
        // What the clients' `set_env` appends for "two\nlines" and for "it's\n\"x\"\t$HOME".
        let text = "A='two\nlines'\nB=\"it's\\n\\\"x\\\"\\t$HOME\"\nC='last'  # note\nD= spaced \n";
        assert_eq!(
            parse_env_file(text),
            vec![
                ("A".into(), "two\nlines".into()),
                ("B".into(), "it's\n\"x\"\t$HOME".into()),
                ("C".into(), "last".into()),
                ("D".into(), "spaced".into()),
            ]
        );
        // An unclosed quote is the rest of its line, and what follows is read on.
        assert_eq!(
            parse_env_file("E='open\nF=1\n"),
            vec![("E".into(), "'open".into()), ("F".into(), "1".into())]
        );
    }

    #[test]
    fn utf8_carry_keeps_split_chars() {
        let bytes = "héllo€".as_bytes();
        let mut carry = Utf8Carry::default();
        let mut out = String::new();
        for b in bytes {
            out.push_str(&carry.push(std::slice::from_ref(b)));
        }
        out.push_str(&carry.finish());
        assert_eq!(out, "héllo€");
    }

    #[test]
    fn utf8_carry_after_an_invalid_byte_keeps_the_next_char_whole() {
        // An invalid byte, then a character cut in two: it used to come out as three U+FFFD.
        let bytes = [0xff, 0xe2, 0x82, 0xac];
        let mut carry = Utf8Carry::default();
        let mut out = carry.push(&bytes[..2]);
        out.push_str(&carry.push(&bytes[2..]));
        out.push_str(&carry.finish());
        assert_eq!(out, String::from_utf8_lossy(&bytes));
    }
}
