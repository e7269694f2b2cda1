//! End to end: `arcticd serve` on a tiny model, driven by the official
//! `openai` Python client (tests/ref/openai_client_check.py), then stopped
//! with SIGTERM, which must end it cleanly.
//!
//! Python: `$ARCTICD_PYTHON`, else `.venv/bin/python` in the repository,
//! else `python3`, the first that can import `openai`. If none can, the test
//! makes a virtual environment under target/ and installs `openai` from PyPI
//! into it. If that fails too, the test is skipped with a message, except
//! under CI (`CI` set), where it fails.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
    let dir = std::env::temp_dir().join(format!("arcticd-serve-e2e-{}", std::process::id()));
    arcticd_engine::init::init_model(arcticd_engine::init::TINY, &dir, 11).unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(["serve", "--port", "0", "--served-model-name", "tiny"])
        .args([
            "--max-model-len",
            "2048",
            "--cache-memory",
            "32",
            "--replicas",
            "2",
        ])
        .arg("--model")
        .arg(&dir)
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
    // Keep draining stderr so the server never blocks on a full pipe.
    let drain = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ref/openai_client_check.py");
    let out = Command::new(&py)
        .arg(&script)
        .args(["--base-url", &format!("{addr}/v1"), "--model", "tiny"])
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();

    let _ = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = server.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = server.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = drain.join().unwrap_or_default();
    assert!(out.status.success(), "client check failed:\n{stderr}");
    let status = status.unwrap_or_else(|| panic!("no exit after SIGTERM; log: {log:?}"));
    assert!(status.success(), "server exit {status:?}; log: {log:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
