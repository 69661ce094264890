//! Create: admission, the image (from the store, pulled, or by reference), the runtime's create,
//! the network link and the credential proxy, the preStart hook, and Running.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::Utc;
use tracing::Instrument;
use warren_api::lifecycle::SandboxState;
use warren_api::ErrorCode;
use warren_core::{Background, ImageSource, RuntimeExt, SandboxImage, SandboxSpec};
use warren_store::SandboxRecord;

use super::{limit_reached, lock, moved, Entry, InFlight, Sandboxes, REASON_PRE_START_FAILED};
use crate::error::{ErrorKind, SandboxError};
use crate::network::{needs_link, runtime_policy};
use crate::validate::CreatePlan;

/// The create extension that asks for execd's isolated sessions (`/v1/isolated/…`), as the
/// reference names it.
pub const ISOLATION_EXTENSION: &str = "bootstrap.execd.isolation";

/// Whether a create's extensions ask for isolated sessions.
pub fn isolation_requested(extensions: &BTreeMap<String, String>) -> bool {
    extensions
        .get(ISOLATION_EXTENSION)
        .is_some_and(|v| v == "enable")
}

impl Sandboxes {
    /// The image from the store, leased to `holder`; pulled first when it is missing and pulls are
    /// on (concurrent creates of one image share the pull).
    pub(super) async fn store_image(
        &self,
        name: &str,
        auth: Option<&warren_api::lifecycle::ImageAuth>,
        holder: &str,
    ) -> Result<warren_image::ResolvedImage, SandboxError> {
        let resolve = || {
            // Resolving and leasing are file work that may wait on the store's lock during an
            // import.
            let images = self.inner.images.clone();
            let (name, holder) = (name.to_owned(), holder.to_owned());
            async move {
                tokio::task::spawn_blocking(move || {
                    let image = images.resolve(&name)?;
                    images.lease(&holder, &image)?;
                    Ok(image)
                })
                .await
                .map_err(|e| SandboxError::internal("resolving the image", &e))
            }
        };
        match resolve().await? {
            Ok(image) => return Ok(image),
            Err(warren_image::ImageError::NotFound { .. }) if self.inner.puller.is_some() => {}
            Err(e) => return Err(image_error(name, e)),
        }
        let Some(puller) = &self.inner.puller else {
            unreachable!("checked above");
        };
        let credentials = auth.map(|a| warren_registry::Credentials {
            username: a.username.clone(),
            password: a.password.clone(),
        });
        let pulled = puller.pull(name, credentials, None).await;
        crate::metrics::image_pull(pulled.is_ok());
        pulled.map_err(|e| pull_error(&e))?;
        resolve().await?.map_err(|e| image_error(name, e))
    }

    /// A 507 while the data dir's filesystem is too full for `what` ("a sandbox", "a snapshot")
    /// to be made (see `disk_space`).
    pub fn check_room(&self, what: &str) -> Result<(), SandboxError> {
        crate::disk_space::check(&self.inner.data_dir, what)
    }

    /// Creates a sandbox and returns once execd answers. On failure nothing remains: no record, no
    /// lease, no runtime resource.
    pub async fn create(&self, plan: CreatePlan) -> Result<SandboxRecord, SandboxError> {
        self.create_in_background(plan, Background::default()).await
    }

    /// [`Sandboxes::create`] for a sandbox made ahead of need: while `background` is on, its CPU
    /// yields to the sandboxes in use (see [`Background`]).
    pub async fn create_in_background(
        &self,
        plan: CreatePlan,
        background: Background,
    ) -> Result<SandboxRecord, SandboxError> {
        let started = std::time::Instant::now();
        // Traced (see the CLI's `telemetry`): the create and its phases, under the request's span.
        let span = tracing::info_span!(
            "sandbox.create",
            image = %plan.image,
            sandbox_id = tracing::field::Empty,
            code = tracing::field::Empty
        );
        let created = self
            .create_timed(plan, background, started)
            .instrument(span.clone())
            .await;
        match &created {
            Ok(r) => span.record("sandbox_id", r.id.as_str()),
            Err(e) => span.record("code", e.code.as_str()),
        };
        crate::metrics::create_phase("total", started.elapsed());
        crate::metrics::create_answered(created.as_ref().map(drop).map_err(|e| e.code.as_str()));
        created
    }

    /// [`Sandboxes::create_in_background`] from `started`, each phase timed.
    async fn create_timed(
        &self,
        plan: CreatePlan,
        background: Background,
        started: std::time::Instant,
    ) -> Result<SandboxRecord, SandboxError> {
        self.check_room("a sandbox")?;
        if plan.hooks.idle.is_some() && !self.inner.runtime.capabilities().pause {
            return Err(SandboxError::new(
                ErrorKind::Invalid,
                ErrorCode::ApiNotSupported,
                format!(
                    "lifecycle.idlePolicy pauses and wakes sandboxes, which {} cannot do",
                    self.inner.runtime.sandboxes_described()
                ),
            ));
        }
        let caps = self.inner.caps;
        let in_flight = self
            .inner
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _in_flight = InFlight(&self.inner.in_flight);
        if in_flight >= caps.creates_in_flight {
            return Err(limit_reached(format!(
                "{} creates are in flight, the most this server takes at once ([limits] max_creates_in_flight); retry shortly",
                caps.creates_in_flight
            )));
        }
        let id = uuid::Uuid::new_v4().to_string();
        let mut partial = PartialCreate {
            sandboxes: self,
            id: id.clone(),
            leased: false,
            entered: false,
        };
        let image_started = std::time::Instant::now();
        let image = match self.inner.runtime.capabilities().image_source {
            ImageSource::Store => {
                let image = self
                    .store_image(&plan.image, plan.image_auth.as_ref(), &id)
                    .instrument(tracing::info_span!("create.image"))
                    .await?;
                partial.leased = true;
                SandboxImage::Resolved(image)
            }
            ImageSource::Engine => SandboxImage::Reference {
                name: plan.image.clone(),
                auth: plan.image_auth.clone(),
            },
        };
        let image_took = image_started.elapsed();
        crate::metrics::create_phase("image", image_took);
        let entrypoint = plan
            .entrypoint
            .clone()
            .unwrap_or_else(|| default_entrypoint(&image));
        let policy = plan
            .network_policy
            .clone()
            .unwrap_or_else(|| self.inner.network.default_policy());
        let caps_now = self.inner.runtime.capabilities();
        // What the runtime enforces itself when it has no link (a NetworkPolicy).
        let mut by_address = None;
        let egress = if needs_link(&policy) && !caps_now.egress_policy && caps_now.egress_addresses
        {
            let checked = if plan.credential_proxy {
                Err(SandboxError::new(
                    ErrorKind::Invalid,
                    ErrorCode::ApiNotSupported,
                    format!(
                        "the credential vault needs a network link, which sandboxes of the {} runtime do not have",
                        self.inner.runtime.name()
                    ),
                ))
            } else {
                runtime_policy(&policy, &self.inner.runtime.name(), caps_now.egress_names)
            };
            by_address = Some(checked?);
            None
        } else if needs_link(&policy) {
            if !caps_now.egress_policy {
                return Err(SandboxError::new(
                    ErrorKind::Invalid,
                    ErrorCode::ApiNotSupported,
                    format!(
                        "networkPolicy: Warren cannot enforce network policies on {} (the native runtime, embedded or runc, and Docker on this host can)",
                        self.inner.runtime.sandboxes_described()
                    ),
                ));
            }
            Some(self.inner.network.egress().await?)
        } else {
            None
        };
        let isolation = isolation_requested(&plan.extensions);
        let now = Utc::now();
        let hooks = plan.hooks.clone();
        let record = SandboxRecord {
            id: id.clone(),
            image: plan.image.clone(),
            snapshot_id: plan.snapshot_id.clone(),
            warm_pool: plan.warm_pool.clone(),
            pool_ref: None,
            entrypoint: entrypoint.clone(),
            env: plan.env.clone(),
            metadata: plan.metadata,
            extensions: plan.extensions,
            limits: plan.limits.clone(),
            created_at: now,
            expires_at: plan
                .timeout_seconds
                .map(|t| now + chrono::Duration::seconds(t)),
            state: SandboxState::Pending,
            reason: None,
            message: None,
            last_transition_at: now,
            token: self.inner.records.secret(&id),
            runtime_state: serde_json::Value::Null,
            network_policy: serde_json::to_value(&policy).ok(),
            network_link: None,
            credential_proxy: plan.credential_proxy,
            lifecycle_hooks: (!hooks.is_empty())
                .then(|| serde_json::to_value(&hooks).ok())
                .flatten(),
            tenant: plan.tenant.clone(),
        };
        let entry = Arc::new(Entry::new(&record, false, self.inner.timeline.clone()));
        let _op = entry.op.lock().await;
        {
            // Counted and inserted under one lock: concurrent creates cannot all slip under the cap.
            let mut entries = self
                .inner
                .entries
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let live = entries
                .values()
                .filter(|e| !lock(&e.record).state.is_terminal())
                .count();
            if live >= caps.sandboxes {
                drop(entries);
                return Err(limit_reached(format!(
                    "{live} sandboxes are running, the most this server runs at once ([limits] max_sandboxes); retry when one ends"
                )));
            }
            entries.insert(id.clone(), entry.clone());
            partial.entered = true;
        }
        self.persist(&record);
        crate::metrics::create_phase("admission", started.elapsed().saturating_sub(image_took));

        let mut env = self.inner.default_env.clone();
        env.extend(plan.env);
        let spec = SandboxSpec {
            id: id.clone(),
            image,
            entrypoint,
            env,
            limits: plan.limits,
            volumes: plan.volumes,
            background,
            isolation,
            execd_verifier: crate::tokens::execd_verifier(&record.token),
            record: self.inner.records.runtime_copy(&record),
            egress: by_address,
            hardening: self.inner.floor.clone(),
        };
        // The semaphore is never closed; were it, creating without a slot is still correct.
        let queued = std::time::Instant::now();
        let _slot = match &self.inner.create_slots {
            Some(s) => s
                .acquire()
                .instrument(tracing::info_span!("create.queue"))
                .await
                .ok(),
            None => None,
        };
        crate::metrics::create_phase("queue", queued.elapsed());
        let starting = std::time::Instant::now();
        // A panic while the runtime makes this sandbox (a bug in Warren or a runtime) is this
        // sandbox's failure alone: it is marked Failed with what could be made of it released,
        // instead of a task that ends silently and a record left Pending for ever.
        let provisioned = std::panic::AssertUnwindSafe(self.provision(
            &id,
            &spec,
            egress.as_ref(),
            &policy,
            plan.credential_proxy,
        ));
        let created = futures::FutureExt::catch_unwind(provisioned)
            .instrument(tracing::info_span!("create.start", sandbox_id = %id))
            .await;
        crate::metrics::create_phase("start", starting.elapsed());
        let created = match created {
            Ok(created) => created,
            Err(_) => {
                // The sandbox stays, Failed, for its caller to see; what was made is released.
                partial.keep();
                return Err(self.failed_by_panic(&entry, "creating the sandbox").await);
            }
        };
        match created {
            Ok((state, link)) => {
                // A sandbox now: from here its end (a failed preStart hook, a delete) releases
                // what it holds.
                partial.keep();
                let made = self.update(&entry, |r| {
                    r.runtime_state = state;
                    r.network_link = link;
                });
                if let Some(pre_start) = &hooks.pre_start {
                    if let Some(failed) = self.pre_start(&entry, &made, pre_start).await {
                        return Ok(failed);
                    }
                }
                let rec = self.update(&entry, |r| {
                    moved(r, SandboxState::Running, Some("ready"), None);
                });
                // Idle from now, not from the server's start.
                self.inner.activity.touch(&id);
                self.arm_periodic(&id, &hooks.periodic);
                if self.inner.records.feed().is_none() {
                    // With shared records, ends come from the records' feed (`shared`).
                    self.watch(&rec);
                }
                if rec.warm_pool.is_some() {
                    // A pool's sandbox waits for a client whose first command should not pay for
                    // the connect. Others open theirs on first use: a parked connection is ~17 KiB
                    // of server memory, which an idle sandbox nobody has called yet need not hold.
                    self.inner.execd_conns.prewarm(
                        id.clone(),
                        self.endpoint_of(&rec),
                        self.execd_live(&id),
                    );
                }
                Ok(rec)
            }
            Err(e) => {
                // The runtime left nothing behind (its create's promise); the rest goes now, while
                // the sandbox's lock is still held, so that no other verb finds it half made.
                drop(partial);
                Err(e)
            }
        }
    }

    /// Runs a new sandbox's `preStart` hook before it is reported Running. `None` when it
    /// succeeded; else the sandbox, ended Failed with the hook's exit code and the end of its output
    /// (what the runtime made of it released, as for a sandbox whose processes ended).
    pub(super) async fn pre_start(
        &self,
        entry: &Arc<Entry>,
        rec: &SandboxRecord,
        hook: &crate::hooks::Hook,
    ) -> Option<SandboxRecord> {
        let run = crate::hooks::run(&self.endpoint_of(rec), "preStart", hook).await;
        let (ok, summary) = (run.succeeded(), run.summary());
        self.inner.hook_runs.record(&rec.id, run);
        if ok {
            return None;
        }
        tracing::info!(sandbox_id = %rec.id, hook = %summary, "the preStart hook failed");
        self.inner.execd_conns.forget(&rec.id);
        if let Err(e) = self
            .inner
            .runtime
            .destroy(&rec.id, &rec.runtime_state)
            .await
        {
            tracing::warn!(sandbox_id = %rec.id, error = %e, "removing a sandbox whose preStart hook failed");
        }
        self.unlink(&rec.id).await;
        let _ = self.inner.images.release(&rec.id);
        Some(self.update(entry, |r| {
            moved(
                r,
                SandboxState::Failed,
                Some(REASON_PRE_START_FAILED),
                Some(format!("the preStart hook failed: {summary}")),
            )
        }))
    }

    /// The runtime's part of a create: the sandbox made, then its network link (and credential
    /// proxy) if its policy lets anything out; a failure of the link undoes the sandbox.
    pub(super) async fn provision(
        &self,
        id: &str,
        spec: &SandboxSpec,
        egress: Option<&Arc<warren_egress::Egress>>,
        policy: &warren_egress::NetworkPolicy,
        credential_proxy: bool,
    ) -> Result<(warren_core::RuntimeState, Option<u32>), SandboxError> {
        match self.inner.runtime.create(spec).await {
            Ok(state) => match egress {
                // The link comes once the sandbox's namespace exists; a failure undoes the create.
                Some(eg) => {
                    let linked = match self.link(eg, id, &state, policy.clone(), None).await {
                        Ok(index) if credential_proxy => {
                            self.start_credential_proxy(eg, id).await.map(|()| index)
                        }
                        other => other,
                    };
                    match linked {
                        Ok(index) => Ok((state, Some(index))),
                        Err(e) => {
                            let _ = self.inner.runtime.destroy(id, &state).await;
                            self.unlink(id).await;
                            Err(e)
                        }
                    }
                }
                None => Ok((state, None)),
            },
            Err(e) => Err(match crate::disk_space::shortage(&self.inner.data_dir) {
                // Filled while this create ran: say so, as the runtime's own error rarely can.
                Some(why) => crate::disk_space::insufficient(format!(
                    "creating the sandbox failed: {why} ({e})"
                )),
                None => SandboxError::from_runtime("creating the sandbox", e),
            }),
        }
    }

    /// After a panic in a task of the sandbox in `entry` (`task` says which): releases what the
    /// runtime made of it (by the state on record: none yet while it is created), marks it Failed,
    /// and returns the "internal error" a caller waiting for that task gets.
    pub(super) async fn failed_by_panic(&self, entry: &Entry, task: &str) -> SandboxError {
        let (id, state) = {
            let r = lock(&entry.record);
            (r.id.clone(), r.runtime_state.clone())
        };
        tracing::error!(sandbox_id = %id, task, "a sandbox's task panicked; it is marked Failed");
        if let Err(e) = self.inner.runtime.destroy(&id, &state).await {
            tracing::warn!(sandbox_id = %id, error = %e, "cleaning up after the panic failed");
        }
        self.unlink(&id).await;
        let _ = self.inner.images.release(&id);
        self.inner.execd_conns.forget(&id);
        let message = format!("{task} panicked (a bug in Warren); the server's log has it");
        self.update(entry, |r| {
            moved(
                r,
                SandboxState::Failed,
                Some("internal_error"),
                Some(message.clone()),
            )
        });
        SandboxError::internal(
            task,
            &std::io::Error::other(format!("sandbox {id}: {message}")),
        )
    }
}

fn image_error(name: &str, e: warren_image::ImageError) -> SandboxError {
    match e {
        warren_image::ImageError::NotFound { .. } => SandboxError::new(
            ErrorKind::NotFound,
            ErrorCode::ImageNotFound,
            format!("image {name:?} is not in the local store and this server does not pull ([images] pull = \"never\"); pull it with `warren image pull {name}`, import it with `warren image import {name} PATH`, or use the built-in \"host\" image"),
        ),
        warren_image::ImageError::InvalidName { .. } => SandboxError::invalid(format!("invalid image reference {name:?}")),
        other => SandboxError::internal("resolving the image", &other),
    }
}

/// The main process of a create that names none: the image's Entrypoint + Cmd, as `docker run`
/// would start (store images; an Engine image's config is the daemon's to read), else a process
/// that keeps the sandbox up.
fn default_entrypoint(image: &SandboxImage) -> Vec<String> {
    if let SandboxImage::Resolved(warren_image::ResolvedImage::Layers { config, .. }) = image {
        let argv: Vec<String> = config
            .entrypoint
            .iter()
            .chain(&config.cmd)
            .cloned()
            .collect();
        if argv.first().is_some_and(|a| !a.is_empty()) {
            return argv;
        }
    }
    vec!["tail".into(), "-f".into(), "/dev/null".into()]
}

/// A failed pull as the create's answer: the message names the image and the cause.
fn pull_error(e: &warren_registry::PullError) -> SandboxError {
    use warren_registry::PullErrorKind as K;
    let (status, code) = match e.kind() {
        K::BadName => (ErrorKind::Invalid, ErrorCode::InvalidParameter),
        K::NotFound => (ErrorKind::NotFound, ErrorCode::ImageNotFound),
        K::Denied => (ErrorKind::Forbidden, ErrorCode::ImagePullDenied),
        K::Upstream => (ErrorKind::Upstream, ErrorCode::ImagePullFailed),
        K::Invalid => (ErrorKind::Unprocessable, ErrorCode::ImageInvalid),
        K::Internal => return SandboxError::internal("pulling the image", e),
    };
    SandboxError::new(status, code, e.to_string())
}

/// What a create has made so far, undone if it ends before there is a sandbox (an early `?`, a
/// refusal, the runtime's failure): the image lease, and the entry with its journal line. One
/// guard instead of a release before every early return, which a new return would forget.
struct PartialCreate<'a> {
    sandboxes: &'a Sandboxes,
    id: String,
    leased: bool,
    entered: bool,
}

impl PartialCreate<'_> {
    /// There is a sandbox now (or a Failed record of one): its own end releases what it holds.
    fn keep(&mut self) {
        self.leased = false;
        self.entered = false;
    }
}

impl Drop for PartialCreate<'_> {
    fn drop(&mut self) {
        if self.entered {
            self.sandboxes.forget(&self.id);
        }
        if self.leased {
            let _ = self.sandboxes.inner.images.release(&self.id);
        }
    }
}
