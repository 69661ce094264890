//! File and directory routes other than upload/download: info, delete, permissions, move, search,
//! replace, list, mkdir, rm -rf. Paths are absolute or relative to execd's workdir, and every one is
//! resolved through `safe_path` (never through a /proc magic link).

use std::collections::{BTreeMap, HashMap};
use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use warren_api::execd::FileInfo;

use crate::command::rfc3339;
use crate::error::{code, ApiError, ApiJson, ApiResult};
use crate::ids::Ids;
use crate::query::Params;
use crate::safe_path;
use crate::AppState;

/// Runs blocking filesystem work off the async workers.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::runtime(format!("worker failed: {e}")))?
}

/// `0o644` → `644`: the protocol writes octal permissions as decimal digits.
pub fn mode_to_wire(mode: u32) -> u32 {
    format!("{:o}", mode & 0o7777).parse().unwrap_or(0)
}

/// `755` → `0o755`; digits 8/9 are rejected.
pub fn mode_from_wire(mode: u32) -> ApiResult<u32> {
    u32::from_str_radix(&mode.to_string(), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| ApiError::bad_body(format!("mode {mode} is not an octal permission")))
}

fn time(t: std::io::Result<std::time::SystemTime>) -> Option<String> {
    t.ok().map(|t| rfc3339(DateTime::<Utc>::from(t)))
}

pub fn file_info(path: &Path, meta: &Metadata, ids: &Ids) -> FileInfo {
    let ft = meta.file_type();
    let kind = if ft.is_symlink() {
        "symlink"
    } else if ft.is_dir() {
        "directory"
    } else if ft.is_file() {
        "file"
    } else {
        "other"
    };
    let modified = time(meta.modified()).unwrap_or_default();
    FileInfo {
        path: path.to_string_lossy().into_owned(),
        kind: kind.to_string(),
        size: meta.len(),
        created_at: time(meta.created()).unwrap_or_else(|| modified.clone()),
        modified_at: modified,
        owner: ids.user_name(meta.uid()),
        group: ids.group_name(meta.gid()),
        mode: mode_to_wire(meta.mode()),
    }
}

pub async fn info(
    State(app): State<Arc<AppState>>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<BTreeMap<String, FileInfo>>> {
    let paths = Params::parse(q.as_deref()).require_all("path")?;
    let ids = Ids::load();
    let mut out = BTreeMap::new();
    for p in paths {
        let full = app.resolve(&p);
        let meta = safe_path::metadata(&full).map_err(|e| ApiError::io(&p, e))?;
        out.insert(p, file_info(&full, &meta, &ids));
    }
    Ok(Json(out))
}

pub async fn delete_files(
    State(app): State<Arc<AppState>>,
    RawQuery(q): RawQuery,
) -> ApiResult<()> {
    for p in Params::parse(q.as_deref()).require_all("path")? {
        let full = app.resolve(&p);
        let target = match safe_path::entry(&full) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(ApiError::io(&p, e)),
        };
        match std::fs::symlink_metadata(target.path()) {
            Ok(m) if m.is_dir() => {
                return Err(ApiError::invalid_file(format!("{p} is a directory")))
            }
            Ok(_) => std::fs::remove_file(target.path()).map_err(|e| ApiError::io(&p, e))?,
            // Deleting what is not there is not a failure: the caller's goal is reached.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ApiError::io(&p, e)),
        }
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
pub struct Ownership {
    #[serde(default)]
    owner: Option<String>,
    #[serde(default)]
    group: Option<String>,
    #[serde(default)]
    mode: Option<u32>,
}

/// Applies mode and ownership; names resolve through `/etc/passwd`/`/etc/group`, numbers are accepted.
pub fn apply_ownership(path: &Path, display: &str, o: &Ownership, ids: &Ids) -> ApiResult<()> {
    if let Some(mode) = o.mode {
        let mode = mode_from_wire(mode)?;
        safe_path::set_mode(path, mode).map_err(|e| ApiError::io(display, e))?;
    }
    chown(path, display, o.owner.as_deref(), o.group.as_deref(), ids)
}

pub fn chown(
    path: &Path,
    display: &str,
    owner: Option<&str>,
    group: Option<&str>,
    ids: &Ids,
) -> ApiResult<()> {
    let owner = owner.filter(|s| !s.is_empty());
    let group = group.filter(|s| !s.is_empty());
    let uid = owner
        .map(|o| {
            ids.resolve_user(o)
                .ok_or_else(|| ApiError::bad_body(format!("unknown user {o}")))
        })
        .transpose()?;
    let gid = group
        .map(|g| {
            ids.resolve_group(g)
                .ok_or_else(|| ApiError::bad_body(format!("unknown group {g}")))
        })
        .transpose()?;
    if uid.is_some() || gid.is_some() {
        safe_path::chown(path, uid, gid).map_err(|e| ApiError::io(display, e))?;
    }
    Ok(())
}

pub async fn permissions(
    State(app): State<Arc<AppState>>,
    ApiJson(body): ApiJson<BTreeMap<String, Ownership>>,
) -> ApiResult<()> {
    let ids = Ids::load();
    for (p, o) in &body {
        let full = app.resolve(p);
        safe_path::symlink_metadata(&full).map_err(|e| ApiError::io(p, e))?;
        apply_ownership(&full, p, o, &ids)?;
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
pub struct MoveItem {
    src: String,
    dest: String,
}

pub async fn mv(
    State(app): State<Arc<AppState>>,
    ApiJson(items): ApiJson<Vec<MoveItem>>,
) -> ApiResult<()> {
    // Off execd's one thread: across filesystems (a volume and the root) a move is a copy.
    blocking(move || move_all(&app, items)).await
}

fn move_all(app: &AppState, items: Vec<MoveItem>) -> ApiResult<()> {
    for item in items {
        let (src, dest) = (app.resolve(&item.src), app.resolve(&item.dest));
        let src_entry = safe_path::entry(&src).map_err(|e| ApiError::io(&item.src, e))?;
        std::fs::symlink_metadata(src_entry.path()).map_err(|e| ApiError::io(&item.src, e))?;
        let dest_entry = match safe_path::entry(&dest) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ApiError::not_found(
                    code::FILE_NOT_FOUND,
                    format!("target directory of {} does not exist", item.dest),
                ))
            }
            Err(e) => return Err(ApiError::io(&item.dest, e)),
        };
        match std::fs::rename(src_entry.path(), dest_entry.path()) {
            Ok(()) => {}
            // Across filesystems a rename is a copy plus delete; only plain files are handled that way.
            Err(e)
                if e.raw_os_error() == Some(libc::EXDEV)
                    && safe_path::metadata(&src).is_ok_and(|m| m.is_file()) =>
            {
                copy_file(&src, &item.src, &dest, &item.dest)?;
                std::fs::remove_file(src_entry.path()).map_err(|e| ApiError::io(&item.src, e))?;
            }
            Err(e) => return Err(ApiError::io(&item.src, e)),
        }
    }
    Ok(())
}

/// `cp` of a plain file, contents and permission bits, both ends resolved through `safe_path`.
fn copy_file(src: &Path, src_display: &str, dest: &Path, dest_display: &str) -> ApiResult<()> {
    let mut from =
        safe_path::open(src, libc::O_RDONLY, 0).map_err(|e| ApiError::io(src_display, e))?;
    let mode = from
        .metadata()
        .map_err(|e| ApiError::io(src_display, e))?
        .permissions();
    let mut to = safe_path::open(dest, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC, 0o600)
        .map_err(|e| ApiError::io(dest_display, e))?;
    std::io::copy(&mut from, &mut to).map_err(|e| ApiError::io(dest_display, e))?;
    to.set_permissions(mode)
        .map_err(|e| ApiError::io(dest_display, e))
}

/// Walks the folder `root` (resolved through `safe_path`, as the folder itself or as an entry of
/// its parent) without following symlinks, calling
/// `visit` with each entry's path under `shown` (the name the caller gave `root`), its metadata and
/// its depth (1 = child). A `root` that cannot be read is an error; unreadable folders below it
/// are left out.
fn walk(
    root: &safe_path::Resolved,
    shown: &Path,
    max_depth: usize,
    visit: &mut dyn FnMut(&Path, &Metadata, usize),
) -> std::io::Result<()> {
    let base = root.path();
    let mut stack = vec![(PathBuf::new(), 1usize)];
    while let Some((rel, depth)) = stack.pop() {
        let entries = match std::fs::read_dir(base.join(&rel)) {
            Ok(entries) => entries,
            // The folder asked for must be readable (a listing as a user who may not read it is
            // refused, not empty); a folder below it that is not is left out.
            Err(e) if rel.as_os_str().is_empty() => return Err(e),
            Err(_) => continue,
        };
        for entry in entries.flatten() {
            let rel = rel.join(entry.file_name());
            let Ok(meta) = std::fs::symlink_metadata(base.join(&rel)) else {
                continue;
            };
            visit(&shown.join(&rel), &meta, depth);
            if meta.is_dir() && depth < max_depth {
                stack.push((rel, depth + 1));
            }
        }
    }
    Ok(())
}

pub async fn search(
    State(app): State<Arc<AppState>>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Vec<FileInfo>>> {
    let params = Params::parse(q.as_deref());
    let root_s = params.require("path")?.to_string();
    let pattern_s = params
        .get("pattern")
        .filter(|p| !p.is_empty())
        .unwrap_or("**")
        .to_string();
    let root = app.resolve(&root_s);
    let pattern = glob::Pattern::new(&pattern_s)
        .map_err(|e| ApiError::bad_body(format!("invalid pattern {pattern_s}: {e}")))?;
    blocking(move || {
        let dir = safe_path::follow(&root).map_err(|e| ApiError::io(&root_s, e))?;
        let meta = std::fs::metadata(dir.path()).map_err(|e| ApiError::io(&root_s, e))?;
        if !meta.is_dir() {
            return Err(ApiError::invalid_file(format!(
                "{root_s} is not a directory"
            )));
        }
        let ids = Ids::load();
        // As in the reference, the pattern matches the file name; one with a slash (which never
        // matches a name there) matches the path below the root, `*` within one folder.
        let by_path = pattern_s.contains('/');
        let opts = glob::MatchOptions {
            case_sensitive: true,
            require_literal_separator: by_path,
            require_literal_leading_dot: false,
        };
        let mut out = Vec::new();
        walk(&dir, &root, usize::MAX, &mut |path, meta, _| {
            if meta.is_dir() {
                return;
            }
            let subject = if by_path {
                path.strip_prefix(&root)
                    .unwrap_or(path)
                    .to_string_lossy()
                    .into_owned()
            } else {
                path.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
            };
            if pattern.matches_with(&subject, opts) {
                out.push(file_info(path, meta, &ids));
            }
        })
        .map_err(|e| ApiError::io(&root_s, e))?;
        sort_as_walked(&mut out);
        Ok(Json(out))
    })
    .await
}

/// The reference's order: depth first, each folder's entries by name, a folder's contents right
/// after it (`a/b`, `a/b/x`, `a/b.txt`), which is the order of the paths' components.
fn sort_as_walked(entries: &mut [FileInfo]) {
    entries.sort_by(|a, b| Path::new(&a.path).cmp(Path::new(&b.path)));
}

#[derive(Debug, Deserialize)]
pub struct Replacement {
    old: String,
    #[serde(default)]
    new: String,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplaceResult {
    replaced_count: usize,
}

pub async fn replace(
    State(app): State<Arc<AppState>>,
    RawQuery(q): RawQuery,
    ApiJson(body): ApiJson<BTreeMap<String, Replacement>>,
) -> ApiResult<axum::response::Response> {
    use axum::response::IntoResponse;
    let verbose = Params::parse(q.as_deref()).flag("verbose");
    if let Some((p, _)) = body.iter().find(|(_, r)| r.old.is_empty()) {
        return Err(ApiError::bad_body(format!("{p}: 'old' must not be empty")));
    }
    let resolved: Vec<(String, PathBuf, Replacement)> = body
        .into_iter()
        .map(|(p, r)| (p.clone(), app.resolve(&p), r))
        .collect();
    let counts = blocking(move || {
        let mut counts = BTreeMap::new();
        for (p, full, r) in resolved {
            use std::io::{Read, Seek, Write};
            let mut file =
                safe_path::open(&full, libc::O_RDWR, 0).map_err(|e| ApiError::io(&p, e))?;
            let mut text = Vec::new();
            file.read_to_end(&mut text)
                .map_err(|e| ApiError::io(&p, e))?;
            let text = String::from_utf8(text).map_err(|_| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    code::INVALID_FILE_CONTENT,
                    format!("{p} is not UTF-8 text"),
                )
            })?;
            let n = text.matches(&r.old).count();
            if n > 0 {
                // Writing in place keeps the inode, and with it mode, owner and hard links.
                let new = text.replace(&r.old, &r.new);
                file.set_len(0)
                    .and_then(|()| file.rewind())
                    .and_then(|()| file.write_all(new.as_bytes()))
                    .map_err(|e| ApiError::io(&p, e))?;
            }
            counts.insert(p, ReplaceResult { replaced_count: n });
        }
        Ok(counts)
    })
    .await?;
    Ok(if verbose {
        Json(counts).into_response()
    } else {
        StatusCode::OK.into_response()
    })
}

pub async fn list(
    State(app): State<Arc<AppState>>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Vec<FileInfo>>> {
    let params = Params::parse(q.as_deref());
    let p = params.require("path")?.to_string();
    // 0 lists nothing, as in the reference (after the path is checked)
    let depth = params.number::<usize>("depth")?.unwrap_or(1);
    let root = app.resolve(&p);
    blocking(move || {
        // The entry itself, resolved once: it must be a folder, not a link to one, and is walked
        // from that same handle.
        let dir = safe_path::entry(&root).map_err(|e| ApiError::io(&p, e))?;
        let meta = std::fs::symlink_metadata(dir.path()).map_err(|e| ApiError::io(&p, e))?;
        if meta.file_type().is_symlink() {
            return Err(ApiError::invalid_file(format!("{p} is a symlink")));
        }
        if !meta.is_dir() {
            return Err(ApiError::invalid_file(format!("{p} is not a directory")));
        }
        let ids = Ids::load();
        let mut out = Vec::new();
        if depth > 0 {
            walk(&dir, &root, depth, &mut |path, meta, _| {
                out.push(file_info(path, meta, &ids))
            })
            .map_err(|e| ApiError::io(&p, e))?;
        }
        sort_as_walked(&mut out);
        Ok(Json(out))
    })
    .await
}

pub async fn mkdir(
    State(app): State<Arc<AppState>>,
    ApiJson(body): ApiJson<HashMap<String, Ownership>>,
) -> ApiResult<()> {
    let ids = Ids::load();
    for (p, o) in &body {
        let full = app.resolve(p);
        safe_path::create_dir_all(&full).map_err(|e| ApiError::io(p, e))?;
        apply_ownership(&full, p, o, &ids)?;
    }
    Ok(())
}

pub async fn rmdir(State(app): State<Arc<AppState>>, RawQuery(q): RawQuery) -> ApiResult<()> {
    let paths = Params::parse(q.as_deref()).require_all("path")?;
    let resolved: Vec<(String, PathBuf)> = paths
        .into_iter()
        .map(|p| (p.clone(), app.resolve(&p)))
        .collect();
    blocking(move || {
        for (p, full) in resolved {
            if full == Path::new("/") {
                return Err(ApiError::invalid_file("refusing to remove /"));
            }
            let target = match safe_path::entry(&full) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(ApiError::io(&p, e)),
            };
            match std::fs::symlink_metadata(target.path()) {
                Ok(m) if m.is_dir() => {
                    // A sandbox's tree may be any depth: a loop, never std's recursion.
                    warren_fstree::remove_all(target.path()).map_err(|e| ApiError::io(&p, e))?
                }
                Ok(_) => return Err(ApiError::invalid_file(format!("{p} is not a directory"))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(ApiError::io(&p, e)),
            }
        }
        Ok(())
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_round_trip() {
        assert_eq!(mode_to_wire(0o100644), 644);
        assert_eq!(mode_to_wire(0o755), 755);
        assert_eq!(mode_from_wire(755).ok(), Some(0o755));
        assert_eq!(mode_from_wire(4755).ok(), Some(0o4755));
        assert!(mode_from_wire(789).is_err());
    }
}
