//! Sandbox: isolated execution for agent tool calls and for grading.
//!
//! Every tool call of every rollout, and every reward, runs through this
//! crate. It gives one [`Sandbox`] trait with two backends: [`docker`] (one
//! container per rollout, driven over the Docker API with bollard) and
//! [`local`] (bubblewrap namespaces plus cgroup limits, for machines without
//! Docker). It is not a tool layer for the model (no token or prompt
//! knowledge lives here) and not a task loader.
//!
//! # Threat model
//!
//! The adversary is the policy under RL: code it writes runs with the
//! sandbox user's rights and will find any shortcut to reward. We close, by
//! construction:
//!
//! - **Network**: no network at all. Docker containers get network mode
//!   `none`; local sandboxes get a fresh network namespace with only loopback.
//!   A server on the host's loopback is unreachable and DNS fails.
//! - **History**: the working tree is a single root commit made by
//!   [`Snapshot`]; no other commits, branches, tags, remotes, reflog, stash,
//!   packed refs or dangling objects exist, so `git log --all` shows one commit.
//!   A task image's own repository (history included) is only read to make
//!   the snapshot; in the sandbox it lies hidden beneath the workdir's
//!   empty volume (Docker) or bind mount (local).
//! - **Hidden tests**: the task's test patch never enters the agent's sandbox.
//!   [`grading::grade`] applies only the agent's diff, plus the test patch, in
//!   a fresh sandbox from the same snapshot, and throws it away.
//! - **Host files**: the root file system is the image (read-only for both
//!   backends); the host's home, the repository checkout and everything
//!   else on the host is not mounted.
//! - **Host user**: commands run as an unprivileged host user without
//!   capabilities: the policy's user under Docker; under bubblewrap the
//!   user that runs arcticd or, for root, `nobody` ([`local::HOST_USER`]),
//!   unless that cannot work (a warning says why; the user is then host
//!   root without capabilities, with `/proc` read-only).
//! - **Disk**: the working copy and `/tmp` are in-memory file systems of
//!   [`Policy::disk_bytes`] and `disk_inodes`, the rest read-only, so a
//!   rollout cannot fill the disk the run's checkpoints go to (the local
//!   backend needs root to mount them, and warns without it).
//! - **Resources**: memory (no swap), pids and CPU are limited per sandbox; a
//!   memory kill is reported as `memory_exceeded`; every call has a timeout
//!   and kills the command's whole process group (Docker) or pid namespace
//!   (local) when it fires; stdout and stderr are capped per call, keeping the
//!   first and last parts, so 100 MB of output cannot exhaust host memory.
//! - **Leaks**: every container carries the [`docker::LABEL`] label and the
//!   owning process's identity; the reaper removes containers (and local
//!   sandbox folders and cgroups) of dead owners at start-up, and sandboxes
//!   are removed on close, on drop and on Ctrl-C in the command line.
//!
//! Not isolated, and out of scope: the kernel itself (both backends share the
//! host kernel, so a kernel exploit escapes; use gVisor or VMs behind the same
//! trait when that matters), CPU side channels, and timing (commands see
//! the real clock). Processes a command leaves in the background are killed when it
//! ends (Docker: its process group; local: its pid namespace), except, under
//! Docker, one that starts a session of its own, which lives until the
//! sandbox closes (bounded by the pids and memory limits).
//! The test command's exit code and log are trusted only as far as
//! [`grading`] checks them (missing tests fail, unparseable logs are
//! infrastructure errors, non-zero exits without failures are rejected).
//!
//! Design follows the nanochat `execution.py` and mistral.rs sandbox shape:
//! a trait, a [`Policy`] with safe defaults, and an [`ExecResult`] that states
//! timed-out, memory-exceeded, exit code and truncation explicitly.

pub mod docker;
pub mod grading;
pub mod image;
pub mod local;
pub mod logparse;
pub mod output;
pub mod policy;
pub mod pool;
pub mod procs;
pub mod sandbox;
pub mod snapshot;
pub mod tasks;

pub use output::{CappedOutput, ExecRequest, ExecResult};
pub use policy::Policy;
pub use pool::Pool;
pub use sandbox::{Backend, DirEntry, PatchOutcome, Sandbox};
pub use snapshot::Snapshot;

/// Re-exported so the binary, tests and benchmarks drive the async API with
/// the same runtime version as this crate without each depending on tokio.
pub use tokio;

/// Errors of the sandbox crate. Command failures inside a sandbox are not
/// errors (they are an [`ExecResult`] with a non-zero exit code); these are
/// failures of the sandbox machinery itself.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The io error is said in the message, not chained as a source
    /// (a chain would print it twice).
    #[error("{context}: {error}")]
    Io {
        context: String,
        error: std::io::Error,
    },
    #[error("docker: {0}")]
    Docker(#[from] bollard::errors::Error),
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    #[error("{op} timed out after {secs:.1} s")]
    Timeout { op: String, secs: f64 },
    #[error("sandbox is closed")]
    Closed,
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("snapshot: {0}")]
    Snapshot(String),
    #[error("image: {0}")]
    Image(String),
    #[error("{what} is larger than the limit of {limit} bytes")]
    TooLarge { what: String, limit: u64 },
    #[error("sandbox: {0}")]
    Sandbox(String),
    /// The working copy cannot be read back (its `.git` removed or broken
    /// by the commands run in it): the agent's doing, not the
    /// infrastructure's.
    #[error("working copy: {0}")]
    Workspace(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            error: source,
        }
    }
}

/// A multi-threaded tokio runtime for callers that are not async themselves
/// (the command line, tests, benchmarks).
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("building the tokio runtime", e))
}

/// A time limit of `secs` seconds, or an error where it is none (NaN,
/// negative, or past what a `Duration` holds) instead of a panic.
/// The longest time limit a command or operation may have, in seconds
/// (about 116 days): past it a limit is a mistake, not a wish.
pub const MAX_TIMEOUT_SECS: f64 = 1e7;

/// Whether `secs` is a time limit a sandbox takes: above 0 and below
/// [`MAX_TIMEOUT_SECS`] (NaN is not).
pub fn timeout_ok(secs: f64) -> bool {
    secs > 0.0 && secs < MAX_TIMEOUT_SECS
}

pub(crate) fn limit(secs: f64) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(secs)
        .map_err(|_| Error::InvalidInput(format!("a time limit of {secs:?} s")))
}

/// Runs `fut` under `secs` seconds, mapping expiry to [`Error::Timeout`].
pub(crate) async fn with_timeout<T>(
    op: &str,
    secs: f64,
    fut: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit(secs)?, fut).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            op: op.to_string(),
            secs,
        }),
    }
}
