//! Base images without a registry: debootstrap a minimal Debian with
//! python3, pytest (Debian's package), git and ca-certificates into a root
//! file system folder, add the non-root sandbox user, and `docker import` it.
//!
//! The folder is the local backend's image; the imported tag is the Docker
//! backend's. Both are cached by tag: a second build is a no-op. Builds hold
//! a file lock, so concurrent test processes build once. Needs root (for
//! debootstrap) and the `debootstrap` package. The apt mirror comes from
//! `$ARCTICD_DEBIAN_MIRROR`, else the host's apt sources, else Debian's
//! default. Not for task-specific images (those add a repository's
//! dependencies on top; later work).

use crate::{Error, Result};
use futures_util::StreamExt;
use std::path::{Path, PathBuf};

/// Tag of the base image for Python repositories.
pub const DEFAULT_TAG: &str = "arcticd-python-base:bookworm-1";
const SUITE: &str = "bookworm";
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
const PACKAGES: &str = "python3,python3-pytest,git,ca-certificates";
const MARKER: &str = ".arcticd-image-complete";

/// Where image folders live: `$ARCTICD_IMAGE_DIR`, else
/// `$XDG_CACHE_HOME/arcticd/images`, else, for root,
/// `/var/cache/arcticd/images` (where the unprivileged user its local
/// sandboxes run as can reach them; `/root` is private), else
/// `~/.cache/arcticd/images`.
pub fn cache_root() -> PathBuf {
    if let Some(d) = std::env::var_os("ARCTICD_IMAGE_DIR") {
        return PathBuf::from(d);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| root.then(|| PathBuf::from("/var/cache")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("arcticd").join("images")
}

fn tag_dir(tag: &str) -> PathBuf {
    let safe: String = tag
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    cache_root().join(safe)
}

/// The root file system folder of `tag`.
pub fn rootfs_dir(tag: &str) -> PathBuf {
    tag_dir(tag).join("rootfs")
}

/// The local backend's image argument: an existing folder path, or a tag
/// whose folder was built.
pub fn resolve_rootfs(image: &str) -> Result<PathBuf> {
    let p = Path::new(image);
    if image.contains('/') && p.join("bin").exists() {
        return Ok(p.to_path_buf());
    }
    let dir = rootfs_dir(image);
    if dir.join(MARKER).exists() {
        return Ok(dir);
    }
    Err(Error::Image(format!(
        "no root file system for {image:?}; build it with `arcticd sandbox build-image --tag {image}`"
    )))
}

/// The Debian mirror for debootstrap.
pub fn debian_mirror() -> String {
    if let Ok(m) = std::env::var("ARCTICD_DEBIAN_MIRROR") {
        if !m.trim().is_empty() {
            return m.trim().to_string();
        }
    }
    let mut texts = Vec::new();
    if let Ok(t) = std::fs::read_to_string("/etc/apt/sources.list") {
        texts.push(t);
    }
    if let Ok(rd) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut paths: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        paths.sort();
        for p in paths {
            if let Ok(t) = std::fs::read_to_string(p) {
                texts.push(t);
            }
        }
    }
    texts
        .iter()
        .find_map(|t| mirror_from_sources(t, SUITE))
        .unwrap_or_else(|| DEFAULT_MIRROR.to_string())
}

/// The first main-archive URI for `suite` in an apt sources file, either
/// one-line (`deb URI suite comps`) or deb822 (`URIs:` / `Suites:`) format.
pub fn mirror_from_sources(text: &str, suite: &str) -> Option<String> {
    let ok = |uri: &str| uri.starts_with("http") && !uri.contains("security");
    for line in text.lines() {
        let mut w = line.split_whitespace().peekable();
        if w.next() != Some("deb") {
            continue;
        }
        if w.peek().is_some_and(|x| x.starts_with('[')) {
            for x in w.by_ref() {
                if x.ends_with(']') {
                    break;
                }
            }
        }
        if let (Some(uri), Some(s)) = (w.next(), w.next()) {
            if s == suite && ok(uri) {
                return Some(uri.trim_end_matches('/').to_string());
            }
        }
    }
    for stanza in text.split("\n\n") {
        let field = |name: &str| {
            stanza.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim().eq_ignore_ascii_case(name)).then(|| v.trim().to_string())
            })
        };
        if let (Some(uris), Some(suites)) = (field("URIs"), field("Suites")) {
            if suites.split_whitespace().any(|s| s == suite) {
                if let Some(u) = uris.split_whitespace().find(|u| ok(u)) {
                    return Some(u.trim_end_matches('/').to_string());
                }
            }
        }
    }
    None
}

/// What [`build_base_image`] did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BuildReport {
    pub tag: String,
    pub rootfs: PathBuf,
    pub rootfs_built: bool,
    pub docker_imported: bool,
    pub seconds: f64,
}

/// Builds (or finds cached) the base image: the root file system folder,
/// and with `docker` the imported Docker tag.
pub async fn build_base_image(tag: &str, docker: bool, force: bool) -> Result<BuildReport> {
    let t0 = std::time::Instant::now();
    let dir = tag_dir(tag);
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let lock_path = dir.join("lock");
    let _lock = tokio::task::spawn_blocking(move || FileLock::acquire(&lock_path))
        .await
        .map_err(|e| Error::Image(format!("lock task failed: {e}")))??;
    let rootfs = rootfs_dir(tag);
    let mut rootfs_built = false;
    if force || !rootfs.join(MARKER).exists() {
        let r = rootfs.clone();
        tokio::task::spawn_blocking(move || debootstrap(&r))
            .await
            .map_err(|e| Error::Image(format!("debootstrap task failed: {e}")))??;
        rootfs_built = true;
    }
    let mut docker_imported = false;
    if docker {
        let backend = crate::docker::DockerBackend::new().await?;
        if force || rootfs_built || !backend.has_image(tag).await? {
            docker_import(backend.client(), &rootfs, tag).await?;
            docker_imported = true;
        }
    }
    Ok(BuildReport {
        tag: tag.to_string(),
        rootfs,
        rootfs_built,
        docker_imported,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

fn run(cmd: &mut std::process::Command, what: &str) -> Result<()> {
    let out = cmd
        .output()
        .map_err(|e| Error::io(format!("running {what}"), e))?;
    if !out.status.success() {
        let log = String::from_utf8_lossy(&out.stdout);
        let tail: String = log.lines().rev().take(20).collect::<Vec<_>>().join("\n");
        return Err(Error::Image(format!(
            "{what} failed: {}\n{tail}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

fn debootstrap(rootfs: &Path) -> Result<()> {
    let tmp = rootfs.with_extension("tmp");
    for d in [&tmp, &rootfs.to_path_buf()] {
        if d.exists() {
            std::fs::remove_dir_all(d)
                .map_err(|e| Error::io(format!("removing {}", d.display()), e))?;
        }
    }
    let mirror = debian_mirror();
    tracing::info!(%mirror, "debootstrap {SUITE} into {}", tmp.display());
    run(
        std::process::Command::new("debootstrap")
            .arg("--variant=minbase")
            .arg(format!("--include={PACKAGES}"))
            .arg(SUITE)
            .arg(&tmp)
            .arg(&mirror),
        "debootstrap (needs root and the debootstrap package)",
    )?;
    let io = |e| Error::io("customizing the root file system", e);
    // The sandbox user, uid/gid 1000 as in the default policy.
    let append = |file: &str, line: &str| -> Result<()> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(tmp.join(file))
            .map_err(io)?;
        writeln!(f, "{line}").map_err(io)
    };
    append("etc/passwd", "agent:x:1000:1000:sandbox user:/tmp:/bin/sh")?;
    append("etc/group", "agent:x:1000:")?;
    std::fs::create_dir_all(tmp.join("testbed")).map_err(io)?;
    std::os::unix::fs::chown(tmp.join("testbed"), Some(1000), Some(1000)).map_err(io)?;
    // Package caches are dead weight in every container.
    for d in ["var/cache/apt/archives", "var/lib/apt/lists"] {
        if let Ok(rd) = std::fs::read_dir(tmp.join(d)) {
            for e in rd.flatten() {
                if e.path().is_file() {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
    std::fs::write(tmp.join(MARKER), format!("{SUITE} {PACKAGES}\n")).map_err(io)?;
    std::fs::rename(&tmp, rootfs).map_err(io)?;
    Ok(())
}

async fn docker_import(docker: &bollard::Docker, rootfs: &Path, tag: &str) -> Result<()> {
    let (repo, version) = match tag.rsplit_once(':') {
        Some((r, v)) if !v.contains('/') => (r.to_string(), v.to_string()),
        _ => (tag.to_string(), "latest".to_string()),
    };
    let tarfile =
        tempfile::NamedTempFile::new().map_err(|e| Error::io("creating a temp file", e))?;
    let path = tarfile.path().to_path_buf();
    let root = rootfs.to_path_buf();
    tokio::task::spawn_blocking(move || -> Result<()> {
        let io = |e| Error::io("archiving the root file system", e);
        let f = std::fs::File::create(&path).map_err(io)?;
        let mut b = tar::Builder::new(std::io::BufWriter::new(f));
        b.follow_symlinks(false);
        b.append_dir_all(".", &root).map_err(io)?;
        b.into_inner().map_err(io)?;
        Ok(())
    })
    .await
    .map_err(|e| Error::Image(format!("archiver failed: {e}")))??;
    let file = tokio::fs::File::open(tarfile.path())
        .await
        .map_err(|e| Error::io("opening the archive", e))?;
    let body = futures_util::stream::unfold(file, |mut f| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 1 << 20];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok::<_, std::io::Error>(bytes::Bytes::from(buf)), f))
            }
            Err(e) => Some((Err(e), f)),
        }
    });
    let opts = bollard::query_parameters::CreateImageOptionsBuilder::new()
        .from_src("-")
        .repo(&repo)
        .tag(&version)
        .build();
    let mut progress = docker.create_image(Some(opts), Some(bollard::body_try_stream(body)), None);
    while let Some(item) = progress.next().await {
        item?;
    }
    Ok(())
}

/// An exclusive advisory lock held until drop.
struct FileLock(std::fs::File);

impl FileLock {
    fn acquire(path: &Path) -> Result<FileLock> {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        // SAFETY: flock on a file descriptor we own for the call's duration.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(Error::io(
                "locking the image folder",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(FileLock(f))
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: unlocking our own descriptor.
        unsafe {
            libc::flock(self.0.as_raw_fd(), libc::LOCK_UN);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_mirror_in_one_line_sources() {
        let t = "# comment\ndeb [arch=amd64 signed-by=/x.gpg] http://mirror.example/debian/ bookworm main\n\
                 deb http://security.debian.org/debian-security bookworm-security main\n";
        assert_eq!(
            mirror_from_sources(t, "bookworm").as_deref(),
            Some("http://mirror.example/debian")
        );
    }

    #[test]
    fn finds_mirror_in_deb822_sources() {
        let t = "Types: deb\nURIs: http://deb.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n\
                 Types: deb\nURIs: http://deb.example/debian-security\nSuites: bookworm-security\n";
        assert_eq!(
            mirror_from_sources(t, "bookworm").as_deref(),
            Some("http://deb.example/debian")
        );
        assert_eq!(
            mirror_from_sources(
                "Types: deb\nURIs: https://x/y\nSuites: nodistro\n",
                "bookworm"
            ),
            None
        );
    }

    #[test]
    fn tags_map_to_safe_folders() {
        let d = rootfs_dir("a/b:c");
        assert!(d.ends_with("a_b_c/rootfs"));
    }
}
