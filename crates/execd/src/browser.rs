//! A browser for agents: when the sandbox asks (`WARREN_BROWSER`, which the server sets from the
//! create's `extensions.browser`), execd starts the image's Chromium with its DevTools endpoint on
//! [`CDP_PORT`] (loopback inside the sandbox; callers reach it through Warren's endpoint proxy,
//! as every port), on the desktop when there is one, headless otherwise. execd listens only once
//! DevTools answers: the sandbox is Running with its browser ready.
//!
//! DevTools writes its own absolute WebSocket URLs (`/json/version`'s `webSocketDebuggerUrl`)
//! from the `Host` it was asked with, which is `localhost` behind the proxy; [`rewrite_json`]
//! turns them into the URL the caller used (Warren's `X-Forwarded-*`), so Playwright's
//! `connect_over_cdp` and Puppeteer's `connect` work from outside unchanged.
//!
//! The browser runs without Chromium's own sandbox: that needs a setuid helper or user namespaces
//! inside the sandbox, which the sandbox does not give. The sandbox itself is the boundary, and
//! its egress policy applies to every page the browser loads.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use warren_api::desktop::{CDP_PORT, FORWARDED_HOST, FORWARDED_PREFIX, FORWARDED_PROTO};

use crate::desktop::{find, spawn, DISPLAY};
use crate::process::command_env;
use crate::reaper::Reaper;

/// How long Chromium may take to open DevTools.
const START: Duration = Duration::from_secs(30);

/// A running browser.
pub struct Browser {
    pub pid: i32,
    /// Where downloads land (the files API reads them there).
    pub downloads: PathBuf,
}

impl Browser {
    /// Starts the image's Chromium and waits for DevTools to answer. `desktop`: whether it has a
    /// display to draw on.
    pub async fn start(reaper: &Reaper, desktop: bool) -> Result<Browser, String> {
        let mut env = command_env(&BTreeMap::new());
        let path = env.get("PATH").cloned().unwrap_or_default();
        let chromium = find(
            &path,
            &["chromium", "chromium-browser", "google-chrome", "chrome"],
        )
        .ok_or("the image has no browser: install Chromium (Debian: chromium)")?;
        let home = PathBuf::from(env.get("HOME").cloned().unwrap_or_else(|| "/root".into()));
        let downloads = home.join("Downloads");
        let profile = std::env::temp_dir().join("warren-browser");
        prepare_profile(&profile, &downloads)
            .map_err(|e| format!("the browser's profile in {}: {e}", profile.display()))?;
        let mut argv = vec![
            chromium.to_string_lossy().into_owned(),
            format!("--remote-debugging-port={CDP_PORT}"),
            "--remote-debugging-address=127.0.0.1".into(),
            format!("--user-data-dir={}", profile.display()),
            "--no-sandbox".into(),
            "--no-first-run".into(),
            "--no-default-browser-check".into(),
            "--disable-dev-shm-usage".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--password-store=basic".into(),
        ];
        if desktop {
            env.insert("DISPLAY".into(), DISPLAY.into());
            argv.push("--start-maximized".into());
        } else {
            env.remove("DISPLAY");
            argv.extend(["--headless=new".into(), "--disable-gpu".into()]);
        }
        argv.push("about:blank".into());
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let pid = spawn(reaper, &argv, &env)?;
        let started = Instant::now();
        loop {
            if tokio::task::spawn_blocking(answers).await.unwrap_or(false) {
                break;
            }
            if started.elapsed() >= START {
                return Err(format!(
                    "the browser's DevTools did not answer on port {CDP_PORT} within {} s",
                    START.as_secs()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::info!(
            pid,
            headless = !desktop,
            ms = started.elapsed().as_millis() as u64,
            "browser ready"
        );
        Ok(Browser { pid, downloads })
    }
}

/// A fresh profile whose downloads go to `downloads` without asking.
fn prepare_profile(profile: &std::path::Path, downloads: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(profile.join("Default"))?;
    std::fs::create_dir_all(downloads)?;
    let prefs = serde_json::json!({
        "download": {
            "default_directory": downloads,
            "prompt_for_download": false,
            "directory_upgrade": true,
        },
    });
    std::fs::write(profile.join("Default/Preferences"), prefs.to_string())
}

/// Whether DevTools answers `/json/version` (HTTP/1.1: it does not answer 1.0).
fn answers() -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], CDP_PORT)),
        Duration::from_millis(500),
    ) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /json/version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// DevTools' JSON answers (`/json/version`, `/json/list`, `/json/new`) with its WebSocket URLs,
/// written for `Host: localhost`, made into the URL the caller used: `ws[s]://{host}{prefix}/…`
/// from `X-Forwarded-Host`, `-Proto` and `-Prefix`. Without a forwarded host, as it is.
pub fn rewrite_json(body: &[u8], request: &HeaderMap) -> Option<Vec<u8>> {
    let header = |n: &str| request.get(n).and_then(|v| v.to_str().ok());
    let host = header(FORWARDED_HOST)?;
    let secure = header(FORWARDED_PROTO) == Some("https");
    let prefix = header(FORWARDED_PREFIX).unwrap_or("");
    // Only what a URL's authority and path hold: nothing that could end the JSON string.
    let plain = |s: &str, extra: &[char]| {
        s.chars()
            .all(|c| c.is_ascii_alphanumeric() || ".-:[]_".contains(c) || extra.contains(&c))
    };
    if !plain(host, &[]) || !plain(prefix, &['/', '%', '~']) {
        return None;
    }
    let text = std::str::from_utf8(body).ok()?;
    let scheme = if secure { "wss" } else { "ws" };
    Some(
        text.replace(
            "\"ws://localhost/",
            &format!("\"{scheme}://{host}{prefix}/"),
        )
        .replace("ws=localhost/", &format!("{scheme}={host}{prefix}/"))
        .into_bytes(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn websocket_urls_become_the_callers() {
        let body = br#"{"webSocketDebuggerUrl": "ws://localhost/devtools/browser/ab-1",
            "devtoolsFrontendUrl": "/devtools/inspector.html?ws=localhost/devtools/page/P1"}"#;
        let mut h = HeaderMap::new();
        assert_eq!(rewrite_json(body, &h), None);
        h.insert(
            "x-forwarded-host",
            "tok.sandboxes.example:8443".parse().expect("header value"),
        );
        h.insert("x-forwarded-proto", "https".parse().expect("header value"));
        let out = String::from_utf8(rewrite_json(body, &h).expect("rewritten")).expect("utf-8");
        assert!(
            out.contains(r#""wss://tok.sandboxes.example:8443/devtools/browser/ab-1""#),
            "{out}"
        );
        assert!(
            out.contains("wss=tok.sandboxes.example:8443/devtools/page/P1"),
            "{out}"
        );
        h.insert("x-forwarded-proto", "http".parse().expect("header value"));
        h.insert(
            "x-forwarded-prefix",
            "/v1/sandboxes/s1/proxy/9222".parse().expect("header value"),
        );
        let out = String::from_utf8(rewrite_json(body, &h).expect("rewritten")).expect("utf-8");
        assert!(
            out.contains(r#""ws://tok.sandboxes.example:8443/v1/sandboxes/s1/proxy/9222/devtools/browser/ab-1""#),
            "{out}"
        );
        // A host that would break out of the JSON string is not written in.
        h.insert("x-forwarded-host", "evil\"x".parse().expect("header value"));
        assert_eq!(rewrite_json(body, &h), None);
    }
}
