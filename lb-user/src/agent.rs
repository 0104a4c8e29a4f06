//! `lb agent`: load and pin the datapath, attach it to the node's interfaces, and keep its maps in
//! sync with the manifest directory until SIGTERM/SIGINT.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use lb_common::{
    CONFIG_F_MASQUERADE_ALL, CONFIG_F_READY, Config, SNAT_PORT_MAX, SNAT_PORT_MIN, ipv4_be,
};
use lb_user::bpffs;
use lb_user::datapath::{Datapath, MapSizes};
use lb_user::links::{Attachments, InterfaceFilter, LinkEvent, LinkWatcher};
use lb_user::manifests;
use lb_user::model::Model;
use lb_user::nodeport::NodePortAllocator;
use lb_user::reconcile::{Reconciler, SyncReport};
use notify::Watcher as _;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::args::AgentArgs;

/// Editors and `kubectl`-style tools write a file in several steps: wait for them to settle.
const SETTLE: Duration = Duration::from_millis(100);
/// A sync with failed map writes is retried after this long even if nothing changes.
const RETRY: Duration = Duration::from_secs(5);

pub async fn run(args: AgentArgs) -> Result<()> {
    let filter = InterfaceFilter::new(&args.external_interface, &args.pod_interfaces)?;
    anyhow::ensure!(
        args.manifests.is_dir(),
        "--manifests {}: not a directory",
        args.manifests.display()
    );

    bpffs::ensure(&args.bpffs)?;
    let mut datapath = Datapath::load(
        &args.bpffs,
        MapSizes {
            frontends: args.frontends_max,
            backends: args.backends_max,
            conntrack: args.conntrack_max,
        },
    )?;
    // No program is attached yet, so nothing reads the config while it is written.
    datapath.write_config(&Config {
        node_addr: ipv4_be(args.node_ip.octets()),
        cluster_cidr_addr: ipv4_be(args.cluster_cidr.network().octets()),
        cluster_cidr_mask: ipv4_be(args.cluster_cidr.netmask().octets()),
        flags: CONFIG_F_READY
            | if args.masquerade_all {
                CONFIG_F_MASQUERADE_ALL
            } else {
                0
            },
        snat_port_min: SNAT_PORT_MIN,
        snat_port_max: SNAT_PORT_MAX,
    })?;

    let existing = datapath.service_maps.read()?;
    info!(
        bpffs = %args.bpffs.display(),
        frontends = existing.frontends.len(),
        backends = existing.backends.len(),
        "datapath loaded, maps pinned"
    );
    let mut state = State {
        dir: args.manifests.clone(),
        reconciler: Reconciler::new(args.node_ip, existing),
        node_ports: NodePortAllocator::new(args.nodeport_range.clone()),
        datapath,
    };

    // Subscribe before watching/listing, so no change in between is missed.
    let (fs_tx, mut fs_rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // Our own reads of the directory are no change.
        if !matches!(event, Ok(ref e) if e.kind.is_access()) {
            let _ = fs_tx.send(event);
        }
    })?;
    watcher
        .watch(&args.manifests, notify::RecursiveMode::NonRecursive)
        .with_context(|| format!("watching {}", args.manifests.display()))?;
    let mut links = LinkWatcher::start()?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;

    let first = state.sync();
    let mut attachments = Attachments::default();
    for (index, name) in links.list().await? {
        attachments.add(state.datapath.ingress()?, &filter, index, &name);
    }
    if attachments.is_empty() {
        warn!("no interface matches --external-interface or --pod-interfaces yet");
    }
    let mut next_sync = first.and_then(|r| log_sync(&r));
    let mut links_open = true;

    loop {
        let deadline = next_sync.map(tokio::time::Instant::from_std);
        tokio::select! {
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            Some(event) = fs_rx.recv() => {
                if let Err(err) = event {
                    warn!(error = %err, "manifest directory watch");
                }
                // Restart the settle time on every event of a burst; this also replaces a
                // pending retry, as the sync it leads to retries failed writes anyway.
                next_sync = Some(Instant::now() + SETTLE);
            }
            () = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() => {
                next_sync = state.sync().and_then(|r| log_sync(&r));
            }
            event = links.next(), if links_open => match event {
                Some(LinkEvent::Present(index, name)) => {
                    attachments.add(state.datapath.ingress()?, &filter, index, &name);
                }
                Some(LinkEvent::Gone(index)) => attachments.remove(state.datapath.ingress()?, index),
                Some(LinkEvent::Lost) => {
                    warn!("netlink notifications lost: listing interfaces again");
                    let present = links.list().await?;
                    for index in attachments.missing_from(&present) {
                        attachments.remove(state.datapath.ingress()?, index);
                    }
                    for (index, name) in present {
                        attachments.add(state.datapath.ingress()?, &filter, index, &name);
                    }
                }
                None => {
                    error!("netlink connection closed: new interfaces are no longer attached");
                    links_open = false;
                }
            },
        }
    }

    info!(interfaces = attachments.len(), "stopping: detaching");
    attachments.detach_all(state.datapath.ingress()?);
    info!(
        failed_map_writes = state.reconciler.failed_total,
        "stopped; maps stay pinned"
    );
    Ok(())
}

struct State {
    dir: PathBuf,
    reconciler: Reconciler,
    node_ports: NodePortAllocator,
    datapath: Datapath,
}

struct Sync {
    report: SyncReport,
    services: usize,
    endpoints: usize,
    failed_total: u64,
    took: Duration,
}

impl State {
    /// Reads the whole directory and applies it; None (and the maps untouched) if any of it is
    /// bad.
    fn sync(&mut self) -> Option<Sync> {
        let start = Instant::now();
        let loaded = match manifests::load_dir(&self.dir) {
            Ok(loaded) => loaded,
            Err(err) => {
                error!(error = %err, "manifests rejected, the maps keep the last good state");
                return None;
            }
        };
        let model = Model::join(loaded.services, &loaded.slices, &mut self.node_ports);
        let report = self
            .reconciler
            .sync(&model, &mut self.datapath.service_maps);
        Some(Sync {
            report,
            services: model.services.len(),
            endpoints: model.ready_endpoints(),
            failed_total: self.reconciler.failed_total,
            took: start.elapsed(),
        })
    }
}

/// Logs the one line per sync; returns when to retry if writes failed.
fn log_sync(sync: &Sync) -> Option<Instant> {
    let r = &sync.report;
    info!(
        services = sync.services,
        endpoints = sync.endpoints,
        frontends_added = r.frontends_added,
        frontends_updated = r.frontends_updated,
        frontends_removed = r.frontends_removed,
        backends_added = r.backends_added,
        backends_updated = r.backends_updated,
        backends_removed = r.backends_removed,
        failed_writes = r.failed,
        failed_writes_total = sync.failed_total,
        took_ms = format!("{:.1}", sync.took.as_secs_f64() * 1000.0),
        "sync done"
    );
    (r.failed > 0).then(|| Instant::now() + RETRY)
}
