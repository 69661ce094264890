//! Query strings with repeated keys (`?path=a&path=b`), which axum's `Query` (serde_urlencoded) cannot
//! collect into a list.

use percent_encoding::percent_decode_str;

use crate::error::{ApiError, ApiResult};

pub struct Params(Vec<(String, String)>);

impl Params {
    pub fn parse(raw: Option<&str>) -> Self {
        let pairs = raw
            .unwrap_or("")
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|pair| {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                (decode(k), decode(v))
            })
            .collect();
        Self(pairs)
    }

    pub fn all(&self, key: &str) -> Vec<String> {
        self.0
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .collect()
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// A non-empty value, or 400 `MISSING_QUERY`.
    pub fn require(&self, key: &str) -> ApiResult<&str> {
        self.get(key)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| ApiError::missing_query(key))
    }

    /// All non-empty values, at least one, or 400 `MISSING_QUERY`.
    pub fn require_all(&self, key: &str) -> ApiResult<Vec<String>> {
        let all: Vec<String> = self
            .all(key)
            .into_iter()
            .filter(|v| !v.is_empty())
            .collect();
        if all.is_empty() {
            return Err(ApiError::missing_query(key));
        }
        Ok(all)
    }

    /// An optional number; garbage is a 400 rather than silently ignored.
    pub fn number<T: std::str::FromStr>(&self, key: &str) -> ApiResult<Option<T>> {
        match self.get(key).filter(|v| !v.is_empty()) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| {
                ApiError::new(
                    axum::http::StatusCode::BAD_REQUEST,
                    crate::error::code::INVALID_REQUEST_BODY,
                    format!("query parameter '{key}' must be a number"),
                )
            }),
        }
    }

    pub fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1" | "yes"))
    }
}

fn decode(s: &str) -> String {
    percent_decode_str(&s.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_and_encoded() {
        let p = Params::parse(Some("path=%2Fa%20b&path=c+d&x=&depth=2"));
        assert_eq!(p.all("path"), vec!["/a b".to_string(), "c d".to_string()]);
        assert!(p.require("x").is_err());
        assert_eq!(p.number::<u32>("depth").ok().flatten(), Some(2));
        assert!(p.number::<u32>("path").is_err());
    }
}
