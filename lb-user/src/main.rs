//! `lb`: see args.rs for the commands.
mod agent;
mod args;
mod cleanup;
mod conntrack;
mod stats;
mod trace;

use std::io::IsTerminal as _;

use clap::Parser as _;
use tracing_subscriber::EnvFilter;

use crate::args::{Cli, Command};

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match Cli::parse().command {
        Command::Agent(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(agent::run(*args)),
        Command::Stats(args) => stats::run(args),
        Command::Conntrack(args) => conntrack::run(args),
        Command::Trace(args) => trace::run(args),
        Command::Cleanup(args) => cleanup::run(args),
    }
}
