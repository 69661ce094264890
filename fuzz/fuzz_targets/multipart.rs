//! `POST /files/upload` of execd: a multipart body (boundary `B`) of `metadata` and `file` parts,
//! delivered in pieces whose sizes the input's first byte picks, through the real handler, as root
//! into a scratch working folder (confined: see `warren_fuzz::confine`).
#![no_main]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::extract::{Request, State};
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use warren_execd::reaper::Reaper;
use warren_execd::AppState;

struct Env {
    scratch: PathBuf,
    rt: tokio::runtime::Runtime,
}

static ENV: OnceLock<Env> = OnceLock::new();

fuzz_target!(
    init: {
        ENV.get_or_init(|| {
            let scratch = warren_fuzz::confine();
            let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
            Env { scratch, rt }
        });
    },
    |data: &[u8]| {
        let Some((&piece, body)) = data.split_first() else { return };
        let env = ENV.get().expect("set up in init");
        let work = env.scratch.join("work");
        std::fs::create_dir(&work).expect("scratch is writable");
        let piece = usize::from(piece).max(1);
        let chunks: Vec<Result<Bytes, std::io::Error>> =
            body.chunks(piece).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        let req = Request::builder()
            .method("POST")
            .uri("/files/upload")
            .header("content-type", "multipart/form-data; boundary=B")
            .body(Body::from_stream(futures_stream(chunks)))
            .expect("request");
        let app = Arc::new(AppState::new(Reaper::new(), work));
        let _ = env.rt.block_on(warren_execd::upload::upload(State(app), req));
        warren_fuzz::empty(&env.scratch);
    }
);

fn futures_stream<T>(items: Vec<T>) -> impl futures_core::Stream<Item = T> + Send + 'static
where
    T: Send + 'static,
{
    futures_util::stream::iter(items)
}
