//! Trainer: backward of the model, losses, optimizer, checkpoints, rollout harness (to come).
