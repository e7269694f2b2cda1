//! The `arcticd` command line: thin wiring over the engine, trainer and sandbox crates.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "arcticd", version, about = "Async RL for software-engineering agents, on its own engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let _cli = Cli::parse();
}
