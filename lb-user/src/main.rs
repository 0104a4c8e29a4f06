//! `lb`: see cli/args.rs for the commands.
mod agent;
mod cli;

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

use crate::cli::args::{Cli, Command, LogFormat};
use crate::cli::{cleanup, conntrack, services, stats, status, trace};

fn main() -> anyhow::Result<()> {
    let (cli, ignored) = Cli::parse_with_config(std::env::args_os().collect())?;
    let log_format = match &cli.command {
        Command::Agent(args) => args.log_format,
        _ => LogFormat::Text,
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr);
    match log_format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().init(),
    }
    for field in &ignored {
        tracing::warn!("--config: {field}: ignored");
    }
    match cli.command {
        // The agent's loop (syncs, audits: map work that blocks) runs on this thread; the servers
        // and watchers on two workers, so /healthz and /metrics answer during a long sync.
        Command::Agent(args) => {
            agent::limit_malloc_arenas();
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(agent::run(*args))
        }
        Command::Stats(args) => stats::run(args),
        Command::Services(args) => services::run(args),
        Command::Conntrack(args) => conntrack::run(args),
        Command::Trace(args) => trace::run(args),
        Command::Cleanup(args) => cleanup::run(args),
        Command::Status(args) => status::run(args),
    }
}
