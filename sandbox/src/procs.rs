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
}
