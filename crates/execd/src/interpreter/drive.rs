//! One run on a Jupyter kernel: the code sent, the kernel's messages turned into the event
//! stream, and the interrupts that end it when asked (or when the client went away).

use std::time::{Duration, Instant};

use serde_json::Value;
use warren_api::execd::{EventKind, ExecError, StreamEvent};

use super::kernel::{self, Event, Kernel};
use super::{kernel_died, Context};
use crate::sse::{self, EventStream};

/// How long an interrupt may show no effect before it is sent again, and how long one asked for
/// before the kernel shows the execution started (`execute_input`) waits for that before it is sent
/// anyway (a kernel that never shows it). An interrupt is held until then because ipykernel turns
/// SIGINT on only while it handles a message, and one landing in the few instructions between
/// turning it on and entering the handler's `try` escapes the event loop: the kernel exits. Once
/// the execution started, its handler takes the interrupt. A kernel drops one that lands outside an
/// execution, hence the resends; none once the execution shows it ended (an `error`, a reply,
/// idle), since one landing while ipykernel turns SIGINT off again stops the kernel the same way.
const INTERRUPT_AGAIN: Duration = Duration::from_secs(1);

/// After an interrupt, how long an idle kernel gets to send the `execute_reply` it owes before the
/// run ends without it.
const REPLY_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Interrupts sent again at most this many times per execution: code that catches
/// `KeyboardInterrupt` and goes on is the user's to stop (a restart of the context), not a signal
/// every second for as long as it runs.
const INTERRUPT_RESENDS: u32 = 10;

/// For kernels whose output may trail their idle status ([`kernel::Kernel::late_output`]): how
/// long the execution's messages must have been quiet, once it is idle with its reply, before the
/// run ends.
const LATE_OUTPUT_QUIET: Duration = Duration::from_millis(50);

/// Runs one execution and turns the kernel's messages into the event stream. Returns only when the
/// kernel is idle again (or dead), so the context's busy lock covers the whole execution even when the
/// client went away (then the execution is interrupted, not left running).
///
/// Once interrupted (`DELETE /code`, or the client gone) the interrupt is sent again until the
/// execution ends, and an idle kernel ends it even without its `execute_reply` (after
/// [`REPLY_AFTER_IDLE`]): the stream always ends with a terminal event, and the context is free.
pub(super) async fn drive(ctx: &Context, kernel: &Kernel, code: &str, out: EventStream) {
    let started = Instant::now();
    let send = |ev: StreamEvent| {
        let tx = out.tx.clone();
        async move {
            let _ = tx.send(ev).await;
        }
    };
    // Interrupts from before this run are not for it; any after its `init` are.
    let mut interrupts = ctx.interrupts.subscribe();
    interrupts.mark_unchanged();
    send(sse::init(&ctx.id)).await;
    let (msg_id, mut rx) = match kernel.execute(code).await {
        Ok(r) => r,
        Err(why) => return send(kernel_died(why)).await,
    };
    let (mut idle, mut reply, mut failed) = (false, None::<Value>, false);
    // When an interrupt was asked for, when one was last sent for this execution, and when the
    // kernel was first seen idle after one was asked for.
    let (mut asked, mut sent, mut idle_since) = (None::<Instant>, None::<Instant>, None::<Instant>);
    // The kernel showed this execution started (its `execute_input`).
    let mut executing = false;
    let mut resends = 0u32;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let late_output = kernel.late_output();
    while !(idle && reply.is_some()) || late_output {
        let ending = idle || failed || reply.is_some();
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = tokio::time::sleep(LATE_OUTPUT_QUIET), if late_output && idle && reply.is_some() => break,
            _ = out.cancelled.cancelled(), if asked.is_none() => {
                tracing::info!(context = %ctx.id, "client went away; interrupting the execution");
                asked = Some(Instant::now());
                if idle {
                    idle_since.get_or_insert_with(Instant::now);
                }
                if executing && !ending {
                    sent = Some(Instant::now());
                    kernel.interrupt().await;
                }
                continue;
            }
            Ok(()) = interrupts.changed() => {
                asked = Some(Instant::now());
                if idle {
                    // already idle, the reply still owed: the idle clock starts now
                    idle_since.get_or_insert_with(Instant::now);
                }
                if executing && !ending {
                    sent = Some(Instant::now());
                    kernel.interrupt().await;
                }
                continue;
            }
            _ = tick.tick(), if asked.is_some() => {
                if idle_since.is_some_and(|t| t.elapsed() >= REPLY_AFTER_IDLE) {
                    tracing::info!(context = %ctx.id, "interrupted kernel is idle without a reply; ending the run");
                    reply = Some(serde_json::json!({
                        "status": "error",
                        "ename": "KeyboardInterrupt",
                        "evalue": "interrupted",
                        "traceback": [],
                    }));
                    break;
                }
                // sent again after a while without effect; held ones sent anyway after as long
                let since = sent.or(asked);
                if !ending
                    && resends < INTERRUPT_RESENDS
                    && since.is_some_and(|t| t.elapsed() >= INTERRUPT_AGAIN)
                {
                    resends += 1;
                    sent = Some(Instant::now());
                    kernel.interrupt().await;
                }
                continue;
            }
        };
        let msg = match ev {
            Some(Event::IoPub(m)) => m,
            Some(Event::Reply(m)) => {
                reply = Some(m.content);
                continue;
            }
            Some(Event::Died(why)) => {
                if !failed {
                    send(kernel_died(why)).await;
                }
                return;
            }
            None => return,
        };
        let c = &msg.content;
        if msg.msg_type() == "status" {
            idle |= c["execution_state"] == "idle";
            if idle && asked.is_some() {
                idle_since.get_or_insert_with(Instant::now);
            }
        }
        if msg.msg_type() == "execute_input" && !executing {
            executing = true;
            // an interrupt held until now goes out at once
            if asked.is_some() && sent.is_none() && !(idle || failed || reply.is_some()) {
                sent = Some(Instant::now());
                kernel.interrupt().await;
            }
        }
        if failed {
            continue; // `error` is terminal for the stream; just wait for the kernel to go idle
        }
        match msg.msg_type() {
            "status" => {
                let state = c["execution_state"].as_str().unwrap_or_default();
                send(sse::event(EventKind::Status, Some(state.to_string()))).await;
            }
            "stream" => {
                let kind = if c["name"] == "stderr" {
                    EventKind::Stderr
                } else {
                    EventKind::Stdout
                };
                let text = c["text"].as_str().unwrap_or_default().to_string();
                send(sse::event(kind, Some(text))).await;
            }
            "execute_input" => {
                if let Some(n) = c["execution_count"].as_i64() {
                    send(StreamEvent {
                        execution_count: Some(n),
                        ..sse::event(EventKind::ExecutionCount, None)
                    })
                    .await;
                }
            }
            "execute_result" | "display_data" | "update_display_data" => {
                send(StreamEvent {
                    results: Some(kernel::results_of(&c["data"])),
                    execution_count: c["execution_count"].as_i64(),
                    ..sse::event(EventKind::Result, None)
                })
                .await;
            }
            "error" => {
                failed = true;
                send(error_event(c)).await;
            }
            _ => {}
        }
    }
    kernel.forget(&msg_id);
    if failed {
        return;
    }
    let reply = reply.unwrap_or_default();
    match reply["status"].as_str() {
        Some("error") => send(error_event(&reply)).await,
        Some("aborted") => {
            // An interrupt that reaches the kernel before the execution starts makes ipykernel
            // abort it: to the caller that is its interrupt, answered as every other one.
            let (ename, evalue) = match asked {
                Some(_) => ("KeyboardInterrupt", "interrupted before it started"),
                None => ("ExecutionAborted", "the kernel aborted the execution"),
            };
            send(StreamEvent {
                error: Some(ExecError {
                    ename: ename.into(),
                    evalue: evalue.into(),
                    traceback: Vec::new(),
                }),
                ..sse::event(EventKind::Error, None)
            })
            .await
        }
        _ => send(sse::complete(started.elapsed().as_millis() as i64)).await,
    }
}

fn error_event(content: &Value) -> StreamEvent {
    let traceback = content["traceback"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|l| l.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default();
    StreamEvent {
        error: Some(ExecError {
            // bash_kernel, for one, reports a failing command with an empty ename
            ename: content["ename"]
                .as_str()
                .filter(|n| !n.is_empty())
                .unwrap_or("Error")
                .to_string(),
            evalue: content["evalue"].as_str().unwrap_or_default().to_string(),
            traceback,
        }),
        ..sse::event(EventKind::Error, None)
    }
}
