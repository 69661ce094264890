//! The desktop tools of `warren mcp`, shaped like the computer-use tools agents already call
//! (Anthropic's `computer` tool: `coordinate: [x, y]`, `text` for keys and typing,
//! `scroll_direction` with `scroll_amount`, `start_coordinate` for a drag), one tool per action so
//! each has a small schema. A screenshot is an MCP image, which a model sees as it is.

use base64::Engine;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock};
use rmcp::{tool, tool_router};
use schemars::JsonSchema;
use serde::Deserialize;
use warren_api::desktop::{KeyboardAction, Launch, MouseAction, MouseButton, Point};
use warren_sdk::Region;

use super::{ok_json, tool_error, ToolResult, WarrenMcp};

#[derive(Deserialize, JsonSchema)]
pub struct ScreenshotArgs {
    pub sandbox_id: String,
    /// Only this part of the screen: `[x, y, width, height]`.
    #[serde(default)]
    pub region: Option<[u32; 4]>,
    /// Scale the image down (above 0, at most 1) to save tokens.
    #[serde(default)]
    pub scale: Option<f64>,
}

#[derive(Deserialize, JsonSchema, Clone, Copy, Default)]
#[serde(rename_all = "lowercase")]
pub enum Button {
    #[default]
    Left,
    Middle,
    Right,
}

#[derive(Deserialize, JsonSchema)]
pub struct ClickArgs {
    pub sandbox_id: String,
    /// Where to click, `[x, y]` in screen pixels; where the pointer is when absent.
    #[serde(default)]
    pub coordinate: Option<[i32; 2]>,
    #[serde(default)]
    pub button: Button,
    /// 1 (default), 2 for a double click, 3 for a triple click.
    #[serde(default)]
    pub count: Option<u8>,
}

#[derive(Deserialize, JsonSchema)]
pub struct MoveArgs {
    pub sandbox_id: String,
    /// `[x, y]` in screen pixels.
    pub coordinate: [i32; 2],
}

#[derive(Deserialize, JsonSchema)]
pub struct DragArgs {
    pub sandbox_id: String,
    /// Where the left button goes down, `[x, y]`.
    pub start_coordinate: [i32; 2],
    /// Where it comes up, `[x, y]`.
    pub coordinate: [i32; 2],
}

#[derive(Deserialize, JsonSchema, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Up,
    Down,
    Left,
    Right,
}

#[derive(Deserialize, JsonSchema)]
pub struct ScrollArgs {
    pub sandbox_id: String,
    /// Where to scroll, `[x, y]`; where the pointer is when absent.
    #[serde(default)]
    pub coordinate: Option<[i32; 2]>,
    pub scroll_direction: Direction,
    /// Clicks of the wheel (default 3).
    #[serde(default)]
    pub scroll_amount: Option<u16>,
}

#[derive(Deserialize, JsonSchema)]
pub struct TextArgs {
    pub sandbox_id: String,
    pub text: String,
}

#[derive(Deserialize, JsonSchema)]
pub struct SandboxArgs {
    pub sandbox_id: String,
}

#[derive(Deserialize, JsonSchema)]
pub struct LaunchArgs {
    pub sandbox_id: String,
    /// A program to start on the desktop (run by the shell)…
    #[serde(default)]
    pub command: Option<String>,
    /// …or a URL to open in the image's browser.
    #[serde(default)]
    pub url: Option<String>,
}

fn point(c: [i32; 2]) -> Point {
    Point { x: c[0], y: c[1] }
}

#[tool_router(router = desktop_router, vis = "pub(super)")]
impl WarrenMcp {
    #[tool(
        description = "A screenshot of the sandbox's desktop (made with extensions.desktop) as a PNG image: the whole screen, or a region, optionally scaled down."
    )]
    async fn desktop_screenshot(&self, Parameters(a): Parameters<ScreenshotArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let region = match a.region {
            None => Region {
                scale: a.scale,
                ..Region::default()
            },
            Some([x, y, width, height]) => Region {
                x: Some(x as i32),
                y: Some(y as i32),
                width: Some(width),
                height: Some(height),
                scale: a.scale,
            },
        };
        let png = try_tool!("taking the screenshot", sb.screenshot(&region).await);
        let data = base64::engine::general_purpose::STANDARD.encode(png);
        Ok(CallToolResult::success(vec![ContentBlock::image(
            data,
            "image/png",
        )]))
    }

    #[tool(
        description = "Click at a point of the desktop (left, middle or right; single, double or triple). Returns where the pointer is."
    )]
    async fn desktop_click(&self, Parameters(a): Parameters<ClickArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let button = match a.button {
            Button::Left => MouseButton::Left,
            Button::Middle => MouseButton::Middle,
            Button::Right => MouseButton::Right,
        };
        let action = MouseAction::Click {
            x: a.coordinate.map(|c| c[0]),
            y: a.coordinate.map(|c| c[1]),
            button,
            count: a.count.unwrap_or(1),
        };
        ok_json(try_tool!("clicking", sb.mouse(&action).await))
    }

    #[tool(description = "Move the pointer to a point of the desktop.")]
    async fn desktop_move(&self, Parameters(a): Parameters<MoveArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let [x, y] = a.coordinate;
        ok_json(try_tool!(
            "moving the pointer",
            sb.mouse(&MouseAction::Move { x, y }).await
        ))
    }

    #[tool(description = "Drag with the left button held from start_coordinate to coordinate.")]
    async fn desktop_drag(&self, Parameters(a): Parameters<DragArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let action = MouseAction::Drag {
            from: point(a.start_coordinate),
            to: point(a.coordinate),
            button: MouseButton::Left,
        };
        ok_json(try_tool!("dragging", sb.mouse(&action).await))
    }

    #[tool(
        description = "Scroll the wheel up, down, left or right, at a point or where the pointer is."
    )]
    async fn desktop_scroll(&self, Parameters(a): Parameters<ScrollArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let n = i32::from(a.scroll_amount.unwrap_or(3));
        let (dx, dy) = match a.scroll_direction {
            Direction::Up => (0, -n),
            Direction::Down => (0, n),
            Direction::Left => (-n, 0),
            Direction::Right => (n, 0),
        };
        let action = MouseAction::Scroll {
            x: a.coordinate.map(|c| c[0]),
            y: a.coordinate.map(|c| c[1]),
            dx,
            dy,
        };
        ok_json(try_tool!("scrolling", sb.mouse(&action).await))
    }

    #[tool(description = "Type text (any Unicode) into the focused window.")]
    async fn desktop_type(&self, Parameters(a): Parameters<TextArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        try_tool!(
            "typing",
            sb.keyboard(&KeyboardAction::Type { text: a.text }).await
        );
        ok_json(serde_json::json!({}))
    }

    #[tool(
        description = "Press a key or chord, xdotool style: `Return`, `ctrl+s`, `alt+F4`; several separated by spaces are pressed in turn (`ctrl+a Delete`)."
    )]
    async fn desktop_key(&self, Parameters(a): Parameters<TextArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let keys: Vec<String> = a.text.split_whitespace().map(str::to_owned).collect();
        if keys.is_empty() {
            return tool_error("pressing keys", "no key given (say `Return` or `ctrl+c`)");
        }
        try_tool!(
            "pressing keys",
            sb.keyboard(&KeyboardAction::Key { keys }).await
        );
        ok_json(serde_json::json!({}))
    }

    #[tool(description = "Where the pointer is, as {x, y}.")]
    async fn desktop_cursor_position(&self, Parameters(a): Parameters<SandboxArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        ok_json(try_tool!("reading the cursor", sb.cursor().await))
    }

    #[tool(description = "The desktop's top-level windows: id, title, geometry, which has focus.")]
    async fn desktop_windows(&self, Parameters(a): Parameters<SandboxArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let windows = try_tool!("listing windows", sb.windows().await);
        ok_json(serde_json::json!({ "windows": windows }))
    }

    #[tool(description = "Start a program on the desktop, or open a URL in the image's browser.")]
    async fn desktop_launch(&self, Parameters(a): Parameters<LaunchArgs>) -> ToolResult {
        let sb = try_tool!("connecting", self.sandbox(&a.sandbox_id).await);
        let launch = Launch {
            command: a.command,
            url: a.url,
        };
        ok_json(try_tool!("launching", sb.launch(&launch).await))
    }
}
