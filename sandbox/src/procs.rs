//! Process identity for the reapers: "pid:starttime", so a recycled pid is
//! never mistaken for the process that made a sandbox.
//!
//! Linux only (reads /proc). Not a process supervisor.

/// Identity of this process, as written into container labels and local
/// sandbox names.
pub fn self_owner() -> String {
    let pid = std::process::id();
    format!("{pid}-{}", start_time(pid).unwrap_or(0))
}

/// The start time of `pid` in clock ticks since boot (field 22 of
/// /proc/PID/stat), or `None` when there is no such process.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses; fields
    // after the last ')' are plain.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the owner named `owner` ("pid-starttime") is still running.
/// Unparseable owners count as alive, so nothing unknown is reaped.
pub fn owner_alive(owner: &str) -> bool {
    let Some((pid, start)) = owner.split_once('-') else {
        return true;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return true;
    };
    start_time(pid) == Some(start)
}

/// Whether `name` is `prefix` then an owner (`pid-start`, optionally
/// followed by `-anything`) that is no longer running: a leftover of a
/// process that is gone. Names without an owner are never orphans.
pub fn orphaned(name: &str, prefix: &str) -> bool {
    let Some(rest) = name.strip_prefix(prefix) else {
        return false;
    };
    let mut parts = rest.splitn(3, '-');
    match (parts.next(), parts.next()) {
        (Some(pid), Some(start)) => !owner_alive(&format!("{pid}-{start}")),
        _ => false,
    }
}

/// This machine's name, so a reaper only touches sandboxes made here when
/// several hosts share a Docker daemon.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_is_alive_and_fake_owner_is_not() {
        assert!(owner_alive(&self_owner()));
        let pid = std::process::id();
        assert!(!owner_alive(&format!("{pid}-1")));
        assert!(owner_alive("garbage"));
    }

    #[test]
    fn only_named_leftovers_of_gone_owners_are_orphans() {
        let pid = std::process::id();
        assert!(!orphaned(&format!("x-{}-abc", self_owner()), "x-"));
        assert!(orphaned(&format!("x-{pid}-1-abc"), "x-"));
        assert!(orphaned(&format!("x-{pid}-1"), "x-"));
        assert!(!orphaned(&format!("y-{pid}-1-abc"), "x-"));
        assert!(!orphaned("x-", "x-"));
        assert!(!orphaned("x-notapid-1", "x-"));
    }
}
