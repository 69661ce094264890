//! Tenants' API keys: a store in the data dir (`keys.json`, owner-only), each key kept as the
//! SHA-256 of its secret, never the secret, with its tenant, role and name. A key reads
//! `wk_<id>_<secret>`: the id finds its entry, the secret's digest is compared in constant time.
//! The secret is 32 random bytes, so a plain digest is as good as a slow one: nothing to guess.
//!
//! The server and `warren key` (the CLI, on the same data dir) both change the store, each under a
//! lock file and each writing the whole file anew (renamed over the old one); the server looks at the
//! file's identity on every request (one `stat`) and reads it again when it changed, so a key
//! created, revoked or rotated from either side works or stops working at once, without a restart.
//!
//! Replicas that share their sandboxes (`[kubernetes] shared_key_file`) share their key store too:
//! it is a document the runtime's backend keeps (a Secret), changed by compare-and-swap through
//! the admin API, and read again by every replica each [`SHARED_REFRESH`]; a key revoked on one
//! replica stops on all within that. A replica that cannot read it for [`SHARED_STALE`] refuses
//! every key of it (the server's own still works) rather than keep honouring revoked ones.
//!
//! Why one file: one `KeyStore` with two backings (the file under its lock, the replicas' shared
//! document by compare-and-swap) behind the same `current` and `change`, so each operation is
//! written once; ~135 of its lines are tests.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

pub use warren_store::DEFAULT_TENANT;
const STORE_FILE: &str = "keys.json";
const LOCK_FILE: &str = "keys.lock";
/// Left in the data dir of a replica, whose keys are the shared store's: `warren key` refuses to
/// edit a file the server does not read.
const SHARED_MARK: &str = "keys.shared";

/// Whether the server on `data_dir` keeps its keys in a store shared by replicas.
pub fn is_shared(data_dir: &Path) -> bool {
    data_dir.join(SHARED_MARK).exists()
}

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Every tenant's objects (acting for one with `X-Warren-Tenant`), and the keys themselves.
    Admin,
    /// Everything on its own tenant's objects.
    Full,
    /// Only reads of its own tenant's objects: no change, no command, no proxied request.
    ReadOnly,
}

impl Role {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "admin" => Ok(Self::Admin),
            "full" => Ok(Self::Full),
            "read-only" | "readonly" => Ok(Self::ReadOnly),
            other => Err(format!(
                "role must be admin, full or read-only, not {other:?}"
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admin => "admin",
            Self::Full => "full",
            Self::ReadOnly => "read-only",
        }
    }
}

/// One key as stored (and as listed: there is no secret in it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyEntry {
    pub id: String,
    pub tenant: String,
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub created_at: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotated_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<DateTime<Utc>>,
    /// SHA-256 (hex) of the secret.
    #[serde(rename = "secretSha256")]
    pub(crate) secret_sha256: String,
}

impl KeyEntry {
    pub fn to_wire(&self) -> warren_api::admin::KeyInfo {
        let time = |t: &DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        warren_api::admin::KeyInfo {
            id: self.id.clone(),
            tenant: self.tenant.clone(),
            role: self.role.as_str().into(),
            name: self.name.clone(),
            created_at: time(&self.created_at),
            rotated_at: self.rotated_at.as_ref().map(time),
            revoked_at: self.revoked_at.as_ref().map(time),
        }
    }
}

impl KeyEntry {
    /// The answer to a create or a rotate: the entry and its text, shown this once.
    pub fn issued(&self, key: String) -> warren_api::admin::IssuedKey {
        warren_api::admin::IssuedKey {
            info: self.to_wire(),
            key,
        }
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StoreFile {
    keys: Vec<KeyEntry>,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("{0}")]
    Invalid(String),
    #[error("no key {0}")]
    NotFound(String),
    #[error("the key store {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Which version of the file the cache holds: a replaced file is a new inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    mtime_ns: i128,
    len: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        ino: m.ino(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        len: m.len(),
    })
}

struct Cached {
    stamp: Option<Stamp>,
    keys: Vec<KeyEntry>,
}

pub struct KeyStore {
    dir: PathBuf,
    cache: Mutex<Cached>,
    /// Replicas: the store is the backend's shared document, not the file.
    shared: Option<Shared>,
}

struct Shared {
    records: Arc<dyn warren_core::SharedRecords>,
    /// When the document was last read (or written).
    read_at: Mutex<Option<Instant>>,
    /// Counts this replica's own writes: a read that began before one is older than the cache.
    writes: std::sync::atomic::AtomicU64,
}

/// How long one call to the backend may take in a change.
const SHARED_CALL: Duration = Duration::from_secs(10);

/// The shared document's name.
const DOCUMENT: &str = "keys";
/// How often replicas read the shared store again.
pub const SHARED_REFRESH: Duration = Duration::from_secs(1);
/// How long a replica that cannot read the shared store keeps its keys.
pub const SHARED_STALE: Duration = Duration::from_secs(30);

/// Tenant names: lower-case letters, digits and `-`, 1 to 63, starting with a letter or digit (they
/// appear in labels, paths and logs).
pub fn check_tenant(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "tenant {name:?}: 1 to 63 lower-case letters, digits or '-', not starting with '-'"
        ))
    }
}

fn digest_hex(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// `wk_<id>_<secret>` → (id, secret).
fn split_key(presented: &str) -> Option<(&str, &str)> {
    let rest = presented.strip_prefix("wk_")?;
    let (id, secret) = rest.split_once('_')?;
    (id.len() == 12 && !secret.is_empty()).then_some((id, secret))
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::thread_rng().fill_bytes(&mut b);
    hex::encode(b)
}

/// Held while the store is read, changed and written (by the server or the CLI).
struct FileLock {
    _file: std::fs::File,
}

impl FileLock {
    fn take(dir: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::create_dir_all(dir)?;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(dir.join(LOCK_FILE))?;
        // SAFETY: flock on a descriptor we own; released when the file closes.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { _file: f })
    }
}

impl KeyStore {
    pub fn open(data_dir: &Path) -> Self {
        Self {
            dir: data_dir.to_path_buf(),
            cache: Mutex::new(Cached {
                stamp: None,
                keys: Vec::new(),
            }),
            shared: None,
        }
    }

    /// The store replicas share through `records` (see the module documentation); call
    /// [`KeyStore::refresh`] every [`SHARED_REFRESH`].
    pub fn shared(data_dir: &Path, records: Arc<dyn warren_core::SharedRecords>) -> Self {
        let mark = "this server's tenants' keys are the replicas' shared store (a Secret): manage them with the admin API\n";
        if let Err(e) = std::fs::write(data_dir.join(SHARED_MARK), mark) {
            tracing::warn!(error = %e, "marking the data dir's key store as unused");
        }
        if data_dir.join(STORE_FILE).exists() {
            tracing::warn!(
                "{} is not read: replicas share their keys (the admin API manages them)",
                data_dir.join(STORE_FILE).display()
            );
        }
        Self {
            shared: Some(Shared {
                records,
                read_at: Mutex::new(None),
                writes: std::sync::atomic::AtomicU64::new(0),
            }),
            ..Self::open(data_dir)
        }
    }

    /// Replicas: reads the shared store again. A failure keeps the keys read last, until they are
    /// [`SHARED_STALE`].
    pub async fn refresh(&self) -> Result<(), KeyError> {
        let Some(shared) = &self.shared else {
            return Ok(());
        };
        let writes = shared.writes.load(std::sync::atomic::Ordering::SeqCst);
        let (_, keys) = self.read_shared(shared).await?;
        self.take_read(shared, writes, keys);
        Ok(())
    }

    /// The shared store as it is now: its version and its keys.
    async fn read_shared(
        &self,
        shared: &Shared,
    ) -> Result<(Option<String>, Vec<KeyEntry>), KeyError> {
        let doc = shared
            .records
            .read_document(DOCUMENT)
            .await
            .map_err(|e| self.io(std::io::Error::other(e.to_string())))?;
        let keys =
            parse_document(doc.as_ref().map(|(_, b)| b.as_slice())).map_err(|e| self.io(e))?;
        Ok((doc.map(|(v, _)| v), keys))
    }

    /// Caches `keys`, read when this replica had made `writes_before` writes, unless it wrote
    /// since: then the read is older than the cache (a revocation, say) and must not undo it; the
    /// next refresh reads after the write.
    fn take_read(&self, shared: &Shared, writes_before: u64, keys: Vec<KeyEntry>) -> bool {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if shared.writes.load(std::sync::atomic::Ordering::SeqCst) != writes_before {
            return false;
        }
        cache.keys = keys;
        *shared.read_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        true
    }

    fn path(&self) -> PathBuf {
        self.dir.join(STORE_FILE)
    }

    fn io(&self, source: std::io::Error) -> KeyError {
        KeyError::Io {
            path: self.path(),
            source,
        }
    }

    fn read_file(&self) -> Result<Vec<KeyEntry>, KeyError> {
        match std::fs::read(self.path()) {
            Ok(bytes) => serde_json::from_slice::<StoreFile>(&bytes)
                .map(|f| f.keys)
                .map_err(|e| self.io(std::io::Error::other(e))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(self.io(e)),
        }
    }

    /// The keys as the file holds them now (read again when it changed since last time).
    fn current(&self) -> MutexGuard<'_, Cached> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(shared) = &self.shared {
            let read_at = *shared.read_at.lock().unwrap_or_else(|e| e.into_inner());
            if read_at.is_none_or(|t| t.elapsed() > SHARED_STALE) && !cache.keys.is_empty() {
                tracing::error!("the shared key store has not been read for {SHARED_STALE:?}: its keys are refused until it is");
                cache.keys.clear();
            }
            return cache;
        }
        let now = stamp(&self.path());
        if now != cache.stamp || now.is_none() {
            match self.read_file() {
                Ok(keys) => {
                    cache.keys = keys;
                    cache.stamp = now;
                }
                // A file that cannot be read opens nothing (rather than what it held before).
                Err(e) => {
                    tracing::error!(error = %e, "the key store cannot be read: its keys are refused");
                    cache.keys.clear();
                    cache.stamp = None;
                }
            }
        }
        cache
    }

    /// The live key `presented` is, if it is one.
    pub fn authenticate(&self, presented: &str) -> Option<KeyEntry> {
        let (id, secret) = split_key(presented)?;
        let digest = digest_hex(secret);
        let cache = self.current();
        let entry = cache.keys.iter().find(|k| k.id == id)?;
        let same: bool = entry
            .secret_sha256
            .as_bytes()
            .ct_eq(digest.as_bytes())
            .into();
        (same && entry.revoked_at.is_none()).then(|| entry.clone())
    }

    /// Every key, revoked ones too (none with a secret).
    pub fn list(&self) -> Vec<KeyEntry> {
        self.current().keys.clone()
    }

    /// Reads, changes and writes the store under its lock (replicas: by compare-and-swap, from a
    /// blocking task: it waits for the backend).
    fn change<T>(
        &self,
        mut f: impl FnMut(&mut Vec<KeyEntry>) -> Result<T, KeyError>,
    ) -> Result<T, KeyError> {
        if let Some(shared) = &self.shared {
            return self.change_shared(shared, &mut f);
        }
        let _lock = FileLock::take(&self.dir).map_err(|e| self.io(e))?;
        let mut keys = self.read_file()?;
        let out = f(&mut keys)?;
        let bytes = serde_json::to_vec_pretty(&StoreFile { keys })
            .map_err(|e| self.io(std::io::Error::other(e)))?;
        crate::state_file::replace(&self.path(), &bytes).map_err(|e| self.io(e))?;
        Ok(out)
    }

    fn change_shared<T>(
        &self,
        shared: &Shared,
        f: &mut dyn FnMut(&mut Vec<KeyEntry>) -> Result<T, KeyError>,
    ) -> Result<T, KeyError> {
        let backend = |e: warren_core::RuntimeError| self.io(std::io::Error::other(e.to_string()));
        let late = || {
            self.io(std::io::Error::other(
                "the shared key store did not answer in time",
            ))
        };
        let runtime = tokio::runtime::Handle::current();
        for _ in 0..10 {
            let (version, mut keys) = runtime
                .block_on(tokio::time::timeout(SHARED_CALL, self.read_shared(shared)))
                .map_err(|_| late())??;
            let out = f(&mut keys)?;
            let bytes = serde_json::to_vec(&StoreFile { keys: keys.clone() })
                .map_err(|e| self.io(std::io::Error::other(e)))?;
            if runtime
                .block_on(tokio::time::timeout(
                    SHARED_CALL,
                    shared
                        .records
                        .write_document(DOCUMENT, version.as_deref(), &bytes),
                ))
                .map_err(|_| late())?
                .map_err(backend)?
            {
                let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                shared
                    .writes
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                cache.keys = keys;
                *shared.read_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
                return Ok(out);
            }
            // Another replica changed the store in between: read it again and redo the change.
        }
        Err(self.io(std::io::Error::other(
            "the shared key store kept changing under this change; try again",
        )))
    }

    /// A new key; its text is in the answer and nowhere else.
    pub fn create(
        &self,
        tenant: &str,
        role: Role,
        name: Option<String>,
    ) -> Result<(KeyEntry, String), KeyError> {
        check_tenant(tenant).map_err(KeyError::Invalid)?;
        if tenant == DEFAULT_TENANT && role != Role::Admin {
            // The default tenant's objects include the server's (host folders, pools and volumes
            // under their plain names): only admins act as it.
            return Err(KeyError::Invalid(format!(
                "tenant {DEFAULT_TENANT} is the server's own: only admin keys belong to it"
            )));
        }
        if let Some(n) = &name {
            if n.len() > 128 || n.chars().any(char::is_control) {
                return Err(KeyError::Invalid(
                    "a key's name is at most 128 printable characters".into(),
                ));
            }
        }
        self.change(|keys| {
            let id = loop {
                let id = random_hex(6);
                if !keys.iter().any(|k| k.id == id) {
                    break id;
                }
            };
            let secret = random_hex(32);
            let entry = KeyEntry {
                id: id.clone(),
                tenant: tenant.to_string(),
                role,
                name: name.clone(),
                created_at: Utc::now(),
                rotated_at: None,
                revoked_at: None,
                secret_sha256: digest_hex(&secret),
            };
            keys.push(entry.clone());
            Ok((entry, format!("wk_{id}_{secret}")))
        })
    }

    /// Revokes key `id` (it stays listed, revoked); revoking twice is fine.
    pub fn revoke(&self, id: &str) -> Result<KeyEntry, KeyError> {
        self.change(|keys| {
            let k = keys
                .iter_mut()
                .find(|k| k.id == id)
                .ok_or_else(|| KeyError::NotFound(id.to_string()))?;
            k.revoked_at.get_or_insert_with(Utc::now);
            Ok(k.clone())
        })
    }

    /// A new secret for key `id` (same id, tenant and role): the old text stops working at once.
    pub fn rotate(&self, id: &str) -> Result<(KeyEntry, String), KeyError> {
        self.change(|keys| {
            let k = keys
                .iter_mut()
                .find(|k| k.id == id && k.revoked_at.is_none())
                .ok_or_else(|| KeyError::NotFound(id.to_string()))?;
            let secret = random_hex(32);
            k.secret_sha256 = digest_hex(&secret);
            k.rotated_at = Some(Utc::now());
            Ok((k.clone(), format!("wk_{}_{secret}", k.id)))
        })
    }
}

/// The keys a shared document holds (none when there is no document yet).
fn parse_document(bytes: Option<&[u8]>) -> std::io::Result<Vec<KeyEntry>> {
    match bytes {
        None => Ok(Vec::new()),
        Some(b) => serde_json::from_slice::<StoreFile>(b)
            .map(|f| f.keys)
            .map_err(std::io::Error::other),
    }
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The key's id (`server` for the server's own key).
    pub key_id: String,
    pub role: Role,
    /// The tenant it acts as: whose objects it makes.
    pub tenant: String,
    /// An admin acting for no one tenant: it sees every tenant's objects.
    pub all_tenants: bool,
}

impl Caller {
    /// The server's own key, or no key at all (`--insecure-no-auth`).
    pub fn server() -> Self {
        Self {
            key_id: "server".into(),
            role: Role::Admin,
            tenant: DEFAULT_TENANT.into(),
            all_tenants: true,
        }
    }

    /// Whether objects of `tenant` are this caller's to see.
    pub fn sees(&self, tenant: &str) -> bool {
        self.all_tenants || self.tenant == tenant
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_opens_only_while_live_and_only_with_its_own_secret() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = KeyStore::open(dir.path());
        let (entry, text) = store
            .create("acme", Role::Full, Some("ci".into()))
            .expect("create");
        assert_eq!(
            store.authenticate(&text).map(|k| k.tenant),
            Some("acme".into())
        );
        // Not the id alone, nor the digest at rest, nor a near miss.
        let at_rest = std::fs::read_to_string(dir.path().join(STORE_FILE)).expect("file");
        let secret = text.rsplit('_').next().expect("secret");
        assert!(!at_rest.contains(secret), "the secret is never stored");
        for wrong in [
            format!("wk_{}_", entry.id),
            format!("wk_{}_{}", entry.id, entry.secret_sha256),
            format!("{}x", text),
            text.replace("wk_", "wk-"),
        ] {
            assert!(store.authenticate(&wrong).is_none(), "{wrong}");
        }
        // Rotated: the old text stops, the new one works; revoked: nothing does.
        let (_, new) = store.rotate(&entry.id).expect("rotate");
        assert!(store.authenticate(&text).is_none());
        assert!(store.authenticate(&new).is_some());
        store.revoke(&entry.id).expect("revoke");
        assert!(store.authenticate(&new).is_none());
        assert!(
            store.rotate(&entry.id).is_err(),
            "a revoked key stays revoked"
        );
        assert!(store.list()[0].revoked_at.is_some());
    }

    #[test]
    fn a_change_made_by_another_process_is_seen_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = KeyStore::open(dir.path());
        let cli = KeyStore::open(dir.path());
        assert!(cli.create(DEFAULT_TENANT, Role::Full, None).is_err());
        let (entry, text) = cli.create("acme", Role::ReadOnly, None).expect("create");
        assert!(server.authenticate(&text).is_some());
        cli.revoke(&entry.id).expect("revoke");
        assert!(server.authenticate(&text).is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replicas_share_one_store_and_a_revocation_reaches_every_one() {
        let records: Arc<dyn warren_core::SharedRecords> =
            Arc::new(warren_core::fake::FakeRecords::default());
        let (da, db) = (
            tempfile::tempdir().expect("a"),
            tempfile::tempdir().expect("b"),
        );
        let a = Arc::new(KeyStore::shared(da.path(), records.clone()));
        let b = Arc::new(KeyStore::shared(db.path(), records.clone()));
        let on = |store: &Arc<KeyStore>| store.clone();
        // Made on replica a: works on a at once, and on b once it reads the store again.
        let sa = on(&a);
        let (entry, text) =
            tokio::task::spawn_blocking(move || sa.create("acme", Role::Full, None))
                .await
                .expect("join")
                .expect("create");
        assert!(a.authenticate(&text).is_some());
        assert!(
            b.authenticate(&text).is_none(),
            "b has not read the store yet"
        );
        b.refresh().await.expect("refresh");
        assert!(b.authenticate(&text).is_some());
        // Revoked on b: refused on a after its next read.
        let (sb, id) = (on(&b), entry.id.clone());
        tokio::task::spawn_blocking(move || sb.revoke(&id))
            .await
            .expect("join")
            .expect("revoke");
        a.refresh().await.expect("refresh");
        assert!(a.authenticate(&text).is_none());
        // Changes made at once on both replicas both land (compare-and-swap, then again).
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let s = if i % 2 == 0 { on(&a) } else { on(&b) };
                tokio::task::spawn_blocking(move || s.create(&format!("t{i}"), Role::Full, None))
            })
            .collect();
        for t in tasks {
            t.await.expect("join").expect("create");
        }
        a.refresh().await.expect("refresh");
        assert_eq!(a.list().len(), 9);
        // Nothing went to the data dirs' files: the store is the shared one.
        assert!(!da.path().join(STORE_FILE).exists() && !db.path().join(STORE_FILE).exists());
        // A replica that has not read the store for too long refuses its keys.
        let (_, fresh) = tokio::task::spawn_blocking({
            let s = on(&a);
            move || s.create("late", Role::Full, None)
        })
        .await
        .expect("join")
        .expect("create");
        assert!(a.authenticate(&fresh).is_some());
        if let Some(shared) = &a.shared {
            *shared.read_at.lock().expect("lock") =
                Instant::now().checked_sub(SHARED_STALE + Duration::from_secs(1));
        }
        assert!(a.authenticate(&fresh).is_none());
        a.refresh().await.expect("refresh");
        assert!(a.authenticate(&fresh).is_some());
        // A read that began before this replica's own write (a revocation) does not undo it.
        let shared = a.shared.as_ref().expect("shared");
        let writes = shared.writes.load(std::sync::atomic::Ordering::SeqCst);
        let (_, before) = a.read_shared(shared).await.expect("read");
        let (s, id) = (on(&a), a.authenticate(&fresh).expect("live").id);
        tokio::task::spawn_blocking(move || s.revoke(&id))
            .await
            .expect("join")
            .expect("revoke");
        assert!(!a.take_read(shared, writes, before));
        assert!(a.authenticate(&fresh).is_none());
    }

    #[test]
    fn tenant_names_are_checked() {
        for bad in ["", "-a", "A", "a b", "a/b", &"a".repeat(64)] {
            assert!(check_tenant(bad).is_err(), "{bad:?}");
        }
        for good in ["a", "acme-2", "0team"] {
            assert!(check_tenant(good).is_ok(), "{good:?}");
        }
    }
}
