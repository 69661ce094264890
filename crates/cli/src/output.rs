//! How verbs print what they got: a table for people (the default), JSON or YAML for programs.

use serde::Serialize;

#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    #[default]
    Table,
    Json,
    Yaml,
}

#[derive(clap::Args, Debug, Clone, Default)]
pub struct OutputArgs {
    /// Output format [default: table, or `output.format` of the CLI config]
    #[arg(short = 'o', long, value_enum, global = true)]
    pub output: Option<Format>,
}

/// Rows under headers, columns padded to their widest cell.
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&'static str]) -> Self {
        Self {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Two columns, KEY and VALUE, for one object.
    pub fn pairs(pairs: Vec<(&'static str, String)>) -> Self {
        let mut t = Self::new(&[]);
        for (k, v) in pairs {
            t.row(vec![k.to_string(), v]);
        }
        t
    }

    pub fn render(&self) -> String {
        let cols = self
            .headers
            .len()
            .max(self.rows.iter().map(Vec::len).max().unwrap_or(0));
        let mut width = vec![0usize; cols];
        let header: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        for row in std::iter::once(&header).chain(self.rows.iter()) {
            for (i, c) in row.iter().enumerate() {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let line = |row: &[String]| {
            let cells: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    if i + 1 == row.len() {
                        c.clone()
                    } else {
                        format!("{c:<w$}", w = width[i])
                    }
                })
                .collect();
            cells.join("  ").trim_end().to_string() + "\n"
        };
        let mut out = String::new();
        if !self.headers.is_empty() {
            out += &line(&header);
        }
        for r in &self.rows {
            out += &line(r);
        }
        out
    }
}

/// Prints `value` in `format`; `table` builds the human form.
pub fn emit<T: Serialize>(
    format: Format,
    value: &T,
    table: impl FnOnce(&T) -> Table,
) -> anyhow::Result<()> {
    match format {
        Format::Table => print!("{}", table(value).render()),
        Format::Json => println!("{}", serde_json::to_string_pretty(value)?),
        Format::Yaml => print!("{}", serde_yaml::to_string(value)?),
    }
    Ok(())
}

/// `-` for an absent value.
pub fn or_dash(v: Option<&str>) -> String {
    v.filter(|s| !s.is_empty()).unwrap_or("-").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_and_last_column_is_not_padded() {
        let mut t = Table::new(&["ID", "STATE", "IMAGE"]);
        t.row(vec!["a".into(), "Running".into(), "host".into()]);
        t.row(vec!["bbbbbb".into(), "Paused".into(), "python:3.12".into()]);
        assert_eq!(
            t.render(),
            "ID      STATE    IMAGE\na       Running  host\nbbbbbb  Paused   python:3.12\n"
        );
    }
}
