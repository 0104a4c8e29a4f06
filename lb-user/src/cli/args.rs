//! Command line.
use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context as _;
use clap::parser::ValueSource;
use clap::{ArgAction, Args, CommandFactory as _, Parser, Subcommand, ValueEnum};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use lb_common::{ConntrackTimeouts, default_size};
use lb_user::model::{Family, IpFamily, Scheduler};

use crate::cli::kube_proxy_config::{self, FileFlags};

pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/lb";
/// `lb_common::SNAT_PORT_MIN`-`SNAT_PORT_MAX`, above Linux's default ephemeral range.
const DEFAULT_MASQUERADE_PORT_RANGE: &str = "61000-65535";

/// `--forwarding`: which path translated service traffic takes through the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Forwarding {
    /// The kernel's forwarding path (netfilter applies): destination translated at tc ingress,
    /// source at tc egress.
    Stack,
    /// Redirected from tc ingress to the egress interface, bypassing netfilter.
    Redirect,
}

#[derive(Debug, Parser)]
#[command(name = "lb", version, about = "eBPF replacement for kube-proxy")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The command line, with what `lb agent --config FILE` sets added as flags where the
    /// command line has none; and the file's fields that were not applied, each a sentence.
    /// Exits as clap does on a usage error, `--help` or `--version`.
    pub fn parse_with_config(mut argv: Vec<OsString>) -> anyhow::Result<(Cli, Vec<String>)> {
        let mut ignored = Vec::new();
        if let Some(file) = config_file_flags(&argv)? {
            ignored = add_file_flags(&mut argv, file);
        }
        let cli = Cli::try_parse_from(argv).unwrap_or_else(|e| e.exit());
        Ok((cli, ignored))
    }
}

/// What the `--config` file of an `lb agent` command line sets, if it names one.
fn config_file_flags(argv: &[OsString]) -> anyhow::Result<Option<FileFlags>> {
    // Leniently: a required flag may be missing until the file adds it.
    let matches = Cli::command()
        .ignore_errors(true)
        .try_get_matches_from(argv)
        .unwrap_or_else(|e| e.exit());
    let Some(("agent", agent)) = matches.subcommand() else {
        return Ok(None);
    };
    let Some(path) = agent.get_one::<PathBuf>("config") else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --config {}", path.display()))?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let flags = kube_proxy_config::flags_from(&text, u32::try_from(cpus).unwrap_or(u32::MAX))
        .with_context(|| format!("--config {}", path.display()))?;
    Ok(Some(flags))
}

/// Appends the file's flags that the command line does not give; returns the file's fields
/// that were not applied.
fn add_file_flags(argv: &mut Vec<OsString>, file: FileFlags) -> Vec<String> {
    let mut ignored = file.ignored;
    let command = Cli::command();
    let agent = command
        .find_subcommand("agent")
        .expect("lb has an agent command");
    let given = Cli::command()
        .ignore_errors(true)
        .try_get_matches_from(argv.iter())
        .ok();
    let on_command_line = |id: &str| {
        given
            .as_ref()
            .and_then(|m| m.subcommand_matches("agent"))
            .and_then(|m| m.value_source(id))
            == Some(ValueSource::CommandLine)
    };
    for (id, value) in file.flags {
        let flag = kube_proxy_config::flag_of(id);
        let Some(arg) = agent.get_arguments().find(|a| a.get_id() == id) else {
            ignored.push(format!("{flag}: not an option of this version"));
            continue;
        };
        if on_command_line(id) {
            continue;
        }
        argv.push(flag.into());
        if !matches!(arg.get_action(), ArgAction::SetTrue) {
            argv.push(value.into());
        }
    }
    ignored
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Program the datapath from the apiserver (or a manifest directory) and keep it in sync.
    Agent(Box<AgentArgs>),
    /// Print the datapath's packet counters (summed over CPUs), each with its meaning, and the
    /// drops by reason.
    Stats(StatsArgs),
    /// List the frontends, each with its Service port, kind, scheduler and traffic policy, and
    /// under it the backends it sends new connections to, with each one's traffic counters
    /// (connections, packets, bytes), as `ipvsadm -Ln --stats`.
    Services(StatsArgs),
    /// List the connections the datapath tracks (both directions of each as one row), as
    /// `conntrack -L`; `lb conntrack delete` deletes them, as `conntrack -D`. Packets and bytes
    /// are not counted per connection.
    Conntrack(ConntrackArgs),
    /// Show what the datapath does now with one packet, and why: its frontend, policy, backend
    /// candidates, connection, translation and verdict. Runs the real program on a crafted packet
    /// (BPF_PROG_TEST_RUN) against the pinned service maps; changes no state.
    Trace(TraceArgs),
    /// Remove the datapath, as kube-proxy's --cleanup removes its rules: detach every hook,
    /// remove every pin under --bpffs, and the iptables chain LB-FORWARD with FORWARD's jump. The datapath stays in the kernel when the agent stops;
    /// this is the only way it goes away (uninstall).
    Cleanup(CleanupArgs),
    /// Per Service, whether the datapath holds exactly what the agent wants (in sync, missing,
    /// extra, or failed with the error), from the records the agent pins next to the maps; how
    /// full every map is; the last sync's time and result; the agent's version and uptime.
    /// Exits non-zero when a Service is not in sync.
    Status(StatsArgs),
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// kube-proxy's configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1).
    /// Each field that applies sets the flag of the same meaning (clusterCIDR, nodePortAddresses,
    /// conntrack, healthzBindAddress, metricsBindAddress, syncPeriod, minSyncPeriod,
    /// hostnameOverride, ...); a flag given on the command line wins. Fields that do not apply
    /// are named in a warning.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of Kubernetes YAML (*.yaml, *.yml): v1 Services and discovery.k8s.io/v1
    /// EndpointSlices, watched for changes, instead of the apiserver.
    #[arg(long, value_name = "DIR", conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,
    /// Kubeconfig to reach the apiserver with; without it (and without --manifests), the
    /// in-cluster config of the pod's service account.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// This node's name, whose Node object gives the node IP; default: the NODE_NAME
    /// environment variable, else the hostname.
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// This node's zone: Cluster traffic goes only to the endpoints hinted for it
    /// (EndpointSlice hints.forZones) when every ready endpoint has hints, as kube-proxy does
    /// (hints.forNodes for this node, from --hostname-override, come first).
    /// Default: the Node's topology.kubernetes.io/zone label (as of each sync); without a zone,
    /// hints are ignored.
    #[arg(long, value_name = "ZONE", default_value = "")]
    pub zone: String,
    /// The node's address: NodePort frontends, and the masquerade source where routing picks
    /// none (masquerade takes the source the route to the endpoint selects). Required with
    /// --manifests. With it the agent starts, attaches and serves what the maps hold without
    /// the apiserver (the DaemonSet passes status.hostIP). Without it, from the apiserver: the
    /// Node's first InternalIP (else ExternalIP), and start-up waits for the Node before it
    /// loads and attaches the datapath. At most one address per family, comma-separated, as
    /// kubelet's --node-ip on a dual-stack node; a family left out is taken from the Node's
    /// first InternalIP of that family if the Node is known at start.
    #[arg(long, value_name = "IP[,IP]", value_parser = parse_node_ips)]
    pub node_ip: Option<NodeIps>,
    /// Pod network; connections from outside it are masqueraded. At most one CIDR per family,
    /// comma-separated, as kube-proxy's --cluster-cidr on a dual-stack cluster.
    #[arg(long, value_name = "CIDR[,CIDR]", value_parser = parse_cluster_cidrs)]
    pub cluster_cidr: ClusterCidrs,
    /// Interface where traffic from outside the node enters.
    #[arg(long, value_name = "IFNAME")]
    pub external_interface: String,
    /// How translated service traffic is forwarded. `stack` (the default): through the
    /// kernel's forwarding path, as under kube-proxy, so netfilter's FORWARD and POSTROUTING
    /// rules (NetworkPolicy of an iptables/nftables CNI, host firewalls) apply to it.
    /// `redirect`: straight to the egress interface, bypassing netfilter; faster, and safe only
    /// when no netfilter rule is meant to filter Service traffic. With `--xdp` the default is
    /// `redirect`, and `stack` is refused.
    #[arg(long, value_enum)]
    pub forwarding: Option<Forwarding>,
    /// Also attach the XDP fast path to the external interface, in native (driver) mode: external
    /// service traffic is translated and forwarded before the kernel builds an skb. tc stays
    /// attached for what XDP passes on. Fails if the driver has no native XDP. lb_xdp redirects
    /// only into interfaces whose XDP features take redirects (a veth: while its pod-side end
    /// has GRO or an XDP program on), and leaves the rest to tc. XDP bypasses netfilter: it
    /// implies `--forwarding redirect`.
    #[arg(long)]
    pub xdp: bool,
    /// Pod-side interfaces (shell globs, comma-separated), also those created later: where pods'
    /// traffic enters the node, and the overlay tunnels where remote pods' replies to
    /// masqueraded connections arrive. The default covers the common CNIs: Calico (cali*,
    /// vxlan.calico), flannel (flannel.1, cni0), Cilium (lxc*, cilium_vxlan, cilium_geneve),
    /// bridge CNIs and docker (cni0, docker0, veth*: kindnet's too).
    #[arg(
        long,
        value_name = "GLOB[,GLOB...]",
        value_delimiter = ',',
        default_value = DEFAULT_POD_INTERFACES
    )]
    pub pod_interfaces: Vec<String>,
    /// Range nodePorts are allocated from when a manifest gives none.
    #[arg(long, value_name = "MIN-MAX", default_value = "30000-32767", value_parser = parse_port_range)]
    pub nodeport_range: RangeInclusive<u16>,
    /// Masquerade every new service connection, not only those from outside the cluster CIDR.
    #[arg(long)]
    pub masquerade_all: bool,
    /// Source ports masqueraded connections take. Keep it clear of the node's
    /// net.ipv4.ip_local_port_range (its own connections would contend for the same ports) and
    /// ip_local_reserved_ports: the agent warns at start when it is not.
    #[arg(long, value_name = "MIN-MAX", default_value = DEFAULT_MASQUERADE_PORT_RANGE, value_parser = parse_port_range)]
    pub masquerade_port_range: RangeInclusive<u16>,
    /// kube-proxy's: the bit of the packet mark (skb->mark, 0 to 31) that tells masqueraded
    /// Service traffic apart, as KUBE-MARK-MASQ sets it: the datapath sets it on the packets of
    /// masqueraded connections it hands to the stack, and the agent's FORWARD rule (chain
    /// LB-FORWARD) accepts packets that carry it.
    #[arg(long, value_name = "BIT", default_value_t = 14, value_parser = clap::value_parser!(u32).range(0..=31))]
    pub iptables_masquerade_bit: u32,
    /// Do not add the iptables chain LB-FORWARD (and FORWARD's jump to it), kube-proxy's
    /// KUBE-FORWARD: accept packets with the masquerade mark, and those of connections netfilter
    /// already accepted. For nodes whose firewall manager owns FORWARD and accepts Service
    /// traffic itself; without either, a node whose FORWARD policy is DROP drops masqueraded
    /// Service connections in `--forwarding stack`.
    #[arg(long)]
    pub no_forward_rules: bool,
    /// How new connections pick an endpoint, for services without the
    /// lb.kubernetes.io/scheduler annotation.
    #[arg(long, value_enum, default_value_t = Scheduler::Random)]
    pub scheduler: Scheduler,
    /// NodePorts answer only on the node's addresses in these CIDRs (read at start), of
    /// either family; default: every address but loopback.
    #[arg(long, value_name = "CIDR[,CIDR...]", value_delimiter = ',')]
    pub nodeport_addresses: Vec<IpNet>,
    /// Where /healthz and /livez are served (IP:PORT, or IP for port 10256); "" disables.
    #[arg(long, value_name = "IP:PORT", default_value = "0.0.0.0:10256", value_parser = |s: &str| parse_bind_address(s, 10256))]
    pub healthz_bind_address: BindAddress,
    /// Log lines as text, or as one JSON object each (for a log collector).
    #[arg(long, value_enum, default_value_t)]
    pub log_format: LogFormat,
    /// Where /metrics and /proxyMode are served (IP:PORT, or IP for port 10249); "" disables.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249", value_parser = |s: &str| parse_bind_address(s, 10249))]
    pub metrics_bind_address: BindAddress,
    /// Changes are synced to the maps at most this often: a burst in between is one sync.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    pub min_sync_period: Duration,
    /// kube-proxy's sync period: this often the service maps are audited against what the agent
    /// wrote, and entries changed, lost or added behind its back are repaired ("0s": never);
    /// /healthz and /livez fail when a change has waited twice this long to be synced.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub sync_period: Duration,
    /// cgroup v2 directory whose sockets (host processes, hostNetwork pods) reach services
    /// through the socket hooks, at connect and send time; "" disables. Only sockets in the
    /// agent's network namespace are translated. Default: the cgroup v2 root mounted here (from
    /// /proc/self/mountinfo), else one the agent mounts (on /sys/fs/cgroup when nothing is
    /// mounted there, as under `ip netns exec`).
    #[arg(long, value_name = "PATH", value_parser = |s: &str| Ok::<_, String>(PathBuf::from(s)))]
    pub cgroup: Option<PathBuf>,
    /// bpffs directory for the pinned maps and links (mounted if needed). The datapath stays
    /// attached and pinned when the agent exits; a new agent swaps its programs in place and
    /// `lb cleanup` removes it. On a node this is the host's bpffs: one the agent mounts itself
    /// (under `ip netns exec`) lives only as long as the agent.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Frontends map size: (ClusterIP, port, protocol) and (node IP, nodePort, protocol) entries.
    #[arg(long, value_name = "N", default_value_t = default_size::FRONTENDS)]
    pub frontends_max: u32,
    /// Backends map size: one entry per endpoint of every service port.
    #[arg(long, value_name = "N", default_value_t = default_size::BACKENDS)]
    pub backends_max: u32,
    /// Conntrack map size: two entries per connection.
    #[arg(long, value_name = "N", default_value_t = default_size::CONNTRACK)]
    pub conntrack_max: u32,
    /// kube-proxy's: how long an idle established TCP connection is tracked ("0": Linux's 5
    /// days).
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_established: Duration,
    /// kube-proxy's: how long an idle TCP connection stays tracked in CLOSE_WAIT, once one side
    /// has closed and the other still sends ("0": Linux's 60s).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_close_wait: Duration,
    /// kube-proxy's: how long an idle UDP flow is tracked until it is a stream (replied to, then
    /// sent on); "0": Linux's 30s.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub conntrack_udp_timeout: Duration,
    /// kube-proxy's: how long an idle UDP stream is tracked ("0": Linux's 120s).
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = parse_duration)]
    pub conntrack_udp_timeout_stream: Duration,
    /// sessionAffinity map size: one entry per (service port with ClientIP affinity, client)
    /// within its timeout; when full, the least recently used client loses its affinity.
    #[arg(long, value_name = "N", default_value_t = default_size::AFFINITY)]
    pub affinity_max: u32,
    /// Backend counter slots: one per (service port, endpoint), for `lb services`; endpoints
    /// beyond them are not counted. Allocated on every CPU, 32 bytes each.
    #[arg(
        long,
        value_name = "N",
        default_value_t = default_size::BACKEND_STATS,
        value_parser = clap::value_parser!(u32).range(2..=i64::from(lb_common::MAX_BACKEND_STATS)),
    )]
    pub backend_stats_max: u32,
}

impl AgentArgs {
    /// `--nodeport-addresses` of one family.
    pub fn nodeport_addresses_of<A: Family>(&self) -> Vec<A::Net> {
        self.nodeport_addresses
            .iter()
            .filter_map(|net| A::net_of(*net))
            .collect()
    }

    /// `--forwarding`, or its default: `stack`, `redirect` with `--xdp`. Err for `--forwarding
    /// stack --xdp`: XDP redirects past netfilter.
    pub fn forwarding(&self) -> anyhow::Result<Forwarding> {
        match (self.forwarding, self.xdp) {
            (Some(Forwarding::Stack), true) => anyhow::bail!(
                "--xdp redirects past netfilter: it cannot be combined with --forwarding stack \
                 (leave --forwarding out or set it to redirect)"
            ),
            (Some(forwarding), _) => Ok(forwarding),
            (None, true) => Ok(Forwarding::Redirect),
            (None, false) => Ok(Forwarding::Stack),
        }
    }

    /// The `--conntrack-*-timeout*` flags, in whole seconds (rounded up), "0" as Linux's
    /// default, as kube-proxy leaves the kernel's setting then.
    pub fn conntrack_timeouts(&self) -> ConntrackTimeouts {
        let seconds = |flag: Duration, linux: u32| match flag.as_secs_f64().ceil() {
            0.0 => linux,
            s => s.min(f64::from(u32::MAX)) as u32,
        };
        let linux = ConntrackTimeouts::LINUX;
        ConntrackTimeouts {
            tcp_established_s: seconds(
                self.conntrack_tcp_timeout_established,
                linux.tcp_established_s,
            ),
            tcp_close_wait_s: seconds(
                self.conntrack_tcp_timeout_close_wait,
                linux.tcp_close_wait_s,
            ),
            udp_s: seconds(self.conntrack_udp_timeout, linux.udp_s),
            udp_stream_s: seconds(self.conntrack_udp_timeout_stream, linux.udp_stream_s),
        }
    }
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    /// bpffs directory of the agent's pinned maps.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    #[arg(short, long, value_enum, default_value_t)]
    pub output: Output,
}

/// How the inspection commands print.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    #[default]
    Table,
    Json,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ConntrackArgs {
    #[command(subcommand)]
    pub command: Option<ConntrackCommand>,
    #[command(flatten)]
    pub query: ConntrackQuery,
}

#[derive(Debug, Subcommand)]
pub enum ConntrackCommand {
    /// Delete the connections the filters select (every one without a filter), both
    /// directions, which frees their masquerade ports; prints them.
    Delete(ConntrackQuery),
}

#[derive(Debug, Args)]
pub struct ConntrackQuery {
    /// Only connections to this frontend (a ClusterIP's, or a node address and nodePort);
    /// IPv6 as `[2001:db8:96::10]:80`.
    #[arg(long, value_name = "IP:PORT")]
    pub service: Option<SocketAddr>,
    /// Only connections to this backend.
    #[arg(long, value_name = "IP:PORT")]
    pub backend: Option<SocketAddr>,
    /// Only connections from this client.
    #[arg(long, value_name = "IP")]
    pub client: Option<IpAddr>,
    /// bpffs directory of the agent's pinned maps.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    #[arg(short, long, value_enum, default_value_t)]
    pub output: Output,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Proto {
    Tcp,
    Udp,
}

#[derive(Debug, Args)]
pub struct TraceArgs {
    #[arg(long, value_enum)]
    pub proto: Proto,
    /// The packet's source, IPv4 or IPv6 (`[IPV6]:PORT`); without a port, an unprivileged one.
    #[arg(long, value_name = "IP[:PORT]", value_parser = parse_source)]
    pub from: SocketAddr,
    /// The packet's destination, of the source's family.
    #[arg(long, value_name = "IP:PORT")]
    pub to: SocketAddr,
    /// The interface the packet arrives on (the FIB lookup's input); default: the loopback.
    #[arg(long, value_name = "IFNAME")]
    pub in_interface: Option<String>,
    /// bpffs directory of the agent's pinned maps.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    #[arg(short, long, value_enum, default_value_t)]
    pub output: Output,
}

/// The source port of a `--from` without one.
pub const TRACE_SOURCE_PORT: u16 = 40_000;

fn parse_source(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>()
        .or_else(|_| {
            s.parse::<IpAddr>()
                .map(|ip| SocketAddr::new(ip, TRACE_SOURCE_PORT))
        })
        .map_err(|_| format!("{s}: not an IP address[:port] ([IPV6]:PORT)"))
}

#[derive(Debug, Args)]
pub struct CleanupArgs {
    /// bpffs directory of the agent's pins.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
}

/// At most one value of each family, as kubelet's --node-ip and kube-proxy's --cluster-cidr
/// take them on a dual-stack cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DualStack<V4, V6> {
    pub v4: Option<V4>,
    pub v6: Option<V6>,
}

/// The values comma-separated, IPv4's first, as given.
impl<V4: std::fmt::Display, V6: std::fmt::Display> std::fmt::Display for DualStack<V4, V6> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.v4, &self.v6) {
            (Some(v4), Some(v6)) => write!(f, "{v4},{v6}"),
            (Some(v4), None) => write!(f, "{v4}"),
            (None, Some(v6)) => write!(f, "{v6}"),
            (None, None) => Ok(()),
        }
    }
}

/// `--node-ip`.
pub type NodeIps = DualStack<Ipv4Addr, Ipv6Addr>;
/// `--cluster-cidr`.
pub type ClusterCidrs = DualStack<Ipv4Net, Ipv6Net>;

/// `s`'s comma-separated values, at most one of each family: (IPv4's, IPv6's).
fn one_per_family<T: FromStr>(
    s: &str,
    flag: &str,
    family: fn(&T) -> IpFamily,
) -> Result<(Option<T>, Option<T>), String>
where
    T::Err: std::fmt::Display,
{
    let (mut v4, mut v6) = (None, None);
    for value in s.split(',').map(str::trim) {
        let parsed: T = value
            .parse()
            .map_err(|e| format!("{flag} {value:?}: {e}"))?;
        let family = family(&parsed);
        let slot = match family {
            IpFamily::V4 => &mut v4,
            IpFamily::V6 => &mut v6,
        };
        if slot.replace(parsed).is_some() {
            return Err(format!("{flag} {s:?}: at most one {family} value"));
        }
    }
    Ok((v4, v6))
}

fn parse_node_ips(s: &str) -> Result<NodeIps, String> {
    let (v4, v6) = one_per_family::<IpAddr>(s, "--node-ip", |ip| IpFamily::of(*ip))?;
    Ok(NodeIps {
        v4: v4.and_then(Ipv4Addr::of),
        v6: v6.and_then(Ipv6Addr::of),
    })
}

fn parse_cluster_cidrs(s: &str) -> Result<ClusterCidrs, String> {
    let (v4, v6) = one_per_family::<IpNet>(s, "--cluster-cidr", |net| IpFamily::of(net.addr()))?;
    Ok(ClusterCidrs {
        v4: v4.and_then(Ipv4Addr::net_of),
        v6: v6.and_then(Ipv6Addr::net_of),
    })
}

fn parse_port_range(s: &str) -> Result<RangeInclusive<u16>, String> {
    let (min, max) = s
        .split_once('-')
        .ok_or_else(|| format!("{s:?}: expected MIN-MAX"))?;
    let parse = |p: &str| p.trim().parse::<u16>().map_err(|e| format!("{p:?}: {e}"));
    let (min, max) = (parse(min)?, parse(max)?);
    if min == 0 || min > max {
        return Err(format!("{s:?}: expected 1 <= MIN <= MAX"));
    }
    Ok(min..=max)
}

/// A listen address; None when disabled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindAddress(pub Option<SocketAddr>);

fn parse_bind_address(s: &str, default_port: u16) -> Result<BindAddress, String> {
    if s.is_empty() {
        return Ok(BindAddress(None));
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(BindAddress(Some((ip, default_port).into())));
    }
    s.parse()
        .map(|a| BindAddress(Some(a)))
        .map_err(|e| format!("{s:?}: {e} (expected IP:PORT, IP or \"\")"))
}

/// Go-style durations as kube-proxy takes them: `1s`, `500ms`, `1m30s`, `24h0m0s`, `0`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?}: expected a duration like 1s, 500ms, 1m30s");
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let duration: jiff::SignedDuration = s.parse().map_err(|_| bad())?;
    Duration::try_from(duration).map_err(|_| bad())
}

/// `--pod-interfaces`' default. Not IPIP's tunl0 (Calico's IPIP mode) nor WireGuard devices:
/// they carry no Ethernet header, which the datapath parses (docs/datapath.md).
const DEFAULT_POD_INTERFACES: &str =
    "cali*,vxlan.calico,flannel.1,cni0,lxc*,cilium_vxlan,cilium_geneve,docker0,veth*";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges() {
        assert_eq!(parse_port_range("30000-32767"), Ok(30000..=32767));
        assert!(parse_port_range("32767-30000").is_err());
        assert!(parse_port_range("0-10").is_err());
        assert!(parse_port_range("30000").is_err());
    }

    /// `lb agent` in manifest mode with its required flags (pod interfaces `lbp*,veth*`) and
    /// `extra`, parsed.
    fn parse_manifest_agent(extra: &[&str]) -> Result<Cli, clap::Error> {
        let required = [
            "lb",
            "agent",
            "--manifests",
            "/m",
            "--node-ip",
            "198.51.100.1",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--external-interface",
            "ext0",
            "--pod-interfaces",
            "lbp*,veth*",
        ];
        Cli::try_parse_from(required.iter().chain(extra))
    }

    /// [`parse_manifest_agent`]'s arguments, which must parse.
    fn manifest_agent(extra: &[&str]) -> AgentArgs {
        let cli = parse_manifest_agent(extra).unwrap();
        let Command::Agent(a) = cli.command else {
            panic!("not agent")
        };
        *a
    }

    /// Without --pod-interfaces: the interfaces of the common CNIs, pods' and tunnels'.
    #[test]
    fn default_pod_interfaces_cover_common_cnis() {
        let cli = Cli::try_parse_from([
            "lb",
            "agent",
            "--manifests",
            "/m",
            "--node-ip",
            "198.51.100.1",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--external-interface",
            "eth0",
        ])
        .unwrap();
        let Command::Agent(a) = cli.command else {
            panic!("not agent")
        };
        let filter =
            lb_user::datapath::links::InterfaceFilter::new("eth0", &a.pod_interfaces).unwrap();
        for name in [
            "cali0123456789a",
            "vxlan.calico",
            "flannel.1",
            "cni0",
            "lxc0123456789a",
            "cilium_vxlan",
            "cilium_geneve",
            "docker0",
            "veth01234567",
        ] {
            assert!(filter.matches(name), "{name}");
        }
        for name in ["lo", "eth1", "tunl0", "cilium_host", "kube-ipvs0"] {
            assert!(!filter.matches(name), "{name}");
        }
    }

    #[test]
    fn agent_command_line() {
        let a = manifest_agent(&[]);
        assert_eq!(a.pod_interfaces, ["lbp*", "veth*"]);
        assert_eq!(a.nodeport_range, 30000..=32767);
        assert_eq!(a.bpffs, PathBuf::from(DEFAULT_BPFFS));
        assert_eq!(a.conntrack_max, default_size::CONNTRACK);
        assert_eq!(a.affinity_max, default_size::AFFINITY);
        assert!(!a.masquerade_all);
        assert_eq!(
            a.masquerade_port_range,
            lb_common::SNAT_PORT_MIN..=lb_common::SNAT_PORT_MAX
        );
        assert_eq!(a.forwarding().unwrap(), Forwarding::Stack);
        assert_eq!(
            a.healthz_bind_address,
            BindAddress(Some("0.0.0.0:10256".parse().unwrap()))
        );
        assert_eq!(
            a.metrics_bind_address,
            BindAddress(Some("127.0.0.1:10249".parse().unwrap()))
        );
        assert_eq!(a.min_sync_period, Duration::from_secs(1));
        assert_eq!(a.manifests, Some(PathBuf::from("/m")));
        assert_eq!(a.conntrack_timeouts(), ConntrackTimeouts::KUBE_PROXY);
    }

    #[test]
    fn node_ip_and_cluster_cidr_take_one_value_per_family() {
        let v4: Ipv4Addr = "198.51.100.10".parse().unwrap();
        let v6: Ipv6Addr = "2001:db8:100::10".parse().unwrap();
        let net4: Ipv4Net = "10.244.0.0/16".parse().unwrap();
        let net6: Ipv6Net = "fd00:10:244::/56".parse().unwrap();
        let parse = |node_ip: &str, cidr: &str| {
            Cli::try_parse_from([
                "lb",
                "agent",
                "--manifests",
                "/m",
                "--node-ip",
                node_ip,
                "--cluster-cidr",
                cidr,
                "--external-interface",
                "ext0",
            ])
            .map(|cli| match cli.command {
                Command::Agent(a) => (a.node_ip.unwrap(), a.cluster_cidr),
                other => panic!("{other:?}"),
            })
        };
        let flags = |node_ip: &str, cidr: &str| parse(node_ip, cidr).unwrap();
        let dual = (
            NodeIps {
                v4: Some(v4),
                v6: Some(v6),
            },
            ClusterCidrs {
                v4: Some(net4),
                v6: Some(net6),
            },
        );
        assert_eq!(
            flags(
                "198.51.100.10,2001:db8:100::10",
                "10.244.0.0/16,fd00:10:244::/56"
            ),
            dual
        );
        assert_eq!(
            flags(
                "2001:db8:100::10,198.51.100.10",
                "fd00:10:244::/56,10.244.0.0/16"
            ),
            dual,
            "IPv6 first"
        );
        let (ip, cidr) = flags("198.51.100.10", "10.244.0.0/16");
        assert_eq!(
            (ip.v4, ip.v6, cidr.v4, cidr.v6),
            (Some(v4), None, Some(net4), None)
        );
        assert_eq!(ip.to_string(), "198.51.100.10", "logged as before");
        let (ip, cidr) = flags("2001:db8:100::10", "fd00:10:244::/56");
        assert_eq!(
            (ip.v4, ip.v6, cidr.v4, cidr.v6),
            (None, Some(v6), None, Some(net6))
        );

        for (flag, node_ip, cidr) in [
            ("--node-ip", "198.51.100.10,198.51.100.11", "10.244.0.0/16"),
            ("--node-ip", "2001:db8::1,2001:db8::2", "10.244.0.0/16"),
            (
                "--cluster-cidr",
                "198.51.100.10",
                "10.244.0.0/16,10.245.0.0/16",
            ),
            ("--cluster-cidr", "198.51.100.10", "fd00::/56,fd01::/56"),
        ] {
            let err = parse(node_ip, cidr).unwrap_err().to_string();
            assert!(err.contains(flag) && err.contains("at most one"), "{err}");
        }
        assert!(parse("", "10.244.0.0/16").is_err());
        assert!(parse("198.51.100.10", "10.244.0.0/16,").is_err());
    }

    #[test]
    fn nodeport_addresses_of_both_families() {
        let a = manifest_agent(&["--nodeport-addresses", "198.51.100.0/24,2001:db8::/64"]);
        assert_eq!(
            a.nodeport_addresses_of::<Ipv4Addr>(),
            ["198.51.100.0/24".parse::<Ipv4Net>().unwrap()]
        );
        assert_eq!(
            a.nodeport_addresses_of::<Ipv6Addr>(),
            ["2001:db8::/64".parse::<Ipv6Net>().unwrap()]
        );
    }

    #[test]
    fn masquerade_port_range() {
        let a = manifest_agent(&["--masquerade-port-range", "20000-29999"]);
        assert_eq!(a.masquerade_port_range, 20000..=29999);
        for bad in ["0-100", "30000-20000", "61000", "61000-70000"] {
            let parsed = parse_manifest_agent(&["--masquerade-port-range", bad]);
            assert!(parsed.is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn forwarding_defaults_to_the_stack_and_to_redirect_with_xdp() {
        let forwarding = |extra: &[&str]| manifest_agent(extra).forwarding();
        assert_eq!(forwarding(&[]).unwrap(), Forwarding::Stack);
        assert_eq!(forwarding(&["--xdp"]).unwrap(), Forwarding::Redirect);
        assert_eq!(
            forwarding(&["--forwarding", "redirect"]).unwrap(),
            Forwarding::Redirect
        );
        assert_eq!(
            forwarding(&["--forwarding", "redirect", "--xdp"]).unwrap(),
            Forwarding::Redirect
        );
        let refused = forwarding(&["--forwarding", "stack", "--xdp"]).unwrap_err();
        assert!(
            refused.to_string().contains("--forwarding stack"),
            "{refused}"
        );
    }

    #[test]
    fn conntrack_timeouts_as_kube_proxy_takes_them() {
        let a = manifest_agent(&[
            "--conntrack-tcp-timeout-established",
            "0",
            "--conntrack-tcp-timeout-close-wait",
            "1m30s",
            "--conntrack-udp-timeout",
            "1500ms",
            "--conntrack-udp-timeout-stream",
            "0",
        ]);
        assert_eq!(
            a.conntrack_timeouts(),
            ConntrackTimeouts {
                tcp_established_s: 5 * 86_400,
                tcp_close_wait_s: 90,
                udp_s: 2,
                udp_stream_s: 120,
            }
        );
    }

    #[test]
    fn apiserver_command_line() {
        let cli = Cli::try_parse_from([
            "lb",
            "agent",
            "--kubeconfig",
            "/k",
            "--hostname-override",
            "n1",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--external-interface",
            "ext0",
            "--pod-interfaces",
            "lbp*",
            "--healthz-bind-address",
            "",
            "--metrics-bind-address",
            "0.0.0.0",
            "--min-sync-period",
            "250ms",
            "--nodeport-addresses",
            "198.51.100.0/24,10.0.0.0/8",
        ])
        .unwrap();
        let Command::Agent(a) = cli.command else {
            panic!("not agent")
        };
        assert_eq!(a.node_ip, None);
        assert_eq!(a.healthz_bind_address, BindAddress(None));
        assert_eq!(
            a.metrics_bind_address,
            BindAddress(Some("0.0.0.0:10249".parse().unwrap()))
        );
        assert_eq!(a.min_sync_period, Duration::from_millis(250));
        assert_eq!(a.nodeport_addresses.len(), 2);
        assert!(
            Cli::try_parse_from(["lb", "agent", "--manifests", "/m", "--kubeconfig", "/k"])
                .is_err()
        );
    }

    #[test]
    fn conntrack_command_lines() {
        let parse = |args: &[&str]| match Cli::try_parse_from(args).map(|c| c.command) {
            Ok(Command::Conntrack(a)) => Ok(a),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        let list = parse(&[
            "lb",
            "conntrack",
            "--service",
            "10.96.0.10:80",
            "-o",
            "json",
        ])
        .unwrap();
        assert!(list.command.is_none());
        assert_eq!(list.query.service, Some("10.96.0.10:80".parse().unwrap()));
        assert_eq!(list.query.output, Output::Json);
        assert_eq!(list.query.bpffs, PathBuf::from(DEFAULT_BPFFS));
        let delete = parse(&[
            "lb",
            "conntrack",
            "delete",
            "--backend",
            "10.244.1.3:8080",
            "--client",
            "198.51.100.2",
            "--bpffs",
            "/b",
        ])
        .unwrap();
        let Some(ConntrackCommand::Delete(query)) = delete.command else {
            panic!("not delete")
        };
        assert_eq!(query.backend, Some("10.244.1.3:8080".parse().unwrap()));
        assert_eq!(query.client, Some("198.51.100.2".parse().unwrap()));
        assert_eq!(query.output, Output::Table);
        assert!(parse(&["lb", "conntrack", "--backend", "10.244.1.3"]).is_err());
    }

    #[test]
    fn config_file_fills_what_the_command_line_leaves_out() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            file.path(),
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clusterCIDR: 10.244.0.0/16
metricsBindAddress: 0.0.0.0:10249
minSyncPeriod: 3s
linux: {masqueradeAll: true}
oomScoreAdj: -999
",
        )
        .unwrap();
        let argv = [
            "lb",
            "agent",
            "--config",
            file.path().to_str().unwrap(),
            "--manifests",
            "/m",
            "--external-interface",
            "ext0",
            "--pod-interfaces",
            "lbp*",
            "--min-sync-period",
            "250ms",
        ];
        let (cli, ignored) =
            Cli::parse_with_config(argv.iter().map(OsString::from).collect()).unwrap();
        let Command::Agent(a) = cli.command else {
            panic!("not agent")
        };
        // The required --cluster-cidr comes from the file.
        assert_eq!(
            a.cluster_cidr,
            parse_cluster_cidrs("10.244.0.0/16").unwrap()
        );
        assert_eq!(
            a.metrics_bind_address,
            BindAddress(Some("0.0.0.0:10249".parse().unwrap()))
        );
        assert!(a.masquerade_all);
        // The command line wins.
        assert_eq!(a.min_sync_period, Duration::from_millis(250));
        assert_eq!(ignored, ["oomScoreAdj: not a field lb uses"]);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("1x").is_err());
        assert!(parse_duration("").is_err());
        assert_eq!(parse_duration("24h0m0s"), Ok(Duration::from_secs(86_400)));
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn trace_command_line() {
        let cli = Cli::try_parse_from([
            "lb",
            "trace",
            "--proto",
            "udp",
            "--from",
            "198.51.100.2",
            "--to",
            "10.96.0.10:53",
            "--in-interface",
            "ext0",
            "-o",
            "json",
        ])
        .unwrap();
        let Command::Trace(a) = cli.command else {
            panic!("not trace");
        };
        assert_eq!(a.proto, Proto::Udp);
        assert_eq!(
            a.from,
            SocketAddr::new(Ipv4Addr::new(198, 51, 100, 2).into(), TRACE_SOURCE_PORT)
        );
        assert_eq!(a.to, "10.96.0.10:53".parse().unwrap());
        assert_eq!(a.in_interface.as_deref(), Some("ext0"));
        assert_eq!(a.bpffs, PathBuf::from(DEFAULT_BPFFS));
        assert_eq!(a.output, Output::Json);
        assert!(parse_source("198.51.100.2:1234").is_ok_and(|s| s.port() == 1234));
        assert!(parse_source("example").is_err());
        assert!(parse_source("2001:db8::7").is_ok_and(|s| s.port() == TRACE_SOURCE_PORT));
        assert!(parse_source("[2001:db8::7]:1234").is_ok_and(|s| s.port() == 1234));
    }
}
