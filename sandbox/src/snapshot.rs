//! Repository snapshots: a task's tree as a single root commit and nothing
//! else, the hygiene rule of docs/ARCHITECTURE.md, recipe step 10 (no history
//! to read the fix from).
//!
//! A snapshot is built once on the host in a private temporary folder and
//! copied into every sandbox. The source's own `.git` folders (at any depth)
//! are never copied; `git init` + one commit with fixed identity and date
//! makes the only history, and the reflog is deleted. Not a task loader.

use crate::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

/// Snapshot folders in the temp folder are named this, then their owner
/// process (`pid-start`), so those of a process that is gone can be found.
const SNAPSHOT_PREFIX: &str = "arcticd-snapshot-";

/// Removes the snapshot folders in `dir` whose owner process is gone
/// (killed, or ended with snapshots still cached: a process that exits
/// does not drop its caches). Called once per process, before its first
/// snapshot. Returns how many it removed.
pub fn reap_orphans(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if crate::procs::orphaned(&name, SNAPSHOT_PREFIX)
            && std::fs::remove_dir_all(e.path()).is_ok()
        {
            n += 1;
        }
    }
    n
}

/// A staged repository: the working tree plus a `.git` holding exactly one
/// commit. Deleted from disk when dropped.
#[derive(Debug)]
pub struct Snapshot {
    dir: tempfile::TempDir,
    commit: String,
}

impl Snapshot {
    /// Snapshots the files of `src` (a folder, a git checkout or not).
    /// Symlinks are copied as links, never followed.
    pub fn from_dir(src: &Path) -> Result<Snapshot> {
        let meta = std::fs::metadata(src)
            .map_err(|e| Error::io(format!("reading {}", src.display()), e))?;
        if !meta.is_dir() {
            return Err(Error::InvalidInput(format!(
                "{} is not a folder",
                src.display()
            )));
        }
        static REAPED: std::sync::Once = std::sync::Once::new();
        REAPED.call_once(|| {
            reap_orphans(&std::env::temp_dir());
        });
        let dir = tempfile::Builder::new()
            .prefix(&format!("{SNAPSHOT_PREFIX}{}-", crate::procs::self_owner()))
            .tempdir()
            .map_err(|e| Error::io("creating the snapshot folder", e))?;
        copy_tree(src, dir.path())?;
        let commit = commit_root(dir.path())?;
        Ok(Snapshot { dir, commit })
    }

    /// The staged folder (working tree and `.git`).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The one commit's id.
    pub fn commit(&self) -> &str {
        &self.commit
    }

    /// A tar of the staged folder with every entry under `prefix` (e.g.
    /// `testbed`) and owned by `uid:gid`.
    pub fn to_tar(&self, prefix: &str, uid: u32, gid: u32) -> Result<Vec<u8>> {
        let mut b = tar::Builder::new(Vec::new());
        b.follow_symlinks(false);
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
        header.set_uid(uid as u64);
        header.set_gid(gid as u64);
        header.set_size(0);
        header.set_mtime(0);
        b.append_data(&mut header, prefix, std::io::empty())
            .map_err(|e| Error::io("writing the snapshot tar", e))?;
        append_tree(&mut b, self.path(), Path::new(prefix), uid, gid)?;
        b.into_inner()
            .map_err(|e| Error::io("writing the snapshot tar", e))
    }
}

/// Snapshots of images' repositories, made once per (image, workdir) and
/// shared, so a task set whose tasks share an image exports it once. Holds
/// at most [`SnapshotCache::CAPACITY`] entries (each is a copy of a
/// repository on disk); the oldest is dropped first, and sandboxes still
/// using it keep it alive through their `Arc`. Concurrent requests for the
/// same key wait for one export; a failed export is not cached.
#[derive(Debug, Default, Clone)]
pub struct SnapshotCache {
    inner: Arc<Mutex<CacheEntries>>,
}

type CacheKey = (String, String);
type CacheCell = Arc<tokio::sync::OnceCell<Arc<Snapshot>>>;

#[derive(Debug, Default)]
struct CacheEntries {
    cells: HashMap<CacheKey, CacheCell>,
    order: VecDeque<CacheKey>,
    /// Most snapshots kept; 0 means [`SnapshotCache::CAPACITY`].
    capacity: usize,
}

impl SnapshotCache {
    /// Most snapshots kept by default.
    pub const CAPACITY: usize = 16;

    /// A cache of at most `capacity` snapshots.
    pub fn with_capacity(capacity: usize) -> Self {
        SnapshotCache {
            inner: Arc::new(Mutex::new(CacheEntries {
                capacity: capacity.max(1),
                ..Default::default()
            })),
        }
    }

    /// The cached snapshot of (`image`, `workdir`), made with `make` when
    /// absent.
    pub async fn get_or_make<F, Fut>(
        &self,
        image: &str,
        workdir: &str,
        make: F,
    ) -> Result<Arc<Snapshot>>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Snapshot>>,
    {
        let key = (image.to_string(), workdir.to_string());
        let cell = {
            // A panic elsewhere while holding the lock leaves the map
            // consistent (every step below is a single insert or remove).
            let mut e = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            match e.cells.get(&key) {
                Some(c) => c.clone(),
                None => {
                    let c = CacheCell::default();
                    e.cells.insert(key.clone(), c.clone());
                    e.order.push_back(key);
                    let capacity = match e.capacity {
                        0 => Self::CAPACITY,
                        n => n,
                    };
                    while e.order.len() > capacity {
                        if let Some(old) = e.order.pop_front() {
                            e.cells.remove(&old);
                        }
                    }
                    c
                }
            }
        };
        cell.get_or_try_init(|| async { make().await.map(Arc::new) })
            .await
            .cloned()
    }

    /// Snapshots held now.
    pub fn len(&self) -> usize {
        let e = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        e.cells.values().filter(|c| c.initialized()).count()
    }

    /// Whether no snapshot is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The folder at `workdir` (absolute, plain names only) below `root`,
/// checked to be a real folder at every step: a symlink in an image folder
/// must not lead the snapshot to host files.
pub(crate) fn folder_below(root: &Path, workdir: &str) -> Result<PathBuf> {
    let rel = Path::new(workdir)
        .strip_prefix("/")
        .map_err(|_| Error::InvalidInput(format!("workdir {workdir:?} is not absolute")))?;
    let mut p = root.to_path_buf();
    let mut any = false;
    for c in rel.components() {
        let std::path::Component::Normal(name) = c else {
            return Err(Error::InvalidInput(format!(
                "workdir {workdir:?} must name a folder with plain components"
            )));
        };
        any = true;
        p.push(name);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(Error::Image(format!(
                    "{} is not a folder (symlinks are not followed)",
                    p.display()
                )))
            }
            Err(_) => return Err(Error::Image(format!("{} does not exist", p.display()))),
        }
    }
    if !any {
        return Err(Error::InvalidInput(
            "workdir / cannot be a repository".into(),
        ));
    }
    Ok(p)
}

/// The entries of `dir` in name order (`doing` names the operation in an
/// error).
fn sorted_entries(dir: &Path, doing: &str) -> Result<Vec<std::fs::DirEntry>> {
    let io = |e| Error::io(format!("{doing} {}", dir.display()), e);
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(io)?
        .collect::<std::io::Result<_>>()
        .map_err(io)?;
    entries.sort_by_key(|e| e.file_name());
    Ok(entries)
}

fn append_tree(
    b: &mut tar::Builder<Vec<u8>>,
    dir: &Path,
    prefix: &Path,
    uid: u32,
    gid: u32,
) -> Result<()> {
    let io = |e| Error::io(format!("archiving {}", dir.display()), e);
    for entry in sorted_entries(dir, "archiving")? {
        let path = entry.path();
        let name = prefix.join(entry.file_name());
        let meta = std::fs::symlink_metadata(&path).map_err(io)?;
        let mut header = tar::Header::new_gnu();
        header.set_metadata(&meta);
        header.set_uid(uid as u64);
        header.set_gid(gid as u64);
        header.set_mtime(0);
        let ft = meta.file_type();
        if ft.is_symlink() {
            let target = std::fs::read_link(&path).map_err(io)?;
            header.set_size(0);
            b.append_link(&mut header, &name, &target).map_err(io)?;
        } else if ft.is_dir() {
            header.set_size(0);
            b.append_data(&mut header, &name, std::io::empty())
                .map_err(io)?;
            append_tree(b, &path, &name, uid, gid)?;
        } else if ft.is_file() {
            let f = std::fs::File::open(&path).map_err(io)?;
            b.append_data(&mut header, &name, f).map_err(io)?;
        }
        // Sockets, fifos and devices are not part of a repository.
    }
    Ok(())
}

/// A stamp of what [`Snapshot::from_dir`] would copy from `src`: every
/// entry's path, kind, size and modification time (`.git` left out, as the
/// copy leaves it out). Equal stamps mean an unchanged folder, so a
/// snapshot made from it is still its snapshot.
pub fn folder_stamp(src: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    fn walk(dir: &Path, rel: &Path, h: &mut Sha256) -> Result<()> {
        let io = |e| Error::io(format!("reading {}", dir.display()), e);
        for entry in sorted_entries(dir, "reading")? {
            if entry.file_name() == ".git" {
                continue;
            }
            let meta = entry.metadata().map_err(io)?;
            let name = rel.join(entry.file_name());
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            let kind = if meta.is_symlink() {
                b'l'
            } else if meta.is_dir() {
                b'd'
            } else {
                b'f'
            };
            let path = name.to_string_lossy();
            h.update((path.len() as u64).to_le_bytes());
            h.update(path.as_bytes());
            h.update([kind]);
            h.update(meta.len().to_le_bytes());
            h.update(mtime.to_le_bytes());
            if meta.is_dir() {
                walk(&entry.path(), &name, h)?;
            }
        }
        Ok(())
    }
    let mut h = Sha256::new();
    walk(src, Path::new(""), &mut h)?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Copies `src` into `dst` (which exists), skipping `.git` entries at every
/// depth and anything that is not a file, folder or symlink.
pub(crate) fn copy_tree(src: &Path, dst: &Path) -> Result<()> {
    let io = |e| Error::io(format!("copying {}", src.display()), e);
    for entry in std::fs::read_dir(src).map_err(io)? {
        let entry = entry.map_err(io)?;
        if entry.file_name() == ".git" {
            continue;
        }
        let from = entry.path();
        let to = dst.join(entry.file_name());
        let ft = entry.file_type().map_err(io)?;
        if ft.is_symlink() {
            let target = std::fs::read_link(&from).map_err(io)?;
            std::os::unix::fs::symlink(target, &to).map_err(io)?;
        } else if ft.is_dir() {
            std::fs::create_dir(&to).map_err(io)?;
            copy_tree(&from, &to)?;
        } else if ft.is_file() {
            std::fs::copy(&from, &to).map_err(io)?;
        }
    }
    Ok(())
}

/// Copies a staged snapshot (with its `.git`) into `dst`.
pub(crate) fn copy_staged(src: &Path, dst: &Path) -> Result<()> {
    let io = |e| Error::io(format!("copying {}", src.display()), e);
    for entry in std::fs::read_dir(src).map_err(io)? {
        let entry = entry.map_err(io)?;
        let from = entry.path();
        let to = dst.join(entry.file_name());
        let ft = entry.file_type().map_err(io)?;
        if ft.is_symlink() {
            let target = std::fs::read_link(&from).map_err(io)?;
            std::os::unix::fs::symlink(target, &to).map_err(io)?;
        } else if ft.is_dir() {
            std::fs::create_dir(&to).map_err(io)?;
            copy_staged(&from, &to)?;
        } else if ft.is_file() {
            std::fs::copy(&from, &to).map_err(io)?;
        }
    }
    Ok(())
}

fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        // Ignore the host's git configuration: it could add hooks, templates
        // or signing that leak into or break the snapshot.
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("HOME", dir)
        .env("GIT_AUTHOR_NAME", "arcticd")
        .env("GIT_AUTHOR_EMAIL", "snapshot@arcticd.invalid")
        .env("GIT_COMMITTER_NAME", "arcticd")
        .env("GIT_COMMITTER_EMAIL", "snapshot@arcticd.invalid")
        .env("GIT_AUTHOR_DATE", "2000-01-01T00:00:00Z")
        .env("GIT_COMMITTER_DATE", "2000-01-01T00:00:00Z")
        .output()
        .map_err(|e| Error::io("running git on the host (is git installed?)", e))?;
    if !out.status.success() {
        return Err(Error::Snapshot(format!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn commit_root(dir: &Path) -> Result<String> {
    git(
        dir,
        &["init", "--quiet", "--initial-branch=main", "--template="],
    )?;
    git(dir, &["add", "--all"])?;
    git(
        dir,
        &[
            "commit",
            "--quiet",
            "--no-verify",
            "--no-gpg-sign",
            "--allow-empty",
            "-m",
            "snapshot",
        ],
    )?;
    let commit = git(dir, &["rev-parse", "HEAD"])?;
    let git_dir: PathBuf = dir.join(".git");
    // The commit's reflog entry is history too; agent commits later keep
    // theirs, which only ever shows the agent its own work.
    let logs = git_dir.join("logs");
    if logs.exists() {
        std::fs::remove_dir_all(&logs).map_err(|e| Error::io("removing the reflog", e))?;
    }
    for f in ["COMMIT_EDITMSG", "description"] {
        let _ = std::fs::remove_file(git_dir.join(f));
    }
    Ok(commit)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Snapshot folders of a process that is gone are removed; this
    /// process's, and folders of other names, are kept.
    #[test]
    fn orphaned_snapshot_folders_are_reaped() {
        let dir = tempfile::tempdir().unwrap();
        let mine = format!("{SNAPSHOT_PREFIX}{}-abc", crate::procs::self_owner());
        // No process has the pid u32::MAX: gone.
        let gone = format!("{SNAPSHOT_PREFIX}{}-1-abc", u32::MAX);
        let old_style = format!("{SNAPSHOT_PREFIX}0V9S1r");
        for name in [&mine, &gone, &old_style, &"other".to_string()] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
        }
        assert_eq!(reap_orphans(dir.path()), 1);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut want = vec![mine, old_style, "other".to_string()];
        want.sort();
        assert_eq!(left, want);
    }

    /// The stamp moves with a file's size or time, a new file or a
    /// renamed one, and ignores `.git`.
    #[test]
    fn folder_stamp_sees_what_the_copy_copies() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        std::fs::create_dir(p.join("pkg")).unwrap();
        std::fs::write(p.join("pkg/a.py"), "a").unwrap();
        let s0 = folder_stamp(p).unwrap();
        assert_eq!(s0, folder_stamp(p).unwrap());
        std::fs::create_dir(p.join(".git")).unwrap();
        std::fs::write(p.join(".git/HEAD"), "ref").unwrap();
        assert_eq!(s0, folder_stamp(p).unwrap(), ".git is not copied");
        std::fs::write(p.join("pkg/a.py"), "ab").unwrap();
        let s1 = folder_stamp(p).unwrap();
        assert_ne!(s0, s1);
        std::fs::rename(p.join("pkg/a.py"), p.join("pkg/b.py")).unwrap();
        assert_ne!(s1, folder_stamp(p).unwrap());
        std::fs::write(p.join("c.py"), "").unwrap();
        assert_ne!(s1, folder_stamp(p).unwrap());
    }

    #[test]
    fn snapshot_has_one_commit_and_no_source_history() {
        let src = tempfile::tempdir().unwrap();
        let p = src.path();
        std::fs::write(p.join("a.py"), "x = 1\n").unwrap();
        std::fs::create_dir(p.join("pkg")).unwrap();
        std::fs::write(p.join("pkg/b.py"), "y = 2\n").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", p.join("link")).unwrap();
        git(p, &["init", "--quiet"]).unwrap();
        git(p, &["add", "-A"]).unwrap();
        git(p, &["commit", "--quiet", "-m", "secret fix"]).unwrap();
        git(p, &["tag", "v1"]).unwrap();

        let s = Snapshot::from_dir(p).unwrap();
        let log = git(s.path(), &["log", "--all", "--format=%s"]).unwrap();
        assert_eq!(log, "snapshot");
        assert_eq!(git(s.path(), &["tag"]).unwrap(), "");
        assert!(!s.path().join(".git/logs").exists());
        assert_eq!(
            std::fs::read_link(s.path().join("link")).unwrap(),
            Path::new("/etc/passwd")
        );
        assert_eq!(git(s.path(), &["status", "--porcelain"]).unwrap(), "");
        // Deterministic: same tree, same commit id.
        let s2 = Snapshot::from_dir(p).unwrap();
        assert_eq!(s.commit(), s2.commit());

        let tar = s.to_tar("testbed", 1000, 1000).unwrap();
        let mut ar = tar::Archive::new(&tar[..]);
        let names: Vec<String> = ar
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert!(names.iter().any(|n| n == "testbed/pkg/b.py"));
        assert!(names.iter().any(|n| n == "testbed/.git/HEAD"));
    }

    #[test]
    fn finds_folders_below_a_root_without_following_links() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("srv/app")).unwrap();
        std::os::unix::fs::symlink("/etc", r.join("link")).unwrap();
        assert_eq!(folder_below(r, "/srv/app").unwrap(), r.join("srv/app"));
        assert!(folder_below(r, "/link").is_err());
        assert!(folder_below(r, "/srv/../..").is_err());
        assert!(folder_below(r, "/missing").is_err());
        assert!(folder_below(r, "/").is_err());
        assert!(folder_below(r, "srv").is_err());
    }

    #[test]
    fn cache_makes_each_snapshot_once() {
        let src = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("a.py"), "x = 1\n").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let cache = SnapshotCache::default();
        let made = std::sync::atomic::AtomicUsize::new(0);
        rt.block_on(async {
            for _ in 0..3 {
                let s = cache
                    .get_or_make("img", "/testbed", || async {
                        made.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        Snapshot::from_dir(src.path())
                    })
                    .await
                    .unwrap();
                assert!(s.path().join("a.py").exists());
            }
            // A failure is not cached.
            let e = cache
                .get_or_make("img", "/other", || async { Err(Error::Image("no".into())) })
                .await;
            assert!(e.is_err());
            let again = cache
                .get_or_make("img", "/other", || async { Snapshot::from_dir(src.path()) })
                .await;
            assert!(again.is_ok());
        });
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn rejects_missing_source() {
        assert!(Snapshot::from_dir(Path::new("/nonexistent/arcticd")).is_err());
    }
}
