//! `cargo xtask bench`: every variant in the same run, on topologies built the same way, results
//! as ratios to `direct` measured in that run. Writes target/bench/<timestamp>/{results.json,
//! report.md, *.svg}. `--smoke` is the tiny run `cargo xtask test` does so the bench cannot rot.
mod bpf;
mod datapath_cost;
mod interrupt;
mod memory;
mod packet;
mod plot;
mod report;
mod results;
mod rulesets;
mod services;
mod sweep;
mod topology;
mod traffic;
mod variants;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use clap::Parser;
use nix::{
    mount::{MntFlags, MsFlags, mount, umount2},
    sched::{CloneFlags, unshare},
};

use crate::{results::Results, variants::Variant};

#[derive(Parser)]
#[command(about = "lb against kube-proxy's rulesets, in network namespaces (run as root)")]
struct Cli {
    /// Tiny counts, direct and tc only: checks the harness end to end in seconds.
    #[arg(long)]
    smoke: bool,
    /// B2/B3 service counts instead of the plan's (e.g. `1,1000`).
    #[arg(long, value_delimiter = ',')]
    services: Vec<usize>,
    /// Output directory [default: target/bench/<timestamp>].
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Prints a progress line.
pub type Progress<'a> = &'a (dyn Fn(&str) + Sync);

/// How much of everything to measure.
#[derive(Clone, Debug)]
pub struct Plan {
    pub smoke: bool,
    pub variants: Vec<Variant>,
    /// B2/B3 service counts.
    pub service_counts: Vec<usize>,
    pub point_duration: Duration,
    /// B1 service counts and runs per case.
    pub datapath_counts: Vec<usize>,
    pub datapath_runs: u32,
    /// B4 duration.
    pub flood_duration: Duration,
    /// B6 service counts, changes per count, and the services × endpoints programmed at once.
    pub control_counts: Vec<usize>,
    pub control_changes: usize,
    pub bulk: (usize, usize),
}

impl Plan {
    fn full() -> Self {
        Plan {
            smoke: false,
            variants: Variant::ALL.to_vec(),
            service_counts: vec![1, 1_000, 5_000, 20_000, 50_000],
            point_duration: Duration::from_secs(2),
            datapath_counts: vec![1, 1_000, 10_000, 50_000],
            datapath_runs: 1_000_000,
            flood_duration: Duration::from_secs(3),
            control_counts: vec![1_000, 10_000, 50_000],
            control_changes: 20,
            bulk: (10_000, 10),
        }
    }

    fn smoke() -> Self {
        Plan {
            smoke: true,
            variants: vec![Variant::Direct, Variant::Tc],
            service_counts: vec![1],
            point_duration: Duration::from_millis(300),
            datapath_counts: vec![1],
            datapath_runs: 2_000,
            flood_duration: Duration::from_millis(300),
            control_counts: vec![10],
            control_changes: 2,
            bulk: (100, 10),
        }
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let mut plan = if cli.smoke {
        Plan::smoke()
    } else {
        Plan::full()
    };
    if !cli.services.is_empty() {
        plan.service_counts = cli.services;
    }
    let out = match cli.out {
        Some(out) => out,
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/bench")
            .join(results::timestamp()?),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    interrupt::install()?;
    let bpffs = private_bpffs()?;

    let started = Instant::now();
    let mut results = Results::new(&plan)?;
    let progress = |what: &str| eprintln!("[{:>6.1}s] {what}", started.elapsed().as_secs_f64());
    progress("B1 datapath cost (BPF_PROG_TEST_RUN)");
    results.datapath = datapath_cost::measure(&plan, &progress)?;
    progress("B2/B3 connection and request rate, every variant");
    let mut deployments = sweep::deploy(&plan, bpffs.path(), &progress)?;
    results.points = sweep::run(&plan, &mut deployments, &progress)?;
    interrupt::check()?;
    // A later phase that fails still leaves the sweep's report.
    results.write(&out)?;
    report::write(&results, &out)?;
    progress("B6 programming from nothing, B7 agent memory");
    results.bulk = sweep::bulk(&plan, &mut deployments, &progress)?;
    drop(deployments);
    interrupt::check()?;
    progress("B7 map memory");
    results.maps = memory::maps()?;
    results.seconds = started.elapsed().as_secs_f64();

    results.write(&out)?;
    report::write(&results, &out)?;
    progress(&format!("done: {}", out.join("report.md").display()));
    Ok(())
}

/// A bpffs mounted on a temporary directory, unmounted and removed on drop.
struct Bpffs {
    dir: tempfile::TempDir,
}

impl Bpffs {
    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = umount2(self.dir.path(), MntFlags::MNT_DETACH);
    }
}

/// Moves the bench into a mount namespace of its own and mounts a bpffs there: the agents pin
/// their maps in it (their `ip netns exec` inherits it), the bench reads them, and nothing of it
/// is seen outside the process.
fn private_bpffs() -> Result<Bpffs> {
    unshare(CloneFlags::CLONE_NEWNS).context("unshare the mount namespace (run as root)")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .context("make mounts private")?;
    let dir = tempfile::Builder::new().prefix("lbbench-bpf").tempdir()?;
    mount(
        Some("bpffs"),
        dir.path(),
        Some("bpf"),
        MsFlags::empty(),
        None::<&str>,
    )
    .context("mount bpffs")?;
    Ok(Bpffs { dir })
}
