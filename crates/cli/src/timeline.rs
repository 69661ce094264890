//! `warren sandbox timeline`'s lines for a person: the time, the event's number and kind, and what
//! it says. The text comes from inside a sandbox (a command an agent wrote, a file name), so
//! control characters are shown escaped: a timeline cannot drive the terminal that reads it.

use serde_json::Value;

/// One event as a line: `21:04:05.123  #12  command  $ echo hi`.
pub fn line(e: &Value) -> String {
    let at = e["at"].as_str().unwrap_or_default();
    // `2026-12-07T21:04:05.123Z` → `21:04:05.123`.
    let time = at.get(11..23).unwrap_or(at);
    let seq = e["seq"].as_u64().map_or(String::new(), |s| format!("#{s}"));
    let kind = e["kind"].as_str().unwrap_or_default();
    format!(
        "{time:<12}  {seq:>5}  {kind:<17} {}",
        safe(&summary(kind, e))
    )
}

fn s<'a>(e: &'a Value, k: &str) -> &'a str {
    e[k].as_str().unwrap_or_default()
}

fn summary(kind: &str, e: &Value) -> String {
    let paths = || {
        e["paths"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|p| p.as_str().unwrap_or_default())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default()
    };
    let status = || match e["status"].as_u64() {
        Some(s) if !(200..300).contains(&s) => format!(" (answered {s})"),
        _ => String::new(),
    };
    match kind {
        "created" => {
            let mut out = format!("image {}", s(e, "image"));
            if let Some(snap) = e["snapshotId"].as_str() {
                out += &format!(", from snapshot {snap}");
            }
            if let Some(pool) = e["pool"].as_str() {
                out += &format!(", pool {pool}");
            }
            out
        }
        "state" => {
            let mut out = s(e, "state").to_string();
            if let Some(r) = e["reason"].as_str() {
                out += &format!(" ({r})");
            }
            if let Some(m) = e["message"].as_str() {
                out += &format!(": {m}");
            }
            out
        }
        "command" => {
            let text = match e["text"].as_str() {
                Some(t) if e["truncated"] == true => format!("$ {t}… (cut)"),
                Some(t) => format!("$ {t}"),
                None => format!("sha256:{}", s(e, "sha256")),
            };
            let mut out = match s(e, "via") {
                "command" | "" => text,
                via => format!(
                    "[{via}{}] {text}",
                    e["language"]
                        .as_str()
                        .map(|l| format!(" {l}"))
                        .unwrap_or_default()
                ),
            };
            if e["background"] == true {
                out += " &";
            }
            out
        }
        "command.exit" => {
            let code = e["exitCode"]
                .as_i64()
                .map_or(String::new(), |c| format!("exit {c}, "));
            format!(
                "of #{}: {code}{} after {} ms",
                e["of"],
                s(e, "outcome"),
                e["durationMs"]
            )
        }
        "file.write" => format!("{} {}{}", s(e, "op"), paths(), status()),
        "file.delete" => format!("{}{}", paths(), status()),
        "file.move" => {
            let moves = e["moves"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|m| format!("{} → {}", s(m, "src"), s(m, "dest")))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default();
            format!("{moves}{}", status())
        }
        "egress.name" => format!("{} {}", s(e, "action"), s(e, "name")),
        "egress.connection" => format!("{} {}", s(e, "action"), s(e, "address")),
        "vault.injection" => format!(
            "binding {} into a request to {}",
            s(e, "binding"),
            s(e, "host")
        ),
        "endpoint" => {
            let signed = if e["signed"] == true {
                " (signed URL)"
            } else {
                ""
            };
            format!("port {}{signed}", e["port"])
        }
        "session.open" => format!("port {} {}", e["port"], s(e, "path")),
        "session.close" => format!("of #{} after {} ms", e["of"], e["durationMs"]),
        "snapshot" => format!("{} {}", s(e, "snapshotId"), s(e, "name")),
        "timeline.missed" => format!("{} older events were dropped", e["count"]),
        _ => {
            let mut rest = e.as_object().cloned().unwrap_or_default();
            for k in ["seq", "at", "kind"] {
                rest.remove(k);
            }
            Value::Object(rest).to_string()
        }
    }
}

/// Control characters escaped (`\u{1b}`), everything else as it is.
fn safe(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_command_and_its_exit() {
        let run = json!({"seq": 4, "at": "2026-12-07T21:04:05.123Z", "kind": "command", "text": "ls /", "via": "command"});
        assert_eq!(line(&run), "21:04:05.123     #4  command           $ ls /");
        let exit = json!({"seq": 5, "at": "2026-12-07T21:04:05.200Z", "kind": "command.exit", "of": 4, "exitCode": 2, "outcome": "failed", "durationMs": 77});
        assert!(line(&exit).ends_with("of #4: exit 2, failed after 77 ms"));
    }

    #[test]
    fn escapes_cannot_reach_the_terminal() {
        let evil =
            json!({"kind": "command", "text": "echo \u{1b}]0;owned\u{7}\u{1b}[2J\nrm -rf /"});
        let l = line(&evil);
        assert!(!l.chars().any(|c| c.is_control()), "{l:?}");
        assert!(l.contains("\\u{1b}[2J"));
    }
}
