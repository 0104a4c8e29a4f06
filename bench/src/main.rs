//! `cargo xtask bench`: every variant in the same run, on topologies built the same way, results
//! as ratios to `direct` measured in that run. Writes target/bench/<timestamp>/{results.json,
//! report.md, *.svg}. `--smoke` is the tiny run `cargo xtask test` does so the bench cannot rot.
mod bpf;
mod conntrack_full;
mod control;
mod control_api;
mod datapath_cost;
mod flood;
mod interrupt;
mod memory;
mod packet;
mod plot;
mod report;
mod restart;
mod results;
mod rulesets;
mod services;
mod sweep;
mod syn_flood;
mod topology;
mod traffic;
mod variants;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use clap::{Parser, ValueEnum};
use nix::{
    mount::{MntFlags, MsFlags, mount, umount2},
    sched::{CloneFlags, unshare},
};

use crate::{results::Results, services::Family, variants::Variant};

#[derive(Parser)]
#[command(about = "lb against kube-proxy's rulesets, in network namespaces (run as root)")]
struct Cli {
    /// Tiny counts, direct, tc and tc-redirect only: checks the harness end to end in seconds.
    #[arg(long)]
    smoke: bool,
    /// B2/B3 service counts instead of the plan's (e.g. `1,1000`).
    #[arg(long, value_delimiter = ',')]
    services: Vec<usize>,
    /// B6 service counts instead of the plan's (e.g. `10000`).
    #[arg(long, value_delimiter = ',')]
    control_services: Vec<usize>,
    /// Only these measurements (e.g. `b4,b6`); default: all.
    #[arg(long, value_delimiter = ',', value_enum)]
    only: Vec<Section>,
    /// Only these variants where a section compares them (e.g. `direct,tc`); default: all.
    #[arg(long, value_delimiter = ',', value_enum)]
    variants: Vec<Variant>,
    /// B2/B3 in only these families (e.g. `ipv4`); default: both.
    #[arg(long, value_delimiter = ',', value_enum)]
    families: Vec<Family>,
    /// B1 runs per case instead of the plan's (1,000,000): with fewer, the new connections' conntrack
    /// entries stay in the CPU's caches.
    #[arg(long)]
    datapath_runs: Option<u32>,
    /// Output directory [default: target/bench/<timestamp>].
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The measurements of issue 4, each run on its own with `--only`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Section {
    /// Datapath cost per packet (BPF_PROG_TEST_RUN).
    B1,
    /// Connection rate, and (B3) request rate and latency, for every variant.
    #[value(alias = "b3")]
    B2,
    /// NodePort packet rate from the frame generator (live XDP frames, else AF_PACKET).
    B4,
    /// Conntrack map full, masquerade ports exhausted.
    B5,
    /// Control plane: change to first packet; programming 10k × 10 from nothing; the restart gap
    /// on those pins.
    B6,
    /// B6's restart gap alone: the agent programs 10k × 10 from nothing, then is restarted on
    /// its pins.
    B6Restart,
    /// B6 through the in-test apiserver: cold start, change to first packet, relist, RSS.
    B6Api,
    /// Map and agent memory.
    B7,
}

/// Prints a progress line.
pub type Progress<'a> = &'a (dyn Fn(&str) + Sync);

/// How much of everything to measure.
#[derive(Clone, Debug)]
pub struct Plan {
    pub smoke: bool,
    pub sections: Vec<Section>,
    pub variants: Vec<Variant>,
    /// B2/B3 service counts, and the families measured at each.
    pub service_counts: Vec<usize>,
    pub families: Vec<Family>,
    /// B2/B3 measuring time per point and metric, split into rounds across the variants.
    pub point_duration: Duration,
    pub rounds: u32,
    /// B1 service counts and runs per case.
    pub datapath_counts: Vec<usize>,
    pub datapath_runs: u32,
    /// B4 duration and service count.
    pub flood_duration: Duration,
    pub flood_services: usize,
    /// B5's SYN flood: the agent's `--conntrack-max`; three times as many SYNs.
    pub syn_flood_conntrack_max: u32,
    /// B6 service counts, changes per count, and the services × endpoints programmed at once.
    pub control_counts: Vec<usize>,
    pub control_changes: usize,
    pub bulk: (usize, usize),
}

impl Plan {
    fn full() -> Self {
        Plan {
            smoke: false,
            sections: Section::value_variants().to_vec(),
            variants: Variant::ALL.to_vec(),
            service_counts: vec![1, 1_000, 5_000, 20_000, 50_000],
            families: Family::ALL.to_vec(),
            point_duration: Duration::from_secs(2),
            rounds: 4,
            datapath_counts: vec![1, 1_000, 10_000, 50_000],
            datapath_runs: 1_000_000,
            flood_duration: Duration::from_secs(3),
            flood_services: 1_000,
            syn_flood_conntrack_max: 16_384,
            control_counts: vec![1_000, 10_000, 50_000],
            control_changes: 20,
            bulk: (10_000, 10),
        }
    }

    pub fn wants(&self, section: Section) -> bool {
        self.sections.contains(&section)
    }

    /// Whether B6's restart gap is measured (after the bulk programming).
    pub fn wants_restart(&self) -> bool {
        self.wants(Section::B6) || self.wants(Section::B6Restart)
    }

    /// The variants some wanted section measures.
    fn deployed_variants(&self) -> Vec<Variant> {
        self.variants
            .iter()
            .copied()
            .filter(|&v| {
                self.wants(Section::B2) && v != Variant::Xdp
                    || self.wants(Section::B4) && flood::VARIANTS.contains(&v)
                    || self.wants(Section::B5) && v == Variant::Tc
                    || (self.wants(Section::B6) || self.wants(Section::B7))
                        && !matches!(v, Variant::Direct | Variant::TcRedirect | Variant::Xdp)
                    || self.wants(Section::B6Restart) && v == Variant::Tc
            })
            .collect()
    }

    /// A rough guess of the run's length from the plan, printed at the start: measuring time
    /// plus what programming the largest rulesets took on this machine (iptables-restore about
    /// 0.5 ms per Service, nft -f capped by its timeout at 20k and up).
    fn expected(&self) -> Duration {
        let mut seconds = 0.0;
        if self.wants(Section::B1) {
            seconds +=
                (self.datapath_counts.len() * 5) as f64 * f64::from(self.datapath_runs) * 3e-6;
        }
        // Both measurements, each round with its warmup.
        let point = (self.point_duration.as_secs_f64() + f64::from(self.rounds) * 0.2) * 2.0 + 0.5;
        if self.wants(Section::B2) {
            for &count in &self.service_counts {
                let loaders = if count >= 20_000 { 180.0 } else { 0.0 };
                seconds += self.families.len() as f64
                    * (self.variants.len() as f64 * point + count as f64 * 1.5e-3 + loaders);
            }
        }
        if self.wants(Section::B4) {
            seconds += flood::VARIANTS.len() as f64 * (self.flood_duration.as_secs_f64() + 5.0);
        }
        if self.wants(Section::B5) {
            seconds += 4.0 * point + 5.0;
            // The SYN flood's deployments, ~12,800 SYNs a second.
            seconds += syn_flood::VARIANTS.len() as f64
                * (10.0 + f64::from(self.syn_flood_conntrack_max) * 3.0 / 12_800.0);
        }
        if self.wants(Section::B6) {
            let per_change: f64 = self
                .control_counts
                .iter()
                .map(|&c| 0.5 + c as f64 * 7e-5)
                .sum();
            seconds += control::MIN_SYNC_PERIODS.len() as f64
                * (per_change * self.control_changes as f64 + 10.0);
            // The two iptables loaders take about 0.4 ms per endpoint together; nft -f of 100k
            // endpoints runs into its timeout.
            let endpoints = (self.bulk.0 * self.bulk.1) as f64;
            seconds += endpoints * 4e-4 + if endpoints >= 50_000.0 { 180.0 } else { 0.0 };
        }
        if self.wants(Section::B6Api) {
            let per_count: f64 = self
                .control_counts
                .iter()
                .map(|&c| 2.0 + c as f64 * 1e-4 + self.control_changes as f64 * 0.2)
                .sum();
            seconds += per_count;
        }
        if self.wants_restart() {
            // The agent's start on them, then two restarts.
            seconds += 3.0 * (self.bulk.0 * self.bulk.1) as f64 * 1e-5 + 5.0;
        }
        Duration::from_secs_f64(seconds)
    }

    fn smoke() -> Self {
        Plan {
            smoke: true,
            sections: Section::value_variants().to_vec(),
            variants: vec![Variant::Direct, Variant::Tc, Variant::TcRedirect],
            service_counts: vec![1],
            families: Family::ALL.to_vec(),
            point_duration: Duration::from_millis(300),
            rounds: 2,
            datapath_counts: vec![1],
            datapath_runs: 2_000,
            flood_duration: Duration::from_millis(300),
            flood_services: 1,
            syn_flood_conntrack_max: 1_024,
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
    if !cli.control_services.is_empty() {
        plan.control_counts = cli.control_services;
    }
    if !cli.only.is_empty() {
        plan.sections = cli.only;
    }
    if !cli.variants.is_empty() {
        plan.variants.retain(|v| cli.variants.contains(v));
    }
    if !cli.families.is_empty() {
        plan.families = cli.families;
    }
    if let Some(runs) = cli.datapath_runs {
        plan.datapath_runs = runs;
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
    progress(&format!(
        "{:?}: expected about {:.0} min",
        plan.sections,
        plan.expected().as_secs_f64() / 60.0
    ));
    if plan.wants(Section::B1) {
        progress("B1 datapath cost (BPF_PROG_TEST_RUN)");
        results.datapath = datapath_cost::measure(&plan, &progress)?;
    }
    let mut deployments = sweep::deploy(&plan.deployed_variants(), bpffs.path(), &progress)?;
    if plan.wants(Section::B2) {
        progress("B2/B3 connection and request rate, every variant");
        results.points = sweep::run(&plan, &mut deployments, &progress)?;
        interrupt::check()?;
        // A later phase that fails still leaves the sweep's report.
        results.write(&out)?;
        report::write(&results, &out)?;
    }
    if plan.wants(Section::B4) {
        progress("B4 NodePort packet rate (frames from the external client)");
        results.flood = flood::run(&plan, &mut deployments, &progress)?;
    }
    if plan.wants(Section::B5) {
        progress("B5 conntrack full, masquerade ports exhausted");
        results.conntrack = conntrack_full::run(&plan, &mut deployments, &progress)?;
        progress("B5 SYN flood of three conntrack tables");
        results.syn_flood = syn_flood::run(&plan, bpffs.path(), &progress)?;
    }
    if plan.wants(Section::B6) {
        progress("B6 control plane: endpoint change to first packet");
        results.control = control::run(&plan, bpffs.path(), &progress)?;
        results.write(&out)?;
        report::write(&results, &out)?;
    }
    if plan.wants(Section::B6Api) {
        progress("B6 through the apiserver: cold start, change to first packet, relist");
        results.control_api = control_api::run(&plan, bpffs.path(), &progress)?;
        results.write(&out)?;
        report::write(&results, &out)?;
    }
    if plan.wants_restart() || plan.wants(Section::B7) {
        progress("B6 programming from nothing and the restart gap, B7 agent memory");
        (results.bulk, results.restarts) =
            sweep::bulk(&plan, &mut deployments, bpffs.path(), &progress)?;
    }
    drop(deployments);
    interrupt::check()?;
    if plan.wants(Section::B7) {
        progress("B7 map memory");
        results.maps = memory::maps()?;
    }
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
