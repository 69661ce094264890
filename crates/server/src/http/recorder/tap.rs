//! The bodies the recorder watches: a [`Tap`] relays a body unchanged and shows each chunk, and its
//! end, to a [`Watch`]; [`Copy`] keeps a request body's first bytes for the record.

use std::sync::{Arc, Mutex as StdMutex};

use axum::body::Body;
use bytes::Bytes;

use super::{Captured, MAX_BODY};

/// Sees a body's bytes as they pass, and its end (`whole`: it ended; not whole: it was dropped
/// first, the client or execd gone).
pub(super) trait Watch: Send + Unpin + 'static {
    fn data(&mut self, data: &Bytes);
    fn ended(&mut self, whole: bool);
}

/// A body relayed unchanged, shown to a [`Watch`] as it goes.
pub(super) struct Tap<W: Watch> {
    inner: Body,
    watch: W,
    ended: bool,
}

impl<W: Watch> Tap<W> {
    pub(super) fn new(inner: Body, watch: W) -> Self {
        Self {
            inner,
            watch,
            ended: false,
        }
    }
}

impl<W: Watch> http_body::Body for Tap<W> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.watch.data(data);
                }
            }
            std::task::Poll::Ready(None) if !this.ended => {
                this.ended = true;
                this.watch.ended(true);
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<W: Watch> Drop for Tap<W> {
    fn drop(&mut self) {
        if !self.ended {
            self.ended = true;
            self.watch.ended(false);
        }
    }
}

/// Copies a request body's first [`MAX_BODY`] bytes.
pub(super) struct Copy(pub(super) Arc<StdMutex<Captured>>);

impl Watch for Copy {
    fn data(&mut self, data: &Bytes) {
        let mut c = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let room = MAX_BODY.saturating_sub(c.bytes.len());
        if data.len() > room {
            c.cut = true;
        }
        c.bytes.extend_from_slice(&data[..data.len().min(room)]);
    }

    fn ended(&mut self, _whole: bool) {}
}
