//! Isolation tests of the sandbox, each run on both backends against the
//! real Docker daemon and real bubblewrap: no network, no history, no host
//! files, contained fork bombs and memory hogs, timeouts that kill the whole
//! process group, capped output, reaping after SIGKILL, and grading.
//!
//! A backend that is unavailable fails the test when `CI` is set and is
//! skipped loudly otherwise. The base image is built once (cached by tag).
//! Not a benchmark (see benches/sandbox.rs).

mod common;
use anyhow::{ensure, Result};
use arcticd_sandbox::docker;
use arcticd_sandbox::grading::{self, GradeOutcome, TestSpec};
use arcticd_sandbox::image;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::{Backend, ExecRequest, Policy, Sandbox, Snapshot};
use common::{run_on_backend, skip, Kind, TempDir};
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Ctx {
    kind: Kind,
    backend: Arc<dyn Backend>,
    image: String,
}

impl Ctx {
    async fn start(
        &self,
        repo: &Path,
        policy: &Policy,
    ) -> Result<(Arc<Snapshot>, Box<dyn Sandbox>)> {
        let snap = Arc::new(Snapshot::from_dir(repo)?);
        let sb = self.backend.start(&snap, &self.image, policy).await?;
        Ok((snap, sb))
    }
}

fn unavailable(kind: Kind, why: &str) {
    skip(&format!("{kind:?}"), why);
}

type Body = Box<dyn FnOnce(Ctx) -> Pin<Box<dyn Future<Output = Result<()>>>>>;

fn run_on(kind: Kind, body: Body) {
    run_on_backend(
        kind,
        Box::new(move |backend| {
            body(Ctx {
                kind,
                backend,
                image: image::DEFAULT_TAG.to_string(),
            })
        }),
    );
}

macro_rules! both_backends {
    ($name:ident, |$ctx:ident| $body:block) => {
        mod $name {
            use super::*;
            #[test]
            fn docker() {
                run_on(Kind::Docker, Box::new(|$ctx| Box::pin(async move $body)));
            }
            #[test]
            fn local() {
                run_on(Kind::Local, Box::new(|$ctx| Box::pin(async move $body)));
            }
        }
    };
}

fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@t")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@t")
        .output()?;
    ensure!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A small Python repository with history that must not leak: a buggy
/// `calc.add`, a passing test, and a "gold fix" commit later reset away.
fn fixture_repo() -> Result<TempDir> {
    let d = TempDir::new("repo")?;
    let p = d.path();
    std::fs::create_dir(p.join("tests"))?;
    std::fs::write(
        p.join("calc.py"),
        "def add(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n",
    )?;
    std::fs::write(
        p.join("tests/test_mul.py"),
        "from calc import mul\n\ndef test_mul():\n    assert mul(2, 3) == 6\n",
    )?;
    git(p, &["init", "-q"])?;
    git(p, &["add", "-A"])?;
    git(p, &["commit", "-qm", "initial"])?;
    std::fs::write(
        p.join("calc.py"),
        "def add(a, b):\n    return a + b  # GOLD_FIX_MARKER\n\ndef mul(a, b):\n    return a * b\n",
    )?;
    git(p, &["commit", "-qam", "the gold fix GOLD_FIX_MARKER"])?;
    git(p, &["tag", "v1.0"])?;
    git(p, &["branch", "fix-branch"])?;
    git(p, &["reset", "-q", "--hard", "HEAD~1"])?;
    std::fs::write(p.join("wip.txt"), "stash me GOLD_FIX_MARKER\n")?;
    git(p, &["add", "wip.txt"])?;
    git(p, &["stash", "-q"])?;
    git(
        p,
        &[
            "remote",
            "add",
            "origin",
            "https://example.invalid/repo.git",
        ],
    )?;
    git(p, &["pack-refs", "--all"])?;
    Ok(d)
}

fn sh(script: &str) -> ExecRequest {
    ExecRequest::shell(script)
}

both_backends!(runs_commands_and_moves_files, |ctx| {
    let repo = fixture_repo()?;
    let (_snap, sb) = ctx.start(repo.path(), &Policy::default()).await?;
    let r = sb.exec(sh("echo out; echo err >&2; exit 3")).await?;
    ensure!(r.exit_code == Some(3), "{r:?}");
    ensure!(
        r.stdout.text() == "out\n" && r.stderr.text() == "err\n",
        "{r:?}"
    );
    let r = sb
        .exec(ExecRequest::argv(["cat"]).stdin(b"piped input".to_vec()))
        .await?;
    ensure!(r.stdout.text() == "piped input", "{r:?}");
    let r = sb.exec(ExecRequest::argv(["id", "-u"])).await?;
    ensure!(r.stdout.text().trim() == "1000", "runs as non-root: {r:?}");

    let data: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    sb.write_file("data.bin", &data).await?;
    ensure!(
        sb.read_file("/testbed/data.bin").await? == data,
        "binary round trip"
    );
    ensure!(sb.read_file("missing.txt").await.is_err());
    ensure!(
        sb.read_file("tests").await.is_err(),
        "a folder is not a file"
    );
    let names: Vec<String> = sb
        .list_dir(".")
        .await?
        .into_iter()
        .map(|e| e.name)
        .collect();
    ensure!(
        names.contains(&"calc.py".to_string()) && names.contains(&"tests".to_string()),
        "{names:?}"
    );

    ensure!(sb.diff().await?.contains("data.bin"));
    sb.exec(sh("rm data.bin")).await?;
    ensure!(sb.diff().await?.is_empty(), "clean tree has an empty diff");
    let patch = "--- a/calc.py\n+++ b/calc.py\n@@ -1,3 +1,3 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n \n";
    ensure!(sb.apply_patch(patch).await?.applied);
    ensure!(
        !sb.apply_patch(patch).await?.applied,
        "applying twice fails"
    );
    let d = sb.diff().await?;
    ensure!(d.contains("+    return a + b"), "{d}");
    let id = sb.id().to_string();
    sb.close().await?;
    ensure!(matches!(
        sb.exec(sh("true")).await,
        Err(arcticd_sandbox::Error::Closed)
    ));
    if ctx.kind == Kind::Docker {
        let client = docker::connect().await?;
        ensure!(
            !docker::list_own(&client).await?.contains(&id),
            "container removed on close"
        );
    }
    Ok(())
});

// Whoever the sandbox's host user is (host root without capabilities
// where bubblewrap cannot start as `nobody`): host-wide kernel settings
// stay unwritable, descriptors the launching process holds do not reach
// it, and the local sandboxes' folder is private (the agent's files,
// set-uid bits included, are that user's).
both_backends!(cannot_touch_host_settings_or_inherited_files, |ctx| {
    let repo = fixture_repo()?;
    let (_snap, sb) = ctx.start(repo.path(), &Policy::default()).await?;
    let before = std::fs::read_to_string("/proc/sys/kernel/core_pattern")?;
    let r = sb
        .exec(sh("echo arcticd-test > /proc/sys/kernel/core_pattern"))
        .await?;
    let after = std::fs::read_to_string("/proc/sys/kernel/core_pattern")?;
    if after != before {
        // Put the host back before failing.
        let _ = std::fs::write("/proc/sys/kernel/core_pattern", before.trim_end());
    }
    ensure!(
        after == before,
        "the sandbox wrote the host's core_pattern: {r:?}"
    );
    ensure!(!r.success(), "{r:?}");
    // Docker's commands are started by the daemon, never by this process,
    // so only the local backend can pass a descriptor on.
    if ctx.kind == Kind::Local {
        // A descriptor without close-on-exec, as a launcher may leave one.
        let dir = TempDir::new("inherited-fd")?;
        let leak = dir.path().join("leak");
        let file = std::fs::File::create(&leak)?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        // SAFETY: flags of a descriptor this test owns.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
        }
        let r = sb.exec(sh(&format!("echo escaped >&{fd}"))).await?;
        drop(file);
        ensure!(
            std::fs::read_to_string(&leak)?.is_empty(),
            "the sandbox wrote through an inherited descriptor: {r:?}"
        );
        use std::os::unix::fs::PermissionsExt;
        let state = local_state_dir();
        // Private: no other user lists it or writes there (0711 lets the
        // sandboxes' host user pass through to its own folders).
        let mode = std::fs::metadata(&state)?.permissions().mode();
        ensure!(mode & 0o066 == 0, "{} has mode {mode:o}", state.display());
    }
    sb.close().await?;
    Ok(())
});

// The sandbox's processes are an unprivileged user on the host, even when
// this process is root. Local: the host's /proc shows the uid of a command
// while it runs (a sandbox's own uid_map cannot tell: bubblewrap nests a
// second user namespace inside the one it starts in). Docker runs commands
// as the policy's user, with no user namespace, so `id` there is the host's.
both_backends!(runs_as_an_unprivileged_host_user, |ctx| {
    let repo = fixture_repo()?;
    let (_snap, sb) = ctx.start(repo.path(), &Policy::default()).await?;
    let uid = sb.exec(sh("id -u")).await?;
    ensure!(uid.success() && uid.stdout.text().trim() != "0", "{uid:?}");
    if ctx.kind == Kind::Local {
        // A command no other process runs, found by its exact arguments.
        let argv = b"sleep\x002.4817\x00";
        let find = async {
            for _ in 0..200 {
                tokio::time::sleep(Duration::from_millis(10)).await;
                for e in std::fs::read_dir("/proc")?.flatten() {
                    let p = e.path();
                    if std::fs::read(p.join("cmdline")).is_ok_and(|c| c == argv) {
                        let status = std::fs::read_to_string(p.join("status"))?;
                        return Ok(status
                            .lines()
                            .find(|l| l.starts_with("Uid:"))
                            .map(str::to_string));
                    }
                }
            }
            Ok::<_, std::io::Error>(None)
        };
        let (r, found) = tokio::join!(sb.exec(sh("sleep 2.4817")), find);
        ensure!(r?.success());
        let line = found?.ok_or_else(|| anyhow::anyhow!("the sandbox's sleep was not seen"))?;
        let host: Vec<&str> = line.split_whitespace().skip(1).collect();
        ensure!(
            !host.is_empty() && host.iter().all(|u| *u != "0"),
            "the sandbox's command runs as host root: {line}"
        );
    }
    sb.close().await?;
    Ok(())
});

both_backends!(has_no_network, |ctx| {
    let repo = fixture_repo()?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let port = listener.local_addr()?.port();
    let (_snap, sb) = ctx.start(repo.path(), &Policy::default()).await?;
    let connect = format!(
        "python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)\""
    );
    let r = sb.exec(sh(&connect)).await?;
    ensure!(
        r.exit_code != Some(0),
        "connected to the host's loopback: {r:?}"
    );
    ensure!(
        listener.accept().is_err(),
        "the host server saw a connection"
    );
    let r = sb
        .exec(sh(
            "python3 -c \"import socket; socket.getaddrinfo('deb.debian.org', 80)\"",
        ))
        .await?;
    ensure!(r.exit_code != Some(0), "DNS resolved: {r:?}");
    let r = sb.exec(sh("cat /proc/net/dev")).await?;
    let devs = r.stdout.text();
    ensure!(
        devs.lines()
            .skip(2)
            .all(|l| l.trim_start().starts_with("lo:")),
        "only loopback: {devs}"
    );
    sb.close().await?;
    Ok(())
});

both_backends!(holds_only_the_snapshot_commit, |ctx| {
    let repo = fixture_repo()?;
    let (_snap, sb) = ctx.start(repo.path(), &Policy::default()).await?;
    let checks = [
        ("git log --all --oneline | wc -l", "1"),
        ("git reflog | wc -l", "0"),
        ("git branch -a | wc -l", "1"),
        ("git tag | wc -l", "0"),
        ("git remote | wc -l", "0"),
        ("git stash list | wc -l", "0"),
        ("git fsck --lost-found 2>/dev/null | wc -l", "0"),
        ("ls .git/lost-found 2>/dev/null | wc -l", "0"),
        ("test -e .git/packed-refs && echo yes || echo no", "no"),
        ("test -e .git/logs && echo yes || echo no", "no"),
        ("git status --porcelain | wc -l", "0"),
        ("git grep -c GOLD_FIX_MARKER $(git rev-list --all) | wc -l", "0"),
        // Every object in the store is reachable from the one commit.
        ("test $(git cat-file --batch-all-objects --batch-check | wc -l) -eq $(git rev-list --objects --all | wc -l) && echo same", "same"),
    ];
    for (script, want) in checks {
        let r = sb.exec(sh(script)).await?;
        ensure!(
            r.stdout.text().trim() == want,
            "{script}: got {:?} (stderr {:?})",
            r.stdout.text(),
            r.stderr.text()
        );
    }
    let r = sb.exec(sh("grep -r GOLD_FIX_MARKER . ; true")).await?;
    ensure!(
        r.stdout.text().is_empty(),
        "gold fix text leaked: {}",
        r.stdout.text()
    );
    sb.close().await?;
    Ok(())
});

both_backends!(cannot_see_or_touch_host_files, |ctx| {
    let repo = fixture_repo()?;
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let marker = Path::new(&home).join(format!(
        ".arcticd-sandbox-test-{}-{:?}",
        std::process::id(),
        ctx.kind
    ));
    std::fs::write(&marker, "host secret")?;
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let (_snap, sb) = ctx.start(repo.path(), &Policy::default()).await?;
    let mut failures = vec![];
    for path in [marker.as_path(), checkout.as_path(), repo.path()] {
        let p = path.display().to_string();
        let r = sb
            .exec(ExecRequest::argv([
                "sh",
                "-c",
                r#"cat "$1" || ls "$1""#,
                "sh",
                &p,
            ]))
            .await?;
        if r.exit_code == Some(0) {
            failures.push(format!("read {p}"));
        }
        let r = sb
            .exec(ExecRequest::argv([
                "sh",
                "-c",
                r#"echo pwned > "$1""#,
                "sh",
                &p,
            ]))
            .await?;
        if r.exit_code == Some(0)
            && path.is_file()
            && std::fs::read_to_string(path)?.contains("pwned")
        {
            failures.push(format!("wrote {p}"));
        }
    }
    let r = sb
        .exec(sh("touch /etc/pwned || touch /usr/bin/pwned"))
        .await?;
    ensure!(r.exit_code != Some(0), "system folders are writable");
    let _ = std::fs::remove_file(&marker);
    sb.close().await?;
    ensure!(failures.is_empty(), "host files reachable: {failures:?}");
    Ok(())
});

both_backends!(contains_a_fork_bomb, |ctx| {
    let repo = fixture_repo()?;
    let policy = Policy {
        pids_limit: 64,
        ..Policy::default()
    };
    let (_snap, sb) = ctx.start(repo.path(), &policy).await?;
    let t0 = Instant::now();
    let r = sb
        .exec(sh("f() { f | f & }; f; sleep 3").timeout(8.0))
        .await?;
    ensure!(
        t0.elapsed() < Duration::from_secs(30),
        "bomb took {:?}",
        t0.elapsed()
    );
    let _ = r;
    // The sandbox recovers: the limit held and the bomb is gone.
    let mut ok = false;
    for _ in 0..20 {
        let r = sb.exec(sh("echo alive").timeout(10.0)).await?;
        if r.stdout.text().trim() == "alive" {
            ok = true;
            break;
        }
        tokio_sleep(500).await;
    }
    ensure!(ok, "sandbox unusable after the fork bomb");
    // Killed bomb processes are zombies until the sandbox's init reaps
    // them, which takes a moment on a loaded machine; a bomb still running
    // would keep the count at the limit.
    let mut n = u32::MAX;
    for _ in 0..40 {
        let r = sb
            .exec(sh(
                "n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; echo $n",
            ))
            .await?;
        n = r.stdout.text().trim().parse().unwrap_or(u32::MAX);
        if n < 16 {
            break;
        }
        tokio_sleep(500).await;
    }
    ensure!(n < 16, "{n} processes left 20 s after the bomb");
    sb.close().await?;
    Ok(())
});

// A local command that bubblewrap cannot start for want of pids (a local
// sandbox's finished commands release theirs up to ~2 s late) is started
// again once they are free, instead of coming back as if the command had
// failed with exit 1. One that cannot start within its time limit is an
// error of the sandbox, not the command's. The command never holds the
// descriptor bubblewrap reports on.
#[test]
fn a_local_start_refused_for_pids_waits_for_them() {
    run_on(
        Kind::Local,
        Box::new(|ctx| {
            Box::pin(async move {
                let repo = fixture_repo()?;
                let policy = Policy {
                    pids_limit: 8,
                    ..Policy::default()
                };
                let (_snap, sb) = ctx.start(repo.path(), &policy).await?;
                let sb: Arc<dyn Sandbox> = sb.into();
                // The shell's own descriptors, while `ls` runs.
                let fds = sb.exec(sh("ls -l /proc/$$/fd")).await?;
                let listing = fds.stdout.text();
                let open: Vec<&str> = listing
                    .lines()
                    .filter_map(|l| l.split_once(" -> ")?.0.rsplit(' ').next())
                    .collect();
                ensure!(open == ["0", "1", "2"], "{fds:?}");
                // Holds every pid the sandbox has for `secs`: forks until
                // the limit refuses, leaves a file in /tmp, then the
                // children and itself sleep. Returns once the file is seen
                // from the host.
                let full = local_state_dir().join(sb.id()).join("tmp/full");
                let hold = |secs: f64| {
                    let sb = sb.clone();
                    let script = format!(
                        "import os, time\n\
                         while True:\n\
                         \x20   try:\n\
                         \x20       pid = os.fork()\n\
                         \x20   except OSError:\n\
                         \x20       break\n\
                         \x20   if pid == 0:\n\
                         \x20       time.sleep({secs})\n\
                         \x20       os._exit(0)\n\
                         open('/tmp/full', 'w').close()\n\
                         time.sleep({secs})\n"
                    );
                    let _ = std::fs::remove_file(&full);
                    let hog = tokio::spawn(async move {
                        sb.exec(ExecRequest::argv(["python3", "-c", &script])).await
                    });
                    let full = full.clone();
                    async move {
                        for _ in 0..200 {
                            if full.exists() {
                                return Ok(hog);
                            }
                            tokio_sleep(50).await;
                        }
                        anyhow::bail!("the pids were never all in use")
                    }
                };
                let hog = hold(1.5).await?;
                let t0 = Instant::now();
                let r = sb.exec(sh("echo started")).await?;
                ensure!(
                    r.success() && r.stdout.text().trim() == "started",
                    "a start refused for pids came back as the command's result: {r:?}"
                );
                ensure!(
                    t0.elapsed() > Duration::from_millis(300),
                    "the pids were not all in use ({:?}): the test proves nothing",
                    t0.elapsed()
                );
                hog.await??;
                let hog = hold(6.0).await?;
                let r = sb.exec(sh("echo started").timeout(1.5)).await;
                ensure!(
                    matches!(&r, Err(arcticd_sandbox::Error::Sandbox(m))
                        if m.contains("Resource temporarily unavailable")),
                    "a command that could not start in its time: {r:?}"
                );
                hog.await??;
                sb.close().await?;
                Ok(())
            })
        }),
    );
}

/// Where the local backend keeps its sandboxes' folders.
fn local_state_dir() -> std::path::PathBuf {
    std::env::var_os("ARCTICD_LOCAL_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("arcticd-local"))
}

async fn tokio_sleep(ms: u64) {
    arcticd_sandbox::tokio::time::sleep(Duration::from_millis(ms)).await;
}

both_backends!(kills_a_memory_hog, |ctx| {
    let repo = fixture_repo()?;
    let policy = Policy {
        memory_bytes: 256 << 20,
        ..Policy::default()
    };
    let (_snap, sb) = ctx.start(repo.path(), &policy).await?;
    let r = sb
        .exec(sh("python3 -c \"b = b'x' * (1 << 30); print(len(b))\""))
        .await?;
    ensure!(r.memory_exceeded, "not reported as memory-exceeded: {r:?}");
    ensure!(r.exit_code == Some(137), "{r:?}");
    let r = sb
        .exec(sh("python3 -c \"b = b'x' * (64 << 20); print(len(b))\""))
        .await?;
    ensure!(
        r.success() && !r.memory_exceeded,
        "a modest allocation fails: {r:?}"
    );
    sb.close().await?;
    Ok(())
});

// The working copy and /tmp are bounded (a tmpfs of their own): a command
// that writes past `disk_bytes` or `disk_inodes` gets ENOSPC, and the
// sandbox goes on. Nothing else is writable. A local sandbox leaves no
// mount behind when closed.
both_backends!(bounds_disk_use, |ctx| {
    let repo = fixture_repo()?;
    let policy = Policy {
        disk_bytes: 32 << 20,
        disk_inodes: 2048,
        ..Policy::default()
    };
    let (_snap, sb) = ctx.start(repo.path(), &policy).await?;
    let mounted = |id: &str| {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .contains(id)
    };
    if ctx.kind == Kind::Local && !mounted(sb.id()) {
        // Not root: said at start-up as a warning.
        unavailable(ctx.kind, "no right to mount a tmpfs (not root)");
        return sb.close().await.map_err(Into::into);
    }
    for place in [".", "/tmp"] {
        let r = sb
            .exec(sh(&format!(
                "dd if=/dev/zero of={place}/big bs=1M count=64 2>&1; rm -f {place}/big"
            )))
            .await?;
        ensure!(
            r.stdout.text().contains("No space left on device"),
            "{place}: 64 MiB written past a 32 MiB limit: {r:?}"
        );
    }
    let r = sb
        .exec(sh(
            "mkdir many && cd many && for i in $(seq 4000); do touch f$i || exit 3; done",
        ))
        .await?;
    ensure!(
        r.exit_code == Some(3) && r.stderr.text().contains("No space left on device"),
        "4,000 files past 2,048 inodes: {r:?}"
    );
    let r = sb
        .exec(sh("rm -rf many && echo fine > note && cat note"))
        .await?;
    ensure!(
        r.stdout.text().trim() == "fine",
        "the sandbox did not recover: {r:?}"
    );
    // Files move in and out of both bounded places.
    for path in ["/tmp/moved.txt", "moved.txt"] {
        sb.write_file(path, b"moved").await?;
        ensure!(sb.read_file(path).await? == b"moved", "{path}");
    }
    let r = sb
        .exec(sh("touch /var/tmp/x || touch /home/x || touch /x"))
        .await?;
    ensure!(
        !r.success(),
        "a folder outside the limits is writable: {r:?}"
    );
    let id = sb.id().to_string();
    sb.close().await?;
    ensure!(
        !mounted(&id),
        "the tmpfs of {id} is still mounted after close"
    );
    Ok(())
});

fn host_processes_with(needle: &str) -> usize {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return 0;
    };
    rd.flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .chars()
                .all(|c| c.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| {
            String::from_utf8_lossy(c)
                .replace('\0', " ")
                .contains(needle)
        })
        .count()
}

both_backends!(timeout_kills_the_process_group, |ctx| {
    let repo = fixture_repo()?;
    let (_snap, sb) = ctx.start(repo.path(), &Policy::default()).await?;
    let needle = format!("sleep 1000.{}{}", std::process::id() % 1000, ctx.kind as u8);
    let t0 = Instant::now();
    let r = sb
        .exec(sh(&format!("{needle} & {needle} & {needle}")).timeout(2.0))
        .await?;
    ensure!(r.timed_out && r.exit_code.is_none(), "{r:?}");
    ensure!(
        t0.elapsed() < Duration::from_secs(15),
        "timeout took {:?}",
        t0.elapsed()
    );
    let mut left = usize::MAX;
    for _ in 0..20 {
        left = host_processes_with(&needle);
        if left == 0 {
            break;
        }
        tokio_sleep(100).await;
    }
    ensure!(left == 0, "{left} processes of the timed-out group survive");
    sb.close().await?;
    Ok(())
});

both_backends!(caps_huge_output, |ctx| {
    let repo = fixture_repo()?;
    let (_snap, sb) = ctx.start(repo.path(), &Policy::default()).await?;
    let r = sb
        .exec(sh("head -c 100000000 /dev/zero | tr '\\0' x; echo END").timeout(120.0))
        .await?;
    ensure!(r.success(), "{:?} {:?}", r.exit_code, r.stderr.text());
    ensure!(
        r.truncated && r.stdout_bytes == 100_000_004,
        "{} bytes",
        r.stdout_bytes
    );
    let kept = r.stdout.bytes();
    ensure!(
        kept.len() <= Policy::default().output_cap_bytes,
        "kept {}",
        kept.len()
    );
    ensure!(r.stdout.text().ends_with("xEND\n"), "tail kept");
    sb.close().await?;
    Ok(())
});

both_backends!(grades_in_a_fresh_sandbox, |ctx| {
    let repo = fixture_repo()?;
    let test_patch = "--- /dev/null\n+++ b/tests/test_add.py\n@@ -0,0 +1,4 @@\n+from calc import add\n+\n+def test_add():\n+    assert add(2, 3) == 5\n";
    let spec = TestSpec {
        test_command: "python3 -m pytest -rA -p no:cacheprovider tests".into(),
        test_patch: test_patch.into(),
        fail_to_pass: vec!["tests/test_add.py::test_add".into()],
        pass_to_pass: vec!["tests/test_mul.py::test_mul".into()],
        log_parser: "pytest".into(),
        timeout_secs: 120.0,
    };
    let policy = Policy::default();
    let (snap, sb) = ctx.start(repo.path(), &policy).await?;
    // The hidden test is not in the agent's sandbox.
    ensure!(sb.read_file("tests/test_add.py").await.is_err());
    // An agent that only rewrites the hidden test's file gains nothing.
    sb.write_file("tests/test_add.py", b"def test_add():\n    pass\n")
        .await?;
    let cheat = sb.diff().await?;
    let fix = "--- a/calc.py\n+++ b/calc.py\n@@ -1,3 +1,3 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n \n";
    sb.close().await?;

    let g = grading::grade(ctx.backend.as_ref(), &snap, &ctx.image, &policy, fix, &spec).await?;
    ensure!(
        g.outcome == GradeOutcome::Resolved && g.reward == 1.0,
        "{g:#?}"
    );
    let g = grading::grade(ctx.backend.as_ref(), &snap, &ctx.image, &policy, "", &spec).await?;
    ensure!(
        g.outcome == GradeOutcome::Unresolved && g.reward == 0.0,
        "{g:#?}"
    );
    let g = grading::grade(
        ctx.backend.as_ref(),
        &snap,
        &ctx.image,
        &policy,
        &cheat,
        &spec,
    )
    .await?;
    ensure!(
        g.outcome == GradeOutcome::Unresolved,
        "editing the hidden test passed: {g:#?}"
    );
    let g = grading::grade(
        ctx.backend.as_ref(),
        &snap,
        &ctx.image,
        &policy,
        "--- a/nope\n+++ b/nope\n@@ -1 +1 @@\n-x\n+y\n",
        &spec,
    )
    .await?;
    ensure!(g.outcome == GradeOutcome::PatchFailed, "{g:#?}");
    let broken = TestSpec {
        test_command: "echo no tests here; exit 4".into(),
        ..spec.clone()
    };
    let g = grading::grade(
        ctx.backend.as_ref(),
        &snap,
        &ctx.image,
        &policy,
        fix,
        &broken,
    )
    .await?;
    ensure!(g.outcome == GradeOutcome::InfraError, "{g:#?}");
    Ok(())
});

// Starts `arcticd sandbox run ... -- sleep 100`, SIGKILLs it, and checks the
// next start's reaper removes what it left.
both_backends!(reaps_after_sigkill, |ctx| {
    let repo = fixture_repo()?;
    let backend = match ctx.kind {
        Kind::Docker => "docker",
        Kind::Local => "local",
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(["sandbox", "run", "--backend", backend, "--repo"])
        .arg(repo.path())
        .args(["--", "sleep", "100"])
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let owner_pid = format!("{}-", child.id());
    let client = if ctx.kind == Kind::Docker {
        Some(docker::connect().await?)
    } else {
        None
    };
    let local_dir = std::env::var_os("ARCTICD_LOCAL_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("arcticd-local"));
    let leftovers = || async {
        match &client {
            Some(c) => {
                let list = docker::list_labelled(c).await.unwrap_or_default();
                list.into_iter()
                    .filter(|(_, labels)| {
                        labels
                            .get(docker::OWNER_LABEL)
                            .is_some_and(|o| o.starts_with(&owner_pid))
                    })
                    .count()
            }
            None => std::fs::read_dir(&local_dir)
                .map(|rd| {
                    rd.flatten()
                        .filter(|e| {
                            e.file_name()
                                .to_string_lossy()
                                .starts_with(&format!("arcticd-{owner_pid}"))
                        })
                        .count()
                })
                .unwrap_or(0),
        }
    };
    let mut seen = 0;
    for _ in 0..100 {
        seen = leftovers().await;
        if seen > 0 {
            break;
        }
        tokio_sleep(100).await;
    }
    ensure!(seen > 0, "the child never started a sandbox");
    tokio_sleep(300).await;
    child.kill()?; // SIGKILL
    child.wait()?;
    ensure!(
        leftovers().await > 0,
        "nothing left to reap (test proves nothing)"
    );
    match &client {
        Some(c) => {
            docker::reap_orphans(c).await?;
        }
        None => {
            LocalBackend::new().await?.reap_orphans();
        }
    }
    ensure!(leftovers().await == 0, "orphans survive the reaper");
    Ok(())
});
