//! Setup shared by the integration tests that run tasks in sandboxes: a
//! temporary folder, the sandbox base image (built once per test binary),
//! and the skip rule (a missing backend fails under CI, is skipped
//! elsewhere).

#![allow(dead_code)]

use arcticd_sandbox::docker::DockerBackend;
use arcticd_sandbox::image;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::Backend;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

/// A folder removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh folder, unique within the process (a counter) and across
    /// processes (the pid).
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("arcticd-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)?;
        Ok(TempDir(p))
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds the base image once; whether Docker is reachable, or why not.
pub fn base_image() -> Result<bool, String> {
    static BUILT: OnceLock<Result<bool, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let rt = arcticd_sandbox::runtime().map_err(|e| e.to_string())?;
            rt.block_on(async {
                let docker_ok = DockerBackend::new().await.is_ok();
                image::build_base_image(image::DEFAULT_TAG, docker_ok, false)
                    .await
                    .map(|_| docker_ok)
                    .map_err(|e| e.to_string())
            })
        })
        .clone()
}

/// A backend is unavailable: fail under CI, skip elsewhere.
pub fn skip(what: &str, why: &str) {
    if std::env::var_os("CI").is_some() {
        panic!("{what} backend unavailable in CI: {why}");
    }
    eprintln!("SKIPPED: {what} sandbox backend unavailable: {why}");
}

/// The sandbox backends a test runs on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Docker,
    Local,
}

/// A test's body on one backend.
pub type OnBackend =
    Box<dyn FnOnce(Arc<dyn Backend>) -> Pin<Box<dyn Future<Output = anyhow::Result<()>>>>>;

/// Runs `body` on a `kind` backend (the base image built first) in a
/// runtime of its own: a backend that is not there is skipped (a failure
/// under CI), and a failing body panics naming the backend.
pub fn run_on_backend(kind: Kind, body: OnBackend) {
    let docker_ok = match base_image() {
        Ok(d) => d,
        Err(e) => return skip(&format!("{kind:?}"), &format!("base image: {e}")),
    };
    if kind == Kind::Docker && !docker_ok {
        return skip(&format!("{kind:?}"), "cannot connect to the Docker daemon");
    }
    let rt = arcticd_sandbox::runtime().expect("runtime");
    rt.block_on(async {
        let backend: Arc<dyn Backend> = match kind {
            Kind::Docker => match DockerBackend::new().await {
                Ok(b) => Arc::new(b),
                Err(e) => return skip(&format!("{kind:?}"), &e.to_string()),
            },
            Kind::Local => match LocalBackend::new().await {
                Ok(b) => Arc::new(b),
                Err(e) => return skip(&format!("{kind:?}"), &e.to_string()),
            },
        };
        if let Err(e) = body(backend).await {
            panic!("{kind:?}: {e:#}");
        }
    });
}
