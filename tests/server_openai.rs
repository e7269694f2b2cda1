//! End to end: `arcticd serve` on a tiny model, driven by the official
//! `openai` Python client (tests/ref/openai_client_check.py), then stopped
//! with SIGTERM, which must end it cleanly; and SIGTERM with a request in
//! flight (plain HTTP), which it lets finish unless a second signal comes.
//!
//! Python: `$ARCTICD_PYTHON`, else `.venv/bin/python` in the repository,
//! else `python3`, the first that can import `openai`. If none can, the test
//! makes a virtual environment under target/ and installs `openai` from PyPI
//! into it. If that fails too, the test is skipped with a message, except
//! under CI (`CI` set), where it fails.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// A tiny random model in a fresh temporary directory named by `tag`.
fn tiny_model(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("arcticd-serve-{tag}-{}", std::process::id()));
    arcticd_engine::init::init_model(arcticd_engine::init::TINY, &dir, 11).unwrap();
    dir
}

/// Starts `arcticd serve` on `dir` with `extra` arguments; returns it, the
/// address it listens on (`http://host:port`) and its stderr's later lines
/// (read on a thread, so the server never blocks on a full pipe).
fn start_server(dir: &Path, extra: &[&str]) -> (Child, String, Receiver<String>) {
    let mut server = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(["serve", "--port", "0", "--served-model-name", "tiny"])
        .args(["--max-model-len", "2048", "--cache-memory", "32"])
        .args(extra)
        .arg("--model")
        .arg(dir)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(server.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("server exited before listening")
            .unwrap();
        if let Some(a) = line.split("listening on ").nth(1) {
            break a.trim().to_string();
        }
    };
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (server, addr, rx)
}

fn sigterm(server: &Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status();
}

/// The server's exit status, or None (and the server killed) after `limit`.
fn exit_within(server: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(s) = server.try_wait().unwrap() {
            return Some(s);
        }
        if start.elapsed() > limit {
            let _ = server.kill();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for a stderr line containing `what`; the lines read on the way.
fn wait_for_line(lines: &Receiver<String>, what: &str) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        match lines.recv_timeout(Duration::from_secs(20)) {
            Ok(l) => {
                let hit = l.contains(what);
                seen.push(l);
                if hit {
                    return seen;
                }
            }
            Err(e) => panic!("no line with {what:?} ({e}); read {seen:?}"),
        }
    }
}

fn has_openai(py: &Path) -> bool {
    Command::new(py)
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn python() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = root.join("target/openai-venv");
    let candidates = [
        std::env::var_os("ARCTICD_PYTHON").map(PathBuf::from),
        Some(root.join(".venv/bin/python")),
        Some(venv.join("bin/python")),
        Some(PathBuf::from("python3")),
    ];
    if let Some(p) = candidates.into_iter().flatten().find(|p| has_openai(p)) {
        return Some(p);
    }
    eprintln!("installing the openai package into {}", venv.display());
    let made = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .is_ok_and(|s| s.success())
        && Command::new(venv.join("bin/pip"))
            .args(["install", "-q", "openai"])
            .status()
            .is_ok_and(|s| s.success());
    let py = venv.join("bin/python");
    (made && has_openai(&py)).then_some(py)
}

#[test]
fn openai_python_client_against_arcticd_serve() {
    let Some(py) = python() else {
        if std::env::var_os("CI").is_some() {
            panic!("the openai Python package is needed (pip install openai)");
        }
        eprintln!("skipped: no Python with the openai package (set ARCTICD_PYTHON)");
        return;
    };
    let dir = tiny_model("e2e");
    let (mut server, addr, lines) = start_server(&dir, &["--replicas", "2"]);
    // Keep draining stderr so the server never blocks on a full pipe.
    let drain = std::thread::spawn(move || lines.iter().collect::<Vec<_>>());

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ref/openai_client_check.py");
    let out = Command::new(&py)
        .arg(&script)
        .args(["--base-url", &format!("{addr}/v1"), "--model", "tiny"])
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();

    sigterm(&server);
    let status = exit_within(&mut server, Duration::from_secs(20));
    let log = drain.join().unwrap_or_default();
    assert!(out.status.success(), "client check failed:\n{stderr}");
    let status = status.unwrap_or_else(|| panic!("no exit after SIGTERM; log: {log:?}"));
    assert!(status.success(), "server exit {status:?}; log: {log:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Opens a streamed completion of `n` choices of `max_tokens` tokens (EOS
/// ignored, usage at the end) over plain HTTP/1.1 and reads until its
/// first chunk; returns the connection and what was read.
fn open_stream(addr: &str, n: usize, max_tokens: usize) -> (TcpStream, String) {
    let host = addr.trim_start_matches("http://");
    let body = format!(
        r#"{{"model":"tiny","prompt":"hello","n":{n},"max_tokens":{max_tokens},"ignore_eos":true,"stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let mut c = TcpStream::connect(host).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut read = String::new();
    let mut buf = [0u8; 4096];
    while !read.contains("data: {") {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the first chunk: {read}");
        read.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    (c, read)
}

/// The rest of a stream: everything until the server closes it.
fn read_to_close(mut c: TcpStream, mut read: String) -> String {
    let mut buf = [0u8; 65536];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return read,
            Ok(n) => read.push_str(&String::from_utf8_lossy(&buf[..n])),
            Err(e) => panic!("reading the stream: {e}; read so far {read}"),
        }
    }
}

/// SIGTERM with a request in flight: the server takes no new connection,
/// the stream runs to its full length, and the server exits 0 after it.
/// A second signal instead ends it at once (`finish_reason: "abort"`).
#[test]
fn sigterm_lets_requests_in_flight_finish_and_a_second_one_ends_them() {
    const LONG: usize = 1500;
    let dir = tiny_model("drain");
    for second_signal in [false, true] {
        let (mut server, addr, lines) = start_server(&dir, &["--shutdown-grace", "120"]);
        // 4 x 1500 tokens: about a second of work on 2 cores, a signal
        // takes milliseconds.
        let (stream, head) = open_stream(&addr, 4, LONG);
        sigterm(&server);
        let mut log = wait_for_line(&lines, "shutting down");
        // The listener closes just after the line: connections are refused
        // from then on.
        let start = Instant::now();
        while TcpStream::connect(addr.trim_start_matches("http://")).is_ok() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "connections still accepted 10 s after the signal"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        if second_signal {
            sigterm(&server);
            log.extend(wait_for_line(&lines, "second signal"));
        }
        let text = read_to_close(stream, head);
        let status = exit_within(&mut server, Duration::from_secs(60));
        log.extend(lines.try_iter());
        let status = status.unwrap_or_else(|| panic!("no exit after SIGTERM; log: {log:?}"));
        assert!(status.success(), "server exit {status:?}; log: {log:?}");
        assert!(text.contains("data: [DONE]"), "{text}");
        if second_signal {
            assert!(text.contains(r#""finish_reason":"abort""#), "{text}");
        } else {
            assert!(text.contains(r#""finish_reason":"length""#), "{text}");
            assert!(
                text.contains(&format!(r#""completion_tokens":{}"#, 4 * LONG)),
                "{text}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
