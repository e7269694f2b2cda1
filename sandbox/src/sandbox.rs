//! The `Sandbox` and `Backend` traits, and the operations every backend
//! shares (listing, patching, diffing), written once on top of `exec`.
//!
//! Backends implement command execution and file transfer; everything else
//! here runs ordinary programs (`find`, `git`) inside the sandbox, so it sees
//! exactly what the agent sees and host paths are never touched.

use crate::{Error, ExecRequest, ExecResult, Policy, Result, Snapshot};
use async_trait::async_trait;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One entry of [`Sandbox::list_dir`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DirEntry {
    pub name: String,
    /// `f` file, `d` directory, `l` symlink, other letters as in `find -printf %y`.
    pub kind: char,
    pub size: u64,
}

/// Result of [`Sandbox::apply_patch`]: a patch that does not apply is an
/// outcome, not an error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PatchOutcome {
    pub applied: bool,
    /// `git apply` output, for the agent or the grading report.
    pub output: String,
}

/// Starts sandboxes from snapshots.
#[async_trait]
pub trait Backend: Send + Sync {
    /// `docker` or `local`.
    fn name(&self) -> &'static str;
    /// A new sandbox with `snapshot` at [`Policy::workdir`], from `image` (a
    /// Docker image tag, or for the local backend a rootfs folder or a tag
    /// built by [`crate::image`]).
    async fn start(
        &self,
        snapshot: &Arc<Snapshot>,
        image: &str,
        policy: &Policy,
    ) -> Result<Box<dyn Sandbox>>;

    /// The repository that `image` holds at `workdir`, as a snapshot: its
    /// files only, any `.git` dropped and one root commit made, as
    /// [`Snapshot::from_dir`] does (the agent never sees the image's
    /// history). Made once per (image, workdir) and cached by the backend.
    /// Errors say whether the image or the folder is missing.
    async fn snapshot_from_image(&self, image: &str, workdir: &str) -> Result<Arc<Snapshot>>;
}

/// One isolated working copy of a repository and the commands run in it.
#[async_trait]
pub trait Sandbox: Send + Sync {
    /// Container id or local sandbox name, for logs.
    fn id(&self) -> &str;
    fn policy(&self) -> &Policy;
    /// The snapshot commit the working tree started from.
    fn snapshot_commit(&self) -> &str;

    /// Runs one command with the policy's (or the request's) timeout and
    /// output cap.
    async fn exec(&self, req: ExecRequest) -> Result<ExecResult>;
    /// Reads a regular file (relative paths are below the workdir).
    async fn read_file(&self, path: &str) -> Result<Vec<u8>>;
    /// Creates or replaces a file; its folder must exist.
    async fn write_file(&self, path: &str, data: &[u8]) -> Result<()>;
    /// Removes the sandbox; later calls fail with [`Error::Closed`].
    async fn close(&self) -> Result<()>;

    /// Entries of a folder, sorted by name.
    async fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>> {
        let path = resolve_path(self.policy(), path)?;
        let cap = 4 * 1024 * 1024;
        let r = self
            .exec(
                ExecRequest::argv([
                    "find",
                    &path,
                    "-mindepth",
                    "1",
                    "-maxdepth",
                    "1",
                    "-printf",
                    "%y\\t%s\\t%P\\0",
                ])
                .output_cap(cap)
                .timeout(self.policy().op_timeout_secs),
            )
            .await?;
        if r.stdout.truncated() {
            return Err(Error::TooLarge {
                what: format!("listing of {path}"),
                limit: cap as u64,
            });
        }
        if !r.success() {
            return Err(Error::Sandbox(format!(
                "listing {path}: {}",
                r.stderr.text().trim()
            )));
        }
        let mut out = parse_find_listing(&r.stdout.bytes());
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Applies a unified diff (as produced by [`Sandbox::diff`] or
    /// `git diff`) to the working tree with `git apply`.
    async fn apply_patch(&self, patch: &str) -> Result<PatchOutcome> {
        if patch.trim().is_empty() {
            return Ok(PatchOutcome {
                applied: true,
                output: String::new(),
            });
        }
        let file = format!("/tmp/.arcticd-patch-{}.diff", next_token());
        self.write_file(&file, patch.as_bytes()).await?;
        let r = self
            .exec(ExecRequest::argv([
                "git",
                "apply",
                "--whitespace=nowarn",
                "--verbose",
                &file,
            ]))
            .await?;
        let _ = self.exec(ExecRequest::argv(["rm", "-f", &file])).await;
        Ok(PatchOutcome {
            applied: r.success(),
            output: format!("{}{}", r.stdout.text(), r.stderr.text()),
        })
    }

    /// The working tree against the snapshot commit, new files included, as a
    /// binary-safe `git diff`; empty when nothing changed.
    async fn diff(&self) -> Result<String> {
        let commit = self.snapshot_commit().to_string();
        let cap = self.policy().max_file_bytes as usize;
        let script = format!(
            "git add -A && git -c core.pager=cat -c color.ui=false diff --cached --binary {commit}"
        );
        let r = self
            .exec(ExecRequest::shell(script).output_cap(cap))
            .await?;
        if r.stdout.truncated() {
            return Err(Error::TooLarge {
                what: "diff of the working tree".into(),
                limit: cap as u64,
            });
        }
        if !r.success() {
            return Err(Error::Workspace(format!(
                "git diff failed: {}",
                r.stderr.text().trim()
            )));
        }
        Ok(r.stdout.text())
    }
}

/// Makes `path` absolute inside the sandbox (relative to the workdir) and
/// rejects what no file name can contain.
pub fn resolve_path(policy: &Policy, path: &str) -> Result<String> {
    if path.is_empty() || path.contains('\0') {
        return Err(Error::InvalidInput(format!("bad path {path:?}")));
    }
    if path.starts_with('/') {
        Ok(path.to_string())
    } else {
        Ok(format!("{}/{}", policy.workdir.trim_end_matches('/'), path))
    }
}

/// A process-unique token for temporary names inside sandboxes.
pub(crate) fn next_token() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn parse_find_listing(bytes: &[u8]) -> Vec<DirEntry> {
    bytes
        .split(|b| *b == 0)
        .filter(|rec| !rec.is_empty())
        .filter_map(|rec| {
            let text = String::from_utf8_lossy(rec);
            let mut parts = text.splitn(3, '\t');
            let kind = parts.next()?.chars().next()?;
            let size = parts.next()?.parse().ok()?;
            let name = parts.next()?.to_string();
            Some(DirEntry { name, kind, size })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_relative_paths_below_workdir() {
        let p = Policy::default();
        assert_eq!(resolve_path(&p, "a/b.py").unwrap(), "/testbed/a/b.py");
        assert_eq!(resolve_path(&p, "/etc/passwd").unwrap(), "/etc/passwd");
        assert!(resolve_path(&p, "").is_err());
        assert!(resolve_path(&p, "a\0b").is_err());
    }

    #[test]
    fn parses_find_output() {
        let v = parse_find_listing(b"f\t12\ta.py\0d\t4096\tsub dir\0l\t3\tlink\0");
        assert_eq!(v.len(), 3);
        assert_eq!(
            v[1],
            DirEntry {
                name: "sub dir".into(),
                kind: 'd',
                size: 4096
            }
        );
    }
}
