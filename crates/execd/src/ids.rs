//! User and group names, read straight from `/etc/passwd` and `/etc/group`: execd is a static glibc binary
//! and static glibc cannot load NSS modules, so `getpwuid` is not an option.

use std::collections::HashMap;

#[derive(Debug, Default, Clone)]
pub struct Ids {
    users: HashMap<u32, String>,
    user_ids: HashMap<String, (u32, u32)>,
    groups: HashMap<u32, String>,
    group_ids: HashMap<String, u32>,
}

impl Ids {
    /// Loads the system databases; missing files give empty maps (names fall back to numbers).
    pub fn load() -> Self {
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        let group = std::fs::read_to_string("/etc/group").unwrap_or_default();
        Self::parse(&passwd, &group)
    }

    pub fn parse(passwd: &str, group: &str) -> Self {
        let mut ids = Self::default();
        for line in passwd.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if let (Some(name), Some(uid), Some(gid)) = (f.first(), f.get(2), f.get(3)) {
                if let (Ok(uid), Ok(gid)) = (uid.parse::<u32>(), gid.parse::<u32>()) {
                    ids.users.entry(uid).or_insert_with(|| name.to_string());
                    ids.user_ids.entry(name.to_string()).or_insert((uid, gid));
                }
            }
        }
        for line in group.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if let (Some(name), Some(gid)) = (f.first(), f.get(2)) {
                if let Ok(gid) = gid.parse::<u32>() {
                    ids.groups.entry(gid).or_insert_with(|| name.to_string());
                    ids.group_ids.entry(name.to_string()).or_insert(gid);
                }
            }
        }
        ids
    }

    pub fn user_name(&self, uid: u32) -> String {
        self.users
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }

    pub fn group_name(&self, gid: u32) -> String {
        self.groups
            .get(&gid)
            .cloned()
            .unwrap_or_else(|| gid.to_string())
    }

    pub fn primary_gid(&self, uid: u32) -> Option<u32> {
        self.user_ids
            .values()
            .find(|(u, _)| *u == uid)
            .map(|(_, g)| *g)
    }

    /// A user given by name or number.
    pub fn resolve_user(&self, name: &str) -> Option<u32> {
        self.user_ids
            .get(name)
            .map(|(u, _)| *u)
            .or_else(|| name.parse().ok())
    }

    /// A group given by name or number.
    pub fn resolve_group(&self, name: &str) -> Option<u32> {
        self.group_ids
            .get(name)
            .copied()
            .or_else(|| name.parse().ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_falls_back_to_numbers() {
        let ids = Ids::parse(
            "root:x:0:0:root:/root:/bin/sh\nbob:x:1000:100::/home/bob:/bin/sh\n",
            "users:x:100:\n",
        );
        assert_eq!(ids.user_name(1000), "bob");
        assert_eq!(ids.user_name(42), "42");
        assert_eq!(ids.group_name(100), "users");
        assert_eq!(ids.group_name(7), "7");
        assert_eq!(ids.primary_gid(1000), Some(100));
        assert_eq!(ids.resolve_user("bob"), Some(1000));
        assert_eq!(ids.resolve_user("55"), Some(55));
        assert_eq!(ids.resolve_group("users"), Some(100));
        assert_eq!(ids.resolve_group("nope"), None);
    }
}
