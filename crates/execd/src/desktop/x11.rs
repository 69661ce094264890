//! The computer-use actions over the X protocol itself (x11rb): screenshots through MIT-SHM
//! (`super::shm`, else `GetImage`),
//! input through the XTEST extension (as a real keyboard and mouse, so every program sees it),
//! windows through the EWMH properties the window manager keeps. One connection, blocking: its
//! callers run it off the async runtime and one at a time.
//!
//! Why one file: one `X` connection and every action over it. The keyboard's scratch-key scheme
//! (about 180 lines) needs the connection's round trips and the keycodes it lends, kept in `X`.

use std::time::Duration;

use warren_api::desktop::{MouseButton, Point, Window};
use x11rb::connection::{Connection, RequestConnection};
use x11rb::protocol::xproto::{
    self, AtomEnum, ClientMessageEvent, ConfigureWindowAux, ConnectionExt as _, EventMask,
    ImageFormat, InputFocus, StackMode,
};
use x11rb::protocol::xtest::ConnectionExt as _;
use x11rb::rust_connection::RustConnection;

use super::keys;

/// Why an action failed: the caller's (a 400) or the display's.
#[derive(Debug)]
pub enum Failure {
    Bad(String),
    Display(String),
}

fn display<E: std::fmt::Display>(e: E) -> Failure {
    Failure::Display(format!("the X display: {e}"))
}

type R<T> = Result<T, Failure>;

/// A keycode to press for a keysym.
#[derive(Clone, Copy)]
struct Key {
    code: u8,
    /// Shift gives the keysym (its second level).
    shifted: bool,
}

/// The keyboard map as [`X::keymap`] reads it.
struct Keymap {
    min: u8,
    /// Keysyms per keycode.
    per: usize,
    syms: Vec<u32>,
    keys: std::collections::HashMap<u32, Key>,
}

/// How many keycodes characters without a key of their own take turns on.
const SCRATCH_KEYS: usize = 16;

pub struct X {
    conn: RustConnection,
    root: xproto::Window,
    pub width: u16,
    pub height: u16,
    /// Shared memory the size of the screen, for screenshots, when the server takes it.
    shm: Option<super::shm::Segment>,
    /// Keycodes no key had when first needed, lent in turn to characters that have none
    /// (see [`X::keycode`]), and which of them is next.
    scratch: std::cell::RefCell<Vec<u8>>,
    next_scratch: std::cell::Cell<usize>,
}

/// The X button numbers: 1 left, 2 middle, 3 right; 4/5 wheel up/down, 6/7 left/right.
fn button(b: MouseButton) -> u8 {
    match b {
        MouseButton::Left => 1,
        MouseButton::Middle => 2,
        MouseButton::Right => 3,
    }
}

impl X {
    pub fn connect(name: &str) -> R<X> {
        let (conn, screen) = x11rb::connect(Some(name)).map_err(display)?;
        let s = &conn.setup().roots[screen];
        let (root, width, height) = (s.root, s.width_in_pixels, s.height_in_pixels);
        conn.extension_information(x11rb::protocol::xtest::X11_EXTENSION_NAME)
            .map_err(display)?
            .ok_or_else(|| Failure::Display("the X server has no XTEST extension".into()))?;
        let shm = super::shm::Segment::attach(&conn, usize::from(width) * usize::from(height) * 4);
        Ok(X {
            conn,
            root,
            width,
            height,
            shm,
            scratch: Default::default(),
            next_scratch: Default::default(),
        })
    }

    /// Whether screenshots come through shared memory (MIT-SHM).
    pub fn shared_memory(&self) -> bool {
        self.shm.is_some()
    }

    /// A round trip: everything sent before has been handled.
    fn sync(&self) -> R<()> {
        self.conn
            .get_input_focus()
            .map_err(display)?
            .reply()
            .map_err(display)?;
        Ok(())
    }

    fn on_screen(&self, x: i32, y: i32) -> R<(i16, i16)> {
        if x < 0 || y < 0 || x >= i32::from(self.width) || y >= i32::from(self.height) {
            return Err(Failure::Bad(format!(
                "({x}, {y}) is off the screen ({}x{})",
                self.width, self.height
            )));
        }
        Ok((x as i16, y as i16))
    }

    /// The screen, or a region of it, as RGB rows.
    pub fn capture(&self, x: i32, y: i32, w: u32, h: u32) -> R<Vec<u8>> {
        let (sx, sy) = self.on_screen(x, y)?;
        // (In i64: a width near u32::MAX must not wrap into range.)
        if w == 0
            || h == 0
            || i64::from(x) + i64::from(w) > i64::from(self.width)
            || i64::from(y) + i64::from(h) > i64::from(self.height)
        {
            return Err(Failure::Bad(format!(
                "the region {w}x{h} at ({x}, {y}) is not within the screen ({}x{})",
                self.width, self.height
            )));
        }
        let bgrx = |data: &[u8]| -> Vec<u8> {
            // Depth 24 in 32 bits per pixel, little-endian: B, G, R, unused.
            data.chunks_exact(4)
                .flat_map(|p| [p[2], p[1], p[0]])
                .collect()
        };
        // Within the screen, whose sides are u16: these fit.
        let (w16, h16) = (w as u16, h as u16);
        if let Some(pixels) = self
            .shm
            .as_ref()
            .and_then(|s| s.get_image(&self.conn, self.root, (sx, sy, w16, h16)))
        {
            return Ok(bgrx(&pixels));
        }
        let img = self
            .conn
            .get_image(
                ImageFormat::Z_PIXMAP,
                self.root,
                sx,
                sy,
                w as u16,
                h as u16,
                !0,
            )
            .map_err(display)?
            .reply()
            .map_err(display)?;
        // Depth 24 in 32 bits per pixel, little-endian: B, G, R, unused.
        if img.data.len() != (w * h * 4) as usize {
            return Err(Failure::Display(format!(
                "the X server answered an image of depth {} this API does not read",
                img.depth
            )));
        }
        Ok(bgrx(&img.data))
    }

    pub fn cursor(&self) -> R<Point> {
        let p = self
            .conn
            .query_pointer(self.root)
            .map_err(display)?
            .reply()
            .map_err(display)?;
        Ok(Point {
            x: i32::from(p.root_x),
            y: i32::from(p.root_y),
        })
    }

    fn fake(&self, kind: u8, detail: u8, x: i16, y: i16) -> R<()> {
        self.conn
            .xtest_fake_input(kind, detail, x11rb::CURRENT_TIME, self.root, x, y, 0)
            .map_err(display)?;
        Ok(())
    }

    pub fn move_to(&self, x: i32, y: i32) -> R<()> {
        let (x, y) = self.on_screen(x, y)?;
        self.fake(xproto::MOTION_NOTIFY_EVENT, 0, x, y)?;
        self.sync()
    }

    pub fn click(&self, at: Option<(i32, i32)>, b: MouseButton, count: u8) -> R<()> {
        if !(1..=3).contains(&count) {
            return Err(Failure::Bad(format!(
                "count {count}: a click is 1, 2 or 3 presses"
            )));
        }
        if let Some((x, y)) = at {
            self.move_to(x, y)?;
        }
        for _ in 0..count {
            self.fake(xproto::BUTTON_PRESS_EVENT, button(b), 0, 0)?;
            self.fake(xproto::BUTTON_RELEASE_EVENT, button(b), 0, 0)?;
        }
        self.sync()
    }

    pub fn drag(&self, from: Point, to: Point, b: MouseButton) -> R<()> {
        self.on_screen(to.x, to.y)?;
        self.move_to(from.x, from.y)?;
        self.fake(xproto::BUTTON_PRESS_EVENT, button(b), 0, 0)?;
        // In steps, as a hand moves: programs that follow motion see the way, not a jump.
        let steps = 10;
        for i in 1..=steps {
            let x = from.x + (to.x - from.x) * i / steps;
            let y = from.y + (to.y - from.y) * i / steps;
            self.fake(xproto::MOTION_NOTIFY_EVENT, 0, x as i16, y as i16)?;
            self.sync()?;
            std::thread::sleep(Duration::from_millis(5));
        }
        self.fake(xproto::BUTTON_RELEASE_EVENT, button(b), 0, 0)?;
        self.sync()
    }

    pub fn scroll(&self, at: Option<(i32, i32)>, dx: i32, dy: i32) -> R<()> {
        if dx.unsigned_abs() > 100 || dy.unsigned_abs() > 100 {
            return Err(Failure::Bad("at most 100 wheel clicks at once".into()));
        }
        if let Some((x, y)) = at {
            self.move_to(x, y)?;
        }
        for (amount, less, more) in [(dy, 4u8, 5u8), (dx, 6, 7)] {
            let b = if amount < 0 { less } else { more };
            for _ in 0..amount.unsigned_abs() {
                self.fake(xproto::BUTTON_PRESS_EVENT, b, 0, 0)?;
                self.fake(xproto::BUTTON_RELEASE_EVENT, b, 0, 0)?;
            }
        }
        self.sync()
    }

    /// The keyboard map: the keysyms of each keycode.
    fn mapping(&self) -> R<(u8, u8, Vec<u32>)> {
        let setup = self.conn.setup();
        let (min, max) = (setup.min_keycode, setup.max_keycode);
        let m = self
            .conn
            .get_keyboard_mapping(min, max - min + 1)
            .map_err(display)?
            .reply()
            .map_err(display)?;
        Ok((min, m.keysyms_per_keycode, m.keysyms))
    }

    /// The keycode that gives `sym`, and whether Shift is needed for it; or, for a character no
    /// key has, a scratch keycode mapped to it (as xdotool does). The scratch keycodes take
    /// turns: one is mapped again only [`SCRATCH_KEYS`] characters later, long after the
    /// programs have read the key it gave (a key mapped back at once can be read with the new
    /// map, and its character lost), and they never run out.
    fn keycode(&self, sym: u32) -> R<Key> {
        let map = self.keymap()?;
        if let Some(key) = map.keys.get(&sym) {
            return Ok(*key);
        }
        let scratch = self.scratch_keys(&map)?;
        let turn = self.next_scratch.get();
        self.next_scratch.set(turn.wrapping_add(1));
        let code = scratch[turn % scratch.len()];
        self.lend(code, 1, map.per, &[sym])?;
        Ok(Key {
            code,
            shifted: false,
        })
    }

    /// The keyboard map, read once: each keysym's key (the first keycode that has it on its
    /// first two levels, unshifted where it can be).
    fn keymap(&self) -> R<Keymap> {
        let (min, per, syms) = self.mapping()?;
        let per = usize::from(per.max(1));
        let mut keys = std::collections::HashMap::new();
        for (i, row) in syms.chunks(per).enumerate() {
            for (level, sym) in row.iter().take(2).enumerate() {
                if *sym != 0 {
                    keys.entry(*sym).or_insert(Key {
                        code: min + i as u8,
                        shifted: level == 1,
                    });
                }
            }
        }
        Ok(Keymap {
            min,
            per,
            syms,
            keys,
        })
    }

    /// Maps `count` keycodes from `first` to `syms` in turn (the rest to none), in one change of
    /// the map, and gives the programs time to read it.
    fn lend(&self, first: u8, count: usize, per: usize, syms: &[u32]) -> R<()> {
        let mut rows = vec![0u32; count * per];
        for (k, s) in syms.iter().enumerate() {
            rows[k * per] = *s;
            if per > 1 {
                rows[k * per + 1] = *s;
            }
        }
        self.conn
            .change_keyboard_mapping(count as u8, first, per as u8, &rows)
            .map_err(display)?;
        self.sync()?;
        // Clients read the new map when its MappingNotify reaches them.
        std::thread::sleep(Duration::from_millis(20));
        Ok(())
    }

    /// The scratch keycodes: the last run of keycodes no key had when first asked (up to
    /// [`SCRATCH_KEYS`] in a row, so that one request maps them all at once).
    fn scratch_keys(&self, map: &Keymap) -> R<Vec<u8>> {
        let mut scratch = self.scratch.borrow_mut();
        if scratch.is_empty() {
            let empty: Vec<bool> = map
                .syms
                .chunks(map.per)
                .map(|row| row.iter().all(|s| *s == 0))
                .collect();
            if let Some(last) = empty.iter().rposition(|e| *e) {
                let first = (0..=last)
                    .rev()
                    .take_while(|i| empty[*i])
                    .last()
                    .unwrap_or(last)
                    .max(last + 1 - SCRATCH_KEYS.min(last + 1));
                *scratch = (first..=last).map(|i| map.min + i as u8).collect();
            }
        }
        if scratch.is_empty() {
            return Err(Failure::Display(
                "the keyboard has no spare keycode to type this character with".into(),
            ));
        }
        Ok(scratch.clone())
    }

    fn shift(&self) -> R<u8> {
        Ok(self.keycode(0xffe1)?.code)
    }

    /// Presses the chord's keys in order (with Shift where a key needs it), then releases them
    /// in reverse.
    pub fn chord(&self, text: &str) -> R<()> {
        let syms = keys::chord(text).map_err(Failure::Bad)?;
        let mut down = Vec::new();
        for sym in syms {
            let key = self.keycode(sym)?;
            if key.shifted {
                let s = self.shift()?;
                self.fake(xproto::KEY_PRESS_EVENT, s, 0, 0)?;
                down.push(s);
            }
            self.fake(xproto::KEY_PRESS_EVENT, key.code, 0, 0)?;
            down.push(key.code);
        }
        for code in down.iter().rev() {
            self.fake(xproto::KEY_RELEASE_EVENT, *code, 0, 0)?;
        }
        self.sync()
    }

    pub fn type_text(&self, text: &str) -> R<()> {
        if text.chars().count() > 10_000 {
            return Err(Failure::Bad("at most 10,000 characters at once".into()));
        }
        let shift = self.shift()?;
        let mut map = self.keymap()?;
        let wanted: Vec<u32> = text.chars().map(keys::char_keysym).collect();
        for (at, sym) in wanted.iter().enumerate() {
            let key = match map.keys.get(sym) {
                Some(k) => *k,
                None => {
                    // The scratch keys take the next characters no key has, all in one change
                    // of the map (each change makes every program and the window manager read
                    // the map again: one per character slowed a whole desktop for seconds).
                    let scratch = self.scratch_keys(&map)?;
                    let mut next: Vec<u32> = Vec::new();
                    for s in &wanted[at..] {
                        let has_key = map.keys.get(s).is_some_and(|k| !scratch.contains(&k.code));
                        if !has_key && !next.contains(s) {
                            next.push(*s);
                            if next.len() == scratch.len() {
                                break;
                            }
                        }
                    }
                    // What was typed with the old map is read with it first.
                    self.sync()?;
                    std::thread::sleep(Duration::from_millis(50));
                    self.lend(scratch[0], scratch.len(), map.per, &next)?;
                    map.keys.retain(|_, k| !scratch.contains(&k.code));
                    for (k, s) in next.iter().enumerate() {
                        map.keys.insert(
                            *s,
                            Key {
                                code: scratch[k],
                                shifted: false,
                            },
                        );
                    }
                    *map.keys.get(sym).ok_or_else(|| {
                        Failure::Display("a character could not be given a key".into())
                    })?
                }
            };
            if key.shifted {
                self.fake(xproto::KEY_PRESS_EVENT, shift, 0, 0)?;
            }
            self.fake(xproto::KEY_PRESS_EVENT, key.code, 0, 0)?;
            self.fake(xproto::KEY_RELEASE_EVENT, key.code, 0, 0)?;
            if key.shifted {
                self.fake(xproto::KEY_RELEASE_EVENT, shift, 0, 0)?;
            }
            self.sync()?;
        }
        Ok(())
    }

    fn atom(&self, name: &str) -> R<u32> {
        Ok(self
            .conn
            .intern_atom(false, name.as_bytes())
            .map_err(display)?
            .reply()
            .map_err(display)?
            .atom)
    }

    fn windows_property(&self, w: u32, name: &str) -> R<Vec<u32>> {
        let atom = self.atom(name)?;
        let p = self
            .conn
            .get_property(false, w, atom, AtomEnum::ANY, 0, 4096)
            .map_err(display)?
            .reply()
            .map_err(display)?;
        Ok(p.value32().map(|v| v.collect()).unwrap_or_default())
    }

    fn title(&self, w: u32) -> R<String> {
        let utf8 = self.atom("UTF8_STRING")?;
        for (prop, kind) in [
            (self.atom("_NET_WM_NAME")?, utf8),
            (AtomEnum::WM_NAME.into(), AtomEnum::STRING.into()),
        ] {
            let p = self
                .conn
                .get_property(false, w, prop, kind, 0, 1024)
                .map_err(display)?
                .reply()
                .map_err(display)?;
            if !p.value.is_empty() {
                return Ok(String::from_utf8_lossy(&p.value).into_owned());
            }
        }
        Ok(String::new())
    }

    /// The top-level windows the window manager lists (`_NET_CLIENT_LIST`), else the root's
    /// mapped children with a title.
    pub fn windows(&self) -> R<Vec<Window>> {
        let mut ids = self.windows_property(self.root, "_NET_CLIENT_LIST")?;
        if ids.is_empty() {
            let tree = self
                .conn
                .query_tree(self.root)
                .map_err(display)?
                .reply()
                .map_err(display)?;
            ids = tree.children;
        }
        let active = self
            .windows_property(self.root, "_NET_ACTIVE_WINDOW")?
            .first()
            .copied()
            .unwrap_or(0);
        let mut out = Vec::new();
        for id in ids {
            let Ok(attrs) = self
                .conn
                .get_window_attributes(id)
                .map_err(display)?
                .reply()
            else {
                continue; // gone meanwhile
            };
            // Unmapped windows, and a window manager's own (override-redirect: its check window,
            // menus) are not the desktop's windows.
            if attrs.map_state != xproto::MapState::VIEWABLE || attrs.override_redirect {
                continue;
            }
            let title = self.title(id)?;
            let (Ok(geo), Ok(at)) = (
                self.conn.get_geometry(id).map_err(display)?.reply(),
                self.conn
                    .translate_coordinates(id, self.root, 0, 0)
                    .map_err(display)?
                    .reply(),
            ) else {
                continue;
            };
            if title.is_empty() && active != id {
                continue;
            }
            out.push(Window {
                id,
                title,
                x: i32::from(at.dst_x),
                y: i32::from(at.dst_y),
                width: u32::from(geo.width),
                height: u32::from(geo.height),
                focused: active == id,
            });
        }
        Ok(out)
    }

    /// Whether an EWMH window manager manages the screen (its `_NET_SUPPORTING_WM_CHECK` set).
    pub fn wm_ready(&self) -> R<bool> {
        Ok(!self
            .windows_property(self.root, "_NET_SUPPORTING_WM_CHECK")?
            .is_empty())
    }

    /// Raises and focuses window `id` (through the window manager when there is one).
    pub fn focus(&self, id: u32) -> R<()> {
        if !self.windows()?.iter().any(|w| w.id == id) {
            return Err(Failure::Bad(format!("no window {id} on the desktop")));
        }
        let active = self.atom("_NET_ACTIVE_WINDOW")?;
        let event = ClientMessageEvent::new(32, id, active, [2, x11rb::CURRENT_TIME, 0, 0, 0]);
        self.conn
            .send_event(
                false,
                self.root,
                EventMask::SUBSTRUCTURE_REDIRECT | EventMask::SUBSTRUCTURE_NOTIFY,
                event,
            )
            .map_err(display)?;
        self.conn
            .configure_window(id, &ConfigureWindowAux::new().stack_mode(StackMode::ABOVE))
            .map_err(display)?;
        self.conn
            .set_input_focus(InputFocus::PARENT, id, x11rb::CURRENT_TIME)
            .map_err(display)?;
        self.sync()
    }

    /// Waits until two looks at the screen `still` apart are the same, or `timeout` passes.
    /// A fingerprint of the whole screen, to tell whether it changed.
    pub fn look(&self) -> R<u64> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.capture(0, 0, u32::from(self.width), u32::from(self.height))?
            .hash(&mut h);
        Ok(h.finish())
    }
}

/// RGB rows of `w`x`h` as PNG, scaled by `scale` (0 < scale ≤ 1, box-averaged).
pub fn png(rgb: &[u8], w: u32, h: u32, scale: f64) -> Result<Vec<u8>, String> {
    let (ow, oh) = (
        ((f64::from(w) * scale).round() as u32).max(1),
        ((f64::from(h) * scale).round() as u32).max(1),
    );
    let scaled;
    let data = if (ow, oh) == (w, h) {
        rgb
    } else {
        let mut out = Vec::with_capacity((ow * oh * 3) as usize);
        for oy in 0..oh {
            let (y0, y1) = (oy * h / oh, ((oy + 1) * h / oh).max(oy * h / oh + 1));
            for ox in 0..ow {
                let (x0, x1) = (ox * w / ow, ((ox + 1) * w / ow).max(ox * w / ow + 1));
                let mut sum = [0u32; 3];
                for y in y0..y1 {
                    for x in x0..x1 {
                        let i = ((y * w + x) * 3) as usize;
                        for (c, s) in sum.iter_mut().enumerate() {
                            *s += u32::from(rgb[i + c]);
                        }
                    }
                }
                let n = (y1 - y0) * (x1 - x0);
                out.extend(sum.iter().map(|s| (s / n) as u8));
            }
        }
        scaled = out;
        &scaled
    };
    let mut bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut bytes, ow, oh);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        enc.set_compression(png::Compression::Fast);
        let mut w = enc.write_header().map_err(|e| e.to_string())?;
        w.write_image_data(data).map_err(|e| e.to_string())?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn png_scales_by_averaging() {
        // 2x2: red, green / blue, white → at half size one pixel, their mean.
        let rgb = [255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255];
        let full = super::png(&rgb, 2, 2, 1.0).expect("png");
        assert_eq!(&full[..8], b"\x89PNG\r\n\x1a\n");
        let half = super::png(&rgb, 2, 2, 0.5).expect("png");
        let dec = png::Decoder::new(std::io::Cursor::new(half));
        let mut r = dec.read_info().expect("info");
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).expect("frame");
        assert_eq!((info.width, info.height), (1, 1));
        assert_eq!(&buf[..3], &[127, 127, 127]);
    }
}
