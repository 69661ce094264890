//! The flight recorder: each sandbox's timeline, a bounded, append-only list of what happened to
//! and in it — state changes, command and code runs (their text or its hash, exit code and
//! duration), file changes made through the API, egress decisions, vault injections (the
//! binding's name), endpoints handed out and sessions opened, snapshots.
//!
//! Recorded by the server, outside the sandbox: nothing running inside can edit or erase it. It
//! lives with the sandbox's entry in the registry, so it is kept after the sandbox ends for as long
//! as its record is (`terminated_retention_seconds`). In memory: a server restart starts a new
//! timeline (its first event says so). Past `max_bytes` the oldest events go, and a reader is told
//! how many it missed: a sandbox flooding its own timeline pushes out its oldest events, never the
//! newest.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex as StdMutex};

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// How the recorder is set (`[timeline]`).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Off: nothing is recorded, and timelines answer 404.
    pub enabled: bool,
    /// Bytes of JSON kept per sandbox; past them the oldest events go.
    pub max_bytes: usize,
    /// Whether a command's (or code cell's) text is kept, or only its SHA-256.
    pub commands: CommandText,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            enabled: true,
            max_bytes: 1 << 20,
            commands: CommandText::Full,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandText {
    /// The text, its first [`MAX_TEXT`] bytes (with its hash when cut).
    Full,
    /// Only the SHA-256 of the text: a run can be matched against a known command, not read.
    Hash,
}

/// The longest text one event keeps: a longer command is cut there, and its hash says what it was.
pub const MAX_TEXT: usize = 4096;

pub struct Timeline {
    settings: Arc<Settings>,
    ring: StdMutex<Ring>,
    /// The newest event's number; followers wait on it. Closed (dropped) never: `ended` says when
    /// no more will come.
    tick: tokio::sync::watch::Sender<u64>,
}

#[derive(Default)]
struct Ring {
    /// Events, oldest first, each with its number and its JSON line: what callers and the server
    /// did (runs, files, states, endpoints, …).
    events: VecDeque<(u64, Arc<str>)>,
    /// Network events (egress decisions, vault injections), apart: code in the sandbox makes them
    /// at will, so they have their own share of the bound and cannot push the others out.
    network: VecDeque<(u64, Arc<str>)>,
    bytes: usize,
    network_bytes: usize,
    /// The number the next event gets (the first is 1).
    next: u64,
    /// The sandbox ended: followers stop once they have read everything.
    ended: bool,
}

/// Kinds a sandbox's own code causes as often as it likes (see [`Ring::network`]).
fn is_network(kind: &str) -> bool {
    kind.starts_with("egress.") || kind == "vault.injection"
}

/// The share of `max_bytes` network events keep when other events need the room.
const NETWORK_SHARE: usize = 4;

/// What a reader gets: the events after the number it asked from.
pub struct Page {
    /// JSON lines, oldest first.
    pub lines: Vec<Arc<str>>,
    /// Events after the asked number that were pushed out before this read.
    pub missed: u64,
    /// The newest event's number (what to ask after next time).
    pub last: u64,
    /// No event will follow.
    pub ended: bool,
}

impl Timeline {
    pub fn new(settings: Arc<Settings>) -> Self {
        Self {
            settings,
            ring: StdMutex::new(Ring {
                next: 1,
                ..Ring::default()
            }),
            tick: tokio::sync::watch::channel(0).0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.settings.enabled
    }

    /// Appends an event: `kind` and the fields of `detail` (an object), after its number (`seq`)
    /// and time (`at`). Returns its number (0 when the recorder is off).
    pub fn record(&self, kind: &str, detail: Value) -> u64 {
        if !self.settings.enabled {
            return 0;
        }
        // The event's own fields first: a caller's field named `seq`, `at` or `kind` (copied from
        // a request body) cannot stand for the recorder's.
        let mut event = match detail {
            Value::Object(fields) => fields,
            _ => Map::new(),
        };
        event.insert("kind".into(), kind.into());
        event.insert(
            "at".into(),
            chrono::Utc::now()
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
                .into(),
        );
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let seq = ring.next;
        ring.next += 1;
        event.insert("seq".into(), seq.into());
        let line: Arc<str> = Value::Object(event).to_string().into();
        let max = self.settings.max_bytes;
        if is_network(kind) {
            ring.network_bytes += line.len();
            ring.network.push_back((seq, line));
        } else {
            ring.bytes += line.len();
            ring.events.push_back((seq, line));
        }
        // Past the bound the oldest go: network events first while they hold more than their
        // share, then the oldest of either. The newest stays even when it alone is over.
        while ring.bytes + ring.network_bytes > max && ring.events.len() + ring.network.len() > 1 {
            let network_first = match (ring.network.front(), ring.events.front()) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(n), Some(e)) => ring.network_bytes > max / NETWORK_SHARE || n.0 < e.0,
            };
            let ring = &mut *ring;
            let (list, bytes) = if network_first {
                (&mut ring.network, &mut ring.network_bytes)
            } else {
                (&mut ring.events, &mut ring.bytes)
            };
            if let Some((_, old)) = list.pop_front() {
                *bytes -= old.len();
            }
        }
        drop(ring);
        self.tick.send_replace(seq);
        seq
    }

    /// The text of a command or code cell as the settings keep it: `{"text": …}` (cut past
    /// [`MAX_TEXT`], then with `"truncated": true` and the whole text's `sha256`), or only
    /// `{"sha256": …}`.
    pub fn text_fields(&self, text: &str) -> Map<String, Value> {
        let mut m = Map::new();
        let hash = || hex::encode(Sha256::digest(text.as_bytes()));
        match self.settings.commands {
            CommandText::Hash => {
                m.insert("sha256".into(), hash().into());
            }
            CommandText::Full if text.len() > MAX_TEXT => {
                m.insert("text".into(), capped(text).into());
                m.insert("truncated".into(), true.into());
                m.insert("sha256".into(), hash().into());
            }
            CommandText::Full => {
                m.insert("text".into(), text.into());
            }
        }
        m
    }

    /// The sandbox ended: followers stop after the events already there (a late event, such as
    /// the exit of a run cut short by the end, is still kept).
    pub fn end(&self) {
        self.set_ended(true);
    }

    /// The sandbox is going on after all (a delete that failed is tried again): followers wait.
    pub fn reopen(&self) {
        self.set_ended(false);
    }

    fn set_ended(&self, ended: bool) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring.ended != ended {
            ring.ended = ended;
            drop(ring);
            self.tick.send_modify(|_| {});
        }
    }

    /// The events numbered after `after`, in order.
    pub fn read(&self, after: u64) -> Page {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let newer = |list: &VecDeque<(u64, Arc<str>)>| {
            // Numbers rise along each list: the first newer one is found by halving.
            let from = list.partition_point(|(s, _)| *s <= after);
            list.range(from..).cloned().collect::<Vec<_>>()
        };
        let (a, b) = (newer(&ring.events), newer(&ring.network));
        let mut lines = Vec::with_capacity(a.len() + b.len());
        let (mut a, mut b) = (a.into_iter().peekable(), b.into_iter().peekable());
        loop {
            let take_a = match (a.peek(), b.peek()) {
                (Some(x), Some(y)) => x.0 < y.0,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => break,
            };
            let next = if take_a { a.next() } else { b.next() };
            if let Some((_, line)) = next {
                lines.push(line);
            }
        }
        let last = ring.next - 1;
        Page {
            missed: last
                .saturating_sub(after)
                .saturating_sub(lines.len() as u64),
            lines,
            last,
            ended: ring.ended,
        }
    }

    /// Wakes on every new event and on the end.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.tick.subscribe()
    }
}

/// Timelines of sandboxes whose records are gone before their retention ended (a user's delete
/// forgets the record at once, as the reference does): kept, with their tenant, until then.
#[derive(Default)]
pub struct Kept {
    map: StdMutex<HashMap<String, KeptTimeline>>,
}

struct KeptTimeline {
    tenant: String,
    timeline: Arc<Timeline>,
    until: DateTime<Utc>,
}

impl Kept {
    /// Keeps sandbox `id`'s timeline until `until` (nothing when that has passed).
    pub fn keep(&self, id: &str, tenant: &str, timeline: Arc<Timeline>, until: DateTime<Utc>) {
        let now = Utc::now();
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, k| k.until > now);
        if until > now && timeline.enabled() {
            let tenant = tenant.to_string();
            map.insert(
                id.to_string(),
                KeptTimeline {
                    tenant,
                    timeline,
                    until,
                },
            );
        }
    }

    /// Drops the timelines whose retention ended.
    pub fn prune(&self) {
        let now = Utc::now();
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, k| k.until > now);
    }

    /// Sandbox `id`'s tenant and timeline, if kept.
    pub fn get(&self, id: &str) -> Option<(String, Arc<Timeline>)> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(id)
            .filter(|k| k.until > Utc::now())
            .map(|k| (k.tenant.clone(), k.timeline.clone()))
    }
}

/// A text as an event keeps it: its first [`MAX_TEXT`] bytes, cut on a character's boundary.
pub fn capped(text: &str) -> &str {
    let mut cut = text.len().min(MAX_TEXT);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    &text[..cut]
}

/// The line a reader is given in place of events pushed out before it read them.
pub fn missed_line(count: u64) -> String {
    serde_json::json!({
        "kind": "timeline.missed",
        "count": count,
        "message": "older events were dropped past [timeline] max_bytes",
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn timeline(max_bytes: usize, commands: CommandText) -> Timeline {
        Timeline::new(Arc::new(Settings {
            enabled: true,
            max_bytes,
            commands,
        }))
    }

    fn parse(line: &str) -> Value {
        serde_json::from_str(line).expect("a JSON line")
    }

    #[test]
    fn events_are_numbered_lines_with_their_fields() {
        let t = timeline(1 << 20, CommandText::Full);
        assert_eq!(t.record("state", json!({"state": "Running"})), 1);
        assert_eq!(t.record("command", json!({"text": "echo \"hi\"\n"})), 2);
        let page = t.read(0);
        assert_eq!((page.lines.len(), page.missed, page.last), (2, 0, 2));
        let second = parse(&page.lines[1]);
        assert_eq!(second["seq"], 2);
        assert_eq!(second["kind"], "command");
        assert_eq!(second["text"], "echo \"hi\"\n");
        assert!(second["at"].as_str().is_some_and(|a| a.ends_with('Z')));
        assert!(!page.lines[1].contains('\n'), "one event, one line");
        assert_eq!(t.read(1).lines.len(), 1);
        assert!(t.read(2).lines.is_empty());
    }

    #[test]
    fn past_its_bound_the_oldest_go_and_readers_are_told() {
        let t = timeline(400, CommandText::Full);
        for i in 0..100 {
            t.record("command", json!({"text": format!("run {i}")}));
        }
        let page = t.read(0);
        let kept: usize = page.lines.iter().map(|l| l.len()).sum();
        assert!(kept <= 400, "{kept} bytes kept");
        assert_eq!(page.missed as usize + page.lines.len(), 100);
        assert_eq!(
            parse(page.lines.last().expect("an event"))["text"],
            "run 99"
        );
        // A reader that had read up to 98 missed nothing.
        let late = t.read(98);
        assert_eq!((late.missed, late.lines.len()), (0, 2));
    }

    #[test]
    fn a_callers_fields_cannot_stand_for_the_recorders() {
        let t = timeline(1 << 20, CommandText::Full);
        t.record("state", json!({"state": "Running"}));
        t.record(
            "desktop.input",
            json!({"kind": "state", "seq": 1, "at": "then"}),
        );
        let e = parse(&t.read(1).lines[0]);
        assert_eq!(
            (e["kind"].as_str(), e["seq"].as_u64()),
            (Some("desktop.input"), Some(2))
        );
        assert_ne!(e["at"], "then");
    }

    #[test]
    fn a_network_flood_cannot_push_out_what_callers_did() {
        let t = timeline(4096, CommandText::Full);
        t.record("command", json!({"text": "rm -rf /data"}));
        for i in 0..10_000 {
            t.record(
                "egress.name",
                json!({"name": format!("n{i}.example"), "action": "deny"}),
            );
        }
        let page = t.read(0);
        let first = parse(&page.lines[0]);
        assert_eq!(first["text"], "rm -rf /data", "the command stays");
        assert_eq!(page.missed as usize + page.lines.len(), 10_001);
        // In order of their numbers, with no repeats.
        let seqs: Vec<u64> = page
            .lines
            .iter()
            .map(|l| parse(l)["seq"].as_u64().unwrap_or(0))
            .collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
        assert_eq!(
            t.read(u64::MAX).missed,
            0,
            "an `after` past the end reads nothing, and no panic"
        );
    }

    #[test]
    fn a_single_event_over_the_bound_is_kept() {
        let t = timeline(10, CommandText::Full);
        t.record("command", json!({"text": "x".repeat(100)}));
        assert_eq!(t.read(0).lines.len(), 1);
    }

    #[test]
    fn long_text_is_cut_on_a_char_boundary_with_its_hash() {
        let t = timeline(1 << 20, CommandText::Full);
        let text = "é".repeat(MAX_TEXT);
        let f = t.text_fields(&text);
        let kept = f["text"].as_str().expect("text");
        assert!(kept.len() <= MAX_TEXT && text.starts_with(kept));
        assert_eq!(f["truncated"], true);
        assert_eq!(f["sha256"], hex::encode(Sha256::digest(text.as_bytes())));
        assert_eq!(
            Value::Object(t.text_fields("ls")),
            json!({"text": "ls"}),
            "short text whole, no hash"
        );
    }

    #[test]
    fn hash_mode_keeps_no_text() {
        let t = timeline(1 << 20, CommandText::Hash);
        let f = Value::Object(t.text_fields("cat /secret"));
        assert!(f.get("text").is_none());
        assert_eq!(
            f["sha256"],
            hex::encode(Sha256::digest(b"cat /secret")).as_str()
        );
    }

    #[test]
    fn off_records_nothing() {
        let t = Timeline::new(Arc::new(Settings {
            enabled: false,
            ..Settings::default()
        }));
        assert_eq!(t.record("state", json!({})), 0);
        assert!(t.read(0).lines.is_empty());
    }

    #[tokio::test]
    async fn followers_wake_on_events_and_on_the_end() {
        let t = Arc::new(timeline(1 << 20, CommandText::Full));
        let mut rx = t.watch();
        let t2 = t.clone();
        tokio::spawn(async move {
            t2.record("state", json!({"state": "Running"}));
            t2.end();
        });
        rx.changed().await.expect("woken");
        loop {
            let page = t.read(0);
            if page.ended {
                assert_eq!(page.lines.len(), 1);
                break;
            }
            rx.changed().await.expect("woken at the end");
        }
    }
}
