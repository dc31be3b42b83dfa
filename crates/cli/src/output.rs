//! Shared output helpers: JSON printing, tables, human sizes and ages,
//! progress bars.

use std::io::IsTerminal;
use std::time::SystemTime;

use indicatif::{ProgressBar, ProgressStyle};

pub fn print_json(value: &serde_json::Value) {
    println!("{value}");
}

/// Reads a paginated list: the first page, then (with `all`) every next
/// one. `fetch(cursor)` answers one page's items and the next cursor;
/// returns the items and the cursor of the page after them, if any.
pub async fn collect_pages<T, F, Fut>(
    all: bool,
    mut fetch: F,
) -> anyhow::Result<(Vec<T>, Option<String>)>
where
    F: FnMut(Option<String>) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(Vec<T>, Option<String>)>>,
{
    let (mut items, mut next) = fetch(None).await?;
    while all && let Some(cursor) = next.take() {
        let (mut more, after) = fetch(Some(cursor)).await?;
        items.append(&mut more);
        next = after;
    }
    Ok((items, next))
}

/// Prints an API record as the one JSON document on stdout.
pub fn print_record<T: serde::Serialize>(record: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string(record)?);
    Ok(())
}

/// Prints rows under `headers` in aligned columns, two spaces apart (the
/// last column unpadded, so long values such as messages do not pad lines).
pub fn print_table(headers: &[&str], rows: &[Vec<String>]) {
    print!("{}", render_table(headers, rows));
}

fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let width = widths.get(i).copied().unwrap_or(0);
                let pad = width.saturating_sub(cell.chars().count());
                line.push_str(cell);
                line.push_str(&" ".repeat(pad + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Prints `name value` lines with the values aligned.
pub fn print_fields(fields: &[(&str, String)]) {
    let width = fields.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
    for (name, value) in fields {
        println!("{name:<width$}  {value}");
    }
}

/// `-` for an absent value, so table columns never collapse.
pub fn or_dash(value: Option<&str>) -> String {
    match value {
        Some(value) if !value.is_empty() => value.to_owned(),
        _ => "-".to_owned(),
    }
}

/// How long ago an RFC 3339 time was, in one unit (`42s`, `5m`, `3h`,
/// `2d`); the text itself when it does not parse.
pub fn age(rfc3339: &str) -> String {
    match humantime::parse_rfc3339_weak(rfc3339) {
        Ok(at) => short_duration(SystemTime::now().duration_since(at).unwrap_or_default()),
        Err(_) => rfc3339.to_owned(),
    }
}

fn short_duration(duration: std::time::Duration) -> String {
    let seconds = duration.as_secs();
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m", seconds / 60),
        3600..86400 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86400),
    }
}

/// An RFC 3339 time with its age: `2025-01-01T10:00:00.000Z (5m ago)`.
pub fn time_and_age(rfc3339: Option<&str>) -> String {
    match rfc3339 {
        Some(at) => format!("{at} ({} ago)", age(at)),
        None => "-".to_owned(),
    }
}

pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A progress bar on stderr, drawn only on a terminal and never with `--json`.
pub struct Bar {
    bar: Option<ProgressBar>,
}

impl Bar {
    pub fn new(json: bool) -> Bar {
        let show = !json && std::io::stderr().is_terminal();
        Bar {
            bar: show.then(ProgressBar::hidden),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl store::progress::Progress for Bar {
    fn phase(&self, name: &'static str, total_bytes: Option<u64>) {
        let Some(bar) = &self.bar else { return };
        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        bar.reset();
        match total_bytes {
            Some(total) => {
                bar.set_length(total);
                bar.set_style(
                    ProgressStyle::with_template(
                        "{msg:>11} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
                );
            }
            None => {
                bar.unset_length();
                bar.set_style(
                    ProgressStyle::with_template("{msg:>11} {spinner} {bytes} {bytes_per_sec}")
                        .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                );
            }
        }
        bar.set_message(name);
    }

    fn advance(&self, bytes: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_every_column_but_the_last() {
        let rows = vec![
            vec!["sbx_1".to_owned(), "running".to_owned(), "a b".to_owned()],
            vec!["sbx_22".to_owned(), "-".to_owned(), "-".to_owned()],
        ];
        assert_eq!(
            render_table(&["ID", "STATE", "MESSAGE"], &rows),
            "ID      STATE    MESSAGE\nsbx_1   running  a b\nsbx_22  -        -\n"
        );
    }

    #[test]
    fn durations_show_their_largest_unit() {
        let check = |seconds: u64, expected: &str| {
            assert_eq!(
                short_duration(std::time::Duration::from_secs(seconds)),
                expected
            );
        };
        check(0, "0s");
        check(59, "59s");
        check(60, "1m");
        check(3599, "59m");
        check(7200, "2h");
        check(86400 * 3 + 5, "3d");
    }
}
