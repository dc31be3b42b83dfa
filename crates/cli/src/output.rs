//! Shared output helpers: JSON printing, human sizes, progress bars.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

pub fn print_json(value: &serde_json::Value) {
    println!("{value}");
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
