//! `$JUPYTER_PORT` (44771): the official code-interpreter SDK checks that something accepts TCP
//! connections there before it trusts the sandbox to run code. execd listens there exactly when the
//! image has a kernel it can launch (or a language's own tools execd drives, see `tools`), and
//! answers what it found in the shape of Jupyter Server's `GET /api/kernelspecs`, so the check
//! means "code can run" rather than "a port is open".

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Map, Value};

use super::kernelspec::{self, KernelSpec};
use crate::process::base_env;

pub const DEFAULT_PORT: u16 = 44771;
/// How often the image is looked at again while it has no kernel (one may be installed at runtime).
const RESCAN: Duration = Duration::from_secs(5);

/// The kernels that could start now, with the environment commands and kernels get.
pub fn launchable_specs() -> Vec<KernelSpec> {
    let env = base_env();
    let dirs = kernelspec::search_path(
        env.get("JUPYTER_PATH").map(String::as_str),
        env.get("HOME").map(String::as_str),
    );
    let path = env.get("PATH").cloned().unwrap_or_default();
    kernelspec::discover(&dirs)
        .into_iter()
        .filter(|s| s.launchable(&path))
        .collect()
}

/// The languages execd drives through their own tools, where no kernel has them (see `tools`).
fn tool_languages(specs: &[KernelSpec]) -> Vec<(&'static str, super::tools::Tool)> {
    let env = base_env();
    ["java", "go"]
        .into_iter()
        .filter(|l| kernelspec::pick(specs, l).is_none())
        .filter_map(|l| super::tools::Tool::find(l, &env).map(|t| (l, t)))
        .collect()
}

fn kernelspecs_body(specs: &[KernelSpec], tools: &[(&str, super::tools::Tool)]) -> Value {
    let mut map = Map::new();
    for (language, tool) in tools {
        map.insert(
            format!("{language}-tools"),
            json!({"name": format!("{language}-tools"), "resources": {},
                   "spec": {"argv": [tool.program()], "display_name": format!("{language} (its own tools)"),
                            "language": language}}),
        );
    }
    for s in specs {
        map.insert(
            s.name.clone(),
            json!({"name": s.name, "resources": {},
                   "spec": {"argv": s.argv, "display_name": s.display_name, "language": s.language}}),
        );
    }
    let default = kernelspec::pick(specs, "python")
        .or(specs.first())
        .map(|s| s.name.clone());
    json!({"default": default, "kernelspecs": map})
}

/// Waits until a kernel is launchable, then serves on `port` of every local address until execd
/// ends. A port already taken (the user runs their own Jupyter there) is logged and left alone.
pub async fn serve(port: u16) {
    loop {
        let specs = launchable_specs();
        if !specs.is_empty() || !tool_languages(&specs).is_empty() {
            break;
        }
        tokio::time::sleep(RESCAN).await;
    }
    let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "not serving the Jupyter port");
            return;
        }
    };
    tracing::info!(%addr, "kernels available; serving the Jupyter port");
    let app = Router::new()
        .route(
            "/api/kernelspecs",
            get(|| async {
                let specs = launchable_specs();
                Json(kernelspecs_body(&specs, &tool_languages(&specs)))
            }),
        )
        .route(
            "/api",
            get(|| async {
                Json(json!({"version": env!("CARGO_PKG_VERSION"), "server": "warren-execd"}))
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!(error = %e, "the Jupyter port listener stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn body_shape() {
        let spec = KernelSpec {
            name: "python3".into(),
            dir: "/k".into(),
            argv: vec!["python3".into()],
            display_name: "Python 3".into(),
            language: "python".into(),
            env: BTreeMap::new(),
            interrupt_mode: Default::default(),
        };
        let b = kernelspecs_body(
            &[spec],
            &[("go", super::super::tools::Tool::Go("/usr/bin/go".into()))],
        );
        assert_eq!(b["default"], "python3");
        assert_eq!(b["kernelspecs"]["python3"]["spec"]["language"], "python");
        assert_eq!(b["kernelspecs"]["go-tools"]["spec"]["language"], "go");
        assert_eq!(kernelspecs_body(&[], &[])["default"], Value::Null);
    }
}
