//! A sandbox pool: a concurrency limit with back-pressure over one backend.
//!
//! `acquire` waits while the limit is reached, so rollout workers slow down
//! instead of overloading the Docker daemon or the host. Sandboxes are not
//! reused between rollouts (a used sandbox carries the agent's state); the
//! pool bounds how many exist at once. Not a scheduler across hosts.

use crate::{Backend, Policy, Result, Sandbox, Snapshot};
use std::ops::Deref;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// At most `max_sandboxes` sandboxes from one backend, image and policy.
#[derive(Clone)]
pub struct Pool {
    backend: Arc<dyn Backend>,
    image: String,
    policy: Policy,
    permits: Arc<Semaphore>,
}

impl Pool {
    pub fn new(
        backend: Arc<dyn Backend>,
        image: &str,
        policy: Policy,
        max_sandboxes: usize,
    ) -> Self {
        Pool {
            backend,
            image: image.to_string(),
            policy,
            permits: Arc::new(Semaphore::new(max_sandboxes.max(1))),
        }
    }

    /// Starts a sandbox, waiting for a free slot first.
    pub async fn acquire(&self, snapshot: &Arc<Snapshot>) -> Result<PooledSandbox> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| crate::Error::Closed)?;
        let sandbox = self
            .backend
            .start(snapshot, &self.image, &self.policy)
            .await?;
        Ok(PooledSandbox {
            sandbox,
            _permit: permit,
        })
    }

    /// Free slots right now.
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

/// A sandbox holding a pool slot until dropped.
pub struct PooledSandbox {
    sandbox: Box<dyn Sandbox>,
    _permit: OwnedSemaphorePermit,
}

impl PooledSandbox {
    /// Closes the sandbox and frees the slot.
    pub async fn close(self) -> Result<()> {
        self.sandbox.close().await
    }
}

impl Deref for PooledSandbox {
    type Target = dyn Sandbox;
    fn deref(&self) -> &Self::Target {
        self.sandbox.as_ref()
    }
}
