//! Docker backend: one container per sandbox, driven over the Docker API
//! (bollard), no network, limited memory/CPU/pids, no capabilities, a
//! non-root user.
//!
//! Commands run through `docker exec` under a small shell wrapper: the
//! command gets its own session and process group (`setsid`), whose id the
//! wrapper writes to a file; the group is killed when the command ends and,
//! from a second exec, when its timeout fires, so no process of a command
//! outlives it unless it starts a session of its own. Files move through the archive API. Containers carry
//! [`LABEL`] and their owner's identity, and [`reap_orphans`] removes those
//! of dead owners when a backend is created. A task image that already
//! holds its repository at the workdir (SWE-bench style) is exported once
//! into a [`Snapshot`] ([`Backend::snapshot_from_image`]); every sandbox
//! gets an empty anonymous volume at the workdir (removed with the
//! container), so the image's own copy there, `.git` and all, is hidden
//! and the image's history never reaches the agent. That volume and `/tmp`
//! are tmpfs of `Policy::disk_bytes`; the image's file system is read-only. Not for building
//! images (see [`crate::image`]). The image must have `sh`, util-linux
//! `setsid`, `find` and `git`.

use crate::output::CappedOutput;
use crate::procs;
use crate::sandbox::{next_token, resolve_path};
use crate::snapshot::SnapshotCache;
use crate::{
    with_timeout, Backend, Error, ExecRequest, ExecResult, Policy, Result, Sandbox, Snapshot,
};
use async_trait::async_trait;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::models::{
    ContainerCreateBody, HostConfig, Mount, MountType, MountVolumeOptions,
    MountVolumeOptionsDriverConfig,
};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
    ListContainersOptionsBuilder, RemoveContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use bollard::Docker;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// Label on every container this crate creates.
pub const LABEL: &str = "arcticd.sandbox";
/// Label naming the creating process ("pid-starttime").
pub const OWNER_LABEL: &str = "arcticd.owner";
/// Label naming the creating host.
pub const HOST_LABEL: &str = "arcticd.host";

const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Limit of exporting one image's repository, seconds.
const EXPORT_TIMEOUT_SECS: f64 = 900.0;

/// The labels of every container this crate creates.
fn labels() -> HashMap<String, String> {
    HashMap::from([
        (LABEL.to_string(), "1".to_string()),
        (OWNER_LABEL.to_string(), procs::self_owner()),
        (HOST_LABEL.to_string(), procs::host_name()),
    ])
}

/// Connects to the local Docker daemon, with the API version negotiated
/// down to the daemon's.
pub async fn connect() -> Result<Docker> {
    let docker = Docker::connect_with_local_defaults()
        .map_err(|e| Error::Unavailable(format!("docker: {e}")))?;
    let docker = with_timeout("connecting to docker", 15.0, async {
        docker
            .negotiate_version()
            .await
            .map_err(|e| Error::Unavailable(format!("docker: {e}")))
    })
    .await?;
    Ok(docker)
}

/// Where a command's process group id is written, so the group can be
/// killed when the command ends or times out: a small tmpfs of its own,
/// apart from `/tmp`, so an agent that fills `/tmp` does not also leave its
/// later commands' groups unkillable.
const PIDFILE_DIR: &str = "/run/arcticd";

/// An empty anonymous volume at `target` (removed with its container),
/// held in memory by the local driver's tmpfs with mount options `o`.
fn tmpfs_volume(target: &str, o: String) -> Mount {
    Mount {
        target: Some(target.to_string()),
        typ: Some(MountType::VOLUME),
        volume_options: Some(MountVolumeOptions {
            // Docker must not seed the volume from the image's folder.
            no_copy: Some(true),
            labels: Some(labels()),
            driver_config: Some(MountVolumeOptionsDriverConfig {
                name: Some("local".into()),
                options: Some(HashMap::from([
                    ("type".to_string(), "tmpfs".to_string()),
                    ("device".to_string(), "tmpfs".to_string()),
                    ("o".to_string(), o),
                ])),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Removes every labelled container on this host whose owning process is
/// gone (a crash or SIGKILL of an earlier run). Returns how many it removed.
pub async fn reap_orphans(docker: &Docker) -> Result<usize> {
    let filters: HashMap<&str, Vec<&str>> = HashMap::from([("label", vec![LABEL])]);
    let list = docker
        .list_containers(Some(
            ListContainersOptionsBuilder::new()
                .all(true)
                .filters(&filters)
                .build(),
        ))
        .await?;
    let host = procs::host_name();
    let mut removed = 0;
    for c in list {
        let (Some(id), Some(labels)) = (c.id, c.labels) else {
            continue;
        };
        let owner = labels.get(OWNER_LABEL).map(String::as_str).unwrap_or("");
        let same_host = labels.get(HOST_LABEL).map(String::as_str) == Some(host.as_str());
        if same_host && !procs::owner_alive(owner) {
            tracing::info!(container = %id, owner, "reaping orphaned sandbox container");
            remove(docker, &id).await?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Every labelled sandbox container on the daemon: id and labels.
pub async fn list_labelled(docker: &Docker) -> Result<Vec<(String, HashMap<String, String>)>> {
    let filters: HashMap<&str, Vec<&str>> = HashMap::from([("label", vec![LABEL])]);
    let list = docker
        .list_containers(Some(
            ListContainersOptionsBuilder::new()
                .all(true)
                .filters(&filters)
                .build(),
        ))
        .await?;
    Ok(list
        .into_iter()
        .filter_map(|c| Some((c.id?, c.labels.unwrap_or_default())))
        .collect())
}

/// Every labelled container made by this process, for checks that nothing
/// leaked.
pub async fn list_own(docker: &Docker) -> Result<Vec<String>> {
    let owner = format!("{OWNER_LABEL}={}", procs::self_owner());
    let filters: HashMap<&str, Vec<&str>> = HashMap::from([("label", vec![owner.as_str()])]);
    let list = docker
        .list_containers(Some(
            ListContainersOptionsBuilder::new()
                .all(true)
                .filters(&filters)
                .build(),
        ))
        .await?;
    Ok(list.into_iter().filter_map(|c| c.id).collect())
}

/// Creates the container `name` from `body`; its id. An image Docker does
/// not have is an error naming `image` and what to do (`fix`).
async fn create_container(
    docker: &Docker,
    name: &str,
    body: ContainerCreateBody,
    image: &str,
    fix: &str,
) -> Result<String> {
    match docker
        .create_container(
            Some(CreateContainerOptionsBuilder::new().name(name).build()),
            body,
        )
        .await
    {
        Ok(c) => Ok(c.id),
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404,
            message,
        }) => Err(Error::Image(format!(
            "image {image} is not available locally ({message}); {fix}"
        ))),
        Err(e) => Err(e.into()),
    }
}

async fn remove(docker: &Docker, id: &str) -> Result<()> {
    let opts = RemoveContainerOptionsBuilder::new()
        .force(true)
        .v(true)
        .build();
    match docker.remove_container(id, Some(opts)).await {
        Ok(()) => Ok(()),
        // Already gone (or being removed by someone else): the goal is met.
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404 | 409,
            ..
        }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Removes a container from a private thread and runtime: for `Drop`,
/// which cannot await and may run while the caller's runtime shuts down.
/// If even this fails, the next start's reaper removes it.
fn remove_detached(id: String) {
    let handle = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            let removal = async {
                let docker = connect().await?;
                remove(&docker, &id).await
            };
            if let Err(e) = with_timeout("removing a container", 30.0, removal).await {
                tracing::warn!(container = %id, "could not remove container: {e}");
            }
        });
    });
    let _ = handle.join();
}

/// A created, never started container whose files are read; removed on
/// drop, so a cancelled or failed export leaves nothing behind.
struct ExportContainer {
    docker: Docker,
    id: String,
    removed: bool,
}

impl ExportContainer {
    async fn remove(mut self) -> Result<()> {
        self.removed = true;
        remove(&self.docker, &self.id).await
    }
}

impl Drop for ExportContainer {
    fn drop(&mut self) {
        if !self.removed {
            remove_detached(self.id.clone());
        }
    }
}

/// Copies `workdir` of `image` into a fresh snapshot: a container is
/// created from the image (never started, so nothing of the image runs),
/// the archive of `workdir` downloaded to a private folder and unpacked,
/// the container removed, and the folder snapshotted (its `.git` dropped).
async fn export_workdir(docker: &Docker, image: &str, workdir: &str) -> Result<Snapshot> {
    let workdir = workdir.trim_end_matches('/');
    let Some(base) = std::path::Path::new(workdir).file_name() else {
        return Err(Error::InvalidInput(format!(
            "workdir {workdir:?} cannot be a repository"
        )));
    };
    if !workdir.starts_with('/') || workdir.split('/').any(|c| c == "..") {
        return Err(Error::InvalidInput(format!(
            "workdir {workdir:?} must be an absolute path without `..`"
        )));
    }
    let base = base.to_owned();
    let body = ContainerCreateBody {
        image: Some(image.to_string()),
        cmd: Some(vec!["true".into()]),
        entrypoint: Some(vec![]),
        labels: Some(labels()),
        network_disabled: Some(true),
        host_config: Some(HostConfig {
            network_mode: Some("none".into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let name = format!("arcticd-export-{}-{}", procs::self_owner(), next_token());
    let id = create_container(docker, &name, body, image, "pull or build it first").await?;
    let container = ExportContainer {
        docker: docker.clone(),
        id,
        removed: false,
    };
    let dir = tempfile::Builder::new()
        .prefix("arcticd-export-")
        .tempdir()
        .map_err(|e| Error::io("creating the export folder", e))?;
    let tar_path = dir.path().join("tree.tar");
    let mut file = tokio::fs::File::create(&tar_path)
        .await
        .map_err(|e| Error::io("creating the export archive", e))?;
    let mut stream = docker.download_from_container(
        &container.id,
        Some(
            DownloadFromContainerOptionsBuilder::new()
                .path(workdir)
                .build(),
        ),
    );
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => {
                return Err(Error::Image(format!(
                    "image {image} has no repository folder {workdir}"
                )))
            }
            Err(e) => return Err(e.into()),
        };
        file.write_all(&chunk)
            .await
            .map_err(|e| Error::io("writing the export archive", e))?;
    }
    file.flush()
        .await
        .map_err(|e| Error::io("writing the export archive", e))?;
    drop(file);
    container.remove().await?;
    let (image, workdir) = (image.to_string(), workdir.to_string());
    tokio::task::spawn_blocking(move || {
        let root = dir.path().join("root");
        let io = |e| Error::io(format!("unpacking {workdir} of image {image}"), e);
        std::fs::create_dir(&root).map_err(io)?;
        let f = std::fs::File::open(&tar_path).map_err(io)?;
        let mut ar = tar::Archive::new(std::io::BufReader::new(f));
        // Modes matter (executable scripts); owners do not (the snapshot
        // is re-owned by the sandbox user). Set-id bits and group / other
        // write are dropped: these files sit on the host until snapshotted.
        ar.set_preserve_permissions(true);
        ar.set_mask(0o7022);
        ar.unpack(&root).map_err(io)?;
        std::fs::remove_file(&tar_path).map_err(io)?;
        let tree = root.join(&base);
        match std::fs::symlink_metadata(&tree) {
            Ok(m) if m.is_dir() => Snapshot::from_dir(&tree),
            _ => Err(Error::Image(format!(
                "{workdir} in image {image} is not a folder"
            ))),
        }
    })
    .await
    .map_err(|e| Error::Snapshot(format!("export worker failed: {e}")))?
}

/// Starts Docker sandboxes.
#[derive(Clone)]
pub struct DockerBackend {
    docker: Docker,
    snapshots: SnapshotCache,
}

impl DockerBackend {
    /// Connects to the daemon and, once per process, reaps orphans.
    pub async fn new() -> Result<Self> {
        static REAPED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        let docker = connect().await?;
        REAPED
            .get_or_try_init(|| async {
                with_timeout("reaping orphaned containers", 60.0, reap_orphans(&docker))
                    .await
                    .map(|_| ())
            })
            .await?;
        Ok(DockerBackend {
            docker,
            snapshots: SnapshotCache::default(),
        })
    }

    pub fn client(&self) -> &Docker {
        &self.docker
    }

    /// Whether `image` exists locally.
    pub async fn has_image(&self, image: &str) -> Result<bool> {
        match self.docker.inspect_image(image).await {
            Ok(_) => Ok(true),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

#[async_trait]
impl Backend for DockerBackend {
    fn name(&self) -> &'static str {
        "docker"
    }

    async fn snapshot_from_image(&self, image: &str, workdir: &str) -> Result<Arc<Snapshot>> {
        let op = format!("exporting {workdir} of image {image}");
        self.snapshots
            .get_or_make(image, workdir, || {
                with_timeout(
                    &op,
                    EXPORT_TIMEOUT_SECS,
                    export_workdir(&self.docker, image, workdir),
                )
            })
            .await
    }

    async fn start(
        &self,
        snapshot: &Arc<Snapshot>,
        image: &str,
        policy: &Policy,
    ) -> Result<Box<dyn Sandbox>> {
        policy.validate()?;
        let (uid, gid) = policy.uid_gid()?;
        let policy = policy.clone();
        let snapshot = snapshot.clone();
        let image = image.to_string();
        let docker = self.docker.clone();
        let op_timeout = policy.op_timeout_secs;
        with_timeout("starting a docker sandbox", op_timeout, async move {
            // Entries relative to the workdir, uploaded into it: the image's
            // file system, where its parent is, is read-only.
            let snap = snapshot.clone();
            let tar = tokio::task::spawn_blocking(move || snap.to_tar(".", uid, gid))
                .await
                .map_err(|e| Error::Sandbox(format!("snapshot archiver failed: {e}")))??;

            let name = format!("arcticd-{}-{}", procs::self_owner(), next_token());
            let disk = format!(
                "size={},nr_inodes={}",
                policy.disk_bytes, policy.disk_inodes
            );
            let memory = i64::try_from(policy.memory_bytes)
                .map_err(|_| Error::InvalidInput("memory_bytes too large".into()))?;
            let body = ContainerCreateBody {
                image: Some(image.clone()),
                cmd: Some(vec!["sleep".into(), "infinity".into()]),
                entrypoint: Some(vec![]),
                user: Some(policy.user.clone()),
                env: Some(vec![
                    PATH_ENV.into(),
                    "HOME=/tmp".into(),
                    "LANG=C.UTF-8".into(),
                ]),
                labels: Some(labels()),
                network_disabled: Some(true),
                host_config: Some(HostConfig {
                    network_mode: Some("none".into()),
                    // The snapshot goes into an empty volume: whatever the
                    // image holds at the workdir (a task image's repository
                    // with its history) stays hidden below it. It and /tmp
                    // are volumes in memory (tmpfs) of the disk limits, so
                    // a full one gives ENOSPC, not a full host disk;
                    // volumes, not Docker's tmpfs mounts, since only a
                    // volume takes files through the archive API.
                    mounts: Some(vec![
                        tmpfs_volume(
                            &policy.workdir,
                            format!("{disk},uid={uid},gid={gid},mode=0755"),
                        ),
                        tmpfs_volume("/tmp", format!("{disk},mode=1777")),
                    ]),
                    // Nothing else is writable, but the small folder of
                    // the exec wrapper's pid files.
                    readonly_rootfs: Some(true),
                    tmpfs: Some(HashMap::from([(
                        PIDFILE_DIR.to_string(),
                        "size=1m,nr_inodes=4096,mode=1777".to_string(),
                    )])),
                    memory: Some(memory),
                    memory_swap: Some(memory),
                    nano_cpus: Some((policy.cpus * 1e9) as i64),
                    pids_limit: Some(policy.pids_limit),
                    cap_drop: Some(vec!["ALL".into()]),
                    security_opt: Some(vec!["no-new-privileges".into()]),
                    privileged: Some(false),
                    init: Some(true),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let id = create_container(
                &docker,
                &name,
                body,
                &image,
                "build it with `arcticd sandbox build-image`",
            )
            .await?;
            // From here the container exists: the sandbox value owns it, so
            // any early return below removes it on drop.
            let sandbox = DockerSandbox {
                docker: docker.clone(),
                id,
                policy,
                commit: snapshot.commit().to_string(),
                closed: AtomicBool::new(false),
                oom_kills_seen: AtomicU64::new(0),
            };
            docker.start_container(&sandbox.id, None).await?;
            docker
                .upload_to_container(
                    &sandbox.id,
                    Some(
                        UploadToContainerOptionsBuilder::new()
                            .path(&sandbox.policy.workdir)
                            .build(),
                    ),
                    bollard::body_full(tar.into()),
                )
                .await?;
            Ok(Box::new(sandbox) as Box<dyn Sandbox>)
        })
        .await
    }
}

/// One running container.
pub struct DockerSandbox {
    docker: Docker,
    id: String,
    policy: Policy,
    commit: String,
    closed: AtomicBool,
    oom_kills_seen: AtomicU64,
}

struct RawOutput {
    exit_code: Option<i64>,
    stdout: CappedOutput,
    stderr: CappedOutput,
    timed_out: bool,
}

impl DockerSandbox {
    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// One `docker exec` with the output capped and a deadline; the process is
    /// left running when the deadline passes (the caller kills it).
    async fn raw_exec(
        &self,
        cmd: Vec<String>,
        workdir: &str,
        stdin: Option<Vec<u8>>,
        timeout: f64,
        cap: usize,
    ) -> Result<RawOutput> {
        let exec = self
            .docker
            .create_exec(
                &self.id,
                CreateExecOptions {
                    attach_stdin: Some(stdin.is_some()),
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    cmd: Some(cmd),
                    user: Some(self.policy.user.clone()),
                    working_dir: Some(workdir.to_string()),
                    ..Default::default()
                },
            )
            .await?;
        let mut stdout = CappedOutput::new(cap);
        let mut stderr = CappedOutput::new(cap);
        let started = self
            .docker
            .start_exec(
                &exec.id,
                Some(StartExecOptions {
                    detach: false,
                    tty: false,
                    output_capacity: None,
                }),
            )
            .await?;
        let StartExecResults::Attached { mut output, input } = started else {
            return Err(Error::Sandbox("docker exec did not attach".into()));
        };
        let writer = stdin.map(|data| {
            let mut input = input;
            tokio::spawn(async move {
                // A command that exits without reading its input closes the
                // pipe; that is not an error of the sandbox.
                let _ = input.write_all(&data).await;
                let _ = input.shutdown().await;
            })
        });
        let collect = async {
            while let Some(item) = output.next().await {
                match item? {
                    LogOutput::StdOut { message } => stdout.push(&message),
                    LogOutput::StdErr { message } => stderr.push(&message),
                    _ => {}
                }
            }
            Ok::<(), Error>(())
        };
        let timed_out = match tokio::time::timeout(crate::limit(timeout)?, collect).await {
            Ok(r) => {
                r?;
                false
            }
            Err(_) => true,
        };
        if let Some(w) = writer {
            w.abort();
        }
        let mut exit_code = None;
        if !timed_out {
            // The stream ends when the process's output closes; the exit code
            // appears a moment later.
            for _ in 0..50 {
                let info = self.docker.inspect_exec(&exec.id).await?;
                if info.running != Some(true) {
                    exit_code = info.exit_code;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(RawOutput {
            exit_code,
            stdout,
            stderr,
            timed_out,
        })
    }

    /// Kills the process group recorded in `pidfile`, repeating until it is
    /// empty (a fork bomb keeps refilling it for a moment). The killer is
    /// itself a process in the sandbox: while a bomb holds every slot of the
    /// pids limit it may fail to start, so it is retried until it reports
    /// the group gone (exit 0).
    async fn kill_group(&self, pidfile: &str) -> Result<()> {
        let script = r#"i=0
while [ ! -s "$0" ] && [ $i -lt 20 ]; do i=$((i+1)); sleep 0.05; done
p=$(cat "$0" 2>/dev/null) || exit 0
i=0
while kill -9 -"$p" 2>/dev/null; do
  i=$((i+1)); [ $i -lt 400 ] || exit 3; sleep 0.02
done
rm -f "$0"; exit 0"#;
        for _ in 0..50 {
            let cmd = vec!["sh".into(), "-c".into(), script.into(), pidfile.to_string()];
            let r = self.raw_exec(cmd, "/", None, 30.0, 4096).await;
            if matches!(&r, Ok(r) if !r.timed_out && r.exit_code == Some(0)) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(Error::Sandbox("could not kill a timed-out command".into()))
    }

    /// Whether the container's memory cgroup recorded a new OOM kill.
    async fn new_oom_kill(&self) -> Result<bool> {
        let cmd = vec![
            "sh".into(),
            "-c".into(),
            "cat /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control 2>/dev/null"
                .into(),
        ];
        let r = self.raw_exec(cmd, "/", None, 10.0, 8192).await?;
        let count = parse_oom_kill_count(&r.stdout.text());
        let before = self.oom_kills_seen.fetch_max(count, Ordering::SeqCst);
        Ok(count > before)
    }
}

/// The `oom_kill N` counter of a cgroup v1 `memory.oom_control` or v2
/// `memory.events` file (0 when absent).
pub(crate) fn parse_oom_kill_count(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.strip_prefix("oom_kill "))
        .filter_map(|n| n.trim().parse::<u64>().ok())
        .max()
        .unwrap_or(0)
}

#[async_trait]
impl Sandbox for DockerSandbox {
    fn id(&self) -> &str {
        &self.id
    }

    fn policy(&self) -> &Policy {
        &self.policy
    }

    fn snapshot_commit(&self) -> &str {
        &self.commit
    }

    async fn exec(&self, req: ExecRequest) -> Result<ExecResult> {
        self.check_open()?;
        validate_request(&req)?;
        let timeout = req.timeout_secs.unwrap_or(self.policy.exec_timeout_secs);
        let cap = req.output_cap_bytes.unwrap_or(self.policy.output_cap_bytes);
        let workdir = match &req.workdir {
            Some(w) => resolve_path(&self.policy, w)?,
            None => self.policy.workdir.clone(),
        };
        let pidfile = format!("{PIDFILE_DIR}/exec-{}.pid", next_token());
        // The outer shell stays outside the command's session: it waits for
        // the command (a session and process group leader, whose id it
        // records), then kills whatever the command left in its group, so no
        // process outlives its command (as with the local backend). Its exit
        // status is the command's, 128+N for signal N.
        let mut cmd: Vec<String> = vec![
            "sh".into(),
            "-c".into(),
            r#"f=$1; shift
setsid -w sh -c '{ echo $$ > "$0"; } 2>/dev/null; exec "$@"' "$f" "$@"; rc=$?
if p=$(cat "$f" 2>/dev/null); then i=0; while kill -9 -"$p" 2>/dev/null && [ $i -lt 200 ]; do i=$((i+1)); done; fi
rm -f "$f"; exit $rc"#
                .into(),
            "sh".into(),
            pidfile.clone(),
        ];
        cmd.extend(req.argv.iter().cloned());
        let t0 = Instant::now();
        let raw = self
            .raw_exec(cmd, &workdir, req.stdin, timeout, cap)
            .await?;
        if raw.timed_out {
            self.kill_group(&pidfile).await?;
        }
        let memory_exceeded = raw.exit_code == Some(137) && self.new_oom_kill().await?;
        Ok(ExecResult::new(
            raw.exit_code,
            raw.stdout,
            raw.stderr,
            raw.timed_out,
            memory_exceeded,
            t0.elapsed(),
        ))
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        self.check_open()?;
        let path = resolve_path(&self.policy, path)?;
        let limit = self.policy.max_file_bytes;
        with_timeout("reading a file", self.policy.op_timeout_secs, async {
            let mut stream = self.docker.download_from_container(
                &self.id,
                Some(
                    DownloadFromContainerOptionsBuilder::new()
                        .path(&path)
                        .build(),
                ),
            );
            let mut tar = Vec::new();
            while let Some(chunk) = stream.next().await {
                let chunk = match chunk {
                    Ok(c) => c,
                    Err(bollard::errors::Error::DockerResponseServerError {
                        status_code: 404,
                        ..
                    }) => return Err(Error::Sandbox(format!("{path}: no such file"))),
                    Err(e) => return Err(e.into()),
                };
                tar.extend_from_slice(&chunk);
                // Tar headers and padding add at most a few KiB to the file.
                if tar.len() as u64 > limit + 64 * 1024 {
                    return Err(Error::TooLarge {
                        what: path.clone(),
                        limit,
                    });
                }
            }
            read_single_file(&tar, &path, limit)
        })
        .await
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        self.check_open()?;
        let path = resolve_path(&self.policy, path)?;
        if data.len() as u64 > self.policy.max_file_bytes {
            return Err(Error::TooLarge {
                what: path,
                limit: self.policy.max_file_bytes,
            });
        }
        let (parent, name) = split_parent(&path)?;
        let (uid, gid) = self.policy.uid_gid()?;
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_uid(uid as u64);
        header.set_gid(gid as u64);
        header.set_mtime(0);
        let mut b = tar::Builder::new(Vec::new());
        b.append_data(&mut header, name, data)
            .map_err(|e| Error::io("building the upload", e))?;
        let tar = b
            .into_inner()
            .map_err(|e| Error::io("building the upload", e))?;
        with_timeout("writing a file", self.policy.op_timeout_secs, async {
            match self
                .docker
                .upload_to_container(
                    &self.id,
                    Some(UploadToContainerOptionsBuilder::new().path(parent).build()),
                    bollard::body_full(tar.into()),
                )
                .await
            {
                Ok(()) => Ok(()),
                Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 404, ..
                }) => Err(Error::Sandbox(format!("{parent}: no such folder"))),
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    async fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        with_timeout(
            "removing a container",
            self.policy.op_timeout_secs,
            remove(&self.docker, &self.id),
        )
        .await
    }
}

impl Drop for DockerSandbox {
    fn drop(&mut self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        remove_detached(self.id.clone());
    }
}

pub(crate) fn validate_request(req: &ExecRequest) -> Result<()> {
    if req.argv.is_empty() {
        return Err(Error::InvalidInput("empty command".into()));
    }
    if req.argv.iter().any(|a| a.contains('\0')) {
        return Err(Error::InvalidInput("command contains a NUL byte".into()));
    }
    if let Some(t) = req.timeout_secs {
        if !crate::timeout_ok(t) {
            return Err(Error::InvalidInput(format!("bad timeout {t}")));
        }
    }
    if req.output_cap_bytes == Some(0) || req.output_cap_bytes == Some(1) {
        return Err(Error::InvalidInput("output cap must be at least 2".into()));
    }
    Ok(())
}

fn split_parent(path: &str) -> Result<(&str, &str)> {
    let (parent, name) = path
        .rsplit_once('/')
        .ok_or_else(|| Error::InvalidInput(format!("bad path {path}")))?;
    if name.is_empty() || name == "." || name == ".." {
        return Err(Error::InvalidInput(format!("bad file name in {path}")));
    }
    Ok((if parent.is_empty() { "/" } else { parent }, name))
}

fn read_single_file(tar: &[u8], path: &str, limit: u64) -> Result<Vec<u8>> {
    let io = |e| Error::io(format!("reading the archive of {path}"), e);
    let mut ar = tar::Archive::new(tar);
    let mut entries = ar.entries().map_err(io)?;
    let Some(entry) = entries.next() else {
        return Err(Error::Sandbox(format!("{path}: empty archive")));
    };
    let mut entry = entry.map_err(io)?;
    if entry.header().entry_type() != tar::EntryType::Regular {
        return Err(Error::Sandbox(format!("{path} is not a regular file")));
    }
    if entry.size() > limit {
        return Err(Error::TooLarge {
            what: path.to_string(),
            limit,
        });
    }
    let mut out = Vec::with_capacity(entry.size() as usize);
    std::io::Read::read_to_end(&mut entry, &mut out).map_err(io)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_oom_counters_of_both_cgroup_versions() {
        assert_eq!(
            parse_oom_kill_count("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
            3
        );
        assert_eq!(
            parse_oom_kill_count("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n"),
            2
        );
        assert_eq!(parse_oom_kill_count(""), 0);
    }

    #[test]
    fn splits_paths() {
        assert_eq!(split_parent("/testbed/a.py").unwrap(), ("/testbed", "a.py"));
        assert_eq!(split_parent("/a").unwrap(), ("/", "a"));
        assert!(split_parent("/testbed/").is_err());
        assert!(split_parent("/testbed/..").is_err());
    }

    #[test]
    fn rejects_bad_requests() {
        assert!(validate_request(&ExecRequest::default()).is_err());
        assert!(validate_request(&ExecRequest::argv(["a\0b"])).is_err());
        assert!(validate_request(&ExecRequest::argv(["true"]).timeout(-1.0)).is_err());
        assert!(validate_request(&ExecRequest::argv(["true"])).is_ok());
    }
}
