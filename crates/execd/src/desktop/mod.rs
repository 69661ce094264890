//! A desktop for GUI agents: when the sandbox asks (`WARREN_DESKTOP=WIDTHxHEIGHT`, which the
//! server sets from the create's `extensions.desktop`), execd starts, from the image's own
//! programs, an X server (Xvfb), a window manager (openbox, else another it finds), and — when the
//! image has them — VNC (x11vnc) with noVNC over websockify on ports 6080 (interactive) and 6081
//! (view-only), each its own VNC server, so a view-only link cannot be turned into a controlling
//! one. execd listens only once the X server answers: the sandbox is Running with its display up.
//!
//! `/desktop/…` is the computer-use API against that display (see `x11`): screenshot, cursor,
//! mouse, keyboard, windows, launch, wait until still.

pub mod keys;
pub mod recording;
mod shm;
pub mod x11;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use warren_api::desktop::{
    DesktopInfo, KeyboardAction, Launch, Launched, MouseAction, Point, Wait, Waited,
    VIEW_ONLY_PORT, VIEW_PORT,
};

use crate::error::{code, ApiError, ApiJson, ApiResult};
use crate::process::command_env;
use crate::reaper::Reaper;
use crate::AppState;
use x11::{Failure, X};

/// The display the desktop is.
pub const DISPLAY: &str = ":0";
/// How long the X server may take to answer.
const X_START: Duration = Duration::from_secs(15);
/// How long the window manager may take to manage the screen.
const WM_START: Duration = Duration::from_secs(5);
/// The VNC servers behind the two views.
const VNC_PORT: u16 = 5900;
const VNC_VIEW_ONLY_PORT: u16 = 5901;

/// A running desktop.
pub struct Desktop {
    pub width: u16,
    pub height: u16,
    pub vnc: bool,
    /// The X connection the API uses, made on first use and again after an error.
    x: Mutex<Option<X>>,
    /// Its recording, if one was started.
    recorder: recording::Recorder,
}

/// The first of `names` on `PATH`.
pub(crate) fn find(path: &str, names: &[&str]) -> Option<PathBuf> {
    names.iter().find_map(|n| {
        std::env::split_paths(path)
            .map(|d| d.join(n))
            .find(|p| p.is_file())
    })
}

pub(crate) fn spawn(
    reaper: &Reaper,
    argv: &[&str],
    env: &BTreeMap<String, String>,
) -> Result<i32, String> {
    let mut cmd = Command::new(argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .envs(env)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let spawned = reaper
        .spawn(&mut cmd)
        .map_err(|e| format!("starting {}: {e}", argv[0]))?;
    Ok(i32::try_from(spawned.child.id()).unwrap_or(i32::MAX))
}

impl Desktop {
    /// Starts the desktop `size` asks for (`WIDTHxHEIGHT`) and waits for its X server to answer.
    pub async fn start(reaper: &Reaper, size: &str) -> Result<Desktop, String> {
        let (width, height) = warren_api::desktop::parse_size(size)?;
        let mut env = command_env(&BTreeMap::new());
        env.insert("DISPLAY".into(), DISPLAY.into());
        let path = env.get("PATH").cloned().unwrap_or_default();
        let xvfb = find(&path, &["Xvfb"])
            .ok_or("the image has no X server for the desktop: install Xvfb (Debian: xvfb)")?;
        let screen = format!("{width}x{height}x24");
        let xvfb = xvfb.to_string_lossy().into_owned();
        // Only this sandbox's processes reach its display (a Unix socket in its own /tmp).
        spawn(
            reaper,
            &[
                &xvfb,
                DISPLAY,
                "-screen",
                "0",
                &screen,
                "-nolisten",
                "tcp",
                "-ac",
            ],
            &env,
        )?;
        let started = Instant::now();
        let mut x = loop {
            match tokio::task::spawn_blocking(|| X::connect(DISPLAY)).await {
                Ok(Ok(x)) => break x,
                Ok(Err(Failure::Display(e) | Failure::Bad(e))) if started.elapsed() >= X_START => {
                    return Err(format!(
                        "the X server did not answer within {} s: {e}",
                        X_START.as_secs()
                    ))
                }
                Err(e) => return Err(format!("connecting to the X server: {e}")),
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        if let Some(wm) = find(
            &path,
            &["openbox", "fluxbox", "twm", "matchbox-window-manager"],
        ) {
            spawn(reaper, &[&wm.to_string_lossy()], &env)?;
            // A window mapped while the manager starts can be lost to it (openbox takes the map
            // request and never maps it): the desktop is ready when the manager says it is
            // (openbox and fluxbox do; twm and matchbox say nothing, and are not waited for).
            let ewmh = wm.ends_with("openbox") || wm.ends_with("fluxbox");
            let waited = Instant::now();
            x = tokio::task::spawn_blocking(move || {
                if !ewmh {
                    return x;
                }
                while waited.elapsed() < WM_START && !x.wm_ready().unwrap_or(false) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                x
            })
            .await
            .map_err(|e| format!("waiting for the window manager: {e}"))?;
        }
        let mut vnc = false;
        if let Some(x11vnc) = find(&path, &["x11vnc"]) {
            let x11vnc = x11vnc.to_string_lossy().into_owned();
            // The view-only server takes no input and gives no clipboard (x11vnc sends the X
            // selection to viewers, which a link that only shows the screen must not).
            for (port, extra) in [
                (VNC_PORT, &[][..]),
                (VNC_VIEW_ONLY_PORT, &["-viewonly", "-nosel"][..]),
            ] {
                let port = port.to_string();
                let mut argv = vec![
                    x11vnc.as_str(),
                    "-display",
                    DISPLAY,
                    "-rfbport",
                    &port,
                    "-localhost",
                    "-shared",
                    "-forever",
                    "-nopw",
                    "-quiet",
                ];
                argv.extend(extra.iter().copied());
                spawn(reaper, &argv, &env)?;
            }
            if let Some(ws) = find(&path, &["websockify"]) {
                let ws = ws.to_string_lossy().into_owned();
                let web = ["/usr/share/novnc", "/usr/share/webapps/novnc", "/opt/novnc"]
                    .into_iter()
                    .find(|d| std::path::Path::new(d).join("vnc.html").is_file());
                for (view, vnc_port) in
                    [(VIEW_PORT, VNC_PORT), (VIEW_ONLY_PORT, VNC_VIEW_ONLY_PORT)]
                {
                    // On loopback: execd's proxy reaches it there, and nothing else should (a
                    // neighbour on a shared network would find a password-free VNC).
                    let (listen, target) =
                        (format!("127.0.0.1:{view}"), format!("localhost:{vnc_port}"));
                    let mut argv = vec![ws.as_str()];
                    if let Some(web) = web {
                        argv.extend(["--web", web]);
                    }
                    argv.extend([listen.as_str(), target.as_str()]);
                    spawn(reaper, &argv, &env)?;
                }
                vnc = web.is_some();
            }
            // Ready when they listen: the live view opens at once, and programs start on a
            // settled display (a Tk app started while the VNC servers were still setting up
            // waited on its window manager forever, its window never mapped).
            let mut ports = vec![VNC_PORT, VNC_VIEW_ONLY_PORT];
            if vnc {
                ports.extend([VIEW_PORT, VIEW_ONLY_PORT]);
            }
            for port in ports {
                while tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_err()
                {
                    if started.elapsed() >= X_START {
                        return Err(format!(
                            "the desktop's VNC did not listen on port {port} within {} s",
                            X_START.as_secs()
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        tracing::info!(
            width,
            height,
            vnc,
            ms = started.elapsed().as_millis() as u64,
            "desktop ready"
        );
        Ok(Desktop {
            width,
            height,
            vnc,
            x: Mutex::new(Some(x)),
            recorder: Default::default(),
        })
    }

    /// Runs `f` on the X connection, off the async runtime.
    pub(crate) async fn with<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&X) -> Result<T, Failure> + Send + 'static,
    ) -> ApiResult<T> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut slot = this.x.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_none() {
                *slot = Some(X::connect(DISPLAY)?);
            }
            let x = slot
                .as_ref()
                .ok_or_else(|| Failure::Display("no connection".into()))?;
            let result = f(x);
            if let Err(Failure::Display(_)) = &result {
                *slot = None; // a broken connection is made again next time
            }
            result
        })
        .await
        .map_err(|e| ApiError::runtime(format!("the desktop action: {e}")))?
        .map_err(|e| match e {
            Failure::Bad(m) => ApiError::bad_body(m),
            Failure::Display(m) => ApiError::runtime(m),
        })
    }
}

/// A scale screenshots take: above 0, at most 1 (a NaN is none: every comparison with it is false).
pub(crate) fn scale_ok(scale: f64) -> bool {
    scale > 0.0 && scale <= 1.0
}

pub(crate) fn desktop(app: &AppState) -> ApiResult<Arc<Desktop>> {
    app.desktop.clone().ok_or_else(|| {
        ApiError::new(
            StatusCode::CONFLICT,
            code::DESKTOP_NOT_RUNNING,
            "this sandbox has no desktop: create it with extensions.desktop (\"true\" or \"1280x800\")",
        )
    })
}

/// `GET /desktop`.
pub async fn info(State(app): State<Arc<AppState>>) -> ApiResult<Json<DesktopInfo>> {
    let d = desktop(&app)?;
    let shared = d.with(|x| Ok(x.shared_memory())).await?;
    Ok(Json(DesktopInfo {
        display: DISPLAY.into(),
        width: d.width,
        height: d.height,
        vnc: d.vnc,
        capture: if shared { "shm" } else { "get_image" }.into(),
    }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShotQuery {
    x: Option<i32>,
    y: Option<i32>,
    width: Option<u32>,
    height: Option<u32>,
    /// 0 < scale ≤ 1.
    scale: Option<f64>,
}

/// `GET /desktop/screenshot`: PNG of the screen or of a region, scaled down if asked.
pub async fn screenshot(
    State(app): State<Arc<AppState>>,
    q: Result<Query<ShotQuery>, QueryRejection>,
) -> ApiResult<Response> {
    let Query(q) = q.map_err(|e| ApiError::bad_body(format!("the query: {}", e.body_text())))?;
    let d = desktop(&app)?;
    let scale = q.scale.unwrap_or(1.0);
    if !scale_ok(scale) {
        return Err(ApiError::bad_body(format!(
            "scale {scale}: from above 0 to 1"
        )));
    }
    let (x, y) = (q.x.unwrap_or(0), q.y.unwrap_or(0));
    let w = q
        .width
        .unwrap_or_else(|| u32::from(d.width).saturating_sub(x.max(0) as u32));
    let h = q
        .height
        .unwrap_or_else(|| u32::from(d.height).saturating_sub(y.max(0) as u32));
    let rgb = d.with(move |xc| xc.capture(x, y, w, h)).await?;
    // Encoded off the desktop's lock: other actions go on meanwhile.
    let png = tokio::task::spawn_blocking(move || x11::png(&rgb, w, h, scale))
        .await
        .map_err(|e| ApiError::runtime(format!("the screenshot: {e}")))?
        .map_err(ApiError::runtime)?;
    Ok(([(header::CONTENT_TYPE, "image/png")], png).into_response())
}

/// `GET /desktop/cursor`.
pub async fn cursor(State(app): State<Arc<AppState>>) -> ApiResult<Json<Point>> {
    let d = desktop(&app)?;
    Ok(Json(d.with(|x| x.cursor()).await?))
}

fn at(x: Option<i32>, y: Option<i32>) -> ApiResult<Option<(i32, i32)>> {
    match (x, y) {
        (Some(x), Some(y)) => Ok(Some((x, y))),
        (None, None) => Ok(None),
        _ => Err(ApiError::bad_body(
            "give both x and y, or neither (where the cursor is)",
        )),
    }
}

/// `POST /desktop/mouse`: move, click (any button, 1 to 3 times), drag, scroll.
pub async fn mouse(
    State(app): State<Arc<AppState>>,
    ApiJson(action): ApiJson<MouseAction>,
) -> ApiResult<Json<Point>> {
    let d = desktop(&app)?;
    let done = match action {
        MouseAction::Move { x, y } => d.with(move |c| c.move_to(x, y)).await,
        MouseAction::Click {
            x,
            y,
            button,
            count,
        } => {
            let at = at(x, y)?;
            d.with(move |c| c.click(at, button, count)).await
        }
        MouseAction::Drag { from, to, button } => d.with(move |c| c.drag(from, to, button)).await,
        MouseAction::Scroll { x, y, dx, dy } => {
            let at = at(x, y)?;
            d.with(move |c| c.scroll(at, dx, dy)).await
        }
    };
    done?;
    Ok(Json(d.with(|x| x.cursor()).await?))
}

/// `POST /desktop/keyboard`: key chords, or text typed.
pub async fn keyboard(
    State(app): State<Arc<AppState>>,
    ApiJson(action): ApiJson<KeyboardAction>,
) -> ApiResult<StatusCode> {
    let d = desktop(&app)?;
    match action {
        KeyboardAction::Key { keys } => {
            if keys.is_empty() || keys.len() > 100 {
                return Err(ApiError::bad_body("keys: 1 to 100 chords"));
            }
            // All checked before any is pressed: a bad name presses nothing.
            for k in &keys {
                keys::chord(k).map_err(ApiError::bad_body)?;
            }
            d.with(move |x| keys.iter().try_for_each(|k| x.chord(k)))
                .await?;
        }
        KeyboardAction::Type { text } => d.with(move |x| x.type_text(&text)).await?,
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /desktop/windows`.
pub async fn windows(
    State(app): State<Arc<AppState>>,
) -> ApiResult<Json<Vec<warren_api::desktop::Window>>> {
    let d = desktop(&app)?;
    Ok(Json(d.with(|x| x.windows()).await?))
}

/// `POST /desktop/windows/{id}/focus`.
pub async fn focus(
    State(app): State<Arc<AppState>>,
    id: Result<Path<u32>, PathRejection>,
) -> ApiResult<StatusCode> {
    let Path(id) =
        id.map_err(|_| ApiError::bad_body("a window id is a number (GET /desktop/windows)"))?;
    let d = desktop(&app)?;
    d.with(move |x| x.focus(id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /desktop/launch`: a command (by the shell) or a URL (in the image's browser), on the
/// desktop, left running.
pub async fn launch(
    State(app): State<Arc<AppState>>,
    ApiJson(req): ApiJson<Launch>,
) -> ApiResult<Json<Launched>> {
    desktop(&app)?;
    let mut env = command_env(&BTreeMap::new());
    env.insert("DISPLAY".into(), DISPLAY.into());
    let argv: Vec<String> = match (req.command, req.url) {
        (Some(c), None) if !c.trim().is_empty() => {
            vec![crate::process::shell().into(), "-c".into(), c]
        }
        (None, Some(url))
            if url.starts_with("http://")
                || url.starts_with("https://")
                || url.starts_with("file://") =>
        {
            let path = env.get("PATH").cloned().unwrap_or_default();
            let browser = find(
                &path,
                &[
                    "chromium",
                    "chromium-browser",
                    "google-chrome",
                    "firefox",
                    "xdg-open",
                ],
            )
            .ok_or_else(|| {
                ApiError::bad_body("the image has no browser to open a URL in (chromium, firefox)")
            })?;
            let b = browser.to_string_lossy().into_owned();
            let mut argv = vec![b.clone()];
            if b.contains("chrom") {
                // (root in a sandbox: Chromium's own sandbox needs namespaces the sandbox refuses)
                argv.extend(
                    ["--no-sandbox", "--no-first-run", "--disable-dev-shm-usage"].map(String::from),
                );
            }
            argv.push(url);
            argv
        }
        _ => {
            return Err(ApiError::bad_body(
                "give a command, or a URL (http, https or file)",
            ))
        }
    };
    let refs: Vec<&str> = argv.iter().map(String::as_str).collect();
    let pid = spawn(&app.reaper, &refs, &env).map_err(ApiError::runtime)?;
    Ok(Json(Launched { pid }))
}

/// `POST /desktop/wait`: until the screen is still.
pub async fn wait(
    State(app): State<Arc<AppState>>,
    ApiJson(w): ApiJson<Wait>,
) -> ApiResult<Json<Waited>> {
    let d = desktop(&app)?;
    if w.timeout_ms > 120_000 || w.still_ms == 0 || w.still_ms > w.timeout_ms {
        return Err(ApiError::bad_body(
            "still_ms from 1 to timeout_ms, timeout_ms at most 120000",
        ));
    }
    // One look at the screen per turn of the desktop's lock: other actions and a recording go on
    // while this waits.
    let (still_for, timeout) = (
        Duration::from_millis(w.still_ms),
        Duration::from_millis(w.timeout_ms),
    );
    let started = Instant::now();
    let mut last = d.with(|x| x.look()).await?;
    let mut since = Instant::now();
    let still = loop {
        if since.elapsed() >= still_for {
            break true;
        }
        if started.elapsed() >= timeout {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50).min(still_for)).await;
        let now = d.with(|x| x.look()).await?;
        if now != last {
            last = now;
            since = Instant::now();
        }
    };
    Ok(Json(Waited {
        still,
        waited_ms: started.elapsed().as_millis() as u64,
    }))
}
