//! Finding the image's Jupyter kernels the way Jupyter does: `kernels/<name>/kernel.json` under
//! `$JUPYTER_PATH`, the user's data dir and the system prefixes, first hit per name wins.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// How an interrupt reaches the kernel (`interrupt_mode` in kernel.json).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InterruptMode {
    #[default]
    Signal,
    Message,
}

#[derive(Debug, Clone, Deserialize)]
struct KernelJson {
    argv: Vec<String>,
    #[serde(default)]
    display_name: String,
    #[serde(default)]
    language: String,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    interrupt_mode: InterruptMode,
}

#[derive(Debug, Clone)]
pub struct KernelSpec {
    pub name: String,
    pub dir: PathBuf,
    pub argv: Vec<String>,
    pub display_name: String,
    /// Lower-cased.
    pub language: String,
    pub env: BTreeMap<String, String>,
    pub interrupt_mode: InterruptMode,
}

impl KernelSpec {
    /// `argv` with Jupyter's placeholders filled in.
    pub fn command(&self, connection_file: &Path) -> Vec<String> {
        self.argv
            .iter()
            .map(|a| {
                a.replace("{connection_file}", &connection_file.to_string_lossy())
                    .replace("{resource_dir}", &self.dir.to_string_lossy())
            })
            .collect()
    }

    /// Whether the kernel's program exists, looked up on `path` (a `PATH` value) when it is bare.
    pub fn launchable(&self, path: &str) -> bool {
        let Some(program) = self.argv.first() else {
            return false;
        };
        if program.contains('/') {
            return is_executable(Path::new(program));
        }
        path.split(':')
            .filter(|d| !d.is_empty())
            .any(|d| is_executable(&Path::new(d).join(program)))
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The folders searched, in Jupyter's order of precedence.
pub fn search_path(jupyter_path: Option<&str>, home: Option<&str>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = jupyter_path
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join("kernels"))
        .collect();
    if let Some(home) = home.filter(|h| !h.is_empty()) {
        dirs.push(Path::new(home).join(".local/share/jupyter/kernels"));
    }
    for prefix in [
        "/usr/local/share/jupyter",
        "/usr/share/jupyter",
        "/opt/conda/share/jupyter",
    ] {
        dirs.push(Path::new(prefix).join("kernels"));
    }
    dirs
}

/// Every readable kernelspec under `dirs`; the first one of each name wins. Unreadable or malformed
/// specs are skipped (with a debug log): one broken kernel must not hide the others.
pub fn discover(dirs: &[PathBuf]) -> Vec<KernelSpec> {
    let mut found: BTreeMap<String, KernelSpec> = BTreeMap::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut names: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
        names.sort();
        for name in names {
            let name = name.to_string_lossy().to_string();
            if found.contains_key(&name) {
                continue;
            }
            let spec_dir = dir.join(&name);
            let parsed = std::fs::read(spec_dir.join("kernel.json"))
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<KernelJson>(&b).map_err(|e| e.to_string()));
            match parsed {
                Ok(k) if !k.argv.is_empty() => {
                    found.insert(
                        name.clone(),
                        KernelSpec {
                            name,
                            dir: spec_dir,
                            argv: k.argv,
                            display_name: k.display_name,
                            language: k.language.to_lowercase(),
                            env: k.env,
                            interrupt_mode: k.interrupt_mode,
                        },
                    );
                }
                Ok(_) => tracing::debug!(dir = %spec_dir.display(), "kernelspec with empty argv"),
                Err(e) => {
                    tracing::debug!(dir = %spec_dir.display(), error = %e, "unreadable kernelspec")
                }
            }
        }
    }
    found.into_values().collect()
}

/// The languages clients ask for, normalised (`Python` → `python`, `js` → `javascript`).
pub fn normalize_language(lang: &str) -> String {
    let l = lang.trim().to_lowercase();
    match l.as_str() {
        "py" | "python3" => "python".into(),
        "js" | "node" => "javascript".into(),
        "ts" => "typescript".into(),
        "sh" | "shell" => "bash".into(),
        _ => l,
    }
}

/// The kernel for `language`: one whose name is the usual one for it first (`python3`, `bash`,
/// `javascript`), else the first by name.
pub fn pick<'a>(specs: &'a [KernelSpec], language: &str) -> Option<&'a KernelSpec> {
    let preferred: &[&str] = match language {
        "python" => &["python3", "python"],
        "javascript" => &["javascript", "node", "nodejs"],
        "typescript" => &["typescript", "tslab", "deno"],
        "bash" => &["bash"],
        _ => &[],
    };
    let matching = || specs.iter().filter(|s| s.language == language);
    preferred
        .iter()
        .find_map(|p| matching().find(|s| s.name == *p))
        .or_else(|| matching().next())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_spec(root: &Path, name: &str, json: &str) {
        let d = root.join(name);
        std::fs::create_dir_all(&d).expect("mkdir");
        std::fs::write(d.join("kernel.json"), json).expect("write");
    }

    #[test]
    fn discovers_with_precedence_and_skips_broken() {
        let a = tempfile::tempdir().expect("tmp");
        let b = tempfile::tempdir().expect("tmp");
        write_spec(
            a.path(),
            "python3",
            r#"{"argv":["python3","-m","ipykernel_launcher","-f","{connection_file}"],"display_name":"A","language":"Python"}"#,
        );
        write_spec(
            b.path(),
            "python3",
            r#"{"argv":["other"],"language":"python"}"#,
        );
        write_spec(
            b.path(),
            "bash",
            r#"{"argv":["python3","-m","bash_kernel"],"language":"bash","interrupt_mode":"message"}"#,
        );
        write_spec(b.path(), "broken", "{not json");
        let specs = discover(&[a.path().to_path_buf(), b.path().to_path_buf()]);
        let names: Vec<_> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["bash", "python3"]);
        let py = pick(&specs, "python").expect("python");
        assert_eq!(py.display_name, "A", "the first folder wins");
        assert_eq!(py.language, "python");
        assert_eq!(
            py.command(Path::new("/tmp/c.json")),
            ["python3", "-m", "ipykernel_launcher", "-f", "/tmp/c.json"]
        );
        assert_eq!(
            pick(&specs, "bash").expect("bash").interrupt_mode,
            InterruptMode::Message
        );
        assert!(pick(&specs, "go").is_none());
    }

    #[test]
    fn launchable_looks_on_path() {
        let d = tempfile::tempdir().expect("tmp");
        let spec = |argv0: &str| KernelSpec {
            name: "k".into(),
            dir: d.path().into(),
            argv: vec![argv0.into()],
            display_name: String::new(),
            language: "python".into(),
            env: BTreeMap::new(),
            interrupt_mode: InterruptMode::Signal,
        };
        assert!(spec("sh").launchable("/nonexistent:/bin:/usr/bin"));
        assert!(!spec("sh").launchable("/nonexistent"));
        assert!(spec("/bin/sh").launchable(""));
        assert!(!spec("/no/such/python").launchable("/bin"));
    }

    #[test]
    fn language_aliases() {
        assert_eq!(normalize_language(" Python "), "python");
        assert_eq!(normalize_language("ts"), "typescript");
        assert_eq!(normalize_language("go"), "go");
    }

    #[test]
    fn search_path_order() {
        let p = search_path(Some("/a:/b"), Some("/root"));
        assert_eq!(p[0], Path::new("/a/kernels"));
        assert_eq!(p[1], Path::new("/b/kernels"));
        assert_eq!(p[2], Path::new("/root/.local/share/jupyter/kernels"));
        assert!(p.contains(&PathBuf::from("/usr/share/jupyter/kernels")));
    }
}
