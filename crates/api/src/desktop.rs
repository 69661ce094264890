//! The desktop's computer-use API (execd's `/desktop/…` routes, Warren's own: the reference has
//! none): what GUI agents send to look at and drive a sandbox's X display.

use serde::{Deserialize, Serialize};

/// The variable that asks execd for a desktop (`WIDTHxHEIGHT`); the server sets it from the
/// create's `extensions.desktop`.
pub const DESKTOP_ENV: &str = warren_env::EnvVars::WARREN_DESKTOP;
/// The create extension that asks for a desktop: `"true"` (1280x800) or `"WIDTHxHEIGHT"`
/// (`"false"`: none).
pub const DESKTOP_EXTENSION: &str = "desktop";
/// The sandbox ports of the desktop's live view: noVNC over websockify, interactive and view-only.
pub const VIEW_PORT: u16 = 6080;
pub const VIEW_ONLY_PORT: u16 = 6081;

/// The create extension that asks for a browser: `"true"`: Chromium with its DevTools endpoint on
/// [`CDP_PORT`], on the desktop when the sandbox has one, headless otherwise.
pub const BROWSER_EXTENSION: &str = "browser";
/// The variable that asks execd for the browser; the server sets it from [`BROWSER_EXTENSION`].
pub const BROWSER_ENV: &str = warren_env::EnvVars::WARREN_BROWSER;
/// The sandbox port of the browser's DevTools endpoint (HTTP and WebSocket): the port the
/// reference's Chrome example reads.
pub const CDP_PORT: u16 = 9222;

/// What the server tells execd of the URL a caller used for the DevTools port (the headers are
/// the server's own; execd takes them off before the browser sees them).
pub const FORWARDED_HOST: &str = "x-forwarded-host";
pub const FORWARDED_PROTO: &str = "x-forwarded-proto";
pub const FORWARDED_PREFIX: &str = "x-forwarded-prefix";
pub const FORWARDED_HEADERS: [&str; 3] = [FORWARDED_HOST, FORWARDED_PROTO, FORWARDED_PREFIX];

/// Whether an extension's value says yes.
pub fn parse_switch(name: &str, text: &str) -> Result<bool, String> {
    match text.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(format!("{name}: {text:?} is not true or false")),
    }
}

/// The default size of a desktop.
pub const DEFAULT_SIZE: (u16, u16) = (1280, 800);

/// A desktop size from `"WIDTHxHEIGHT"` (or `"true"`: the default), within 320x240 to 7680x4320.
pub fn parse_size(text: &str) -> Result<(u16, u16), String> {
    if text.eq_ignore_ascii_case("true") {
        return Ok(DEFAULT_SIZE);
    }
    let bad = || format!("desktop: {text:?} is not WIDTHxHEIGHT (320x240 to 7680x4320) or true");
    let (w, h) = text.split_once(['x', 'X']).ok_or_else(bad)?;
    let (w, h): (u16, u16) = (
        w.trim().parse().map_err(|_| bad())?,
        h.trim().parse().map_err(|_| bad())?,
    );
    if !(320..=7680).contains(&w) || !(240..=4320).contains(&h) {
        return Err(bad());
    }
    Ok((w, h))
}

/// `GET /desktop`: the display.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DesktopInfo {
    pub display: String,
    pub width: u16,
    pub height: u16,
    /// Whether a VNC server (and noVNC on [`VIEW_PORT`] / [`VIEW_ONLY_PORT`]) serves it.
    pub vnc: bool,
    /// How screenshots are read: `shm` (MIT-SHM shared memory) or `get_image` (through the
    /// X connection, where the server has no MIT-SHM).
    pub capture: String,
}

/// `GET /desktop/cursor`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Point {
    pub x: i32,
    pub y: i32,
}

/// `POST /desktop/mouse`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum MouseAction {
    Move {
        x: i32,
        y: i32,
    },
    Click {
        #[serde(default)]
        x: Option<i32>,
        #[serde(default)]
        y: Option<i32>,
        #[serde(default)]
        button: MouseButton,
        /// 1 (default) or 2 for a double click, 3 for a triple one.
        #[serde(default = "one")]
        count: u8,
    },
    Drag {
        from: Point,
        to: Point,
        #[serde(default)]
        button: MouseButton,
    },
    Scroll {
        #[serde(default)]
        x: Option<i32>,
        #[serde(default)]
        y: Option<i32>,
        /// Clicks of the wheel: positive down (or right), negative up (or left).
        #[serde(default)]
        dy: i32,
        #[serde(default)]
        dx: i32,
    },
}

fn one() -> u8 {
    1
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MouseButton {
    #[default]
    Left,
    Middle,
    Right,
}

/// `POST /desktop/keyboard`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum KeyboardAction {
    /// Key chords, pressed one after another: `"ctrl+shift+t"`, `"Return"`, `"alt+F4"`.
    Key { keys: Vec<String> },
    /// Text, any Unicode, typed as it is.
    Type { text: String },
}

/// A top-level window.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Window {
    pub id: u32,
    pub title: String,
    pub x: i32,
    pub y: i32,
    pub width: u32,
    pub height: u32,
    pub focused: bool,
}

/// `POST /desktop/launch`: a program (`command`, run by the shell) or a URL, opened in the
/// image's browser.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Launch {
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default)]
    pub url: Option<String>,
}

/// `POST /desktop/launch`'s answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Launched {
    pub pid: i32,
}

/// `POST /desktop/wait`: until the screen has not changed for `still_ms`, at most `timeout_ms`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Wait {
    #[serde(default = "default_still")]
    pub still_ms: u64,
    #[serde(default = "default_wait")]
    pub timeout_ms: u64,
}

fn default_still() -> u64 {
    500
}

fn default_wait() -> u64 {
    10_000
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Waited {
    pub still: bool,
    pub waited_ms: u64,
}

/// `POST /desktop/recording`: record the screen as a timeline of screenshots: a PNG in `dir`
/// each time the screen changed (looked at `fps` times a second), and `timeline.jsonl` with a
/// line per frame. The files API reads them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RecordingStart {
    /// Where the frames go (made if missing); by default a new folder under `/tmp`.
    #[serde(default)]
    pub dir: Option<String>,
    /// How often the screen is looked at: 1 to 10 times a second (default 2).
    #[serde(default = "default_fps")]
    pub fps: u32,
    /// Frames scaled down (above 0, at most 1).
    #[serde(default)]
    pub scale: Option<f64>,
    /// The recording stops by itself after this long: at most 3600 (default 600).
    #[serde(default = "default_record_seconds")]
    pub max_seconds: u64,
}

fn default_fps() -> u32 {
    2
}

fn default_record_seconds() -> u64 {
    600
}

/// A recording, running or ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Recording {
    pub dir: String,
    pub fps: u32,
    pub running: bool,
    /// Frames written (screens that differed from the one before).
    pub frames: u64,
    pub duration_ms: u64,
    /// Why it ended, when it did by itself (`max_seconds`, `max_frames`, an error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
}

/// One line of `timeline.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Frame {
    pub frame: u64,
    /// Since the recording started.
    pub t_ms: u64,
    pub file: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("true"), Ok(DEFAULT_SIZE));
        assert_eq!(parse_size("1024x768"), Ok((1024, 768)));
        for bad in ["", "1024", "10x10", "99999x1", "ax b", "1024x768x24"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn actions_read_as_sent() {
        let click: MouseAction = serde_json::from_str(
            r#"{"action": "click", "x": 5, "y": 6, "button": "right", "count": 2}"#,
        )
        .expect("click");
        assert_eq!(
            click,
            MouseAction::Click {
                x: Some(5),
                y: Some(6),
                button: MouseButton::Right,
                count: 2
            }
        );
        assert!(serde_json::from_str::<MouseAction>(r#"{"action": "fly"}"#).is_err());
        assert!(serde_json::from_str::<MouseAction>(
            r#"{"action": "move", "x": 1, "y": 2, "z": 3}"#
        )
        .is_err());
        let keys: KeyboardAction =
            serde_json::from_str(r#"{"action": "key", "keys": ["ctrl+c"]}"#).expect("keys");
        assert_eq!(
            keys,
            KeyboardAction::Key {
                keys: vec!["ctrl+c".into()]
            }
        );
    }
}
