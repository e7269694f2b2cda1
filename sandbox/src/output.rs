//! Command requests and results, and the capped output buffer.
//!
//! The buffer keeps the first and the last half of the cap and counts what it
//! drops, so a command printing gigabytes costs the host a bounded amount of
//! memory and the agent still sees how its output began and ended. Not a
//! streaming interface: a result is complete when the command ends.

use serde::{Serialize, Serializer};
use std::collections::VecDeque;

/// Output of one stream, capped: `head` holds the first bytes, `tail` the
/// last ones, `total_bytes` counts everything the command wrote.
#[derive(Debug, Clone, Default)]
pub struct CappedOutput {
    head: Vec<u8>,
    tail: VecDeque<u8>,
    head_cap: usize,
    tail_cap: usize,
    total_bytes: u64,
}

impl CappedOutput {
    /// A buffer keeping at most `cap` bytes in all.
    pub fn new(cap: usize) -> Self {
        let head_cap = cap / 2;
        CappedOutput {
            head: Vec::new(),
            tail: VecDeque::new(),
            head_cap,
            tail_cap: cap - head_cap,
            total_bytes: 0,
        }
    }

    /// Appends bytes, dropping the middle once the cap is reached.
    pub fn push(&mut self, mut data: &[u8]) {
        self.total_bytes += data.len() as u64;
        if self.head.len() < self.head_cap {
            let n = data.len().min(self.head_cap - self.head.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.tail_cap..]);
        } else {
            let overflow = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
            self.tail.drain(..overflow);
            self.tail.extend(data);
        }
    }

    /// Whether bytes were dropped.
    pub fn truncated(&self) -> bool {
        self.total_bytes > (self.head.len() + self.tail.len()) as u64
    }

    /// Bytes the command wrote in all, kept or not.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// The kept bytes, head then tail, without any marker. Only meaningful
    /// as the whole output when not [`truncated`](Self::truncated).
    pub fn bytes(&self) -> Vec<u8> {
        let mut v = self.head.clone();
        v.extend(self.tail.iter());
        v
    }

    /// The kept output as text (invalid UTF-8 replaced), with a marker where
    /// bytes were dropped.
    pub fn text(&self) -> String {
        if !self.truncated() {
            return String::from_utf8_lossy(&self.bytes()).into_owned();
        }
        // The cut falls anywhere: a character split across it is dropped
        // whole (and counted), not shown as replacement characters.
        let head = &self.head[..self.head.len() - split_char_at_end(&self.head)];
        let tail: Vec<u8> = self.tail.iter().copied().collect();
        let skip = tail
            .iter()
            .take(3)
            .take_while(|&&b| b & 0xC0 == 0x80)
            .count();
        let tail = &tail[skip..];
        let dropped = self.total_bytes - (head.len() + tail.len()) as u64;
        format!(
            "{}\n[... {dropped} bytes truncated ...]\n{}",
            String::from_utf8_lossy(head),
            String::from_utf8_lossy(tail)
        )
    }
}

/// How many bytes at the end of `b` begin a UTF-8 character that `b` does
/// not finish (0 to 3).
fn split_char_at_end(b: &[u8]) -> usize {
    for back in 1..=b.len().min(3) {
        let lead = b[b.len() - back];
        if lead & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back
        }
        let need = match lead {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => 1,
        };
        return if need > back { back } else { 0 };
    }
    0
}

impl Serialize for CappedOutput {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text())
    }
}

/// One command to run in a sandbox.
#[derive(Debug, Clone, Default)]
pub struct ExecRequest {
    /// Program and arguments, run without a shell (use `sh -c` for one).
    pub argv: Vec<String>,
    /// Overrides [`crate::Policy::exec_timeout_secs`].
    pub timeout_secs: Option<f64>,
    /// Overrides [`crate::Policy::output_cap_bytes`] (the crate uses larger
    /// caps for its own reads; agent commands should keep the default).
    pub output_cap_bytes: Option<usize>,
    /// Bytes written to the command's standard input, then closed.
    pub stdin: Option<Vec<u8>>,
    /// Working directory; default the policy's workdir.
    pub workdir: Option<String>,
}

impl ExecRequest {
    /// `sh -c script`.
    pub fn shell(script: impl Into<String>) -> Self {
        ExecRequest {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            ..Default::default()
        }
    }

    /// A program and its arguments.
    pub fn argv<I: IntoIterator<Item = S>, S: Into<String>>(argv: I) -> Self {
        ExecRequest {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Default::default()
        }
    }

    pub fn timeout(mut self, secs: f64) -> Self {
        self.timeout_secs = Some(secs);
        self
    }

    pub fn stdin(mut self, data: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(data.into());
        self
    }

    pub fn output_cap(mut self, bytes: usize) -> Self {
        self.output_cap_bytes = Some(bytes);
        self
    }
}

/// What happened to one command: it exited (`exit_code` set) or was killed
/// at its timeout (`timed_out`). `memory_exceeded` says a process of the
/// command was killed for memory: the command itself (then with the exit
/// code of the kill), or a child of it, after which the command may have
/// gone on to exit with a code of its own.
#[derive(Debug, Clone, Serialize)]
pub struct ExecResult {
    /// Exit status; 128+N when killed by signal N; `None` when timed out.
    pub exit_code: Option<i64>,
    pub stdout: CappedOutput,
    pub stderr: CappedOutput,
    pub timed_out: bool,
    pub memory_exceeded: bool,
    /// Either stream lost bytes to the cap.
    pub truncated: bool,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub duration_ms: u64,
}

impl ExecResult {
    pub(crate) fn new(
        exit_code: Option<i64>,
        stdout: CappedOutput,
        stderr: CappedOutput,
        timed_out: bool,
        memory_exceeded: bool,
        elapsed: std::time::Duration,
    ) -> Self {
        ExecResult {
            exit_code,
            truncated: stdout.truncated() || stderr.truncated(),
            stdout_bytes: stdout.total_bytes(),
            stderr_bytes: stderr.total_bytes(),
            stdout,
            stderr,
            timed_out,
            memory_exceeded,
            duration_ms: elapsed.as_millis() as u64,
        }
    }

    /// Exited with status 0.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0) && !self.timed_out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_everything_under_the_cap() {
        let mut c = CappedOutput::new(10);
        c.push(b"abc");
        c.push(b"def");
        assert!(!c.truncated());
        assert_eq!(c.text(), "abcdef");
        assert_eq!(c.bytes(), b"abcdef");
    }

    #[test]
    fn keeps_head_and_tail_over_the_cap() {
        let mut c = CappedOutput::new(6);
        for chunk in [&b"0123"[..], b"4567", b"89", b"abcd"] {
            c.push(chunk);
        }
        assert!(c.truncated());
        assert_eq!(c.total_bytes(), 14);
        assert_eq!(c.bytes(), b"012bcd");
        assert!(c
            .text()
            .starts_with("012\n[... 8 bytes truncated ...]\nbcd"));
    }

    #[test]
    fn a_character_split_by_the_cut_is_dropped_whole() {
        // "é" is 2 bytes, "€" 3: the head's cap ends inside an "é", the
        // tail's begins inside a "€".
        let mut c = CappedOutput::new(10);
        c.push("abcdé".as_bytes()); // head keeps "abcd" + half of é
        c.push(&[b'x'; 20]);
        c.push("€€".as_bytes()); // tail keeps the last 5: 2 bytes of € + €
        let text = c.text();
        assert!(!text.contains('\u{FFFD}'), "{text:?}");
        assert!(
            text.starts_with("abcd\n[... 25 bytes truncated ...]\n€"),
            "{text:?}"
        );
        assert!(text.ends_with('€'));
    }

    #[test]
    fn one_huge_chunk_is_capped() {
        let mut c = CappedOutput::new(4);
        c.push(&vec![b'x'; 1 << 20]);
        assert_eq!(c.bytes().len(), 4);
        assert_eq!(c.total_bytes(), 1 << 20);
    }

    #[test]
    fn exactly_at_cap_is_not_truncated() {
        let mut c = CappedOutput::new(4);
        c.push(b"ab");
        c.push(b"cd");
        assert!(!c.truncated());
        assert_eq!(c.bytes(), b"abcd");
    }
}
