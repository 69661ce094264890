//! One Jupyter kernel: the process (started from its kernelspec, in its own process group, reaped by
//! execd's reaper) and the client ends of its shell, iopub and control channels.
//!
//! Replies and iopub messages are routed by their parent `msg_id` to whoever made the request; when
//! the process exits every open request gets [`Event::Died`] with the reason (exit code, signal,
//! out-of-memory, the last lines the kernel printed).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use super::kernelspec::{InterruptMode, KernelSpec};
use super::message::{Codec, Message};
use super::zmtp::{self, SocketType};
use crate::metrics::Sources;
use crate::process::{command_env, kill_group};
use crate::reaper::{Exit, Reaper, Spawned};

/// How long a kernel may take from exec to answering `kernel_info_request`.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a kernel gets to exit after `shutdown_request` before its process group is killed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How much of the kernel's own stdout/stderr is kept for error messages.
const TAIL_BYTES: usize = 4096;

/// What a request's owner receives.
#[derive(Debug)]
pub enum Event {
    IoPub(Message),
    Reply(Message),
    /// The kernel process is gone; the text says how.
    Died(String),
}

#[derive(Default)]
struct Routes {
    open: Mutex<HashMap<String, mpsc::UnboundedSender<Event>>>,
    /// Set once the kernel has exited: later requests fail at once with this text.
    died: Mutex<Option<String>>,
}

impl Routes {
    fn deliver(&self, parent: &str, ev: Event) {
        if let Some(tx) = lock(&self.open).get(parent) {
            let _ = tx.send(ev);
        }
    }

    /// Marks the kernel dead and tells every open request. `died` is held while `open` is drained
    /// (and `request` holds it while it registers), so no request can slip in unnoticed between.
    fn fail_all(&self, why: String) {
        let mut died = lock(&self.died);
        *died = Some(why.clone());
        for (_, tx) in lock(&self.open).drain() {
            let _ = tx.send(Event::Died(why.clone()));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What starting a kernel needs besides its spec.
pub struct Launch<'a> {
    pub spec: &'a KernelSpec,
    pub cwd: &'a Path,
    /// Where the connection file goes (private to execd's user).
    pub runtime_dir: &'a Path,
    pub id: &'a str,
    pub reaper: &'a Reaper,
    pub sources: &'a Sources,
}

pub struct Kernel {
    pub pid: i32,
    codec: Codec,
    shell: tokio::sync::Mutex<zmtp::Sender>,
    control: tokio::sync::Mutex<zmtp::Sender>,
    /// Never written after the subscription, but closing it would end the subscription.
    _iopub: zmtp::Sender,
    interrupt_mode: InterruptMode,
    /// Output may trail the kernel's idle status (see [`Kernel::late_output`]).
    late_output: bool,
    routes: Arc<Routes>,
    exit: watch::Receiver<Option<Exit>>,
    connection_file: PathBuf,
    tasks: Vec<AbortHandle>,
}

impl Kernel {
    /// Starts the kernel and waits until it answers on shell and publishes on iopub.
    pub async fn start(l: Launch<'_>) -> Result<Kernel, String> {
        let ports = free_ports(5).map_err(|e| format!("choosing ports for the kernel: {e}"))?;
        let key = uuid::Uuid::new_v4().simple().to_string();
        let connection = json!({
            "shell_port": ports[0], "iopub_port": ports[1], "stdin_port": ports[2],
            "control_port": ports[3], "hb_port": ports[4], "ip": "127.0.0.1", "key": key,
            "transport": "tcp", "signature_scheme": "hmac-sha256", "kernel_name": l.spec.name,
        });
        std::fs::create_dir_all(l.runtime_dir)
            .map_err(|e| format!("creating {}: {e}", l.runtime_dir.display()))?;
        let connection_file = l.runtime_dir.join(format!("kernel-{}.json", l.id));
        write_private(
            &connection_file,
            &serde_json::to_vec(&connection).unwrap_or_default(),
        )
        .map_err(|e| format!("writing {}: {e}", connection_file.display()))?;
        match Self::spawn_and_connect(&l, &connection_file, &ports, &key).await {
            Ok(k) => Ok(k),
            Err(e) => {
                let _ = std::fs::remove_file(&connection_file);
                Err(e)
            }
        }
    }

    async fn spawn_and_connect(
        l: &Launch<'_>,
        connection_file: &Path,
        ports: &[u16],
        key: &str,
    ) -> Result<Kernel, String> {
        let argv = l.spec.command(connection_file);
        let (reader, writer) = std::io::pipe().map_err(|e| format!("creating a pipe: {e}"))?;
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .current_dir(l.cwd)
            .env_clear()
            .envs(command_env(&l.spec.env))
            .stdin(Stdio::null())
            .stdout(
                writer
                    .try_clone()
                    .map_err(|e| format!("creating a pipe: {e}"))?,
            )
            .stderr(writer)
            .process_group(0);
        let Spawned { child, exit } = l
            .reaper
            .spawn(&mut cmd)
            .map_err(|e| format!("starting kernel '{}' ({}): {e}", l.spec.name, argv[0]))?;
        drop(cmd);
        let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
        let mut tasks = Vec::new();
        // From here on, any failure must kill the group: the guard does unless disarmed.
        let mut guard = KillOnDrop(Some(pid));

        let tail = Arc::new(Mutex::new(Vec::<u8>::new()));
        if let Ok(rx) = tokio::net::unix::pipe::Receiver::from_owned_fd(reader.into()) {
            tasks.push(tokio::spawn(keep_tail(rx, tail.clone())).abort_handle());
        }
        let routes = Arc::new(Routes::default());
        let (exit_tx, exit_rx) = watch::channel(None);
        let oom_before = l.sources.oom_kills();
        {
            let routes = routes.clone();
            let tail = tail.clone();
            let sources = l.sources.clone();
            let name = l.spec.name.clone();
            tokio::spawn(async move {
                let status = exit.await.unwrap_or(Exit::Code(-1));
                let oom = matches!(status, Exit::Signal(9))
                    && sources.oom_kills().unwrap_or(0) > oom_before.unwrap_or(0);
                // give the tail reader a moment to drain what the kernel printed last
                tokio::time::sleep(Duration::from_millis(20)).await;
                let why = describe_exit(&name, status, oom, &lock(&tail));
                let _ = exit_tx.send(Some(status));
                routes.fail_all(why);
            });
        }

        let deadline = Instant::now() + START_TIMEOUT;
        let mut exit_watch = exit_rx.clone();
        let addr = |port: u16| format!("127.0.0.1:{port}");
        let (shell_tx, shell_rx) = connect_retry(
            &addr(ports[0]),
            SocketType::Dealer,
            &mut exit_watch,
            &routes,
            deadline,
        )
        .await?;
        let (iopub_tx, iopub_rx) = connect_retry(
            &addr(ports[1]),
            SocketType::Sub,
            &mut exit_watch,
            &routes,
            deadline,
        )
        .await?;
        let (control_tx, control_rx) = connect_retry(
            &addr(ports[3]),
            SocketType::Dealer,
            &mut exit_watch,
            &routes,
            deadline,
        )
        .await?;
        let codec = Codec::new(key, uuid::Uuid::new_v4().simple().to_string());
        for (rx, is_reply) in [(shell_rx, true), (iopub_rx, false)] {
            tasks.push(
                tokio::spawn(pump(rx, codec.clone(), routes.clone(), is_reply)).abort_handle(),
            );
        }
        // Control replies (to shutdown and interrupt requests) are not needed; keep the socket drained.
        tasks.push(tokio::spawn(drain(control_rx)).abort_handle());

        let kernel = Kernel {
            pid,
            codec,
            shell: tokio::sync::Mutex::new(shell_tx),
            control: tokio::sync::Mutex::new(control_tx),
            _iopub: iopub_tx,
            interrupt_mode: l.spec.interrupt_mode,
            late_output: l
                .spec
                .argv
                .first()
                .and_then(|p| Path::new(p).file_name())
                .is_some_and(|n| n == "deno"),
            routes,
            exit: exit_rx,
            connection_file: connection_file.to_path_buf(),
            tasks,
        };
        guard.0 = None;
        kernel.wait_ready(deadline).await?;
        // The start-up banner is noise; what the kernel prints from now on may explain its death.
        lock(&tail).clear();
        Ok(kernel)
    }

    /// `kernel_info_request` until its reply and an iopub message for it both arrive: only then is the
    /// SUB subscription known to be live (anything published before it would be lost).
    async fn wait_ready(&self, deadline: Instant) -> Result<(), String> {
        loop {
            let (id, mut rx) = self.request("kernel_info_request", &json!({})).await?;
            let (mut reply, mut iopub) = (false, false);
            let mut until = deadline;
            while !(reply && iopub) {
                match tokio::time::timeout_at(until.into(), rx.recv()).await {
                    Ok(Some(Event::Reply(_))) => {
                        reply = true;
                        // the iopub status for this request comes right around the reply
                        until = until.min(Instant::now() + Duration::from_millis(300));
                    }
                    Ok(Some(Event::IoPub(_))) => iopub = true,
                    Ok(Some(Event::Died(why))) => return Err(why),
                    Ok(None) | Err(_) => break,
                }
            }
            self.forget(&id);
            if reply && iopub {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the kernel did not answer within {} s",
                    START_TIMEOUT.as_secs()
                ));
            }
        }
    }

    /// Sends a shell request; events for it arrive on the returned channel until [`Kernel::forget`].
    pub async fn request(
        &self,
        msg_type: &str,
        content: &Value,
    ) -> Result<(String, mpsc::UnboundedReceiver<Event>), String> {
        let (id, parts) = self.codec.request(msg_type, content);
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let died = lock(&self.routes.died);
            if let Some(why) = died.clone() {
                return Err(why);
            }
            lock(&self.routes.open).insert(id.clone(), tx);
        }
        if let Err(e) = self.shell.lock().await.send(&parts).await {
            self.forget(&id);
            return Err(lock(&self.routes.died)
                .clone()
                .unwrap_or_else(|| format!("sending to the kernel: {e}")));
        }
        Ok((id, rx))
    }

    pub async fn execute(
        &self,
        code: &str,
    ) -> Result<(String, mpsc::UnboundedReceiver<Event>), String> {
        self.request(
            "execute_request",
            &json!({
                "code": code, "silent": false, "store_history": true, "user_expressions": {},
                "allow_stdin": false, "stop_on_error": true,
            }),
        )
        .await
    }

    /// Whether the kernel may publish an execution's output after its idle status: Deno's sends
    /// console output from a task of its own, which a loaded machine can leave behind the idle
    /// status (seen: a `console.log` whose line never reached the run's stream).
    pub fn late_output(&self) -> bool {
        self.late_output
    }

    pub fn forget(&self, msg_id: &str) {
        lock(&self.routes.open).remove(msg_id);
    }

    /// Why the kernel is gone, once it is.
    pub fn died(&self) -> Option<String> {
        lock(&self.routes.died).clone()
    }

    /// Interrupts the running execution the way the kernelspec asks (SIGINT to the kernel's process
    /// group, as jupyter_client does, or an `interrupt_request` on control).
    pub async fn interrupt(&self) {
        match self.interrupt_mode {
            InterruptMode::Signal => kill_group(self.pid, Signal::SIGINT),
            InterruptMode::Message => {
                let (_, parts) = self.codec.request("interrupt_request", &json!({}));
                let _ = self.control.lock().await.send(&parts).await;
            }
        }
    }

    /// Asks the kernel to shut down, then kills whatever is left of its process group.
    pub async fn shutdown(&self) {
        if self.exit.borrow().is_none() {
            let (_, parts) = self
                .codec
                .request("shutdown_request", &json!({"restart": false}));
            let _ = self.control.lock().await.send(&parts).await;
            let mut exit = self.exit.clone();
            let _ = tokio::time::timeout(SHUTDOWN_GRACE, exit.wait_for(|e| e.is_some())).await;
        }
        self.kill();
    }

    /// SIGKILL to the process group; idempotent.
    pub fn kill(&self) {
        kill_group(self.pid, Signal::SIGKILL);
        let _ = std::fs::remove_file(&self.connection_file);
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        self.kill();
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Kills a half-started kernel's group if setup bails out.
pub(super) struct KillOnDrop(pub(super) Option<i32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            kill_group(pid, Signal::SIGKILL);
        }
    }
}

async fn connect_retry(
    addr: &str,
    kind: SocketType,
    exit: &mut watch::Receiver<Option<Exit>>,
    routes: &Routes,
    deadline: Instant,
) -> Result<(zmtp::Sender, zmtp::Receiver), String> {
    loop {
        match zmtp::connect(addr, kind).await {
            Ok(pair) => return Ok(pair),
            Err(e) => {
                if exit.borrow().is_some() {
                    // the exit task fills in the reason right after it sees the status
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return Err(lock(&routes.died)
                        .clone()
                        .unwrap_or_else(|| "the kernel exited during start-up".into()));
                }
                if Instant::now() >= deadline {
                    return Err(format!("the kernel never listened on {addr}: {e}"));
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
            _ = exit.changed() => {}
        }
    }
}

async fn pump(mut rx: zmtp::Receiver, codec: Codec, routes: Arc<Routes>, is_reply: bool) {
    while let Ok(parts) = rx.recv().await {
        let Some(msg) = codec.decode(&parts) else {
            continue;
        };
        let parent = msg.parent_id().to_string();
        let ev = if is_reply {
            Event::Reply(msg)
        } else {
            Event::IoPub(msg)
        };
        routes.deliver(&parent, ev);
    }
}

async fn drain(mut rx: zmtp::Receiver) {
    while rx.recv().await.is_ok() {}
}

pub(super) async fn keep_tail(mut rx: tokio::net::unix::pipe::Receiver, tail: Arc<Mutex<Vec<u8>>>) {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 4096];
    while let Ok(n @ 1..) = rx.read(&mut buf).await {
        let mut t = lock(&tail);
        t.extend_from_slice(&buf[..n]);
        if t.len() > TAIL_BYTES {
            let cut = t.len() - TAIL_BYTES;
            t.drain(..cut);
        }
    }
}

pub(super) fn describe_exit(name: &str, status: Exit, oom: bool, tail: &[u8]) -> String {
    let mut why = match status {
        Exit::Code(c) => format!("kernel '{name}' exited with code {c}"),
        Exit::Signal(s) => {
            let sig = Signal::try_from(s).map(|s| s.as_str()).unwrap_or("?");
            format!("kernel '{name}' was killed by signal {s} ({sig})")
        }
    };
    if oom {
        why.push_str(": the sandbox ran out of memory (its memory limit was reached)");
    }
    let text = String::from_utf8_lossy(tail);
    let last: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if !last.is_empty() {
        let from = last.len().saturating_sub(5);
        why.push_str("; it printed: ");
        why.push_str(&last[from..].join(" | "));
    }
    why.push_str(". The context's state is lost; create a new context.");
    why
}

fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    // All bound at once so they differ; released right before the kernel binds them. Only processes
    // of this sandbox (its own network namespace) could race for them.
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

pub(super) fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)
}

/// The MIME bundle of `execute_result`/`display_data` as execd's `results`: `text/plain` becomes `text`.
pub fn results_of(data: &Value) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    if let Some(map) = data.as_object() {
        for (k, v) in map {
            let key = if k == "text/plain" {
                "text".to_string()
            } else {
                k.clone()
            };
            out.insert(key, v.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mime_bundle_renames_text_plain_only() {
        let r = results_of(
            &json!({"text/plain": "1", "image/png": "iVBOR", "application/json": {"a": 1}}),
        );
        assert_eq!(r["text"], "1");
        assert_eq!(r["image/png"], "iVBOR");
        assert_eq!(r["application/json"]["a"], 1);
        assert!(!r.contains_key("text/plain"));
    }

    #[test]
    fn exit_descriptions() {
        let d = describe_exit("python3", Exit::Signal(9), true, b"boom\n\nlast line\n");
        assert!(d.contains("signal 9 (SIGKILL)"), "{d}");
        assert!(d.contains("out of memory"), "{d}");
        assert!(d.contains("boom | last line"), "{d}");
        let d = describe_exit("python3", Exit::Code(1), false, b"");
        assert!(d.starts_with("kernel 'python3' exited with code 1."), "{d}");
    }

    #[test]
    fn ports_are_distinct() {
        let p = free_ports(5).expect("ports");
        let set: std::collections::HashSet<_> = p.iter().collect();
        assert_eq!(set.len(), 5);
    }
}
