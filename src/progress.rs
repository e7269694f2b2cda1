//! Progress for long commands, on stderr: an `indicatif` bar (a spinner when
//! the total is unknown) when stderr is a terminal, and plain lines otherwise
//! (logs, CI), where indicatif would draw nothing: one line at the first
//! update, then at most one per [`PLAIN_INTERVAL`], and one at the end.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// The least time between two plain progress lines.
pub const PLAIN_INTERVAL: Duration = Duration::from_secs(10);

pub struct Progress {
    /// Drawn bar when stderr is a terminal.
    bar: Option<ProgressBar>,
    what: String,
    total: Option<u64>,
    position: u64,
    message: String,
    start: Instant,
    /// When the last plain line was printed.
    last_line: Option<Instant>,
    interval: Duration,
    /// Plain lines printed so far.
    printed: u64,
}

impl Progress {
    /// Progress of `what` (shown before each line) over `total` units, or
    /// open-ended (a spinner) when `total` is None.
    pub fn new(total: Option<u64>, what: &str) -> Progress {
        Progress::with_terminal(total, what, std::io::stderr().is_terminal())
    }

    /// As [`Progress::new`], choosing the bar (`terminal`) or plain lines.
    pub fn with_terminal(total: Option<u64>, what: &str, terminal: bool) -> Progress {
        let bar = terminal.then(|| {
            let (bar, template) = match total {
                Some(total) => (
                    ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr()),
                    "{prefix} [{bar:30}] {pos}/{len} {msg} [{elapsed_precise}, eta {eta}]",
                ),
                None => (
                    ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()),
                    "{spinner} {prefix} {pos} {msg} [{elapsed_precise}]",
                ),
            };
            let style = ProgressStyle::with_template(template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("#>-");
            bar.set_style(style);
            bar.set_prefix(what.to_string());
            if total.is_none() {
                bar.enable_steady_tick(Duration::from_millis(200));
            }
            bar
        });
        Progress {
            bar,
            what: what.to_string(),
            total,
            position: 0,
            message: String::new(),
            start: Instant::now(),
            last_line: None,
            interval: PLAIN_INTERVAL,
            printed: 0,
        }
    }

    /// Sets the least time between plain lines (tests, chatty loops).
    #[allow(dead_code)] // not every caller tunes it
    pub fn with_interval(mut self, interval: Duration) -> Progress {
        self.interval = interval;
        self
    }

    /// The text after the count, e.g. the latest loss; shown at the next update.
    pub fn set_message(&mut self, message: String) {
        if let Some(bar) = &self.bar {
            bar.set_message(message.clone());
        }
        self.message = message;
    }

    pub fn inc(&mut self, n: u64) {
        self.set_position(self.position.saturating_add(n));
    }

    pub fn set_position(&mut self, position: u64) {
        self.position = position;
        match &self.bar {
            Some(bar) => bar.set_position(position),
            None => {
                let done = self.total.is_some_and(|t| position >= t);
                let due = self
                    .last_line
                    .is_none_or(|last| last.elapsed() >= self.interval);
                if done || due {
                    eprintln!("{}", self.line());
                    self.last_line = Some(Instant::now());
                    self.printed += 1;
                }
            }
        }
    }

    /// Prints a line above the bar (or as it is, without one).
    pub fn println(&self, line: String) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    /// Ends the progress with a closing message.
    pub fn finish(mut self, message: String) {
        match self.bar.take() {
            Some(bar) => {
                bar.finish_with_message(message);
            }
            None => {
                self.message = message;
                eprintln!("{}", self.line());
            }
        }
    }

    /// The plain-text state: `what pos/total message (elapsed)`.
    pub fn line(&self) -> String {
        let count = match self.total {
            Some(total) => format!("{}/{total}", self.position),
            None => self.position.to_string(),
        };
        let mut line = format!("{} {count}", self.what);
        if !self.message.is_empty() {
            line.push(' ');
            line.push_str(&self.message);
        }
        line.push_str(&format!(" ({:.1}s)", self.start.elapsed().as_secs_f64()));
        line
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // A bar dropped without finish (an error on the way) leaves its last
        // state on screen rather than vanishing.
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_count_and_message() {
        let mut p = Progress::with_terminal(Some(4), "sft", false).with_interval(Duration::MAX);
        p.set_message("loss 1.2500".to_string());
        p.inc(1);
        assert_eq!(p.printed, 1, "the first update prints");
        p.inc(1);
        assert_eq!(p.printed, 1, "rate-limited");
        assert!(
            p.line().starts_with("sft 2/4 loss 1.2500 ("),
            "{}",
            p.line()
        );
        p.set_position(4);
        assert_eq!(p.printed, 2, "the last unit prints");
        p.finish("done".to_string());

        let mut open = Progress::with_terminal(None, "eval", false);
        open.inc(3);
        assert!(open.line().starts_with("eval 3 ("), "{}", open.line());
    }
}
