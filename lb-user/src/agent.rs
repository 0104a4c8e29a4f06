//! `lb agent`: load and pin the datapath, attach it to the node's interfaces, and keep its maps in
//! sync with the apiserver (or a manifest directory) until SIGTERM/SIGINT.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use ipnet::{Ipv4Net, Ipv6Net};
use jiff::Timestamp;
use lb_common::{Addr6, AgentInfo, Config6, text_field};
use lb_common::{
    CONFIG_F_MASQUERADE_ALL, CONFIG_F_READY, CONFIG_F_STACK_FORWARDING, Config, RejectLimit,
    ipv4_be,
};
use lb_user::datapath::bpffs;
use lb_user::datapath::cgroup_hooks;
use lb_user::datapath::cgroup_mount;
use lb_user::datapath::forward_rules::{self, Iptables};
use lb_user::datapath::link_pins::LinkPins;
use lb_user::datapath::links::{
    Attachments, InterfaceFilter, Link, LinkEvent, LinkWatcher, TcEgress, TcIngress, XdpNative,
};
use lb_user::datapath::map_pins;
use lb_user::datapath::node_sysctls::{self, IcmpRateLimit};
use lb_user::datapath::xdp_targets::XdpTargets;
use lb_user::datapath::{self, Datapath, MapSizes};
use lb_user::error_chain;
use lb_user::maps::contents::{MapContents, MapContents6};
use lb_user::maps::writer::WriteFailure;
use lb_user::model::node_addresses::NodePortSelection;
use lb_user::model::nodeport::NodePortAllocator;
use lb_user::model::{Endpoint, Model, Service, ServiceName, ServicePort, Specs};
use lb_user::reconcile::coalesce::Coalescer;
use lb_user::reconcile::udp_flush::UdpEndpoint;
use lb_user::reconcile::{Reconciler, SyncReport};
use lb_user::serve::health::{self, Health};
use lb_user::serve::metrics::{Metrics, TrafficPolicyLabel};
use lb_user::serve::service_health::{self, ServiceHealth};
use lb_user::source::apiserver::{self, ApiSource, Next};
use lb_user::source::manifests::{self, ManifestCache};
use notify::Watcher as _;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::cli::args::{AgentArgs, Forwarding, NodeIps};

/// Editors write a file in several steps: while a manifest file is being written (created or
/// modified and not yet closed), a change waits this long for more.
const SETTLE: Duration = Duration::from_millis(100);
/// A change that is complete (a file closed after writing, renamed into place, removed) waits
/// this long, so a burst of them (a tool writing several files) is one sync.
const COMPLETE_SETTLE: Duration = Duration::from_millis(5);
/// A sync with failed map writes is retried after this long even if nothing changes.
const RETRY: Duration = Duration::from_secs(5);

pub async fn run(args: AgentArgs) -> Result<()> {
    let forwarding = args.forwarding()?;
    let metrics = Arc::new(Metrics::new());
    // kube-proxy's health timeout is twice its sync period.
    let health = Arc::new(Mutex::new(Health::new(2 * args.sync_period)));
    serve_health_and_metrics(&args, &health, &metrics).await?;
    let mut source = open_source(&args).await?;
    // Changes the wait for the Node consumed still wait for their sync.
    let (node_ips, changed_meanwhile) = match args.node_ip {
        Some(given) => (source.node_ips_completed(given), false),
        None => source.node_ips().await,
    };
    // The datapath serves IPv4 only (docs/ipv6.md). An IPv6-only node has no IPv4 node address
    // (0.0.0.0 in the config) and no IPv4 pod network (0.0.0.0/32: no source is in it).
    let node_ip = node_ips.v4;
    let cluster_cidr = args
        .cluster_cidr
        .v4
        .unwrap_or(Ipv4Net::new_assert(Ipv4Addr::UNSPECIFIED, 32));
    let node_ports = NodePortSelection {
        node_ip,
        cidrs: args.nodeport_addresses_of::<Ipv4Addr>(),
        node_ip6: node_ips.v6,
        cidrs6: args.nodeport_addresses_of::<Ipv6Addr>(),
    };
    let loaded = load_datapath(&args, forwarding, &node_ips, cluster_cidr)?;
    let links = LinkWatcher::start()?;
    let node_port_addrs = node_ports.addresses(&links.addresses().await?);
    info!(addresses = ?node_port_addrs.0, ipv6 = ?node_port_addrs.1, "NodePorts served on");
    let migrated = loaded.migrated;
    let mut state = State::new(&args, &node_ips, node_port_addrs, loaded, metrics, health)?;

    let sigterm = signal(SignalKind::terminate())?;
    let sigint = signal(SignalKind::interrupt())?;

    let mut coalescer = Coalescer::new(args.min_sync_period, RETRY);
    first_sync(&mut state, &mut source, &mut coalescer, changed_meanwhile);
    let hooks = attach(&args, &mut state, &links, migrated).await?;
    let agent = Agent {
        audit: audit_interval(args.sync_period),
        args,
        node_ports,
        state,
        source,
        coalescer,
        hooks,
        links,
        links_open: true,
        sigterm,
        sigint,
    };
    agent.run_until_signal().await
}

/// The HTTP servers of `/healthz` and `/livez`, and of `/metrics` and `/proxyMode`, those that
/// are asked for.
async fn serve_health_and_metrics(
    args: &AgentArgs,
    health: &Arc<Mutex<Health>>,
    metrics: &Arc<Metrics>,
) -> Result<()> {
    if let Some(addr) = args.healthz_bind_address.0 {
        let routes = health::health_routes(health.clone(), metrics.clone());
        health::serve(addr, "/healthz, /livez", routes)
            .await
            .with_context(|| format!("--healthz-bind-address {addr}"))?;
    }
    if let Some(addr) = args.metrics_bind_address.0 {
        let routes = health::metrics_routes(metrics.clone(), args.bpffs.clone());
        health::serve(addr, "/metrics, /proxyMode", routes)
            .await
            .with_context(|| format!("--metrics-bind-address {addr}"))?;
    }
    Ok(())
}

/// The manifest directory of `--manifests`, else the apiserver.
async fn open_source(args: &AgentArgs) -> Result<Source> {
    match &args.manifests {
        Some(dir) => {
            anyhow::ensure!(
                dir.is_dir(),
                "--manifests {}: not a directory",
                dir.display()
            );
            anyhow::ensure!(args.node_ip.is_some(), "--manifests needs --node-ip");
            Source::manifests(dir)
        }
        None => {
            let api = ApiSource::start(args.kubeconfig.as_deref(), &node_name(args)?).await?;
            Ok(Source::Api(Box::new(api), Specs::default()))
        }
    }
}

/// The datapath loaded with its maps pinned, and what its maps held at start.
struct Loaded {
    datapath: Datapath,
    /// Conntrack entries the first migration pass converted from an earlier layout.
    migrated: usize,
    agent_info: AgentInfo,
    existing: MapContents,
    existing6: MapContents6,
}

/// Loads the datapath (pinning its maps, converting conntrack of an earlier layout) and writes
/// its configuration, REJECT limit and agent record.
fn load_datapath(
    args: &AgentArgs,
    forwarding: Forwarding,
    node_ips: &NodeIps,
    cluster_cidr: Ipv4Net,
) -> Result<Loaded> {
    let node_ip = node_ips.v4;
    bpffs::ensure(&args.bpffs)?;
    let mut datapath = Datapath::load(
        &args.bpffs,
        MapSizes {
            frontends: args.frontends_max,
            backends: args.backends_max,
            conntrack: args.conntrack_max,
            unconfirmed: lb_common::unconfirmed_size(
                args.conntrack_max,
                u32::from(*args.masquerade_port_range.end())
                    - u32::from(*args.masquerade_port_range.start())
                    + 1,
            ),
            affinity: args.affinity_max,
            backend_stats: args.backend_stats_max,
        },
    )?;
    // Before any program of ours is swapped in, so that they never miss an old connection.
    let migrated = datapath.migrate_conntrack(&args.bpffs, false)?;
    // The programs of a previous agent may be reading it: the values are the same unless the
    // flags changed.
    datapath.write_config(&Config {
        node_addr: ipv4_be(node_ip.unwrap_or(Ipv4Addr::UNSPECIFIED).octets()),
        cluster_cidr_addr: ipv4_be(cluster_cidr.network().octets()),
        cluster_cidr_mask: ipv4_be(cluster_cidr.netmask().octets()),
        flags: CONFIG_F_READY
            | if args.masquerade_all {
                CONFIG_F_MASQUERADE_ALL
            } else {
                0
            }
            | match forwarding {
                Forwarding::Stack => CONFIG_F_STACK_FORWARDING,
                Forwarding::Redirect => 0,
            },
        snat_port_min: *args.masquerade_port_range.start(),
        snat_port_max: *args.masquerade_port_range.end(),
        masquerade_mark: masquerade_mark(args.iptables_masquerade_bit),
        netns_cookie: cgroup_hooks::netns_cookie()?,
        clock: datapath::kernel_clock()?,
        timeouts: args.conntrack_timeouts(),
    })?;
    // As IPv4's: without an IPv6 pod network, ::/128 holds no source.
    let cluster_cidr6 = args
        .cluster_cidr
        .v6
        .unwrap_or(Ipv6Net::new_assert(Ipv6Addr::UNSPECIFIED, 128));
    datapath.write_config6(&Config6 {
        node_addr: Addr6::from_octets(node_ips.v6.unwrap_or(Ipv6Addr::UNSPECIFIED).octets()),
        cluster_cidr_addr: Addr6::from_octets(cluster_cidr6.network().octets()),
        cluster_cidr_mask: Addr6::from_octets(cluster_cidr6.netmask().octets()),
    })?;

    let icmp = IcmpRateLimit::read()?;
    let cpus = aya::util::nr_cpus()
        .map_err(|(_, e)| e)
        .context("the number of possible CPUs")?;
    datapath.write_reject_limit(RejectLimit::new(icmp.per_sec, icmp.burst, cpus as u32))?;
    info!(
        per_sec = icmp.per_sec,
        burst = icmp.burst,
        "REJECT replies limited as the node's ICMP errors (net.ipv4.icmp_msgs_per_sec, icmp_msgs_burst)"
    );
    warn_of_port_range_overlaps(&args.masquerade_port_range);
    if args.no_forward_rules {
        info!(
            chain = forward_rules::CHAIN,
            "--no-forward-rules: FORWARD must accept Service traffic by the node's own rules"
        );
    } else {
        ensure_forward_rules(masquerade_mark(args.iptables_masquerade_bit));
    }

    let agent_info = AgentInfo {
        version: text_field(env!("CARGO_PKG_VERSION")),
        started_at_s: Timestamp::now().as_second().max(0) as u64,
        ..AgentInfo::default()
    };
    datapath.write_agent_info(&agent_info)?;

    let existing = datapath.service_maps.read()?;
    let existing6 = datapath.service_maps.read6()?;
    info!(
        bpffs = %args.bpffs.display(),
        node_ip = %node_ips,
        frontends = existing.frontends.len(),
        backends = existing.backends.len(),
        frontends_v6 = existing6.frontends.len(),
        backends_v6 = existing6.backends.len(),
        "datapath loaded, maps pinned"
    );
    Ok(Loaded {
        datapath,
        migrated,
        agent_info,
        existing,
        existing6,
    })
}

/// The manifest directory is whole from the start: syncs it before attaching. The apiserver's
/// stores are not yet: the pinned maps keep serving what they hold until they are.
fn first_sync(
    state: &mut State,
    source: &mut Source,
    coalescer: &mut Coalescer,
    changed_meanwhile: bool,
) {
    if source.whole() {
        state.sync(source, coalescer);
    } else {
        coalescer.queue(Instant::now(), Duration::ZERO);
        if changed_meanwhile {
            state.queued(source);
        }
    }
}

/// Puts the programs in place: the socket hooks, then every present interface; then removes
/// what earlier agents left. Logs "attached to the existing interfaces" when all of it is done.
async fn attach(
    args: &AgentArgs,
    state: &mut State,
    links: &LinkWatcher,
    migrated: usize,
) -> Result<Hooks> {
    let pins = LinkPins::open(&args.bpffs)?;
    // Before the interfaces, so "attached to the existing interfaces" means everything is.
    let cgroup_pins = match cgroup_mount::resolve(args.cgroup.as_deref())? {
        None => Vec::new(),
        Some(cgroup) => {
            let pins = cgroup_hooks::attach(&mut state.datapath, &pins, &cgroup)?;
            info!(cgroup = %cgroup.display(), "socket hooks in place");
            pins
        }
    };
    let mut hooks = Hooks::new(args, &mut state.datapath, pins).await?;
    let mut present = links.list().await?;
    // The pod-side interfaces first: with --xdp, lb_xdp's redirect targets are then known when
    // it is swapped in on the external one. Bridges before their ports, which are wanted as
    // ports of a bridge that has the programs.
    present.sort_by_key(|link| (link.name == args.external_interface, link.master.is_some()));
    for link in &present {
        hooks.add(&mut state.datapath, link).await?;
    }
    hooks.check_started(args)?;
    hooks.remove_stale_pins(&cgroup_pins);
    if migrated > 0 {
        // Connections the old programs opened while the first pass ran.
        state.datapath.migrate_conntrack(&args.bpffs, true)?;
    }
    map_pins::remove_stale(&args.bpffs);
    hooks.log_attached();
    state.health.lock().expect("health lock").attached();
    Ok(hooks)
}

/// The `--sync-period` audit's timer; 0s: no audit (an interval of zero would spin).
fn audit_interval(period: Duration) -> Option<tokio::time::Interval> {
    (!period.is_zero()).then(|| {
        let mut audit = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        audit.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        audit
    })
}

/// The started agent: what its loop waits on and acts on.
struct Agent {
    args: AgentArgs,
    /// The node IPs and --nodeport-addresses of both families.
    node_ports: NodePortSelection,
    state: State,
    source: Source,
    coalescer: Coalescer,
    hooks: Hooks,
    links: LinkWatcher,
    /// Until the netlink connection closes.
    links_open: bool,
    audit: Option<tokio::time::Interval>,
    sigterm: tokio::signal::unix::Signal,
    sigint: tokio::signal::unix::Signal,
}

impl Agent {
    /// The loop: syncs when a change is due, audits, follows the interfaces, until SIGTERM or
    /// SIGINT; then exits the process.
    async fn run_until_signal(mut self) -> Result<()> {
        loop {
            let deadline = self
                .source
                .whole()
                .then(|| self.coalescer.due())
                .flatten()
                .map(tokio::time::Instant::from_std);
            tokio::select! {
                _ = self.sigterm.recv() => break,
                _ = self.sigint.recv() => break,
                settle = self.source.next() => {
                    if let Some(settle) = settle {
                        self.coalescer.queue(Instant::now(), settle);
                        self.state.queued(&self.source);
                    }
                }
                () = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() => {
                    self.state.sync(&mut self.source, &mut self.coalescer);
                }
                _ = async { self.audit.as_mut().expect("guarded").tick().await }, if self.audit.is_some() => {
                    let repair = self.state.audit();
                    // The audit read every map entry whole: tens of MB at 50k Services.
                    release_free_memory();
                    if repair {
                        self.coalescer.queue(Instant::now(), Duration::ZERO);
                    }
                }
                (index, accepts) = self.hooks.next_xdp_target() => {
                    self.hooks.xdp_target_changed(&mut self.state.datapath, index, accepts)?;
                }
                event = self.links.next(), if self.links_open => self.link_event(event).await?,
            }
        }

        info!(
            interfaces = self.hooks.tc.len(),
            failed_map_writes = self.state.reconciler.failed_total,
            bpffs = %self.args.bpffs.display(),
            "stopped; the datapath stays attached and pinned (`lb cleanup` removes it)"
        );
        // Freeing the agent's state one allocation at a time (millions of them at 50k Services)
        // kept it from exiting for seconds; the exit frees it at once, and nothing it holds needs
        // a destructor: the datapath stays pinned.
        std::process::exit(0)
    }

    /// An interface came or went, the node's addresses changed, or netlink lost track.
    async fn link_event(&mut self, event: Option<LinkEvent>) -> Result<()> {
        match event {
            Some(LinkEvent::Present(link)) => {
                self.hooks.add(&mut self.state.datapath, &link).await?
            }
            Some(LinkEvent::Gone(index)) => self.hooks.remove(&mut self.state.datapath, index)?,
            Some(LinkEvent::Addresses) => self.node_addresses_changed().await,
            Some(LinkEvent::Lost) => {
                warn!("netlink notifications lost: listing interfaces and addresses again");
                self.node_addresses_changed().await;
                let present = self.links.list().await?;
                for index in self.hooks.tc.missing_from(&present) {
                    self.hooks.remove(&mut self.state.datapath, index)?;
                }
                for link in &present {
                    self.hooks.add(&mut self.state.datapath, link).await?;
                }
            }
            None => {
                error!("netlink connection closed: new interfaces are no longer attached");
                self.links_open = false;
            }
        }
        Ok(())
    }

    /// Queues a sync when the NodePort addresses changed.
    async fn node_addresses_changed(&mut self) {
        let changed = self
            .state
            .node_addresses_changed(&self.links, &self.node_ports)
            .await;
        if changed {
            self.coalescer.queue(Instant::now(), Duration::ZERO);
        }
    }
}

/// The programs' attachments: tc on the external and pod interfaces, and with `--xdp`, XDP on
/// the external one (never on pod veths: for traffic the stack built, XDP there costs an skb
/// copy and saves nothing).
struct Hooks {
    pins: LinkPins,
    tc: Attachments<TcIngress>,
    tc_egress: Attachments<TcEgress>,
    tc_filter: InterfaceFilter,
    xdp: Option<XdpHooks>,
}

/// With `--xdp`: `lb_xdp` on the external interface, and which of the interfaces `lb_ingress`
/// serves it may redirect into (listed in `LB_XDP_EGRESS_V1`): those whose XDP features say
/// they take redirects, followed as they change.
struct XdpHooks {
    attachments: Attachments<XdpNative>,
    external: InterfaceFilter,
    targets: XdpTargets,
    candidates: BTreeSet<u32>,
}

impl Hooks {
    async fn new(args: &AgentArgs, datapath: &mut Datapath, pins: LinkPins) -> Result<Self> {
        let xdp = if args.xdp {
            datapath.load_xdp()?;
            Some(XdpHooks {
                attachments: Attachments::default(),
                external: InterfaceFilter::new(&args.external_interface, &[])?,
                targets: XdpTargets::start().await?,
                candidates: BTreeSet::new(),
            })
        } else {
            None
        };
        Ok(Self {
            pins,
            tc: Attachments::default(),
            tc_egress: Attachments::default(),
            tc_filter: InterfaceFilter::new(&args.external_interface, &args.pod_interfaces)?,
            xdp,
        })
    }

    /// Attaches what interface `link` gets: the tc programs if `--pod-interfaces` or
    /// `--external-interface` names it, or if it is a port of a bridge that has them. Only an
    /// XDP attach failure is an error: the external interface's driver cannot run XDP
    /// natively. A matching interface without Ethernet headers gets nothing: the programs would
    /// read its IP header as one.
    async fn add(&mut self, datapath: &mut Datapath, link: &Link) -> Result<()> {
        let (index, name) = (link.index, link.name.as_str());
        // A bridge port's packets meet netfilter (br_netfilter's bridge-nf-call-iptables) before
        // they reach the bridge's own tc ingress: translated at the port, netfilter's conntrack
        // sees the connection as the datapath makes it (docs/datapath.md).
        let wanted =
            self.tc_filter.matches(name) || link.master.is_some_and(|master| self.tc.holds(master));
        if !link.is_ethernet() {
            if wanted {
                warn!(
                    interface = name,
                    link_type = ?link.link_type,
                    "not an Ethernet interface (IPIP, WireGuard, tun): lb's programs are not \
                     attached to it, so masqueraded replies of remote endpoints arriving over it \
                     are not translated; use a VXLAN overlay or native routing (docs/datapath.md)"
                );
            }
            return Ok(());
        }
        // Egress first: ingress may then hand the stack packets only egress completes.
        self.tc_egress
            .add(datapath.egress()?, &self.pins, wanted, index, name);
        self.tc
            .add(datapath.ingress()?, &self.pins, wanted, index, name);
        if let Some(xdp) = &mut self.xdp {
            xdp.attachments
                .try_add(
                    datapath.xdp()?,
                    &self.pins,
                    xdp.external.matches(name),
                    index,
                    name,
                )
                .with_context(|| format!("--xdp: attaching lb_xdp in native mode to {name}"))?;
            if self.tc_filter.matches(name) {
                xdp.candidates.insert(index);
                let accepts = xdp
                    .targets
                    .accepts_redirects(index)
                    .await
                    .unwrap_or_else(|err| {
                        warn!(interface = name, error = %error_chain(&err), "XDP features unknown: no XDP redirects into it");
                        false
                    });
                info!(interface = name, accepts, "XDP redirect target");
                datapath.set_xdp_egress(index, accepts)?;
            }
        }
        Ok(())
    }

    fn remove(&mut self, datapath: &mut Datapath, index: u32) -> Result<()> {
        self.tc.remove(&self.pins, index);
        self.tc_egress.remove(&self.pins, index);
        if let Some(xdp) = &mut self.xdp {
            xdp.attachments.remove(&self.pins, index);
            xdp.candidates.remove(&index);
            datapath.set_xdp_egress(index, false)?;
        }
        Ok(())
    }

    /// The next change of an interface's XDP features; pending forever without `--xdp` or once
    /// the netlink socket is gone.
    async fn next_xdp_target(&mut self) -> (u32, bool) {
        match &mut self.xdp {
            Some(xdp) => match xdp.targets.next().await {
                Some(change) => change,
                None => {
                    error!(
                        "netdev netlink connection closed: XDP redirect targets no longer follow changes"
                    );
                    std::future::pending().await
                }
            },
            None => std::future::pending().await,
        }
    }

    /// Interface `index` takes XDP redirects or no longer does.
    fn xdp_target_changed(
        &mut self,
        datapath: &mut Datapath,
        index: u32,
        accepts: bool,
    ) -> Result<()> {
        if let Some(xdp) = &self.xdp
            && xdp.candidates.contains(&index)
        {
            info!(index, accepts, "XDP redirect target changed");
            datapath.set_xdp_egress(index, accepts)?;
        }
        Ok(())
    }

    /// After the interfaces present at start are attached.
    fn check_started(&self, args: &AgentArgs) -> Result<()> {
        if let Some(xdp) = &self.xdp {
            anyhow::ensure!(
                !xdp.attachments.is_empty(),
                "--xdp: no interface {} to attach lb_xdp to",
                args.external_interface
            );
        }
        if self.tc.is_empty() {
            warn!("no interface matches --external-interface or --pod-interfaces yet");
        }
        Ok(())
    }

    /// The line tests and operators wait for: logged once the start is complete (programs
    /// attached, migrations done, stale pins gone).
    fn log_attached(&self) {
        info!(
            interfaces = self.tc.len(),
            xdp = self.xdp.as_ref().map_or(0, |xdp| xdp.attachments.len()),
            "attached to the existing interfaces"
        );
    }

    /// Unpins the links this agent does not hold: interfaces gone or no longer matching while
    /// no agent ran, and hooks it does not use (XDP without --xdp, socket hooks without
    /// --cgroup).
    fn remove_stale_pins(&self, cgroup_pins: &[&str]) {
        let mut keep: BTreeSet<String> = self.tc.pin_names().collect();
        keep.extend(self.tc_egress.pin_names());
        if let Some(xdp) = &self.xdp {
            keep.extend(xdp.attachments.pin_names());
        }
        keep.extend(cgroup_pins.iter().map(|name| name.to_string()));
        self.pins.remove_all_but(&keep);
    }
}

/// `--hostname-override`, else NODE_NAME (the DaemonSet sets it from the downward API), else
/// the hostname, lowercased as kube-proxy does.
fn node_name(args: &AgentArgs) -> Result<String> {
    let given = args
        .hostname_override
        .clone()
        .or_else(|| std::env::var("NODE_NAME").ok());
    let name = match given.filter(|name| !name.trim().is_empty()) {
        Some(name) => name,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("reading the hostname (or give --hostname-override)")?,
    };
    // As kube-proxy's GetHostname: Node names are lowercase.
    Ok(name.trim().to_lowercase())
}

/// Where the desired state comes from.
enum Source {
    Manifests {
        dir: PathBuf,
        cache: ManifestCache,
        /// Manifest files created or modified and not yet closed.
        writing: BTreeSet<PathBuf>,
        _watcher: notify::RecommendedWatcher,
        events: mpsc::UnboundedReceiver<notify::Result<notify::Event>>,
    },
    /// With the specs of its last snapshot.
    Api(Box<ApiSource>, Specs),
}

/// What changed in the desired state a source holds (see [`Source::specs`]).
struct Desired {
    /// The services whose spec or slices changed; None: any may have.
    changed: Option<BTreeSet<ServiceName>>,
    triggers: Vec<Timestamp>,
}

impl Source {
    fn manifests(dir: &Path) -> Result<Self> {
        let (tx, events) = mpsc::unbounded_channel();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                let _ = tx.send(event);
            })?;
        watcher
            .watch(dir, notify::RecursiveMode::NonRecursive)
            .with_context(|| format!("watching {}", dir.display()))?;
        Ok(Source::Manifests {
            dir: dir.to_owned(),
            cache: ManifestCache::default(),
            writing: BTreeSet::new(),
            _watcher: watcher,
            events,
        })
    }

    /// Waits for a change; returns how long it should wait for more, or None when nothing
    /// changed.
    async fn next(&mut self) -> Option<Duration> {
        match self {
            Source::Manifests {
                events, writing, ..
            } => match events.recv().await {
                Some(Err(err)) => {
                    warn!(error = %err, "manifest directory watch");
                    Some(SETTLE)
                }
                Some(Ok(event)) => manifest_event_settle(&event, writing),
                None => std::future::pending().await,
            },
            Source::Api(api, _) => (api.next().await == Next::Changed).then_some(Duration::ZERO),
        }
    }

    fn whole(&self) -> bool {
        match self {
            Source::Manifests { .. } => true,
            Source::Api(api, _) => api.whole(),
        }
    }

    /// Waits for this node's Node and its addresses (one of either family at least); also
    /// whether the desired state changed meanwhile.
    async fn node_ips(&mut self) -> (NodeIps, bool) {
        let Source::Api(api, _) = self else {
            unreachable!("--manifests requires --node-ip")
        };
        info!("no --node-ip: waiting for this node's Node for its address before attaching");
        let (mut logged, mut changed) = (false, false);
        loop {
            if let Some(node) = api.node() {
                let ips = NodeIps {
                    v4: apiserver::node_ip::<Ipv4Addr>(node),
                    v6: apiserver::node_ip::<Ipv6Addr>(node),
                };
                if ips.v4.is_some() || ips.v6.is_some() {
                    return (ips, changed);
                }
            }
            if !logged && api.node_listed() {
                warn!(
                    "this node's Node has no InternalIP or ExternalIP yet (or give --node-ip); waiting"
                );
                logged = true;
            }
            changed |= api.next().await == Next::Changed;
        }
    }

    /// `given` (--node-ip), with a family it leaves out taken from this node's Node if that is
    /// known already: start-up does not wait for the apiserver when --node-ip is given.
    fn node_ips_completed(&self, given: NodeIps) -> NodeIps {
        let Source::Api(api, _) = self else {
            return given;
        };
        let node = api.node();
        NodeIps {
            v4: given
                .v4
                .or_else(|| node.and_then(apiserver::node_ip::<Ipv4Addr>)),
            v6: given
                .v6
                .or_else(|| node.and_then(apiserver::node_ip::<Ipv6Addr>)),
        }
    }

    /// Shows the services whose map writes failed to the cluster's users: an Event on each
    /// (apiserver); from manifests the log says it.
    fn report_write_failures(&mut self, failed: &BTreeMap<ServiceName, WriteFailure>) {
        if let Source::Api(api, _) = self {
            api.report_write_failures(failed);
        }
    }

    /// This node's zone label as the Node has it now ("" without one, or from manifests).
    fn node_zone(&self) -> String {
        let Source::Api(api, _) = self else {
            return String::new();
        };
        let zone = api.node().and_then(apiserver::node_zone);
        zone.unwrap_or_default().to_string()
    }

    /// Brings [`Source::specs`] to the source's state; None (and an error logged) when that
    /// is unusable: the maps stay as they are.
    fn desired(&mut self) -> Option<Desired> {
        match self {
            Source::Manifests { dir, cache, .. } => match cache.load(dir) {
                Ok(changed) => Some(Desired {
                    changed: Some(changed),
                    triggers: Vec::new(),
                }),
                Err(err) => {
                    error!(error = %err, "manifests rejected, the maps keep the last good state");
                    None
                }
            },
            Source::Api(api, specs) => {
                let update = api.update(specs);
                Some(Desired {
                    changed: Some(update.changed),
                    triggers: update.triggers,
                })
            }
        }
    }

    /// The desired state as of the last [`Source::desired`].
    /// Rebuilds the specs' maps with full nodes, after a bulk change ([`lb_user::compact`]).
    fn compact_specs(&mut self) {
        match self {
            Source::Manifests { cache, .. } => cache.compact_specs(),
            Source::Api(_, specs) => specs.compact(),
        }
    }

    fn specs(&self) -> &Specs {
        match self {
            Source::Manifests { cache, .. } => cache.specs(),
            Source::Api(_, specs) => specs,
        }
    }
}

/// How long a change of the manifest directory waits for more, or None for an event that
/// changes no manifest (our own reads, a tool's temporary file). `writing` follows the manifest
/// files being written: while any is, a change waits the longer SETTLE.
fn manifest_event_settle(
    event: &notify::Event,
    writing: &mut BTreeSet<PathBuf>,
) -> Option<Duration> {
    use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind, RenameMode};
    // kubelet's ConfigMap volumes swap a `..data` symlink to the files' new directory.
    let relevant = |path: &PathBuf| {
        manifests::is_manifest_name(path)
            || path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(".."))
    };
    if event.need_rescan() || event.paths.is_empty() {
        return Some(SETTLE);
    }
    if !event.paths.iter().any(relevant) {
        return None;
    }
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {
            for path in &event.paths {
                writing.remove(path);
            }
        }
        EventKind::Access(_) => return None,
        EventKind::Create(_) | EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any) => {
            writing.extend(
                event
                    .paths
                    .iter()
                    .filter(|p| manifests::is_manifest_name(p))
                    .cloned(),
            );
        }
        // A file renamed away or removed is no longer being written; one renamed into place is
        // whole.
        EventKind::Modify(ModifyKind::Name(RenameMode::To)) => {}
        EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => {
            if let Some(from) = event.paths.first() {
                writing.remove(from);
            }
        }
        EventKind::Modify(ModifyKind::Name(_)) | EventKind::Remove(_) => {
            for path in &event.paths {
                writing.remove(path);
            }
        }
        _ => {}
    }
    Some(if writing.is_empty() {
        COMPLETE_SETTLE
    } else {
        SETTLE
    })
}

/// A sync that joined this many services followed a bulk change (the first lists, a relist
/// after an outage): the memory the change's objects took is freed by then.
const BULK_SYNC: usize = 1000;

/// The malloc arenas the agent's threads share (glibc's default: eight per core). The first
/// lists' objects are deserialized on the runtime's workers and freed on the sync thread; in
/// arenas of their own, they leave pages `malloc_trim` cannot hand back (at 50k Services, RSS
/// about 20 MiB higher than with two; the cold start was the same within the load's noise,
/// docs/performance.md).
const MALLOC_ARENAS: i32 = 2;

/// Limits the malloc arenas to [`MALLOC_ARENAS`], unless `MALLOC_ARENA_MAX` chose how many.
/// Before the runtime starts its threads: an arena, once made, stays.
pub fn limit_malloc_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return;
    }
    // SAFETY: mallopt only sets a limit the allocator reads when a thread needs an arena.
    unsafe {
        nix::libc::mallopt(nix::libc::M_ARENA_MAX, MALLOC_ARENAS);
    }
}

/// Hands the allocator's free memory back to the system: glibc otherwise keeps what a bulk
/// change freed (at 50k Services, hundreds of MB) in its arenas.
fn release_free_memory() {
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        nix::libc::malloc_trim(0);
    }
}

struct State {
    /// The desired state joined, as of the last sync.
    model: Model,
    /// Its ready endpoints.
    ready_endpoints: usize,
    no_local_endpoints: NoLocalEndpoints,
    reconciler: Reconciler,
    /// --zone; "" takes the Node's label at each sync.
    zone_flag: String,
    node_ports: Option<NodePortAllocator>,
    datapath: Datapath,
    /// What `lb status` reads about this agent, rewritten after each sync.
    agent_info: AgentInfo,
    metrics: Arc<Metrics>,
    health: Arc<Mutex<Health>>,
    service_health: ServiceHealth,
    /// How many IPv6 addresses NodePorts are served on.
    ipv6_node_port_addrs: usize,
    /// The IPv6 frontends not served that the log last reported.
    ipv6_frontends_logged: usize,
}

struct Sync {
    report: SyncReport,
    services: usize,
    /// The services this sync converted and joined again: those whose objects changed.
    joined: usize,
    endpoints: usize,
    failed_total: u64,
    /// Reading the source, the join, the reconcile (diff and map writes), the rest (UDP
    /// conntrack flush, health servers).
    stages: [Duration; 4],
    took: Duration,
}

impl State {
    fn new(
        args: &AgentArgs,
        node_ips: &NodeIps,
        (node_port_addrs, node_port_addrs6): (Vec<Ipv4Addr>, Vec<Ipv6Addr>),
        loaded: Loaded,
        metrics: Arc<Metrics>,
        health: Arc<Mutex<Health>>,
    ) -> Result<Self> {
        let proxy_health = health.clone();
        let service_health = ServiceHealth::new(move || {
            let health = proxy_health.lock().expect("health lock");
            health.healthz(Timestamp::now()).status == 200
        });
        let datapath = loaded.datapath;
        Ok(State {
            model: Model::default(),
            ready_endpoints: 0,
            no_local_endpoints: NoLocalEndpoints::default(),
            zone_flag: args.zone.clone(),
            reconciler: Reconciler::new(
                node_ips.v4.unwrap_or(Ipv4Addr::UNSPECIFIED),
                loaded.existing,
            )
            .with_ipv6(node_port_addrs6.clone(), loaded.existing6)
            .with_stats_slots(datapath.service_maps.stats_capacity())
            .with_node_port_addresses(node_port_addrs)
            .with_node_name(node_name(args)?)
            .with_default_scheduler(args.scheduler),
            // The apiserver allocates nodePorts; only manifests may leave them out.
            node_ports: args
                .manifests
                .is_some()
                .then(|| NodePortAllocator::new(args.nodeport_range.clone())),
            datapath,
            agent_info: loaded.agent_info,
            metrics,
            health,
            service_health,
            ipv6_node_port_addrs: node_port_addrs6.len(),
            ipv6_frontends_logged: 0,
        })
    }

    /// The `--sync-period` audit: compares the service maps with what the agent wrote; whether
    /// any entry differs (then a full sync, due now, repairs it). A failed read audits nothing.
    fn audit(&mut self) -> bool {
        let actual = match self.datapath.service_maps.read() {
            Ok(actual) => actual,
            Err(err) => {
                warn!(error = %error_chain(&err), "audit: reading the service maps");
                return false;
            }
        };
        let actual6 = match self.datapath.service_maps.read6() {
            Ok(actual) => actual,
            Err(err) => {
                warn!(error = %error_chain(&err), "audit: reading the IPv6 service maps");
                return false;
            }
        };
        let repairs = self.reconciler.audit(actual) + self.reconciler.audit6(actual6);
        if repairs == 0 {
            return false;
        }
        warn!(
            entries = repairs,
            "audit: service map entries differ from what the agent wrote (changed, lost or added \
             behind its back); a full sync repairs them"
        );
        self.metrics.audit_repairs.inc_by(repairs as u64);
        true
    }

    /// Reads the node's addresses again after a netlink change; whether the NodePort addresses
    /// of either family changed (then a sync is due). A failed read keeps the current ones.
    async fn node_addresses_changed(
        &mut self,
        links: &LinkWatcher,
        selection: &NodePortSelection,
    ) -> bool {
        match links.addresses().await {
            Ok(present) => {
                let (addrs, addrs6) = selection.addresses(&present);
                self.ipv6_node_port_addrs = addrs6.len();
                let changed = self.reconciler.set_node_port_addresses(addrs.clone());
                let changed6 = self.reconciler.set_node_port_addresses6(addrs6.clone());
                if changed || changed6 {
                    info!(addresses = ?addrs, ipv6 = ?addrs6, "NodePorts now served on");
                }
                changed || changed6
            }
            Err(err) => {
                warn!(error = %error_chain(&err), "reading the node's addresses: keeping the current ones");
                false
            }
        }
    }

    /// A change arrived: health and metrics know one is waiting.
    fn queued(&self, source: &Source) {
        let now = Timestamp::now();
        let mut health = self.health.lock().expect("health lock");
        health.queued(now);
        if let Source::Api(api, _) = source {
            health.set_node_eligible(api.node_eligible());
        }
        self.metrics.last_queued_timestamp.set(unix_seconds(now));
    }

    /// Reads the whole desired state and applies it; the maps stay untouched if the source's
    /// state is unusable.
    fn sync(&mut self, source: &mut Source, coalescer: &mut Coalescer) {
        let start = Instant::now();
        let Some(desired) = source.desired() else {
            coalescer.ran(start, false);
            return;
        };
        let read = start.elapsed();
        self.follow_zone(source);
        let previous = self.model.update(
            source.specs(),
            desired.changed.as_ref(),
            self.node_ports.as_mut(),
        );
        let mut model = std::mem::take(&mut self.model);
        let joined = start.elapsed();
        let changes = self.count_changes(&model, &previous);
        let report = self.reconcile(&model, &previous);
        let reconciled = start.elapsed();
        self.flush_udp(&report.removed_udp);
        self.warn_of_uncounted(&report);
        self.update_service_health(&model, &previous, desired.changed.is_none());
        if previous.len() >= BULK_SYNC {
            model.compact();
            self.compact(source);
            release_free_memory();
        }
        let took = start.elapsed();
        let now = Timestamp::now();
        self.observe(now, took, &desired, &changes, &report, model.services.len());
        source.report_write_failures(&report.failed_services);
        // Failed writes are retried, not a reason to fail /livez (health.rs).
        self.health
            .lock()
            .expect("health lock")
            .synced(now, report.failed);
        coalescer.ran(start, report.failed > 0);
        let endpoints = self.ready_endpoints;
        self.record_sync(now, &report, model.services.len(), endpoints);
        log_sync(&Sync {
            report,
            services: model.services.len(),
            joined: previous.len(),
            endpoints,
            failed_total: self.reconciler.failed_total,
            stages: [read, joined - read, reconciled - joined, took - reconciled],
            took,
        });
        self.log_ipv6_pending(&model);
        self.model = model;
    }

    /// Rebuilds the specs' and the reconciler's maps, which a bulk change filled in order, with
    /// full nodes ([`lb_user::compact`]).
    fn compact(&mut self, source: &mut Source) {
        source.compact_specs();
        self.reconciler.compact();
    }

    /// Says how many IPv6 frontends the model holds, and what of IPv6 the datapath does not
    /// serve yet (docs/ipv6.md), once per sync that changes the number.
    fn log_ipv6_pending(&mut self, model: &Model) {
        let frontends = model.ipv6_frontends(self.ipv6_node_port_addrs);
        if frontends == self.ipv6_frontends_logged {
            return;
        }
        self.ipv6_frontends_logged = frontends;
        info!(
            services = model.services_v6.len(),
            frontends,
            "IPv6 frontends: TCP and UDP served, masquerade, affinity, schedulers, source ranges, REJECT, ICMPv6 errors and fragments included (IPv6 datapath partial)"
        );
    }

    /// The zone the reconciler follows for topology hints: --zone, else the Node's label.
    fn follow_zone(&mut self, source: &Source) {
        let zone = match self.zone_flag.as_str() {
            "" => source.node_zone(),
            flag => flag.to_string(),
        };
        self.reconciler.set_zone(zone);
    }

    /// Updates the running counts (ready endpoints, services without a local endpoint) for the
    /// services joined again, whose state before is in `previous`; returns kube-proxy's change
    /// counts of this sync.
    fn count_changes(
        &mut self,
        model: &Model,
        previous: &BTreeMap<ServiceName, Option<Service>>,
    ) -> Changes {
        let node_name = self.reconciler.node_name();
        let mut changes = Changes::default();
        for (name, before) in previous {
            let now = model.services.get(name);
            let ready = |s: Option<&Service>| s.map_or(0, Service::ready_endpoints);
            self.ready_endpoints += ready(now);
            self.ready_endpoints -= ready(before.as_ref());
            self.no_local_endpoints.add(now, node_name, 1);
            self.no_local_endpoints.add(before.as_ref(), node_name, -1);
            changes.count(before.as_ref(), now);
        }
        changes
    }

    /// Writes the services that differ from the last sync into the maps.
    fn reconcile(
        &mut self,
        model: &Model,
        previous: &BTreeMap<ServiceName, Option<Service>>,
    ) -> SyncReport {
        // Only these differ from what the reconciler synced last.
        let changed: BTreeSet<ServiceName> = previous
            .iter()
            .filter(|(name, before)| model.services.get(*name) != before.as_ref())
            .map(|(name, _)| name.clone())
            .collect();
        self.reconciler
            .sync_changed(model, Some(&changed), &mut self.datapath.service_maps)
    }

    fn warn_of_uncounted(&self, report: &SyncReport) {
        if report.uncounted > 0 {
            let (slots, in_use) = self.reconciler.stats_slots();
            warn!(
                endpoints = report.uncounted,
                slots,
                in_use,
                "no free backend counter slot: these endpoints' traffic is not counted \
                 (lb services shows them counted: false; --backend-stats-max)"
            );
        }
    }

    /// The healthCheckNodePort servers, after a full sync or one that touched a service with
    /// one. Few services have one: the others' changes leave the servers alone.
    fn update_service_health(
        &mut self,
        model: &Model,
        previous: &BTreeMap<ServiceName, Option<Service>>,
        full: bool,
    ) {
        let health_checked = previous.iter().any(|(name, before)| {
            let now = model.services.get(name);
            now.into_iter()
                .chain(before)
                .any(Service::has_health_check_node_port)
        });
        if full || health_checked {
            self.service_health
                .update(service_health::wanted(model, self.reconciler.node_name()));
        }
    }

    /// The metrics of the sync that ended at `now`, after `took`.
    fn observe(
        &self,
        now: Timestamp,
        took: Duration,
        desired: &Desired,
        changes: &Changes,
        report: &SyncReport,
        services: usize,
    ) {
        let m = &self.metrics;
        m.sync_duration.observe(took.as_secs_f64());
        match desired.changed {
            None => m.sync_full_duration.observe(took.as_secs_f64()),
            Some(_) => m.sync_partial_duration.observe(took.as_secs_f64()),
        }
        m.service_changes.inc_by(changes.services);
        m.endpoint_changes.inc_by(changes.endpoints);
        // A service whose writes failed has its spec and endpoints both waiting for the retry.
        let pending = report.failed_services.len() as i64;
        m.service_changes_pending.set(pending);
        m.endpoint_changes_pending.set(pending);
        for (policy, count) in [
            ("internal", self.no_local_endpoints.internal),
            ("external", self.no_local_endpoints.external),
        ] {
            let label = TrafficPolicyLabel {
                traffic_policy: policy.to_owned(),
            };
            m.no_local_endpoints.get_or_create(&label).set(count);
        }
        m.last_sync_timestamp.set(unix_seconds(now));
        m.services.set(services as i64);
        m.endpoints.set(self.ready_endpoints as i64);
        m.map_write_failures.inc_by(report.failed as u64);
        for trigger in &desired.triggers {
            let latency = now.duration_since(*trigger).as_secs_f64();
            m.network_programming.observe(latency.max(0.0));
        }
    }

    /// Records the sync that ended at `now` for `lb status`.
    fn record_sync(
        &mut self,
        now: Timestamp,
        report: &SyncReport,
        services: usize,
        endpoints: usize,
    ) {
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        self.agent_info = AgentInfo {
            last_sync_at_s: now.as_second().max(0) as u64,
            last_sync_failed_writes: count(report.failed),
            services: count(services),
            endpoints: count(endpoints),
            ..self.agent_info
        };
        if let Err(err) = self.datapath.write_agent_info(&self.agent_info) {
            warn!(error = %error_chain(&err), "recording the sync for lb status");
        }
    }

    /// kube-proxy's UDP conntrack flush: the connections to UDP endpoints that the sync
    /// removed from the maps are forgotten, so their clients' next datagrams pick a live
    /// endpoint.
    fn flush_udp(&mut self, removed: &BTreeSet<UdpEndpoint>) {
        if removed.is_empty() {
            return;
        }
        match self.datapath.flush_udp(removed) {
            Ok(entries) => info!(
                endpoints = removed.len(),
                entries, "UDP conntrack of removed endpoints flushed"
            ),
            Err(err) => warn!(error = %error_chain(&err), "UDP conntrack flush"),
        }
    }
}

/// kube-proxy's change counts of one sync: a service added, removed or whose spec changed is a
/// service change; one whose endpoints changed an endpoint change (a service is both when it
/// comes or goes with endpoints).
#[derive(Debug, Default)]
struct Changes {
    services: u64,
    endpoints: u64,
}

impl Changes {
    fn count(&mut self, before: Option<&Service>, now: Option<&Service>) {
        fn endpoints(s: Option<&Service>) -> Vec<&Vec<Endpoint>> {
            s.into_iter()
                .flat_map(|s| s.ports.iter().map(|p| &p.endpoints))
                .collect()
        }
        fn spec(s: Option<&Service>) -> Option<Service> {
            s.map(|s| Service {
                ports: s
                    .ports
                    .iter()
                    .map(|p| ServicePort {
                        endpoints: Vec::new(),
                        ..p.clone()
                    })
                    .collect(),
                ..s.clone()
            })
        }
        self.services += u64::from(spec(before) != spec(now));
        self.endpoints += u64::from(endpoints(before) != endpoints(now));
    }
}

/// kube-proxy's sync_proxy_rules_no_local_endpoints_total: services with a Local traffic policy
/// and ready endpoints, none of them on this node, kept up to date service by service.
#[derive(Debug, Default)]
struct NoLocalEndpoints {
    internal: i64,
    external: i64,
}

impl NoLocalEndpoints {
    /// Counts `service` (None: nothing) `sign` times.
    fn add(&mut self, service: Option<&Service>, node_name: &str, sign: i64) {
        let Some(service) = service else {
            return;
        };
        let ready = || {
            service
                .ports
                .iter()
                .flat_map(|p| &p.endpoints)
                .filter(|e| e.ready())
        };
        if ready().next().is_none() || ready().any(|e| e.on_node(node_name)) {
            return;
        }
        if service.traffic.internal_local {
            self.internal += sign;
        }
        if service.traffic.external_local {
            self.external += sign;
        }
    }
}

fn unix_seconds(t: Timestamp) -> f64 {
    t.as_nanosecond() as f64 / 1e9
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

/// Logs the one line per sync.
fn log_sync(sync: &Sync) {
    let r = &sync.report;
    info!(
        services = sync.services,
        services_joined = sync.joined,
        endpoints = sync.endpoints,
        frontends_added = r.frontends_added,
        frontends_updated = r.frontends_updated,
        frontends_removed = r.frontends_removed,
        backends_added = r.backends_added,
        backends_updated = r.backends_updated,
        backends_removed = r.backends_removed,
        failed_writes = r.failed,
        failed_writes_total = sync.failed_total,
        took_ms = ms(sync.took),
        read_ms = ms(sync.stages[0]),
        join_ms = ms(sync.stages[1]),
        reconcile_ms = ms(sync.stages[2]),
        rest_ms = ms(sync.stages[3]),
        "sync done"
    );
}

/// `--iptables-masquerade-bit` as the mask the datapath sets and LB-FORWARD matches.
fn masquerade_mark(bit: u32) -> u32 {
    1 << bit
}

/// kube-proxy's KUBE-FORWARD rules, as LB-FORWARD (in both forwarding modes: as kube-proxy,
/// whatever the mode, and a restart may switch it). A node without iptables, or one whose
/// iptables fails, gets a warning, not a failed agent: Service traffic works wherever FORWARD
/// accepts it anyway.
fn ensure_forward_rules(masquerade_mark: u32) {
    let consequence = "on a node whose iptables FORWARD policy is DROP, masqueraded Service \
                       connections (external → NodePort, from outside --cluster-cidr) are \
                       dropped in --forwarding stack";
    let Some((iptables, why)) = Iptables::detect() else {
        warn!(
            chain = forward_rules::CHAIN,
            "iptables not found: FORWARD accept rules not added; {consequence}"
        );
        return;
    };
    match iptables.ensure(masquerade_mark) {
        Ok(()) => info!(
            chain = forward_rules::CHAIN,
            mark = format!("{masquerade_mark:#x}/{masquerade_mark:#x}"),
            iptables = iptables.command,
            why,
            "FORWARD accepts masqueraded Service traffic and established connections"
        ),
        Err(err) => warn!(
            chain = forward_rules::CHAIN,
            iptables = iptables.command,
            error = %error_chain(err.as_ref()),
            "FORWARD accept rules not added; {consequence}"
        ),
    }
}

/// Warns when the masquerade ports are also ports the node's own sockets take.
fn warn_of_port_range_overlaps(masquerade: &RangeInclusive<u16>) {
    let ranges = node_sysctls::local_port_range()
        .and_then(|local| Ok((local, node_sysctls::local_reserved_ports()?)));
    match ranges {
        Ok((local, reserved)) => {
            for overlap in node_sysctls::port_range_overlaps(masquerade, &local, &reserved) {
                warn!("--masquerade-port-range: {overlap}");
            }
        }
        Err(e) => {
            warn!("--masquerade-port-range not checked against the node's local port ranges: {e:#}")
        }
    }
}

#[cfg(test)]
mod tests {
    use notify::event::{
        AccessKind, AccessMode, CreateKind, DataChange, EventKind, ModifyKind, RemoveKind,
        RenameMode,
    };

    use super::*;

    fn event(kind: EventKind, paths: &[&str]) -> notify::Event {
        paths.iter().fold(notify::Event::new(kind), |e, p| {
            e.add_path(PathBuf::from(p))
        })
    }

    #[test]
    fn a_file_being_written_waits_longer_than_a_complete_change() {
        let mut writing = BTreeSet::new();
        let created = event(EventKind::Create(CreateKind::File), &["/m/a.yaml"]);
        assert_eq!(manifest_event_settle(&created, &mut writing), Some(SETTLE));
        let written = event(
            EventKind::Modify(ModifyKind::Data(DataChange::Content)),
            &["/m/a.yaml"],
        );
        assert_eq!(manifest_event_settle(&written, &mut writing), Some(SETTLE));
        // Another file renamed into place meanwhile: a.yaml is still being written.
        let renamed = event(
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            &["/m/b.yaml"],
        );
        assert_eq!(manifest_event_settle(&renamed, &mut writing), Some(SETTLE));
        let closed = event(
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            &["/m/a.yaml"],
        );
        assert_eq!(
            manifest_event_settle(&closed, &mut writing),
            Some(COMPLETE_SETTLE)
        );
        assert_eq!(
            manifest_event_settle(&renamed, &mut writing),
            Some(COMPLETE_SETTLE)
        );
        let removed = event(EventKind::Remove(RemoveKind::File), &["/m/b.yaml"]);
        assert_eq!(
            manifest_event_settle(&removed, &mut writing),
            Some(COMPLETE_SETTLE)
        );
    }

    #[test]
    fn events_that_change_no_manifest_are_ignored() {
        let mut writing = BTreeSet::new();
        let ignored = [
            event(EventKind::Create(CreateKind::File), &["/m/.a.yaml.swp"]),
            event(
                EventKind::Modify(ModifyKind::Data(DataChange::Content)),
                &["/m/notes.txt"],
            ),
            // Our own reads.
            event(
                EventKind::Access(AccessKind::Open(AccessMode::Any)),
                &["/m/a.yaml"],
            ),
            event(
                EventKind::Access(AccessKind::Close(AccessMode::Read)),
                &["/m/a.yaml"],
            ),
        ];
        for e in &ignored {
            assert_eq!(manifest_event_settle(e, &mut writing), None, "{e:?}");
        }
        assert!(writing.is_empty());
        // kubelet's ConfigMap volume swaps its `..data` link; a lost-events rescan may be anything.
        let swapped = event(
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            &["/m/..data"],
        );
        assert_eq!(
            manifest_event_settle(&swapped, &mut writing),
            Some(COMPLETE_SETTLE)
        );
        let rescan = notify::Event::new(EventKind::Other).set_flag(notify::event::Flag::Rescan);
        assert_eq!(manifest_event_settle(&rescan, &mut writing), Some(SETTLE));
    }
}
