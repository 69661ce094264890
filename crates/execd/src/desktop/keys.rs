//! Key names as agents write them (`ctrl+shift+t`, `Return`, `alt+F4`, `a`) to X keysyms.

/// The keysym of one key name, as `xdotool` and the computer-use tools name keys: X's own names
/// (`Return`, `BackSpace`, `Page_Up`, `F5`), common aliases (`enter`, `esc`, `ctrl`, `cmd`,
/// `pgup`), and single characters.
pub fn keysym(name: &str) -> Option<u32> {
    let lower = name.to_ascii_lowercase();
    let named = match lower.as_str() {
        "return" | "enter" | "kp_enter" => 0xff0d,
        "tab" => 0xff09,
        "escape" | "esc" => 0xff1b,
        "backspace" => 0xff08,
        "delete" | "del" => 0xffff,
        "insert" | "ins" => 0xff63,
        "home" => 0xff50,
        "end" => 0xff57,
        "page_up" | "pageup" | "pgup" | "prior" => 0xff55,
        "page_down" | "pagedown" | "pgdn" | "next" => 0xff56,
        "left" => 0xff51,
        "up" => 0xff52,
        "right" => 0xff53,
        "down" => 0xff54,
        "space" => 0x20,
        "shift" | "shift_l" => 0xffe1,
        "shift_r" => 0xffe2,
        "ctrl" | "control" | "control_l" | "ctrl_l" => 0xffe3,
        "control_r" | "ctrl_r" => 0xffe4,
        "alt" | "alt_l" | "option" => 0xffe9,
        "alt_r" => 0xffea,
        "super" | "super_l" | "win" | "cmd" | "command" | "meta" => 0xffeb,
        "super_r" => 0xffec,
        "caps_lock" | "capslock" => 0xffe5,
        "menu" => 0xff67,
        "print" => 0xff61,
        "pause" => 0xff13,
        "minus" => 0x2d,
        "plus" => 0x2b,
        "equal" => 0x3d,
        "comma" => 0x2c,
        "period" => 0x2e,
        "slash" => 0x2f,
        "backslash" => 0x5c,
        "semicolon" => 0x3b,
        "apostrophe" => 0x27,
        "grave" => 0x60,
        "bracketleft" => 0x5b,
        "bracketright" => 0x5d,
        _ => 0,
    };
    if named != 0 {
        return Some(named);
    }
    if let Some(n) = lower.strip_prefix('f').and_then(|n| n.parse::<u32>().ok()) {
        if (1..=24).contains(&n) {
            return Some(0xffbe + n - 1);
        }
    }
    let mut chars = name.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) => Some(char_keysym(c)),
        _ => None,
    }
}

/// The keysym that types `c`: Latin-1 characters are their own code, others `0x0100_0000 + c`.
pub fn char_keysym(c: char) -> u32 {
    match c {
        '\n' => 0xff0d,
        '\t' => 0xff09,
        c if (' '..='~').contains(&c) || ('\u{a0}'..='\u{ff}').contains(&c) => c as u32,
        c => 0x0100_0000 + c as u32,
    }
}

/// A chord (`ctrl+shift+t`) as its keysyms, modifiers first; the name that is no key, if one is
/// not. A lone `+` is the plus key.
pub fn chord(text: &str) -> Result<Vec<u32>, String> {
    if text == "+" {
        return Ok(vec![0x2b]);
    }
    let parts: Vec<&str> = text.split('+').map(str::trim).collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(format!("{text:?} is not a key chord (keys joined by +)"));
    }
    parts
        .iter()
        .map(|p| keysym(p).ok_or_else(|| format!("{p:?} is not a key name")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_chords() {
        assert_eq!(keysym("Return"), Some(0xff0d));
        assert_eq!(keysym("enter"), Some(0xff0d));
        assert_eq!(keysym("F5"), Some(0xffc2));
        assert_eq!(keysym("a"), Some(0x61));
        assert_eq!(keysym("A"), Some(0x41));
        assert_eq!(keysym("é"), Some(0xe9));
        assert_eq!(keysym("€"), Some(0x0100_20ac));
        assert_eq!(keysym("F25"), None);
        assert_eq!(keysym("hyperdrive"), None);
        assert_eq!(chord("ctrl+shift+t"), Ok(vec![0xffe3, 0xffe1, 0x74]));
        assert_eq!(chord("+"), Ok(vec![0x2b]));
        assert!(chord("ctrl+").is_err());
        assert!(matches!(chord("ctrl+warp"), Err(e) if e.contains("warp")));
    }
}
