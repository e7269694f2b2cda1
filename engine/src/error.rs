//! The engine crate's one error type. Every message names the file, field or
//! tensor at fault, because users see these directly from the CLI.

use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("config: {0}")]
    Config(String),
    #[error("weights: {0}")]
    Weights(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("input: {0}")]
    Input(String),
    /// A request whose prompt and completion would pass the most tokens a
    /// sequence may hold: the caller's, like `Input` (OpenAI's
    /// `context_length_exceeded`).
    #[error("input: {0}")]
    ContextLength(String),
    /// A failure inside the engine (a forward or a sampling step), never the
    /// caller's fault: a server logs it and answers 500 without the details.
    /// It keeps the error that caused it (a kernel's, a device's) as a type.
    #[error("internal: {0}")]
    Internal(Failure),
    /// An invariant of the engine broke (a bug, not the caller's input).
    #[error("invariant: {0}")]
    Invariant(String),
    /// The engine cannot take work (it stopped, or is shutting down).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The io error is said in the message, not chained as a source
    /// (a chain would print it twice: "x: No such file: No such file").
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(transparent)]
    Kernel(#[from] arcticd_kernels::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

/// What failed inside the engine, shared by every request the failure hit
/// (one forward serves many), with the cause's type kept.
#[derive(Debug, Clone)]
pub struct Failure(pub Arc<Error>);

impl Failure {
    /// A failure whose cause is only a message (an engine invariant broken).
    pub fn msg(m: impl Into<String>) -> Self {
        Failure(Arc::new(Error::Invariant(m.into())))
    }

    pub fn cause(&self) -> &Error {
        &self.0
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure(Arc::new(e))
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Two failures are equal when they are the same failure or say the same.
impl PartialEq for Failure {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error: source,
        }
    }
}

/// A serde message with the Rust type names it ends its `expected ...` in
/// said as a user reads them: "expected f32" is "expected a number" (the
/// server's request bodies, recipes).
pub fn plain_types(msg: &str) -> String {
    const NAMES: [(&str, &str); 10] = [
        ("f32", "a number"),
        ("f64", "a number"),
        ("u8", "a whole number from 0 to 255"),
        ("u16", "a whole number from 0 to 65535"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("u64", "a whole number from 0 to 18446744073709551615"),
        ("usize", "a whole number from 0 to 18446744073709551615"),
        ("i32", "a whole number from -2147483648 to 2147483647"),
        ("i64", "a whole number"),
        ("isize", "a whole number"),
    ];
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(at) = rest.find("expected ") {
        let (before, after) = rest.split_at(at + "expected ".len());
        out.push_str(before);
        let word = after
            .find(|c: char| !c.is_ascii_alphanumeric())
            .map_or(after, |end| &after[..end]);
        match NAMES.iter().find(|(rust, _)| *rust == word) {
            Some((_, plain)) => {
                out.push_str(plain);
                rest = &after[word.len()..];
            }
            None => rest = after,
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_messages_name_types_as_a_user_reads_them() {
        assert_eq!(
            plain_types("invalid type: string \"hot\", expected f32 at line 1 column 80"),
            "invalid type: string \"hot\", expected a number at line 1 column 80"
        );
        assert_eq!(
            plain_types("invalid value: integer `-1`, expected usize"),
            "invalid value: integer `-1`, expected a whole number from 0 to 18446744073709551615"
        );
        // Other words after "expected" stay, and so does a name inside one.
        assert_eq!(
            plain_types("expected a sequence; expected u32x4, expected `,`"),
            "expected a sequence; expected u32x4, expected `,`"
        );
    }
}
