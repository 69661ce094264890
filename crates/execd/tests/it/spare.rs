//! The spare shell: started once execd has been idle, taken by the next command that fits, and
//! indistinguishable from `bash -c` to that command.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::*;

/// execd's children whose command line is the spare's bootstrap.
fn spares(execd: &Execd) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let mut fields = after.split_whitespace();
        let (state, ppid) = (
            fields.next(),
            fields.next().and_then(|p| p.parse::<i32>().ok()),
        );
        if state == Some("Z") || ppid != Some(execd.pid()) {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains("__warren_go") {
            found.push(pid);
        }
    }
    found
}

/// Waits (well past the idle delay) for exactly one spare shell and returns its pid.
async fn the_spare(execd: &Execd) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = spares(execd);
        if !found.is_empty() {
            assert_eq!(found.len(), 1, "one spare at a time: {found:?}");
            return found[0];
        }
        assert!(Instant::now() < deadline, "no spare shell started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn an_idle_execd_keeps_one_spare_shell_and_the_next_command_runs_in_it() {
    let execd = Execd::start().await;
    let spare = the_spare(&execd).await;
    // Long enough for the spare's own `$SECONDS` to have reached 1.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(spares(&execd), [spare], "still one, the same");

    let cmd = r#"echo "pid=$$ _=$_ s=$SECONDS arg0=$0 args=$# file=$FROM_FILE foo=$FOO q=$Q rc=$? pwd=$PWD";
        echo "vars=${__warren_go-unset}${__warren_cmd-unset} opts=$-"; echo err >&2; exit 7"#;
    let events = execd
        .run(json!({"command": cmd, "envs": {"FOO": "a b", "Q": "it's"}}))
        .await;
    // What bash starts `$_` with: the environment's `_` (execd's, here the test's), else its path.
    let underscore = warren_env::var("_").unwrap_or_else(|| "/bin/bash".into());
    assert_eq!(
        text_of(&events, "stdout"),
        format!(
            "pid={spare} _={underscore} s=0 arg0=/bin/bash args=0 file=yes foo=a b q=it's rc=0 pwd={}\n\
             vars=unsetunset opts=hBc\n",
            execd.work().display()
        )
    );
    assert_eq!(text_of(&events, "stderr"), "err\n");
    let last = events.last().expect("events");
    assert_eq!(
        (last["type"].as_str(), last["error"]["evalue"].as_str()),
        (Some("error"), Some("7"))
    );
    assert!(
        wait_gone(spare, Duration::from_secs(3)).await,
        "the spare ran the command and exited"
    );

    // The same command as a plain `bash -c` prints the same, bar the pid.
    let fresh = execd
        .run(json!({"command": cmd, "envs": {"FOO": "a b", "Q": "it's"}}))
        .await;
    let text = text_of(&fresh, "stdout");
    assert!(!text.contains(&format!("pid={spare} ")), "{text}");
    assert_eq!(
        text.split_once(' ').map(|(_, rest)| rest.to_string()),
        text_of(&events, "stdout")
            .split_once(' ')
            .map(|(_, rest)| rest.to_string()),
    );

    // After a pause, a new spare.
    let next = the_spare(&execd).await;
    assert_ne!(next, spare);
}

#[tokio::test]
async fn no_spare_is_started_while_a_foreground_command_runs() {
    let execd = Execd::start().await;
    let spare = the_spare(&execd).await;
    // Takes the spare, and runs well past the idle delay.
    let run = execd.run(json!({"command": "sleep 0.6; echo done"}));
    let look = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        spares(&execd)
    };
    let (events, during) = tokio::join!(run, look);
    assert_eq!(text_of(&events, "stdout"), "done\n");
    // (The one running the command still has the bootstrap's command line.)
    assert_eq!(during, [spare], "a spare started beside a running command");
    let next = the_spare(&execd).await;
    assert_ne!(next, spare);
}

#[tokio::test]
async fn commands_that_do_not_fit_start_fresh_and_leave_the_spare() {
    let execd = Execd::start().await;
    std::fs::create_dir(execd.work().join("sub")).expect("mkdir");
    let spare = the_spare(&execd).await;
    for body in [
        json!({"command": "echo $$", "cwd": "sub"}),
        json!({"command": "echo $$", "envs": {"BASH_ENV": "/dev/null"}}),
        json!({"command": "echo $$", "envs": {"IFS": ":"}}),
        json!({"command": "echo $$", "background": true}),
        json!({"argv": ["/bin/sh", "-c", "echo $$"]}),
    ] {
        let events = execd.run(body.clone()).await;
        assert!(
            !text_of(&events, "stdout").contains(&spare.to_string()),
            "{body} ran on the spare"
        );
    }
    assert!(
        pid_alive(spare),
        "the spare is kept for a command that fits"
    );
    let events = execd.run(json!({"command": "echo $$"})).await;
    assert_eq!(text_of(&events, "stdout"), format!("{spare}\n"));
}

#[tokio::test]
async fn a_changed_env_file_or_a_dead_spare_means_a_fresh_shell() {
    let execd = Execd::start().await;
    let spare = the_spare(&execd).await;
    std::fs::write(execd.dir.path().join("envs"), "FROM_FILE=changed\n").expect("env file");
    let events = execd
        .run(json!({"command": "echo $$ $FROM_FILE", "envs": {"IFS": ":"}}))
        .await;
    assert!(!text_of(&events, "stdout").contains(&spare.to_string()));
    assert!(
        wait_gone(spare, Duration::from_secs(3)).await,
        "a stale spare is dropped"
    );

    // The env file's change alone, in a plain variable, is exported into the spare.
    let spare = the_spare(&execd).await;
    std::fs::write(execd.dir.path().join("envs"), "FROM_FILE=again\nNEW=1\n").expect("env file");
    let events = execd
        .run(json!({"command": "echo $$ $FROM_FILE $NEW"}))
        .await;
    assert_eq!(text_of(&events, "stdout"), format!("{spare} again 1\n"));

    let spare = the_spare(&execd).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(spare),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    assert!(wait_gone(spare, Duration::from_secs(3)).await);
    let events = execd.run(json!({"command": "echo hi"})).await;
    assert_eq!(text_of(&events, "stdout"), "hi\n");
    assert_eq!(
        kinds(&events).last().map(String::as_str),
        Some("execution_complete")
    );
}

#[tokio::test]
async fn a_command_on_the_spare_times_out_with_its_whole_group() {
    let execd = Execd::start().await;
    let spare = the_spare(&execd).await;
    let child = execd.dir.path().join("child");
    let cmd = format!("sleep 60 & echo $! > {}; wait", child.display());
    let events = execd.run(json!({"command": cmd, "timeout": 500})).await;
    assert!(!pid_alive(spare), "the spare ran it");
    let grandchild = read_pid(&child).await;
    assert!(
        wait_gone(grandchild, Duration::from_secs(3)).await,
        "group member survived"
    );
    assert_eq!(kinds(&events).last().map(String::as_str), Some("error"));
}

#[tokio::test]
async fn the_sandbox_environment_can_turn_it_off() {
    let execd = Execd::start_with_env(&[("WARREN_SPARE_SHELL", "0")]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(spares(&execd), Vec::<i32>::new());
    let events = execd
        .run(json!({"command": "echo $WARREN_SPARE_SHELL"}))
        .await;
    assert_eq!(text_of(&events, "stdout"), "0\n");
}

#[tokio::test]
async fn execd_stopping_takes_its_spare() {
    let mut execd = Execd::start().await;
    let spare = the_spare(&execd).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(execd.pid()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("kill");
    let _ = execd.child.wait();
    assert!(
        wait_gone(spare, Duration::from_secs(3)).await,
        "spare outlived execd"
    );
}
