//! The `arcticd` command line: thin wiring over the engine, trainer and sandbox crates.

use clap::{Parser, Subcommand};
use std::path::Path;

/// clap's parser of a count that must be at least 1 (a 0 was clamped or
/// ran nothing).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s} is not a whole number of at least 1")),
    }
}

/// clap's parser of a name that is not empty or only spaces.
fn non_blank(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("a name is needed, not an empty string".into())
    } else {
        Ok(s.to_string())
    }
}

/// clap's parser of a finite number above 0.
fn positive_number(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s} is not a finite number above 0")),
    }
}

/// `println!` that returns the write's error (`io::Result<()>`) instead of
/// panicking when standard output is gone (`arcticd ... | head`); `main`
/// ends quietly on a closed pipe.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

mod cli_harness;
mod cli_model;
mod cli_plot;
mod cli_rft;
mod cli_rl;
mod cli_sandbox;
mod cli_serve;
mod cli_tasks;
mod cli_train;
mod cli_warm;
mod demo;
mod progress;
mod server;

#[derive(Parser)]
#[command(
    name = "arcticd",
    version,
    about = "Async RL for software-engineering agents, on its own engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Log-probabilities of token sequences: prints {"logprobs": [[null, lp1, ...], ...]}.
    Score(cli_model::ScoreArgs),
    /// Greedy generation from a prompt, through the chat template when the model has one.
    Generate(cli_model::GenerateArgs),
    /// Write a randomly initialised Qwen3.5-architecture model in Hugging Face layout.
    InitModel(cli_model::InitModelArgs),
    /// Time the model's full forward on a random packed batch (tokens/s as JSON).
    BenchForward(cli_model::BenchForwardArgs),
    /// Time the engine's decoding at given batch sizes (tokens/s and memory as JSON).
    BenchDecode(cli_model::BenchDecodeArgs),
    /// Run commands in an isolated sandbox, or build its base image.
    Sandbox(cli_sandbox::SandboxArgs),
    /// Task files: generate the toy pool, validate tasks, audit them for loose tests.
    Tasks(cli_tasks::TasksArgs),
    /// Check raw assistant completions against the strict tool-call format.
    CheckFormat(cli_harness::CheckFormatArgs),
    /// Show rollout trajectories as transcripts.
    Traj(cli_harness::TrajArgs),
    /// pass@1 over K attempts per task through the rollout harness, resumable.
    Eval(cli_harness::EvalArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(cli_serve::ServeArgs),
    /// Supervised fine-tuning (AdamW, torch semantics); writes a Hugging Face checkpoint.
    Sft(cli_train::SftArgs),
    /// Asynchronous RL: a recipe, a resumed run, or with no arguments the built-in demo.
    Train(cli_rl::TrainArgs),
    /// Replay one update of a run from the checkpoint before it, with recipe keys changed: its gradient norm and how it moves probe log-probs (JSON).
    Replay(cli_rl::ReplayArgs),
    /// Rejection fine-tuning: sample K attempts per task, SFT on the solved well-formed ones, repeat.
    Rft(cli_rft::RftArgs),
    /// PNG figures of one or more runs' metrics.jsonl (reward, mismatch, update, staleness, time, load).
    Plot(cli_plot::PlotArgs),
    /// Build the RL demo's warm-started model: SFT on scripted expert trajectories of toy tasks.
    WarmStart(cli_warm::WarmStartArgs),
    /// The training memory plan of a model at a micro-batch shape, on the CPU or one GPU.
    Plan(cli_train::PlanArgs),
    /// Time full training steps on random sequences (tokens/s, update time, model FLOPs as JSON).
    BenchTrain(cli_train::BenchTrainArgs),
}

/// Refuses an output file that is one of the command's input (or other
/// output) files: the same file by device and inode, so through links too,
/// or, where one does not exist yet, the same absolute path. Writing it
/// would change what is being read, or mix two outputs in one file.
pub(crate) fn not_an_input(out: (&str, &Path), inputs: &[(&str, &Path)]) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let abs = |p: &Path| std::path::absolute(p).ok();
    for (flag, path) in inputs {
        let same = match (id(out.1), id(path)) {
            (Some(o), Some(i)) => o == i,
            _ => abs(out.1).is_some() && abs(out.1) == abs(path),
        };
        if same {
            anyhow::bail!(
                "{} {} is the file given to {flag}: writing it would change what is read from \
                 it, or mix two outputs; name another file",
                out.0,
                out.1.display()
            );
        }
    }
    Ok(())
}

/// A JSON setting (`--config`, `--rollout`, `--agent-config`, `--sft`):
/// inline when it starts with `{`, else the path of a file holding it
/// (`arcticd warm-start` writes its rollout setting to rollout.json).
pub(crate) fn json_setting<T: serde::de::DeserializeOwned>(
    flag: &str,
    value: &str,
) -> anyhow::Result<T> {
    use anyhow::Context;
    // Serde's message with its Rust type names said plainly.
    let parse = |text: &str, what: String| {
        serde_json::from_str(text).map_err(|e| {
            anyhow::anyhow!(
                "{what}: {}",
                arcticd_engine::error::plain_types(&e.to_string())
            )
        })
    };
    if value.trim_start().starts_with('{') {
        return parse(value, format!("parsing {flag}"));
    }
    let text = std::fs::read_to_string(value).with_context(|| {
        format!("{flag} {value}: not a JSON object (starting with {{), nor a file to read")
    })?;
    parse(&text, format!("{flag}: parsing the file {value}"))
}

/// Refuses, before any work, an output file that would replace something
/// other than an earlier output of its kind: an existing `path` is
/// replaced only when `is_ours` accepts its bytes (`what` names the kind).
pub(crate) fn replaces_only(
    flag: &str,
    path: &Path,
    what: &str,
    is_ours: impl Fn(&[u8]) -> bool,
) -> anyhow::Result<()> {
    let Ok(bytes) = std::fs::read(path) else {
        // Missing (a new file), or a folder or unreadable: `can_write`'s.
        return Ok(());
    };
    if !is_ours(&bytes) {
        anyhow::bail!(
            "{flag} {}: the file exists and is not {what}, so it is not replaced; name a new \
             file, or remove it",
            path.display()
        );
    }
    Ok(())
}

/// Refuses, before any work, an output folder that is a file.
pub(crate) fn folder_out(flag: &str, path: &Path) -> anyhow::Result<()> {
    if path.exists() && !path.is_dir() {
        anyhow::bail!(
            "{flag} {} is a file; it names a folder (made when missing)",
            path.display()
        );
    }
    Ok(())
}

/// Refuses, before any work, an output file that could not be written
/// once the work is done: a folder, a path in a missing folder, or one in a
/// folder this process may not write in (probed by making and removing an
/// entry there).
pub(crate) fn can_write(flag: &str, path: &Path) -> anyhow::Result<()> {
    if path.is_dir() {
        anyhow::bail!("{flag} {} is a folder; name a file", path.display());
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        anyhow::bail!(
            "{flag} {}: the folder {} does not exist",
            path.display(),
            parent.display()
        );
    }
    arcticd_engine::weights::can_write_in(parent).map_err(|e| {
        anyhow::anyhow!(
            "{flag} {}: cannot write in {}: {e}",
            path.display(),
            parent.display()
        )
    })
}

fn main() {
    arcticd_kernels::host::retain_freed_memory();
    tracing_subscriber::fmt()
        // Warnings are shown unless RUST_LOG says otherwise: they are what a
        // user must see (a resume's losses, a failed evaluation, an ablation
        // on, a skipped step).
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colours on a terminal only, not in a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Score(args) => cli_model::score(args),
        Command::Generate(args) => cli_model::generate(args),
        Command::InitModel(args) => cli_model::init_model(args),
        Command::BenchForward(args) => cli_model::bench_forward(args),
        Command::BenchDecode(args) => cli_model::bench_decode(args),
        Command::Sandbox(args) => cli_sandbox::main(args),
        Command::Tasks(args) => cli_tasks::main(args),
        Command::CheckFormat(args) => cli_harness::check_format(args),
        Command::Traj(args) => cli_harness::traj(args),
        Command::Eval(args) => cli_harness::eval(args),
        Command::Serve(args) => cli_serve::serve(args),
        Command::Sft(args) => cli_train::sft(args),
        Command::Train(args) => cli_rl::train(args),
        Command::Replay(args) => cli_rl::replay(args),
        Command::Rft(args) => cli_rft::rft(args),
        Command::Plot(args) => cli_plot::plot(args),
        Command::WarmStart(args) => cli_warm::warm_start(args),
        Command::Plan(args) => cli_train::plan(args),
        Command::BenchTrain(args) => cli_train::bench_train(args),
    };
    if let Err(e) = result {
        if closed_pipe(&e) {
            // The reader went away (`| head`): quiet, with the status a
            // shell gives a program that SIGPIPE ended.
            std::process::exit(141);
        }
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Whether `e` comes from writing to standard output after its reader
/// went away: a broken pipe in the error's chain, and standard output a
/// pipe with no reader. A broken pipe elsewhere (a sandbox's process that
/// died, a closed socket) is an error like any other.
fn closed_pipe(e: &anyhow::Error) -> bool {
    use std::io::ErrorKind::BrokenPipe;
    let broken = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == BrokenPipe)
            || c.downcast_ref::<serde_json::Error>()
                .is_some_and(|j| j.io_error_kind() == Some(BrokenPipe))
    });
    broken && reader_gone(libc::STDOUT_FILENO)
}

/// Whether `fd` is the write end of a pipe whose every reader has closed
/// it: `poll` reports `POLLERR` on such an end at once.
fn reader_gone(fd: libc::c_int) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, a zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & libc::POLLERR != 0
}

#[cfg(test)]
mod tests {
    use super::{can_write, json_setting, not_an_input, reader_gone};
    use std::path::Path;

    /// A setting inline or in a file reads the same; a path that is not a
    /// file, or a file that is not the setting, names the flag.
    #[test]
    fn json_settings_come_inline_or_from_a_file() {
        #[derive(serde::Deserialize, PartialEq, Debug)]
        struct S {
            max_turns: u32,
        }
        let dir = std::env::temp_dir().join(format!("arcticd-setting-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("s.json");
        std::fs::write(&file, r#"{"max_turns": 7}"#).unwrap();
        let inline: S = json_setting("--config", r#" {"max_turns": 7}"#).unwrap();
        let from_file: S = json_setting("--config", file.to_str().unwrap()).unwrap();
        assert_eq!(inline, from_file);
        let e = json_setting::<S>("--config", "/nonexistent/s.json").unwrap_err();
        assert!(
            format!("{e:#}").contains("--config /nonexistent/s.json"),
            "{e:#}"
        );
        let e = json_setting::<S>("--config", r#"{"max_turns": -1}"#).unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("parsing --config")
                && e.contains("a whole number from 0 to")
                && !e.contains("u32"),
            "{e}"
        );
        std::fs::write(&file, "max_turns = 7").unwrap();
        let e = json_setting::<S>("--rollout", file.to_str().unwrap()).unwrap_err();
        assert!(
            format!("{e:#}").contains("--rollout: parsing the file"),
            "{e:#}"
        );
        // An output: the same path as an input (existing or not), a folder,
        // a missing folder.
        assert!(not_an_input(("--out", &file), &[("--tasks", &file)]).is_err());
        let new = dir.join("new.jsonl");
        assert!(not_an_input(
            ("--traj", &new),
            &[("--out", &dir.join(".").join("new.jsonl"))]
        )
        .is_err());
        assert!(not_an_input(("--traj", &new), &[("--out", &file)]).is_ok());
        assert!(can_write("--out", &new).is_ok());
        assert!(!new.exists(), "the probe left a file");
        assert!(can_write("--out", &dir).is_err());
        assert!(can_write("--out", Path::new("/nonexistent/dir/x.json")).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    fn pipe() -> [libc::c_int; 2] {
        let mut fds = [0; 2];
        // SAFETY: a two-element array for pipe(2) to fill.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        fds
    }

    #[test]
    fn only_a_pipe_without_readers_counts_as_gone() {
        let [r, w] = pipe();
        assert!(!reader_gone(w), "a reader is still there");
        // SAFETY: closing the read end this test opened.
        unsafe { libc::close(r) };
        assert!(reader_gone(w), "its only reader closed it");
        unsafe { libc::close(w) };
        let f = std::fs::File::open("Cargo.toml").unwrap();
        assert!(!reader_gone(std::os::fd::AsRawFd::as_raw_fd(&f)), "a file");
    }
}
