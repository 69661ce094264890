//! A sandbox's desktop (`/desktop…`, made with `extensions.desktop`): the computer-use API GUI
//! agents drive it with.

use warren_api::desktop::{
    DesktopInfo, KeyboardAction, Launch, Launched, MouseAction, Point, Recording, RecordingStart,
    Wait, Waited, Window,
};

use crate::client::{json, send};
use crate::error::Result;
use crate::sandbox::Sandbox;

/// A part of the screen, and how much to scale it down (0 < scale ≤ 1).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Region {
    pub x: Option<i32>,
    pub y: Option<i32>,
    pub width: Option<u32>,
    pub height: Option<u32>,
    pub scale: Option<f64>,
}

impl Sandbox {
    /// The display: its size, and whether a live view serves it.
    pub async fn desktop(&self) -> Result<DesktopInfo> {
        let (r, url) = self.execd_call(reqwest::Method::GET, "/desktop");
        json(send(r, &url).await?).await
    }

    /// A screenshot as PNG: the whole screen, or `region`.
    pub async fn screenshot(&self, region: &Region) -> Result<Vec<u8>> {
        let (mut r, url) = self.execd_call(reqwest::Method::GET, "/desktop/screenshot");
        let q = [
            ("x", region.x.map(|v| v.to_string())),
            ("y", region.y.map(|v| v.to_string())),
            ("width", region.width.map(|v| v.to_string())),
            ("height", region.height.map(|v| v.to_string())),
            ("scale", region.scale.map(|v| v.to_string())),
        ];
        for (k, v) in q.into_iter().filter_map(|(k, v)| Some((k, v?))) {
            r = r.query(&[(k, v)]);
        }
        let resp = send(r, &url).await?;
        Ok(resp
            .bytes()
            .await
            .map_err(crate::error::Error::Broken)?
            .to_vec())
    }

    pub async fn cursor(&self) -> Result<Point> {
        let (r, url) = self.execd_call(reqwest::Method::GET, "/desktop/cursor");
        json(send(r, &url).await?).await
    }

    /// A mouse action; answers where the cursor is after it.
    pub async fn mouse(&self, action: &MouseAction) -> Result<Point> {
        let (r, url) = self.execd_call(reqwest::Method::POST, "/desktop/mouse");
        json(send(r.json(action), &url).await?).await
    }

    pub async fn keyboard(&self, action: &KeyboardAction) -> Result<()> {
        let (r, url) = self.execd_call(reqwest::Method::POST, "/desktop/keyboard");
        send(r.json(action), &url).await?;
        Ok(())
    }

    pub async fn windows(&self) -> Result<Vec<Window>> {
        let (r, url) = self.execd_call(reqwest::Method::GET, "/desktop/windows");
        json(send(r, &url).await?).await
    }

    pub async fn focus_window(&self, id: u32) -> Result<()> {
        let (r, url) = self.execd_call(
            reqwest::Method::POST,
            &format!("/desktop/windows/{id}/focus"),
        );
        send(r, &url).await?;
        Ok(())
    }

    pub async fn launch(&self, launch: &Launch) -> Result<Launched> {
        let (r, url) = self.execd_call(reqwest::Method::POST, "/desktop/launch");
        json(send(r.json(launch), &url).await?).await
    }

    pub async fn wait_still(&self, wait: &Wait) -> Result<Waited> {
        let (r, url) = self.execd_call(reqwest::Method::POST, "/desktop/wait");
        json(send(r.json(wait), &url).await?).await
    }

    /// Starts recording the screen as a timeline of screenshots (read them with the files API).
    pub async fn start_recording(&self, start: &RecordingStart) -> Result<Recording> {
        let (r, url) = self.execd_call(reqwest::Method::POST, "/desktop/recording");
        json(send(r.json(start), &url).await?).await
    }

    /// The current or last recording.
    pub async fn recording(&self) -> Result<Recording> {
        let (r, url) = self.execd_call(reqwest::Method::GET, "/desktop/recording");
        json(send(r, &url).await?).await
    }

    /// Stops the recording and says what it made.
    pub async fn stop_recording(&self) -> Result<Recording> {
        let (r, url) = self.execd_call(reqwest::Method::DELETE, "/desktop/recording");
        json(send(r, &url).await?).await
    }
}
