//! Sandbox: isolated execution for agent tool calls and grading (to come).
