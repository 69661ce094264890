//! Recording a desktop as a timeline of screenshots (`/desktop/recording`): the screen is looked
//! at `fps` times a second, and each time it differs from the last frame a PNG is written to the
//! recording's folder with a line in its `timeline.jsonl` (frame, time since the start, file). A
//! still screen costs a capture and a comparison, no file. The files API reads what is written;
//! nothing needs ffmpeg in the image.
//!
//! One recording at a time per desktop. It ends when stopped, after `max_seconds`, after
//! [`MAX_FRAMES`] frames or [`MAX_BYTES`] of them, or when a frame cannot be read or written (the
//! reason is kept).

use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use tokio_util::sync::CancellationToken;
use warren_api::desktop::{Frame, Recording, RecordingStart};

use super::{desktop, x11, Desktop};
use crate::error::{code, ApiError, ApiJson, ApiResult};
use crate::AppState;

/// The most frames one recording writes (a busy screen at 10 fps fills it in ~17 minutes).
const MAX_FRAMES: u64 = 10_000;
/// The most bytes of frames one recording writes.
const MAX_BYTES: u64 = 2 << 30;

/// A desktop's recording slot.
#[derive(Default)]
pub struct Recorder {
    current: tokio::sync::Mutex<Option<Active>>,
}

struct Active {
    state: Arc<Mutex<Recording>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

fn snapshot(state: &Mutex<Recording>) -> Recording {
    state.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// `POST /desktop/recording`: starts one.
pub async fn start(
    State(app): State<Arc<AppState>>,
    ApiJson(req): ApiJson<RecordingStart>,
) -> ApiResult<(StatusCode, Json<Recording>)> {
    let d = desktop(&app)?;
    let scale = req.scale.unwrap_or(1.0);
    let valid = (1..=10).contains(&req.fps)
        && (1..=3600).contains(&req.max_seconds)
        && super::scale_ok(scale);
    if !valid {
        return Err(ApiError::bad_body(
            "fps from 1 to 10, max_seconds from 1 to 3600, scale above 0 and at most 1",
        ));
    }
    let mut current = d.recorder.current.lock().await;
    if let Some(a) = current.as_ref() {
        if snapshot(&a.state).running {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                code::RECORDING_RUNNING,
                "a recording runs already: stop it first (DELETE /desktop/recording)",
            ));
        }
    }
    let bad = |dir: &std::path::Path, e: std::io::Error| {
        ApiError::bad_body(format!("the folder {}: {e}", dir.display()))
    };
    let dir = match req.dir.as_deref() {
        Some(d) => {
            let dir = app.resolve(d);
            std::fs::create_dir_all(&dir).map_err(|e| bad(&dir, e))?;
            dir
        }
        None => {
            // A new folder nobody else could have made first: a name no one can guess, made
            // here (not found), readable by the sandbox's user only.
            let dir = std::env::temp_dir().join(format!(
                "warren-recording-{}-{}",
                chrono::Utc::now().format("%Y%m%dT%H%M%SZ"),
                uuid::Uuid::new_v4().simple()
            ));
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map_err(|e| bad(&dir, e))?;
            dir
        }
    };
    // Never over another recording's timeline (nor through a link left in its place).
    let timeline = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dir.join("timeline.jsonl"))
        .map_err(|e| bad(&dir, e))?;
    let state = Arc::new(Mutex::new(Recording {
        dir: dir.to_string_lossy().into_owned(),
        fps: req.fps,
        running: true,
        frames: 0,
        duration_ms: 0,
        ended: None,
    }));
    let stop = CancellationToken::new();
    let task = tokio::spawn(record(
        d.clone(),
        dir,
        timeline,
        req,
        scale,
        state.clone(),
        stop.clone(),
    ));
    let answer = snapshot(&state);
    *current = Some(Active { state, stop, task });
    Ok((StatusCode::CREATED, Json(answer)))
}

/// `GET /desktop/recording`: the current or last recording.
pub async fn status(State(app): State<Arc<AppState>>) -> ApiResult<Json<Recording>> {
    let d = desktop(&app)?;
    let current = d.recorder.current.lock().await;
    match current.as_ref() {
        Some(a) => Ok(Json(snapshot(&a.state))),
        None => Err(none()),
    }
}

/// `DELETE /desktop/recording`: stops it (once its last frame is written) and says what it made.
pub async fn stop(State(app): State<Arc<AppState>>) -> ApiResult<Json<Recording>> {
    let d = desktop(&app)?;
    let mut current = d.recorder.current.lock().await;
    let Some(a) = current.as_mut() else {
        return Err(none());
    };
    a.stop.cancel();
    let _ = (&mut a.task).await;
    Ok(Json(snapshot(&a.state)))
}

fn none() -> ApiError {
    ApiError::not_found(
        code::NO_RECORDING,
        "no recording was started (POST /desktop/recording)",
    )
}

async fn record(
    d: Arc<Desktop>,
    dir: PathBuf,
    mut timeline: std::fs::File,
    req: RecordingStart,
    scale: f64,
    state: Arc<Mutex<Recording>>,
    stop: CancellationToken,
) {
    let started = Instant::now();
    let max = Duration::from_secs(req.max_seconds);
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / u64::from(req.fps)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let (w, h) = (u32::from(d.width), u32::from(d.height));
    let mut last: Option<Arc<Vec<u8>>> = None;
    let mut frames = 0u64;
    let mut bytes = 0u64;
    let ended = loop {
        tokio::select! {
            () = stop.cancelled() => break None,
            _ = tick.tick() => {}
        }
        if started.elapsed() >= max {
            break Some("max_seconds".to_string());
        }
        let rgb = match d.with(move |x| x.capture(0, 0, w, h)).await {
            Ok(rgb) => Arc::new(rgb),
            Err(e) => break Some(format!("reading the screen: {}", e.message)),
        };
        if last.as_ref().is_some_and(|l| **l == *rgb) {
            continue;
        }
        last = Some(rgb.clone());
        frames += 1;
        let t_ms = started.elapsed().as_millis() as u64;
        let file = format!("frame-{frames:06}.png");
        let path = dir.join(&file);
        let written = tokio::task::spawn_blocking(move || {
            let png = x11::png(&rgb, w, h, scale)?;
            std::fs::write(&path, &png)
                .map(|()| png.len() as u64)
                .map_err(|e| format!("writing {}: {e}", path.display()))
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        match written {
            Ok(n) => bytes += n,
            Err(e) => break Some(e),
        }
        let line = serde_json::to_string(&Frame {
            frame: frames,
            t_ms,
            file,
        })
        .unwrap_or_default();
        if let Err(e) = writeln!(timeline, "{line}") {
            break Some(format!("writing the timeline: {e}"));
        }
        {
            let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
            s.frames = frames;
            s.duration_ms = t_ms;
        }
        if frames >= MAX_FRAMES {
            break Some("max_frames".to_string());
        }
        if bytes >= MAX_BYTES {
            break Some("max_bytes".to_string());
        }
    };
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    s.running = false;
    s.duration_ms = started.elapsed().as_millis() as u64;
    s.ended = ended;
}
