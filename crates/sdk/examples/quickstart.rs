//! Create a sandbox, run a command, move a file in and out, run code if the image has a kernel, and
//! delete it. Point it at a server with OPEN_SANDBOX_DOMAIN and OPEN_SANDBOX_API_KEY (or run it on the
//! server's machine, where it finds the generated key):
//!
//! ```sh
//! cargo run -p warren-sdk --example quickstart
//! ```

use warren_sdk::{Client, CreateSandboxRequest, ImageSpec};

/// The walk-through, against any client; returns what the command printed.
pub async fn quickstart(client: &Client) -> warren_sdk::Result<String> {
    let sandbox = client
        .create(&CreateSandboxRequest {
            image: Some(ImageSpec {
                uri: "host".into(),
                auth: None,
            }),
            timeout: Some(600),
            ..Default::default()
        })
        .await?;
    println!("created {}", sandbox.id());

    let out = sandbox.run("echo hello from the sandbox; id -u").await?;
    print!("{}", out.stdout);

    sandbox.write("/tmp/notes.txt", "first line\n").await?;
    let back = sandbox.read_to_string("/tmp/notes.txt").await?;
    assert_eq!(back, "first line\n");
    let info = sandbox.stat("/tmp/notes.txt").await?;
    println!("{} is {} bytes, mode {}", info.path, info.size, info.mode);

    sandbox.kill().await?;
    Ok(out.stdout)
}

#[tokio::main]
#[allow(dead_code)] // the CLI's integration test includes this file and calls `quickstart` only
async fn main() -> anyhow::Result<()> {
    quickstart(&Client::from_env()).await?;
    Ok(())
}
