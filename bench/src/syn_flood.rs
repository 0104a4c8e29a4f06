//! B5's SYN flood: the agent with a conntrack table of its own (`--conntrack-max`, small so that
//! the flood fills it three times over in seconds) in a deployment of its own; spoofed SYNs,
//! three times the table, from the external client to a masqueraded TCP NodePort (the shared
//! generator of lb_tests::raw: sources no namespace holds, so no handshake completes). Measured:
//! idle established connections opened before it that still echo after it, and new connections
//! of the real client (the external client, to the same NodePort) during and after it.
use std::{
    io::BufReader,
    net::{SocketAddr, SocketAddrV4, TcpStream},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_common::Counter;
use lb_tests::{
    echo::Proto,
    flows::{LineEchoServer, connect_and_echo_line, echo_line},
    manifests::{ServiceManifest, yaml},
    node::CLUSTER_IP,
    raw::{send_paced, spoofed_syns},
    topology::NODE_IP,
};
use lb_user::datapath::read_counters;
use serde::Serialize;

use crate::{
    Plan, Progress,
    conntrack_full::counter_delta,
    interrupt,
    services::ServiceSet,
    variants::{Deployment, Variant},
};

/// The variants flooded, each in a deployment of its own.
pub const VARIANTS: [Variant; 2] = [Variant::Tc, Variant::TcRedirect];
/// The flooded Service: a line echo server in the backend pod (the bench's own server answers
/// one connection at a time, and the idle established connections stay open).
const SERVER_PORT: u16 = 9002;
const SERVICE_PORT: u16 = 80;
const NODE_PORT: u16 = 30081;
/// SYNs per pause of the flood: at most ~12,800 a second, so that the real client's connections
/// fall during it.
const FLOOD_BATCH: usize = 128;
const FLOOD_PAUSE: Duration = Duration::from_millis(10);
/// Idle established connections opened before the flood.
const ESTABLISHED: usize = 16;
/// New connections of the real client after the flood.
const AFTER: usize = 20;
/// At most this many new connections of the real client during the flood.
const MAX_DURING: usize = 5_000;
/// A connection attempt that takes longer failed (a lost SYN is retransmitted after 1 s).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Serialize)]
pub struct SynFlood {
    pub variant: Variant,
    pub conntrack_max: u32,
    pub syns: u32,
    pub flood_seconds: f64,
    pub established: usize,
    /// Idle established connections that echo after the flood.
    pub established_surviving: usize,
    /// New connections of the real client during the flood, one after the other.
    pub during_attempts: usize,
    pub during_succeeded: usize,
    /// Succeeded connections per second of the flood.
    pub during_per_second: f64,
    pub after_attempts: usize,
    pub after_succeeded: usize,
    /// Counter deltas over the flood.
    pub new_connection: u64,
    pub conntrack_confirmed: u64,
    pub conntrack_unconfirmed_evicted: u64,
    pub conntrack_early_drop: u64,
    pub drop_conntrack_full: u64,
    pub drop_snat_ports_exhausted: u64,
    pub error: Option<String>,
}

pub fn run(plan: &Plan, bpffs: &Path, progress: Progress) -> Result<Vec<SynFlood>> {
    let mut floods = Vec::new();
    for variant in VARIANTS.into_iter().filter(|v| plan.variants.contains(v)) {
        interrupt::check()?;
        let mut flood = SynFlood::new(variant, plan.syn_flood_conntrack_max);
        if let Err(err) = measure(bpffs, &mut flood) {
            flood.error = Some(format!("{err:#}"));
        }
        progress(&flood.summary());
        floods.push(flood);
    }
    Ok(floods)
}

fn measure(bpffs: &Path, flood: &mut SynFlood) -> Result<()> {
    let conntrack_max = flood.conntrack_max.to_string();
    let mut deployment =
        Deployment::new(flood.variant, bpffs, &["--conntrack-max", &conntrack_max])?;
    let backend = deployment.topology.backend().ip;
    let _server = LineEchoServer::start(&deployment.topology.backend().ns, "backend", SERVER_PORT)?;
    let service = ServiceManifest::new("flood", CLUSTER_IP, Proto::Tcp, SERVICE_PORT, SERVER_PORT)
        .node_port(NODE_PORT)
        .endpoints([backend]);
    // The agent starts on the bench's Services, then serves the flooded one alone.
    deployment.program(&ServiceSet::new(1, 1, backend))?;
    deployment
        .agent()
        .context("the agent is not running")?
        .update_manifests(&yaml(&[service]))?;

    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let to = SocketAddr::V4(node_port);
    let client = &deployment.topology.inner.client;
    let mut established = client.run(move || -> Result<Vec<_>> {
        (0..ESTABLISHED).map(|_| connect_and_echo(to)).collect()
    })??;
    let pins = deployment.pins();
    let before = read_counters(pins)?;

    let syns = spoofed_syns(node_port, flood.syns)?;
    let started = Instant::now();
    let (sent, during) = std::thread::scope(|scope| -> Result<_> {
        let sender = scope
            .spawn(|| client.run(move || send_paced(&syns, NODE_IP, FLOOD_BATCH, FLOOD_PAUSE)));
        // New connections of the real client, one after the other, while the flood lasts.
        let mut during = (0, 0);
        while !sender.is_finished() && during.1 < MAX_DURING {
            during.1 += 1;
            if client.run(move || connect_and_echo(to))?.is_ok() {
                during.0 += 1;
            }
        }
        let sent = sender
            .join()
            .map_err(|_| anyhow::anyhow!("the flood's thread panicked"))???;
        Ok((sent, during))
    })?;
    flood.flood_seconds = started.elapsed().as_secs_f64();
    (flood.during_succeeded, flood.during_attempts) = during;
    flood.during_per_second = during.0 as f64 / flood.flood_seconds;
    flood.established_surviving = established
        .iter_mut()
        .map(echo_line)
        .filter(Result::is_ok)
        .count();
    flood.after_succeeded =
        client.run(move || (0..AFTER).filter(|_| connect_and_echo(to).is_ok()).count())?;
    let after = read_counters(pins)?;
    let delta = |counter| counter_delta(&before, &after, counter);
    flood.new_connection = delta(Counter::NewConnection);
    flood.conntrack_confirmed = delta(Counter::ConntrackConfirmed);
    flood.conntrack_unconfirmed_evicted = delta(Counter::ConntrackUnconfirmedEvicted);
    flood.conntrack_early_drop = delta(Counter::ConntrackEarlyDrop);
    flood.drop_conntrack_full = delta(Counter::DropConntrackFull);
    flood.drop_snat_ports_exhausted = delta(Counter::DropSnatPortsExhausted);
    ensure!(sent == flood.syns, "{sent} of {} SYNs sent", flood.syns);
    ensure!(
        flood.new_connection + flood.drop_snat_ports_exhausted >= u64::from(flood.syns),
        "the flood did not reach the datapath: {} new connections",
        flood.new_connection
    );
    Ok(())
}

fn connect_and_echo(to: SocketAddr) -> Result<BufReader<TcpStream>> {
    connect_and_echo_line(to, CONNECT_TIMEOUT)
}

impl SynFlood {
    fn new(variant: Variant, conntrack_max: u32) -> Self {
        SynFlood {
            variant,
            conntrack_max,
            syns: 3 * conntrack_max,
            flood_seconds: 0.0,
            established: ESTABLISHED,
            established_surviving: 0,
            during_attempts: 0,
            during_succeeded: 0,
            during_per_second: 0.0,
            after_attempts: AFTER,
            after_succeeded: 0,
            new_connection: 0,
            conntrack_confirmed: 0,
            conntrack_unconfirmed_evicted: 0,
            conntrack_early_drop: 0,
            drop_conntrack_full: 0,
            drop_snat_ports_exhausted: 0,
            error: None,
        }
    }

    pub fn summary(&self) -> String {
        format!(
            "  syn flood {:<12} {} SYNs (--conntrack-max {}) in {:.2} s: established {} of {} \
             survive; new connections during it {} of {} ({:.0}/s), after it {} of {}; \
             new_connection +{}, conntrack_confirmed +{}, conntrack_unconfirmed_evicted +{}, \
             conntrack_early_drop +{}, drop_conntrack_full +{}, drop_snat_ports_exhausted +{}{}",
            self.variant.name(),
            self.syns,
            self.conntrack_max,
            self.flood_seconds,
            self.established_surviving,
            self.established,
            self.during_succeeded,
            self.during_attempts,
            self.during_per_second,
            self.after_succeeded,
            self.after_attempts,
            self.new_connection,
            self.conntrack_confirmed,
            self.conntrack_unconfirmed_evicted,
            self.conntrack_early_drop,
            self.drop_conntrack_full,
            self.drop_snat_ports_exhausted,
            self.error
                .as_deref()
                .map(|e| format!(" ERROR {e}"))
                .unwrap_or_default()
        )
    }
}
