//! Project tasks: `cargo xtask setup | build | run | demo | test | bench`.
//!
//! Every task but `setup` runs `setup` first, so on a fresh machine `cargo xtask demo` and
//! `cargo xtask test` are all anyone types.
mod setup;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Tasks of the lb project")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what the build and the tests need (idempotent): rust-src for nightly, bpf-linker,
    /// iproute2.
    Setup,
    /// Build the eBPF object and the `lb` binary (release).
    Build,
    /// Build, then run `lb agent` with the given arguments.
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build a test topology in network namespaces, run the agent on examples/manifests, drive
    /// the four Service paths in both families and print what answered.
    Demo,
    /// Check formatting and lints, then run every test: unit, BPF_PROG_TEST_RUN and
    /// network-namespace integration tests (as root).
    Test {
        /// Passed to `cargo test` after `--` (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmark every variant (direct, kube-proxy's iptables and nftables rulesets, tc) in one
    /// run, as root; writes target/bench/<timestamp>/ (results.json, report.md, plots).
    Bench {
        /// Passed to the bench binary (e.g. `--smoke`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    let root = workspace_root();
    match Cli::parse().task {
        Task::Setup => setup::ensure_all(&root),
        Task::Build => {
            setup::ensure_all(&root)?;
            build(&root)
        }
        Task::Run { args } => {
            setup::ensure_all(&root)?;
            build(&root)?;
            let mut agent = Command::new(root.join("target/release/lb"));
            agent.arg("agent").args(args);
            run(&mut agent)
        }
        Task::Demo => {
            setup::ensure_all(&root)?;
            build(&root)?;
            run(cargo(&root).args([
                "run",
                "--release",
                "--package",
                "lb-tests",
                "--bin",
                "lb-demo",
            ]))
        }
        Task::Test { args } => {
            setup::ensure_all(&root)?;
            build(&root)?;
            run(cargo(&root).args(["fmt", "--all", "--", "--check"]))?;
            run(cargo(&root).args([
                "clippy",
                "--release",
                "--workspace",
                "--exclude",
                "lb-ebpf",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]))?;
            run(cargo(&root)
                .args(["test", "--release", "--workspace", "--exclude", "lb-ebpf"])
                .arg("--")
                .args(args))
        }
        Task::Bench { args } => {
            setup::ensure_all(&root)?;
            build(&root)?;
            run(cargo(&root)
                .args(["run", "--release", "--package", "lb-bench", "--"])
                .args(args))
        }
    }
}

fn build(root: &Path) -> Result<()> {
    run(cargo(root).args(["build", "--release", "--package", "lb-user"]))
}

fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root)
        .env("LB_BIN", root.join("target/release/lb"));
    cmd
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("spawn {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace root")
        .to_path_buf()
}
