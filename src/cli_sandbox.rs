//! `arcticd sandbox`: run one command in a fresh sandbox, or build the base
//! image.
//!
//! `arcticd sandbox run --backend docker|local --repo DIR [--image NAME]
//! [--timeout S] -- CMD...` snapshots DIR (one root commit, no history),
//! starts a sandbox, runs CMD, prints the JSON result (exit_code, stdout,
//! stderr, timed_out, memory_exceeded, truncated, ...) and removes the
//! sandbox, also on Ctrl-C or SIGTERM. Outside checks attack the sandbox
//! through exactly this command, so its flags and output are a contract.
//! Thin wiring only: everything lives in the `arcticd-sandbox` crate.

use anyhow::{bail, Context, Result};
use arcticd_sandbox::docker::DockerBackend;
use arcticd_sandbox::image;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::{Backend, ExecRequest, Policy, Snapshot};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct SandboxArgs {
    #[command(subcommand)]
    pub command: SandboxCommand,
}

#[derive(clap::Subcommand)]
pub enum SandboxCommand {
    /// Run one command in a fresh sandbox made from a repository folder and
    /// print the result as JSON.
    Run(RunArgs),
    /// Build (or find cached) the Python base image: a debootstrapped Debian
    /// root file system, imported into Docker.
    BuildImage(BuildImageArgs),
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum BackendKind {
    Docker,
    Local,
}

#[derive(clap::Args)]
pub struct RunArgs {
    /// Which sandbox backend runs the command.
    #[arg(long, value_enum, default_value = "docker")]
    pub backend: BackendKind,
    /// Repository folder; its files (not its git history) become the
    /// sandbox's working tree.
    #[arg(long)]
    pub repo: PathBuf,
    /// Docker image tag, or for the local backend a tag built by
    /// `build-image` or a root file system folder.
    #[arg(long, default_value = image::DEFAULT_TAG, value_parser = crate::non_blank)]
    pub image: String,
    /// Command timeout in seconds.
    #[arg(long, default_value_t = 60.0, value_parser = crate::positive_number)]
    pub timeout: f64,
    /// Policy overrides as JSON, inline or a file (op_timeout_secs,
    /// output_cap_bytes, max_file_bytes, memory_bytes, disk_bytes,
    /// disk_inodes, cpus, pids_limit), e.g. '{"memory_bytes": 268435456}'.
    #[arg(long)]
    pub policy: Option<String>,
    /// The command and its arguments (no shell; use `sh -c '...'` for one).
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
}

#[derive(clap::Args)]
pub struct BuildImageArgs {
    /// Tag of the image (Docker tag and cache folder name).
    #[arg(long, default_value = image::DEFAULT_TAG, value_parser = crate::non_blank)]
    pub tag: String,
    /// Only build the root file system folder (for the local backend).
    #[arg(long)]
    pub no_docker: bool,
    /// Rebuild even when cached.
    #[arg(long)]
    pub force: bool,
}

pub fn main(args: SandboxArgs) -> Result<()> {
    let rt = arcticd_sandbox::runtime()?;
    match args.command {
        SandboxCommand::Run(a) => rt.block_on(run(a)),
        SandboxCommand::BuildImage(a) => rt.block_on(async {
            let report = image::build_base_image(&a.tag, !a.no_docker, a.force).await?;
            outln!("{}", serde_json::to_string_pretty(&report)?)?;
            Ok(())
        }),
    }
}

/// The base image the toy tasks run in, built when missing (cached by
/// tag); says how long a build took, after `who` (the command's name).
pub async fn ensure_base_image(docker: bool, who: &str) -> Result<()> {
    let built = image::build_base_image(image::DEFAULT_TAG, docker, false)
        .await
        .context(
            "building the sandbox base image (needs root and debootstrap: \
             apt-get install debootstrap, or run `arcticd sandbox build-image` once)",
        )?;
    if built.rootfs_built {
        eprintln!(
            "{who}: built the sandbox base image in {:.0} s",
            built.seconds
        );
    }
    Ok(())
}

async fn run(a: RunArgs) -> Result<()> {
    let mut policy = match &a.policy {
        Some(json) => crate::json_setting::<Policy>("--policy", json)?,
        None => Policy::default(),
    };
    policy.exec_timeout_secs = a.timeout;
    policy.validate()?;
    let repo = a.repo.clone();
    let snapshot =
        arcticd_sandbox::tokio::task::spawn_blocking(move || Snapshot::from_dir(&repo)).await??;
    let snapshot = Arc::new(snapshot);
    let backend: Box<dyn Backend> = match a.backend {
        BackendKind::Docker => Box::new(DockerBackend::new().await?),
        BackendKind::Local => Box::new(LocalBackend::new().await?),
    };
    let sandbox: Arc<dyn arcticd_sandbox::Sandbox> =
        Arc::from(backend.start(&snapshot, &a.image, &policy).await?);
    let work = {
        let sandbox = sandbox.clone();
        let cmd = a.cmd.clone();
        async move { sandbox.exec(ExecRequest::argv(cmd)).await }
    };
    use arcticd_sandbox::tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let outcome = arcticd_sandbox::tokio::select! {
        r = work => Some(r),
        _ = arcticd_sandbox::tokio::signal::ctrl_c() => None,
        _ = term.recv() => None,
    };
    let closed = sandbox.close().await;
    let Some(result) = outcome else {
        closed?;
        bail!("interrupted; sandbox removed");
    };
    let result = result?;
    closed?;
    outln!("{}", serde_json::to_string_pretty(&result)?)?;
    Ok(())
}
