//! The sandbox policy: limits and identity every sandbox starts with.
//!
//! Defaults are the safe choice (no network is not even a field: it is always
//! off). Not for per-task settings such as the test command (see
//! [`crate::grading::TestSpec`]).

use serde::{Deserialize, Serialize};

/// Limits applied to one sandbox and to every call on it.
///
/// Unknown keys are refused when read: a mistyped limit (`memory_byte`)
/// would otherwise leave the default in force without a word.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// Wall-clock limit of one command, seconds; the whole process group is
    /// killed when it fires. Default 60.
    pub exec_timeout_secs: f64,
    /// Limit of one file operation, sandbox start or close, seconds. Default 60.
    pub op_timeout_secs: f64,
    /// Bytes kept of each of stdout and stderr per command: the first and last
    /// halves; the rest is counted and dropped. Default 64 KiB.
    pub output_cap_bytes: usize,
    /// Largest file `read_file` returns, bytes. Default 16 MiB.
    pub max_file_bytes: u64,
    /// Memory limit, bytes; swap is disabled. Default 2 GiB.
    pub memory_bytes: u64,
    /// Disk limit of the working copy and `/tmp`, bytes. Default 1 GiB.
    /// Both live in memory (tmpfs), so what a command writes there also
    /// counts against `memory_bytes`; a full one gives ENOSPC, as a full
    /// disk does, and nothing else in the sandbox is writable. The local
    /// backend holds the two on one tmpfs and needs the right to mount
    /// (root; without it, a warning says disk use is unbounded); Docker
    /// gives each its own.
    pub disk_bytes: u64,
    /// Limit on files and folders in the working copy and `/tmp`, as
    /// `disk_bytes`. Default 262,144.
    pub disk_inodes: u64,
    /// CPU limit in cores. Default 1.0.
    pub cpus: f64,
    /// Maximum number of processes and threads. Default 256. Under the
    /// local backend a finished command's pids are released by the kernel
    /// up to about two seconds after it ends, so hundreds of commands a
    /// second (never an agent's pace) can reach the limit. A command that
    /// cannot start for want of pids waits for them, within its time
    /// limit, and is then an error of the sandbox, never the command's own
    /// failure.
    pub pids_limit: i64,
    /// Numeric `uid:gid` that commands run as; files of the snapshot are owned
    /// by it. Default `1000:1000` (non-root).
    pub user: String,
    /// Where the repository lives inside the sandbox. Default `/testbed`.
    pub workdir: String,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            exec_timeout_secs: 60.0,
            op_timeout_secs: 60.0,
            output_cap_bytes: 64 * 1024,
            max_file_bytes: 16 * 1024 * 1024,
            memory_bytes: 2 * 1024 * 1024 * 1024,
            disk_bytes: 1024 * 1024 * 1024,
            disk_inodes: 262_144,
            cpus: 1.0,
            pids_limit: 256,
            user: "1000:1000".to_string(),
            workdir: "/testbed".to_string(),
        }
    }
}

impl Policy {
    /// The numeric uid and gid of [`Policy::user`].
    pub fn uid_gid(&self) -> crate::Result<(u32, u32)> {
        let bad = || crate::Error::InvalidInput(format!("user {:?} is not uid:gid", self.user));
        let (u, g) = self.user.split_once(':').ok_or_else(bad)?;
        Ok((u.parse().map_err(|_| bad())?, g.parse().map_err(|_| bad())?))
    }

    /// Checks the values are usable before any sandbox starts.
    pub fn validate(&self) -> crate::Result<()> {
        self.uid_gid()?;
        let bad = |what: &str| Err(crate::Error::InvalidInput(what.to_string()));
        // As a request's own timeout (`timeout_ok`).
        if !crate::timeout_ok(self.exec_timeout_secs) {
            return bad("exec_timeout_secs must be above 0 and below 1e7 seconds");
        }
        if !crate::timeout_ok(self.op_timeout_secs) {
            return bad("op_timeout_secs must be above 0 and below 1e7 seconds");
        }
        if !(self.cpus > 0.0 && self.cpus.is_finite()) {
            return bad("cpus must be positive");
        }
        if self.memory_bytes < 16 * 1024 * 1024 {
            return bad("memory_bytes must be at least 16 MiB");
        }
        if self.disk_bytes < 16 * 1024 * 1024 {
            return bad("disk_bytes must be at least 16 MiB");
        }
        if self.disk_inodes < 1024 {
            return bad("disk_inodes must be at least 1024");
        }
        if self.pids_limit < 8 {
            return bad("pids_limit must be at least 8");
        }
        if self.output_cap_bytes < 2 {
            return bad("output_cap_bytes must be at least 2");
        }
        if !self.workdir.starts_with('/') || self.workdir.contains("..") || self.workdir == "/" {
            return bad("workdir must be an absolute path below /");
        }
        // Folders the sandbox mounts itself: the repository would be
        // hidden under them, or every command would fail to start there.
        let top = self
            .workdir
            .split('/')
            .find(|c| !c.is_empty())
            .unwrap_or("");
        if matches!(top, "tmp" | "proc" | "dev" | "sys") {
            return bad("workdir must not be in /tmp, /proc, /dev or /sys (the sandbox mounts its own there)");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_non_root() {
        let p = Policy::default();
        p.validate().unwrap();
        assert_eq!(p.uid_gid().unwrap(), (1000, 1000));
    }

    #[test]
    fn rejects_bad_values() {
        let p = Policy {
            user: "root".into(),
            ..Policy::default()
        };
        assert!(p.validate().is_err());
        // NaN, or past what a Duration holds (it panicked when the
        // command's timer started).
        for secs in [f64::NAN, 1e300, f64::INFINITY, 0.0] {
            let p = Policy {
                exec_timeout_secs: secs,
                ..Policy::default()
            };
            assert!(p.validate().is_err(), "{secs}");
            let p = Policy {
                op_timeout_secs: secs,
                ..Policy::default()
            };
            assert!(p.validate().is_err(), "{secs}");
        }
        assert!(crate::limit(1e300).is_err() && crate::limit(f64::NAN).is_err());
        for w in ["/", "/tmp", "/tmp/repo", "/proc/x", "//dev/shm/x", "/sys"] {
            let p = Policy {
                workdir: w.into(),
                ..Policy::default()
            };
            assert!(p.validate().is_err(), "{w}");
        }
        for w in ["/testbed", "/usr/src/app", "/tmpfiles"] {
            let p = Policy {
                workdir: w.into(),
                ..Policy::default()
            };
            assert!(p.validate().is_ok(), "{w}");
        }
    }

    #[test]
    fn deserializes_partial_config_with_defaults() {
        let p: Policy = serde_json::from_str(r#"{"cpus": 2.0}"#).unwrap();
        assert_eq!(p.cpus, 2.0);
        assert_eq!(p.pids_limit, 256);
        let e = serde_json::from_str::<Policy>(r#"{"memory_byte": 67108864}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `memory_byte`"), "{e}");
    }
}
