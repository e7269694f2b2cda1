//! Local backend: bubblewrap namespaces and cgroup limits, for machines
//! without Docker.
//!
//! Why bubblewrap rather than raw `unshare`/`clone` calls: it is a small,
//! audited, widely packaged tool that sets up user, mount, pid, network, IPC
//! and UTS namespaces, drops capabilities and applies `--die-with-parent` in
//! the right order; doing that by hand from a multi-threaded tokio process
//! (fork + unsafe pre-exec code) is where sandbox bugs live.
//!
//! Layout of one sandbox: an empty tmpfs root, remounted read-only, with the
//! image's top-level folders bound read-only into it; the sandbox's own copy
//! of the repository bound read-write at the workdir and a private folder at
//! `/tmp`, both on the sandbox's own tmpfs of `Policy::disk_bytes` and
//! `disk_inodes` (a full one gives ENOSPC, as a full disk does; its pages
//! count against the sandbox's memory limit; without the right to mount it
//! is a plain folder and a warning says disk use is unbounded); a fresh
//! `/proc`, read-only, and a minimal `/dev`; a new network
//! namespace with only loopback. The sandbox's user is, on the host, an
//! unprivileged user without capabilities (bubblewrap maps it so): the
//! user that runs arcticd, or, when that is root, the user `nobody`
//! ([`HOST_USER`]): bubblewrap itself is started as that user
//! (`setpriv`), and the sandbox's folder and working copy are given to it.
//! Where that cannot work (no `setpriv`, user namespaces closed to
//! unprivileged users, or an image folder that user cannot reach, such as
//! one under `/root`) a warning says so and the sandbox's user is host root
//! without capabilities, as a user that runs arcticd as root may choose:
//! then the read-only `/proc` keeps host-wide kernel settings out of reach.
//! Either way the sandboxes' folder is private (0700, or 0711 with each
//! sandbox's own folder 0700 and owned by `nobody`) so that no other host
//! user can run what an agent wrote there, and no descriptor of the
//! launching process crosses the exec. Each command is one bubblewrap run
//! (its pid namespace dies with it, so nothing outlives a command) entered
//! into the sandbox's cgroups (memory without swap, pids, CPU) by a tiny
//! host shell before it execs bubblewrap. Bubblewrap reports the command's
//! exit on a status pipe, so a failure of its own setup is told apart from
//! the command's exit 1: a start refused for want of pids (a finished
//! command's are released up to about two seconds late) is tried again, as
//! the command never ran. Needs `bwrap` on PATH and a writable cgroup (v1
//! controllers or a v2 subtree with memory and pids delegated; root has
//! both).
//! Not for Docker images: the image is a root file system folder, as made by
//! [`crate::image`].

use crate::output::CappedOutput;
use crate::procs;
use crate::sandbox::{next_token, resolve_path};
use crate::snapshot::{copy_staged, folder_below, SnapshotCache};
use crate::{
    with_timeout, Backend, Error, ExecRequest, ExecResult, Policy, Result, Sandbox, Snapshot,
};
use async_trait::async_trait;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

const PREFIX: &str = "arcticd-";

/// The unprivileged host user (uid, gid) that sandboxes of an arcticd run
/// by root run as: `nobody`/`nogroup`.
pub const HOST_USER: (u32, u32) = (65534, 65534);

/// Where a sandbox's limits live.
#[derive(Debug, Clone)]
enum Cgroups {
    /// cgroup v1: one folder per controller.
    V1 {
        memory: PathBuf,
        pids: PathBuf,
        cpu: Option<PathBuf>,
    },
    /// cgroup v2: one folder in a subtree with memory and pids enabled.
    V2 { base: PathBuf },
}

/// Starts local sandboxes.
#[derive(Debug, Clone)]
pub struct LocalBackend {
    state_dir: PathBuf,
    cgroups: Cgroups,
    snapshots: SnapshotCache,
    /// The host user sandboxes run as when it is not this process's own
    /// ([`HOST_USER`], for a process run by root that can drop to it).
    host_user: Option<(u32, u32)>,
}

/// Checks that `dir` is a folder of this process's user, not a link (a
/// predictable name in a shared temp folder could be planted by another
/// user), and makes it private (`mode`: 0700, or 0711 when each sandbox's
/// own folder below is private to the sandbox's host user): sandboxes
/// write files there, set-uid bits included, which no other host user may
/// reach.
fn private_dir(dir: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
    // /proc/self belongs to this process's effective user.
    let me = std::fs::metadata("/proc/self")
        .map_err(|e| Error::io("reading /proc/self", e))?
        .uid();
    if !meta.is_dir() || meta.uid() != me {
        return Err(Error::Unavailable(format!(
            "{} is not a folder of this user (uid {me}; a link, or owned by uid {}): \
             set ARCTICD_LOCAL_DIR to a folder of your own",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o777 != mode {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io(format!("making {} private", dir.display()), e))?;
    }
    Ok(())
}

/// The effective user of this process.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The command prefix that starts what follows as `user`, with no
/// supplementary groups (util-linux `setpriv`).
fn as_user((uid, gid): (u32, u32)) -> [String; 5] {
    [
        "setpriv".into(),
        format!("--reuid={uid}"),
        format!("--regid={gid}"),
        "--clear-groups".into(),
        "--".into(),
    ]
}

/// For a process run by root: whether bubblewrap starts as [`HOST_USER`]
/// (`setpriv` present, user namespaces open to unprivileged users). When
/// not, says why once; sandboxes then run as host root without
/// capabilities.
async fn probe_host_user() -> Option<(u32, u32)> {
    let user = HOST_USER;
    let [setpriv, rest @ ..] = as_user(user);
    let out = tokio::process::Command::new(setpriv)
        .args(rest)
        .args([
            "bwrap",
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
        ])
        .args(["--ro-bind", "/", "/", "--", "true"])
        .stdin(Stdio::null())
        .output()
        .await;
    let why = match out {
        Ok(o) if o.status.success() => return Some(user),
        Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
        Err(e) => format!("setpriv: {e}"),
    };
    tracing::warn!(
        "local sandboxes run as host root without capabilities: bubblewrap cannot start as \
         uid {} ({why}); running arcticd as an ordinary user is the stronger setting",
        user.0
    );
    None
}

/// Whether `user` can reach `path`: every folder from the root down to it
/// (links resolved) searchable by that user (by owner, group or other
/// bits).
fn reachable_by(path: &Path, (uid, gid): (u32, u32)) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(path) = std::fs::canonicalize(path) else {
        return false;
    };
    path.ancestors().all(|p| {
        std::fs::metadata(p).is_ok_and(|m| {
            let bit = if m.uid() == uid {
                0o100
            } else if m.gid() == gid {
                0o010
            } else {
                0o001
            };
            m.mode() & bit != 0
        })
    })
}

/// Gives `dir` and everything below it (links themselves, not followed)
/// to `user`.
fn give_tree(dir: &Path, user: (u32, u32)) -> Result<()> {
    let io = |e| Error::io(format!("giving {} to the sandbox user", dir.display()), e);
    std::os::unix::fs::lchown(dir, Some(user.0), Some(user.1)).map_err(io)?;
    if std::fs::symlink_metadata(dir).map_err(io)?.is_dir() {
        for entry in std::fs::read_dir(dir).map_err(io)? {
            give_tree(&entry.map_err(io)?.path(), user)?;
        }
    }
    Ok(())
}

/// Whether the bubblewrap of `version` (its `--version` line) writes the
/// command's exit code to its status descriptor (0.3.2 and later).
fn reports_exit_codes(version: &str) -> bool {
    let numbers: Vec<u32> = version
        .trim()
        .rsplit(' ')
        .next()
        .unwrap_or("")
        .split('.')
        .map_while(|n| n.parse().ok())
        .collect();
    let part = |i: usize| numbers.get(i).copied().unwrap_or(0);
    numbers.len() >= 2 && (part(0), part(1), part(2)) >= (0, 3, 2)
}

impl LocalBackend {
    /// Checks bubblewrap and cgroups are usable and, once per process, reaps
    /// sandbox folders and cgroups of dead owners. Sandbox folders live under
    /// `$ARCTICD_LOCAL_DIR`, default `arcticd-local` in the temp folder.
    pub async fn new() -> Result<Self> {
        let out = tokio::process::Command::new("bwrap")
            .arg("--version")
            .output()
            .await
            .map_err(|e| {
                Error::Unavailable(format!("bwrap not found ({e}); install bubblewrap"))
            })?;
        if !out.status.success() {
            return Err(Error::Unavailable("bwrap --version failed".into()));
        }
        let said = String::from_utf8_lossy(&out.stdout);
        if !reports_exit_codes(&said) {
            return Err(Error::Unavailable(format!(
                "{} is too old: bubblewrap 0.3.2 or newer reports a command's exit apart \
                 from its own failures (--json-status-fd)",
                said.trim()
            )));
        }
        let state_dir = std::env::var_os("ARCTICD_LOCAL_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("arcticd-local"));
        std::fs::create_dir_all(&state_dir)
            .map_err(|e| Error::io(format!("creating {}", state_dir.display()), e))?;
        let host_user = match euid() {
            0 => probe_host_user().await,
            _ => None,
        };
        // The host user must pass through the folder to its sandbox's own.
        private_dir(&state_dir, if host_user.is_some() { 0o711 } else { 0o700 })?;
        let cgroups = find_cgroups()?;
        let backend = LocalBackend {
            state_dir,
            cgroups,
            snapshots: SnapshotCache::default(),
            host_user,
        };
        static REAPED: std::sync::Once = std::sync::Once::new();
        REAPED.call_once(|| {
            backend.reap_orphans();
        });
        Ok(backend)
    }

    /// Removes sandbox folders and cgroups whose owner process is gone.
    pub fn reap_orphans(&self) -> usize {
        let mut n = 0;
        if let Ok(rd) = std::fs::read_dir(&self.state_dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if procs::orphaned(&name, PREFIX) {
                    match remove_sandbox_dir(&e.path()) {
                        Ok(()) => n += 1,
                        Err(err) => tracing::warn!(
                            "cannot remove the leftover sandbox folder {}: {err}",
                            e.path().display()
                        ),
                    }
                }
            }
        }
        for base in self.cgroup_bases() {
            if let Ok(rd) = std::fs::read_dir(&base) {
                for e in rd.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if procs::orphaned(&name, PREFIX) {
                        kill_cgroup(&e.path());
                        let _ = std::fs::remove_dir(e.path());
                    }
                }
            }
        }
        n
    }

    fn cgroup_bases(&self) -> Vec<PathBuf> {
        match &self.cgroups {
            Cgroups::V1 { memory, pids, cpu } => {
                let mut v = vec![memory.clone(), pids.clone()];
                v.extend(cpu.clone());
                v
            }
            Cgroups::V2 { base } => vec![base.clone()],
        }
    }
}

/// Our own cgroup path for `controller` (v1) or the unified one (`""`).
fn own_cgroup(controller: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        let hit = if controller.is_empty() {
            ctrls.is_empty()
        } else {
            ctrls.split(',').any(|c| c == controller)
        };
        hit.then(|| path.trim_start_matches('/').to_string())
    })
}

fn c_path(p: &Path) -> std::io::Result<std::ffi::CString> {
    std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}

/// Mounts a tmpfs of `policy.disk_bytes` and `policy.disk_inodes` on the
/// new, empty sandbox folder `dir`, so a command cannot fill the host's
/// disk (it gets ENOSPC, as on a full disk). Without the right to mount
/// (not root), warns once and leaves the folder on the host's file system.
fn bound_disk(dir: &Path, policy: &Policy) -> Result<()> {
    let opts = format!(
        "size={},nr_inodes={},mode=0700",
        policy.disk_bytes, policy.disk_inodes
    );
    let io = |e| Error::io(format!("mounting a tmpfs on {}", dir.display()), e);
    let target = c_path(dir).map_err(io)?;
    let opts =
        std::ffi::CString::new(opts).map_err(|_| Error::InvalidInput("disk limits".into()))?;
    // SAFETY: every pointer is a valid NUL-terminated string for the call.
    let rc = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr().cast(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EPERM) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                "local sandboxes: disk use is not bounded (mounting a tmpfs needs root): \
                 a command can fill the file system of {}",
                dir.parent().unwrap_or(dir).display()
            )
        });
        return Ok(());
    }
    Err(io(e))
}

/// Removes a sandbox folder: its tmpfs, when it has one (detached, so
/// a process still holding a file there cannot keep it busy), then the
/// folder and whatever is left in it.
fn remove_sandbox_dir(dir: &Path) -> std::io::Result<()> {
    let target = c_path(dir)?;
    // SAFETY: `target` is a valid NUL-terminated path for the call. A folder
    // that is not a mount point gives EINVAL, which changes nothing.
    unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) };
    std::fs::remove_dir_all(dir)
}

fn writable_dir(p: &Path) -> bool {
    let Ok(c) = c_path(p) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    p.is_dir() && unsafe { libc::access(c.as_ptr(), libc::W_OK) } == 0
}

fn find_cgroups() -> Result<Cgroups> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        // v2. Our own cgroup holds processes, so it can only host children
        // when its controllers were delegated (systemd Delegate=yes);
        // otherwise use a dedicated subtree below the root (needs root).
        let has = |dir: &Path| {
            std::fs::read_to_string(dir.join("cgroup.subtree_control"))
                .map(|s| s.contains("memory") && s.contains("pids"))
                .unwrap_or(false)
        };
        if let Some(own) = own_cgroup("") {
            let base = root.join(own);
            if has(&base) && writable_dir(&base) {
                return Ok(Cgroups::V2 { base });
            }
        }
        let base = root.join("arcticd");
        if writable_dir(root) {
            std::fs::create_dir_all(&base)
                .map_err(|e| Error::io("creating the arcticd cgroup", e))?;
            let _ = std::fs::write(base.join("cgroup.subtree_control"), "+memory +pids +cpu");
            if has(&base) {
                return Ok(Cgroups::V2 { base });
            }
        }
        return Err(Error::Unavailable(
            "cgroup v2 without a writable subtree with memory and pids controllers \
             (run as root, or in a systemd scope with Delegate=yes)"
                .into(),
        ));
    }
    let v1 = |ctrl: &str| -> Option<PathBuf> {
        let base = root.join(ctrl).join(own_cgroup(ctrl)?);
        writable_dir(&base).then_some(base)
    };
    match (v1("memory"), v1("pids")) {
        (Some(memory), Some(pids)) => Ok(Cgroups::V1 {
            memory,
            pids,
            cpu: v1("cpu"),
        }),
        _ => Err(Error::Unavailable(
            "no writable memory and pids cgroups (cgroup v1); run as root".into(),
        )),
    }
}

/// Kills every process in a cgroup folder (best effort; used for orphans).
fn kill_cgroup(dir: &Path) {
    if std::fs::write(dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    for _ in 0..10 {
        let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) else {
            return;
        };
        if procs.trim().is_empty() {
            return;
        }
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            // SAFETY: plain kill(2) on a pid read from the cgroup.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The sandbox's own cgroup folders.
#[derive(Debug)]
struct SandboxCgroups {
    dirs: Vec<PathBuf>,
    memory: PathBuf,
    v2: bool,
}

impl SandboxCgroups {
    fn create(cg: &Cgroups, name: &str, policy: &Policy) -> Result<Self> {
        let write = |dir: &Path, file: &str, value: String| -> Result<()> {
            std::fs::write(dir.join(file), &value)
                .map_err(|e| Error::io(format!("setting {file}={value}"), e))
        };
        let mkdir = |p: PathBuf| -> Result<PathBuf> {
            std::fs::create_dir(&p)
                .map_err(|e| Error::io(format!("creating cgroup {}", p.display()), e))?;
            Ok(p)
        };
        match cg {
            Cgroups::V1 { memory, pids, cpu } => {
                let mut me = SandboxCgroups {
                    dirs: vec![],
                    memory: memory.join(name),
                    v2: false,
                };
                let m = mkdir(memory.join(name))?;
                me.dirs.push(m.clone());
                write(&m, "memory.limit_in_bytes", policy.memory_bytes.to_string())?;
                // Without swap accounting this file is absent; then there is
                // no swap to escape into either.
                if m.join("memory.memsw.limit_in_bytes").exists() {
                    write(
                        &m,
                        "memory.memsw.limit_in_bytes",
                        policy.memory_bytes.to_string(),
                    )?;
                }
                let p = mkdir(pids.join(name))?;
                me.dirs.push(p.clone());
                write(&p, "pids.max", policy.pids_limit.to_string())?;
                if let Some(cpu) = cpu {
                    let c = mkdir(cpu.join(name))?;
                    me.dirs.push(c.clone());
                    write(&c, "cpu.cfs_period_us", "100000".into())?;
                    write(
                        &c,
                        "cpu.cfs_quota_us",
                        ((policy.cpus * 100_000.0) as i64).to_string(),
                    )?;
                }
                Ok(me)
            }
            Cgroups::V2 { base } => {
                let d = mkdir(base.join(name))?;
                let me = SandboxCgroups {
                    dirs: vec![d.clone()],
                    memory: d.clone(),
                    v2: true,
                };
                write(&d, "memory.max", policy.memory_bytes.to_string())?;
                if d.join("memory.swap.max").exists() {
                    write(&d, "memory.swap.max", "0".into())?;
                }
                write(&d, "pids.max", policy.pids_limit.to_string())?;
                if d.join("cpu.max").exists() {
                    write(
                        &d,
                        "cpu.max",
                        format!("{} 100000", (policy.cpus * 100_000.0) as i64),
                    )?;
                }
                Ok(me)
            }
        }
    }

    fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.memory.join(file))
            .map(|t| crate::docker::parse_oom_kill_count(&t))
            .unwrap_or(0)
    }

    fn remove(&self) {
        for d in &self.dirs {
            kill_cgroup(d);
            for _ in 0..50 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

#[async_trait]
impl Backend for LocalBackend {
    fn name(&self) -> &'static str {
        "local"
    }

    async fn start(
        &self,
        snapshot: &Arc<Snapshot>,
        image: &str,
        policy: &Policy,
    ) -> Result<Box<dyn Sandbox>> {
        policy.validate()?;
        let (uid, gid) = policy.uid_gid()?;
        let rootfs = crate::image::resolve_rootfs(image)?;
        let host_user = self.host_user.filter(|&u| {
            let ok = reachable_by(&rootfs, u);
            // Said once per image folder, not once per sandbox.
            static WARNED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
            let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
            if !ok && !warned.contains(&rootfs) {
                tracing::warn!(
                    "local sandboxes of {} run as host root without capabilities: uid {} \
                     cannot reach that folder (put images where it can, e.g. with \
                     ARCTICD_IMAGE_DIR)",
                    rootfs.display(),
                    u.0
                );
                warned.push(rootfs.clone());
            }
            ok
        });
        let name = format!(
            "{PREFIX}{}-{}",
            procs::self_owner(),
            next_token().replace('-', "_")
        );
        let dir = self.state_dir.join(&name);
        let cgroups = self.cgroups.clone();
        let snap = snapshot.clone();
        let policy = policy.clone();
        let op_timeout = policy.op_timeout_secs;
        let setup = tokio::task::spawn_blocking(move || -> Result<LocalSandbox> {
            std::fs::create_dir(&dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
            // The value owns the folder from here: an error below removes it.
            let mut sb = LocalSandbox {
                name,
                dir: dir.clone(),
                rootfs,
                policy,
                uid,
                gid,
                host_user,
                commit: snap.commit().to_string(),
                cgroups: None,
                closed: AtomicBool::new(false),
                oom_kills_seen: AtomicU64::new(0),
            };
            bound_disk(&dir, &sb.policy)?;
            let work = dir.join("work");
            let tmp = dir.join("tmp");
            for d in [&work, &tmp] {
                std::fs::create_dir(d)
                    .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
            }
            copy_staged(snap.path(), &work)?;
            if let Some(user) = host_user {
                give_tree(&dir, user)?;
                // Private to that user (a folder not on its own tmpfs was
                // made with the default mode).
                std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                    .map_err(|e| Error::io(format!("making {} private", dir.display()), e))?;
            }
            sb.cgroups = Some(SandboxCgroups::create(&cgroups, &sb.name, &sb.policy)?);
            Ok(sb)
        });
        let sb = with_timeout("starting a local sandbox", op_timeout, async {
            setup
                .await
                .map_err(|e| Error::Sandbox(format!("sandbox setup failed: {e}")))?
        })
        .await?;
        Ok(Box::new(sb))
    }

    /// The image is a root file system folder: the snapshot is made from
    /// its `workdir` folder.
    async fn snapshot_from_image(&self, image: &str, workdir: &str) -> Result<Arc<Snapshot>> {
        let rootfs = crate::image::resolve_rootfs(image)?;
        let (image_name, wd) = (image.to_string(), workdir.to_string());
        self.snapshots
            .get_or_make(image, workdir, || async move {
                tokio::task::spawn_blocking(move || {
                    let src = folder_below(&rootfs, &wd).map_err(|e| match e {
                        Error::Image(m) => Error::Image(format!(
                            "image {image_name} has no repository folder {wd}: {m}"
                        )),
                        other => other,
                    })?;
                    Snapshot::from_dir(&src)
                })
                .await
                .map_err(|e| Error::Snapshot(format!("snapshot worker failed: {e}")))?
            })
            .await
    }
}

/// One local sandbox: a folder with the working copy and `/tmp`, and its
/// cgroups.
#[derive(Debug)]
pub struct LocalSandbox {
    name: String,
    dir: PathBuf,
    rootfs: PathBuf,
    policy: Policy,
    uid: u32,
    gid: u32,
    /// The host user bubblewrap starts as, when not this process's own.
    host_user: Option<(u32, u32)>,
    commit: String,
    cgroups: Option<SandboxCgroups>,
    closed: AtomicBool,
    oom_kills_seen: AtomicU64,
}

impl LocalSandbox {
    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    fn bwrap_args(&self, workdir: &str) -> Result<Vec<String>> {
        let s = |p: &Path| p.to_string_lossy().into_owned();
        // The image folder holding the workdir is left out, so the working
        // copy can be bound where nothing is (`/testbed`). A deeper workdir
        // that the image has (a task image's `/usr/src/app`) keeps its
        // folder: the copy is bound over the image's own, hiding it, and
        // `/usr` stays.
        let parts: Vec<&str> = self
            .policy
            .workdir
            .split('/')
            .filter(|c| !c.is_empty())
            .collect();
        let image_has_workdir = parts.len() > 1
            && crate::snapshot::folder_below(&self.rootfs, &self.policy.workdir).is_ok();
        let top_of_workdir = if image_has_workdir {
            String::new()
        } else {
            parts.first().copied().unwrap_or("").to_string()
        };
        let mut a: Vec<String> = [
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--uid",
            &self.uid.to_string(),
            "--gid",
            &self.gid.to_string(),
            "--hostname",
            "sandbox",
            "--tmpfs",
            "/",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect();
        let rd = std::fs::read_dir(&self.rootfs)
            .map_err(|e| Error::io(format!("reading {}", self.rootfs.display()), e))?;
        let mut entries: Vec<_> = rd.flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            if matches!(name.as_str(), "proc" | "dev" | "sys" | "tmp") || name == top_of_workdir {
                continue;
            }
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_symlink() {
                if let Ok(target) = std::fs::read_link(e.path()) {
                    a.extend(["--symlink".into(), s(&target), format!("/{name}")]);
                }
            } else if ft.is_dir() {
                a.extend(["--ro-bind".into(), s(&e.path()), format!("/{name}")]);
            }
        }
        a.extend([
            "--bind".into(),
            s(&self.dir.join("work")),
            self.policy.workdir.clone(),
            "--bind".into(),
            s(&self.dir.join("tmp")),
            "/tmp".into(),
            "--proc".into(),
            "/proc".into(),
            // The sandbox's user may be host root without capabilities
            // (see the module note), and the kernel lets that user write
            // host-wide settings (/proc/sys, /proc/sysrq-trigger): the
            // whole of /proc is read-only.
            "--remount-ro".into(),
            "/proc".into(),
            "--dev".into(),
            "/dev".into(),
            "--remount-ro".into(),
            "/".into(),
            "--clearenv".into(),
            "--setenv".into(),
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            "--setenv".into(),
            "HOME".into(),
            "/tmp".into(),
            "--setenv".into(),
            "LANG".into(),
            "C.UTF-8".into(),
            "--chdir".into(),
            workdir.to_string(),
        ]);
        Ok(a)
    }

    /// Runs the command once, within `limit`.
    async fn run_once(
        &self,
        req: &ExecRequest,
        stdin: Option<Arc<Vec<u8>>>,
        workdir: &str,
        limit: Duration,
    ) -> Result<Attempt> {
        let cgroups = self.cgroups.as_ref().ok_or(Error::Closed)?;
        let cap = req.output_cap_bytes.unwrap_or(self.policy.output_cap_bytes);
        let status = StatusPipe::new()?;
        // The host shell joins the sandbox's cgroups, opens the status
        // pipe, then becomes bwrap (as the sandbox's host user, when that
        // is not this process's), so every sandbox process is born inside
        // the limits. Exit 125 is the shell's own failure.
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(r#"while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; command exec 3>"$2" || exit 125; shift 2; exec "$@""#)
            .arg("arcticd-enter")
            .args(cgroups.procs_files())
            .arg("--")
            .arg(status.path())
            .args(self.host_user.map(as_user).into_iter().flatten())
            .arg("bwrap")
            .args(["--json-status-fd", "3"])
            .args(self.bwrap_args(workdir)?)
            .arg("--")
            .args(&req.argv)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // Descriptors this process holds without close-on-exec (inherited
        // from whoever started it: log files, pipes, sockets) must not reach
        // the sandbox: every one past stderr is marked to close at an exec,
        // here in this process (what this process opens itself is marked
        // already). Not in a pre-exec hook: that would make every spawn a
        // full fork of this large process instead of a vfork.
        close_on_exec_from(3);
        let t0 = Instant::now();
        let mut child = cmd.spawn().map_err(|e| Error::io("starting bwrap", e))?;
        if let (Some(data), Some(mut stdin)) = (stdin, child.stdin.take()) {
            tokio::spawn(async move {
                // A command that ignores its input closes the pipe early.
                let _ = stdin.write_all(&data).await;
                let _ = stdin.shutdown().await;
            });
        }
        let out_task = child
            .stdout
            .take()
            .map(|r| tokio::spawn(drain(r, CappedOutput::new(cap))));
        let err_task = child
            .stderr
            .take()
            .map(|r| tokio::spawn(drain(r, CappedOutput::new(cap))));
        let (exit_code, timed_out) = match tokio::time::timeout(limit, child.wait()).await {
            Ok(status) => {
                let status = status.map_err(|e| Error::io("waiting for bwrap", e))?;
                let code = status.code().map(i64::from).or_else(|| {
                    std::os::unix::process::ExitStatusExt::signal(&status)
                        .map(|s| 128 + i64::from(s))
                });
                (code, false)
            }
            Err(_) => {
                // Killing bwrap kills its pid-1 child (die-with-parent),
                // and the kernel then kills the whole pid namespace.
                let _ = child.start_kill();
                let _ = child.wait().await;
                (None, true)
            }
        };
        let started = status.started();
        // The pipes close once the namespace is gone; bound the wait anyway.
        let collect = |t: Option<tokio::task::JoinHandle<CappedOutput>>| async move {
            match t {
                Some(t) => tokio::time::timeout(Duration::from_secs(10), t)
                    .await
                    .ok()
                    .and_then(|r| r.ok())
                    .unwrap_or_else(|| CappedOutput::new(cap)),
                None => CappedOutput::new(cap),
            }
        };
        let stdout = collect(out_task).await;
        let stderr = collect(err_task).await;
        if !started && !timed_out && exit_code == Some(125) {
            return Err(Error::Sandbox(format!(
                "starting the command: {}",
                stderr.text().trim()
            )));
        }
        // Any other failure of bwrap itself (a missing program, a workdir
        // that is not there) shows as exit 1 with its message on stderr,
        // as the command's own failure would.
        let count = cgroups.oom_kills();
        let before = self.oom_kills_seen.fetch_max(count, Ordering::SeqCst);
        Ok(Attempt {
            result: ExecResult::new(
                exit_code,
                stdout,
                stderr,
                timed_out,
                count > before,
                t0.elapsed(),
            ),
            started,
        })
    }
}

/// One bubblewrap run of a command, and whether the command itself ran.
struct Attempt {
    result: ExecResult,
    /// Bubblewrap reported the command's exit (see [`StatusPipe`]).
    started: bool,
}

impl Attempt {
    /// When bubblewrap could not start the command because the sandbox's
    /// pids were all in use (its clone or fork failed with EAGAIN), its
    /// message. The command never ran, so what its stderr holds is
    /// bubblewrap's alone: a command cannot pass its own failure off as
    /// this one.
    fn refused_for_pids(&self) -> Option<String> {
        let r = &self.result;
        let err = r.stderr.text();
        let refused = !self.started
            && !r.timed_out
            && r.exit_code == Some(1)
            && err.starts_with("bwrap: ")
            && err.contains("Resource temporarily unavailable");
        refused.then(|| err.trim().to_string())
    }
}

/// The pipe bubblewrap reports on (`--json-status-fd`). It writes the
/// command's exit code there only when the command was started, so a
/// failure of bubblewrap's own setup is told apart from the command's
/// exit 1. Both ends stay close-on-exec in this process (no spawn of
/// another sandbox can inherit them); the host shell opens the write end
/// by its `/proc` path as descriptor 3, and bubblewrap closes it before
/// the command starts.
struct StatusPipe {
    read: std::fs::File,
    write: std::os::fd::OwnedFd,
}

impl StatusPipe {
    fn new() -> Result<Self> {
        use std::os::fd::FromRawFd;
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two new descriptors into the array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::io("creating a status pipe", e));
        }
        // SAFETY: both descriptors are new and owned by nothing else.
        let (read, write) = unsafe {
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        };
        Ok(StatusPipe { read, write })
    }

    /// The write end's path for another process of this user.
    fn path(&self) -> String {
        use std::os::fd::AsRawFd;
        format!("/proc/{}/fd/{}", std::process::id(), self.write.as_raw_fd())
    }

    /// Whether bubblewrap reported the command's exit. Read once bubblewrap
    /// has exited: what it wrote is in the pipe, and the read does not wait
    /// for more (this process still holds the write end).
    fn started(mut self) -> bool {
        use std::io::Read;
        let mut said = Vec::new();
        let _ = self.read.read_to_end(&mut said);
        drop(self.write);
        String::from_utf8_lossy(&said).contains("\"exit-code\"")
    }
}

/// Marks every descriptor of this process from `first` on close-on-exec:
/// one close_range call (Linux 5.11), else each open one in
/// /proc/self/fd.
fn close_on_exec_from(first: i32) {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: a system call on descriptor numbers; it changes only their
    // close-on-exec flag.
    let done = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        ) == 0
    };
    if done {
        return;
    }
    let Ok(rd) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    for fd in rd
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
    {
        if fd >= first {
            // SAFETY: as above, on one descriptor (a closed one errs).
            unsafe {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags >= 0 {
                    libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
                }
            }
        }
    }
}

async fn drain(mut r: impl AsyncRead + Unpin, mut out: CappedOutput) -> CappedOutput {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.push(&buf[..n]),
        }
    }
}

#[async_trait]
impl Sandbox for LocalSandbox {
    fn id(&self) -> &str {
        &self.name
    }

    fn policy(&self) -> &Policy {
        &self.policy
    }

    fn snapshot_commit(&self) -> &str {
        &self.commit
    }

    async fn exec(&self, mut req: ExecRequest) -> Result<ExecResult> {
        self.check_open()?;
        crate::docker::validate_request(&req)?;
        let timeout = req.timeout_secs.unwrap_or(self.policy.exec_timeout_secs);
        let limit = crate::limit(timeout)?;
        let workdir = match &req.workdir {
            Some(w) => resolve_path(&self.policy, w)?,
            None => self.policy.workdir.clone(),
        };
        // Moved out, not copied: every attempt writes the same bytes.
        let stdin = req.stdin.take().map(Arc::new);
        // A start refused for want of pids is tried again: the command
        // never ran, so running it again repeats nothing. The pids of
        // finished commands come free within a few seconds.
        let t0 = Instant::now();
        let mut pause = Duration::from_millis(25);
        loop {
            let left = limit.saturating_sub(t0.elapsed());
            let run = self.run_once(&req, stdin.clone(), &workdir, left).await?;
            let Some(why) = run.refused_for_pids() else {
                let mut r = run.result;
                r.duration_ms = t0.elapsed().as_millis() as u64;
                return Ok(r);
            };
            if t0.elapsed() + pause >= limit {
                return Err(Error::Sandbox(format!(
                    "the command could not start in its {timeout} s: {why}"
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        let path = resolve_path(&self.policy, path)?;
        let limit = self.policy.max_file_bytes;
        let r = self
            .exec(
                ExecRequest::argv(["sh", "-c", r#"[ -f "$1" ] || { echo "$1 is not a regular file" >&2; exit 66; }; exec cat -- "$1""#, "sh", &path])
                    .output_cap(limit as usize + 1)
                    .timeout(self.policy.op_timeout_secs),
            )
            .await?;
        if r.stdout.truncated() || r.stdout_bytes > limit {
            return Err(Error::TooLarge { what: path, limit });
        }
        if !r.success() {
            return Err(Error::Sandbox(format!(
                "{path}: {}",
                r.stderr.text().trim()
            )));
        }
        Ok(r.stdout.bytes())
    }

    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()> {
        let path = resolve_path(&self.policy, path)?;
        if data.len() as u64 > self.policy.max_file_bytes {
            return Err(Error::TooLarge {
                what: path,
                limit: self.policy.max_file_bytes,
            });
        }
        let r = self
            .exec(
                ExecRequest::argv(["sh", "-c", r#"cat > "$1""#, "sh", &path])
                    .stdin(data.to_vec())
                    .timeout(self.policy.op_timeout_secs),
            )
            .await?;
        if !r.success() {
            return Err(Error::Sandbox(format!(
                "{path}: {}",
                r.stderr.text().trim()
            )));
        }
        Ok(())
    }

    async fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let dir = self.dir.clone();
        let cgroups_dirs: Vec<PathBuf> = self
            .cgroups
            .as_ref()
            .map(|c| c.dirs.clone())
            .unwrap_or_default();
        let removal = tokio::task::spawn_blocking(move || {
            for d in &cgroups_dirs {
                kill_cgroup(d);
                let _ = std::fs::remove_dir(d);
            }
            remove_sandbox_dir(&dir)
                .map_err(|e| Error::io(format!("removing {}", dir.display()), e))
        });
        with_timeout(
            "removing a local sandbox",
            self.policy.op_timeout_secs,
            async {
                removal
                    .await
                    .map_err(|e| Error::Sandbox(format!("removal failed: {e}")))?
            },
        )
        .await
    }
}

impl Drop for LocalSandbox {
    fn drop(&mut self) {
        if let Some(c) = &self.cgroups {
            if !self.closed.load(Ordering::SeqCst) {
                c.remove();
            }
        }
        if !self.closed.swap(true, Ordering::SeqCst) {
            let _ = remove_sandbox_dir(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bubblewrap_versions_that_report_exit_codes() {
        for v in [
            "bubblewrap 0.8.0\n",
            "bubblewrap 0.3.2",
            "bubblewrap 0.11",
            "bubblewrap 1.0.0",
        ] {
            assert!(reports_exit_codes(v), "{v}");
        }
        for v in [
            "bubblewrap 0.3.1",
            "bubblewrap 0.2.1",
            "bubblewrap",
            "",
            "bubblewrap x.y",
        ] {
            assert!(!reports_exit_codes(v), "{v}");
        }
    }
}
