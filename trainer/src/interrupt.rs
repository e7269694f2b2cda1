//! What a long run does on SIGINT and SIGTERM (Ctrl-C, `kill`, `docker
//! stop`, service managers, cluster schedulers): the first asks the run to
//! stop at its next safe point and save what it has, then end with the
//! signal's status ([`status`]); a second ends the process at once with
//! its own status (130 for SIGINT, 143 for SIGTERM), since the orderly stop can take
//! minutes (rollouts in flight, a large checkpoint). `train` and `sft`
//! share it.
//!
//! One listener thread per process, started by the first [`watch`]; the
//! run it serves is the one whose [`Watching`] is alive. With none alive a
//! signal ends the process at once, as it would without the listener.
//!
//! Not for: `serve`, which stops on the first signal (`cli_serve`).

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::signal::unix::{signal, Signal, SignalKind};

/// What the run tells the user at each signal.
#[derive(Debug, Clone, Copy)]
pub struct Stops {
    /// The command, as the messages name it (`train`).
    pub command: &'static str,
    /// What the first signal does ("finishing this update, then checkpoint
    /// and stop").
    pub first: &'static str,
    /// What is kept when a second signal stops the process at once.
    pub kept: &'static str,
}

/// The exit status the first signal asks for (128 + its number), 0 before
/// any.
static STATUS: AtomicI32 = AtomicI32::new(0);

/// The exit status an orderly stop should end with: 130 after SIGINT, 143
/// after SIGTERM (the shell's convention for a process a signal ended),
/// None when no signal came.
pub fn status() -> Option<i32> {
    Some(STATUS.load(Ordering::Acquire)).filter(|&s| s != 0)
}

/// The run the listener serves.
static TARGET: Mutex<Option<(Arc<AtomicBool>, Stops)>> = Mutex::new(None);
/// The listener's start, once per process (its error as text).
static LISTENER: OnceLock<Result<(), String>> = OnceLock::new();

/// While alive, SIGINT and SIGTERM set the run's `stop` flag (the first)
/// or end the process (a second).
#[must_use = "the signals are handled only while this is alive"]
pub struct Watching(());

impl Drop for Watching {
    fn drop(&mut self) {
        *TARGET.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Sends SIGINT and SIGTERM to `stop` until the returned value is dropped.
/// Listening has begun when it returns, so no later signal is missed. An
/// error if the signals cannot be caught (the default handling, which ends
/// the process at once, then stays).
pub fn watch(stop: Arc<AtomicBool>, says: Stops) -> crate::Result<Watching> {
    LISTENER
        .get_or_init(|| start().map_err(|e| e.to_string()))
        .clone()
        .map_err(|e| crate::Error::Run(format!("cannot listen for SIGINT and SIGTERM: {e}")))?;
    *TARGET.lock().unwrap_or_else(|e| e.into_inner()) = Some((stop, says));
    Ok(Watching(()))
}

fn start() -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (int, term) = rt.block_on(async {
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    std::thread::Builder::new()
        .name("arcticd-signals".into())
        .spawn(move || rt.block_on(listen(int, term)))?;
    Ok(())
}

async fn listen(mut int: Signal, mut term: Signal) {
    loop {
        let (sig, status) = tokio::select! {
            _ = int.recv() => ("SIGINT", 130),
            _ = term.recv() => ("SIGTERM", 143),
        };
        let target = TARGET.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match target {
            Some((stop, says)) if !stop.load(Ordering::Acquire) => {
                eprintln!(
                    "arcticd {}: {sig}: {} (a second Ctrl-C or SIGTERM stops at once)",
                    says.command, says.first
                );
                let _ = STATUS.compare_exchange(0, status, Ordering::AcqRel, Ordering::Acquire);
                stop.store(true, Ordering::Release);
            }
            Some((_, says)) => {
                eprintln!(
                    "arcticd {}: {sig} again: stopped at once; {}",
                    says.command, says.kept
                );
                std::process::exit(status);
            }
            None => std::process::exit(status),
        }
    }
}
