//! The desired state, whatever its source: services, their ports, and the endpoints of each port.
//!
//! A source (the manifest directory now, the apiserver later) produces [`ServiceSpec`]s and
//! [`SliceSpec`]s; [`Model::join`] joins them the way kube-proxy does. Everything here is pure.
//!
//! The families stay apart, as in kube-proxy's per-family proxiers: a dual-stack Service is a
//! [`Service`] in [`Model::services`] (IPv4) and a `Service<Ipv6Addr>` in
//! [`Model::services_v6`], sharing its name and ports.
pub mod id;
pub mod node_addresses;
pub mod nodeport;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::Hash;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::compact::compact;
pub use crate::model::id::{PortName, Protocol, ServiceName, ServicePortId};
use crate::model::nodeport::NodePortAllocator;

/// An address family, as an EndpointSlice's addressType names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub fn of(ip: IpAddr) -> IpFamily {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        })
    }
}

/// The address type of one family, so that the join is written once for both.
pub trait Family: Copy + Ord + Hash + fmt::Debug + fmt::Display {
    /// The family's CIDRs.
    type Net: Copy + Ord + Hash + fmt::Debug;
    const FAMILY: IpFamily;
    /// The address if it is of this family.
    fn of(ip: IpAddr) -> Option<Self>;
    /// The CIDR if it is of this family.
    fn net_of(net: IpNet) -> Option<Self::Net>;
}

impl Family for Ipv4Addr {
    type Net = Ipv4Net;
    const FAMILY: IpFamily = IpFamily::V4;
    fn of(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        }
    }
    fn net_of(net: IpNet) -> Option<Ipv4Net> {
        match net {
            IpNet::V4(v4) => Some(v4),
            IpNet::V6(_) => None,
        }
    }
}

impl Family for Ipv6Addr {
    type Net = Ipv6Net;
    const FAMILY: IpFamily = IpFamily::V6;
    fn of(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V6(v6) => Some(v6),
            IpAddr::V4(_) => None,
        }
    }
    fn net_of(net: IpNet) -> Option<Ipv6Net> {
        match net {
            IpNet::V6(v6) => Some(v6),
            IpNet::V4(_) => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetPort {
    Number(u16),
    /// A container port name; only the EndpointSlice knows its number. Shared by the spec and
    /// the model.
    Name(Arc<str>),
}

/// A Service as a source reports it, before the join.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceSpec {
    pub name: ServiceName,
    /// The IPv4 ClusterIP when spec.ipFamilies has IPv4.
    pub cluster_ip: Option<Ipv4Addr>,
    /// The IPv6 ClusterIP when spec.ipFamilies has IPv6.
    pub cluster_ip_v6: Option<Ipv6Addr>,
    /// type NodePort or LoadBalancer: every port is also exposed on the node.
    pub node_ports: bool,
    /// A node-exposed port without a nodePort gets one from the manifest mode's allocator; false
    /// for type LoadBalancer with allocateLoadBalancerNodePorts: false (such a port has none).
    pub allocate_node_ports: bool,
    /// sessionAffinity ClientIP with this timeout; None: no affinity.
    pub affinity_timeout_s: Option<u32>,
    pub traffic: TrafficPolicies,
    /// From the annotation; None: the agent's default.
    pub scheduler: Option<Scheduler>,
    pub external: ExternalAddresses,
    pub external_v6: ExternalAddresses<Ipv6Addr>,
    pub ports: Vec<PortSpec>,
}

/// The addresses besides the node's where a service is reached from outside, with the
/// externalTrafficPolicy as for its NodePorts (kube-proxy's "external destinations").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExternalAddresses<A: Family = Ipv4Addr> {
    /// spec.externalIPs.
    pub external_ips: Vec<A>,
    /// type LoadBalancer: status.loadBalancer.ingress IPs, except those with ipMode Proxy
    /// (their load balancer proxies to the nodes, so their traffic must reach it, as kube-proxy
    /// leaves them alone).
    pub load_balancer_ips: Vec<A>,
    /// spec.loadBalancerSourceRanges (this family's, host bits cleared): when any, only these
    /// sources reach the load balancer IPs (not the externalIPs nor the NodePorts, as in
    /// kube-proxy).
    pub source_ranges: Vec<A::Net>,
}

// Not derived: the addresses have no Default.
impl<A: Family> Default for ExternalAddresses<A> {
    fn default() -> Self {
        ExternalAddresses {
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            source_ranges: Vec::new(),
        }
    }
}

impl<A: Family> ExternalAddresses<A> {
    pub fn is_empty(&self) -> bool {
        self.external_ips.is_empty() && self.load_balancer_ips.is_empty()
    }
}

/// How a service port's new connections pick an endpoint (IPVS's scheduler model); the
/// annotation [`crate::source::convert::SCHEDULER_ANNOTATION`] chooses it per service, `--scheduler`
/// otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Scheduler {
    /// Uniformly random: kube-proxy's iptables semantics.
    #[default]
    Random,
    /// Round robin.
    Rr,
    /// Source hash: a client address always gets the same endpoint while the set is unchanged.
    Sh,
    /// Maglev consistent hashing of the 5-tuple: removing one of N endpoints moves about 1/N
    /// of the flows.
    Maglev,
}

impl Scheduler {
    pub fn parse(name: &str) -> Option<Scheduler> {
        match name {
            "random" => Some(Scheduler::Random),
            "rr" => Some(Scheduler::Rr),
            "sh" => Some(Scheduler::Sh),
            "maglev" => Some(Scheduler::Maglev),
            _ => None,
        }
    }

    pub const fn datapath(self) -> u32 {
        match self {
            Scheduler::Random => lb_common::SCHED_RANDOM,
            Scheduler::Rr => lb_common::SCHED_ROUND_ROBIN,
            Scheduler::Sh => lb_common::SCHED_SOURCE_HASH,
            Scheduler::Maglev => lb_common::SCHED_FLOW_HASH,
        }
    }
}

/// externalTrafficPolicy and internalTrafficPolicy (Local: true), and the healthCheckNodePort
/// that comes with externalTrafficPolicy Local.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficPolicies {
    pub external_local: bool,
    pub internal_local: bool,
    pub health_check_node_port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSpec {
    pub name: PortName,
    pub protocol: Protocol,
    pub port: u16,
    /// The nodePort the source gave; a node-exposed port without one gets one allocated.
    pub node_port: Option<u16>,
    pub target_port: TargetPort,
}

/// An EndpointSlice as a source reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceSpec {
    pub service: ServiceName,
    /// addressType: every endpoint's address is of this family.
    pub family: IpFamily,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<SliceEndpoint>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub protocol: Protocol,
    /// None means "all ports": the endpoint listens on the service's numeric targetPort.
    pub port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceEndpoint {
    pub addr: IpAddr,
    pub conditions: Conditions,
    pub placement: Placement,
}

/// The node an endpoint runs on and its topology hints, behind one shared pointer (8 bytes),
/// absent when it has neither: a cluster has millions of endpoints, and the model's endpoints
/// share their slice's (an endpoint is 32 bytes in the slice and 24 in the model, where a node
/// name and hints of their own took 48 and 40).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Placement(Option<Arc<Placed>>);

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Placed {
    node_name: Option<Box<str>>,
    hints: Hints,
}

/// The hints of an endpoint without any.
static NO_HINTS: Hints = Hints(None);

impl Placement {
    pub fn new(node_name: Option<&str>, hints: Hints) -> Placement {
        if node_name.is_none() && hints.is_empty() {
            return Placement(None);
        }
        Placement(Some(Arc::new(Placed {
            node_name: node_name.map(Box::from),
            hints,
        })))
    }

    /// The node the endpoint runs on.
    pub fn node_name(&self) -> Option<&str> {
        self.0.as_ref()?.node_name.as_deref()
    }

    pub fn hints(&self) -> &Hints {
        self.0.as_ref().map_or(&NO_HINTS, |p| &p.hints)
    }

    /// The same node with these hints.
    pub fn with_hints(&self, hints: Hints) -> Placement {
        Placement::new(self.node_name(), hints)
    }

    /// Either slice's (the same address in two slices during a rollout): the first node name,
    /// and per kind the first non-empty hints.
    fn merge(&mut self, other: &Placement) {
        let node_name = self.node_name().or(other.node_name());
        let hints = self.hints().merged(other.hints());
        if node_name != self.node_name() || hints != *self.hints() {
            *self = Placement::new(node_name, hints);
        }
    }
}

/// An endpoint's topology hints, set by the EndpointSlice controller for trafficDistribution
/// (PreferClose/PreferSameZone: zones; PreferSameNode: nodes and zones) or topology-mode Auto.
/// Boxed, and absent when both are empty: most endpoints have none, and a cluster has millions
/// of endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Hints(Option<Box<HintSets>>);

#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct HintSets {
    /// hints.forZones: the zones whose nodes should use it.
    zones: BTreeSet<String>,
    /// hints.forNodes: the nodes that should use it.
    nodes: BTreeSet<String>,
}

/// The hint sets of an endpoint without any.
static NO_HINT_SETS: BTreeSet<String> = BTreeSet::new();

impl Hints {
    pub fn new(zones: BTreeSet<String>, nodes: BTreeSet<String>) -> Hints {
        if zones.is_empty() && nodes.is_empty() {
            Hints(None)
        } else {
            Hints(Some(Box::new(HintSets { zones, nodes })))
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// hints.forZones: the zones whose nodes should use it.
    pub fn zones(&self) -> &BTreeSet<String> {
        self.0.as_ref().map_or(&NO_HINT_SETS, |h| &h.zones)
    }

    /// hints.forNodes: the nodes that should use it.
    pub fn nodes(&self) -> &BTreeSet<String> {
        self.0.as_ref().map_or(&NO_HINT_SETS, |h| &h.nodes)
    }

    /// Per kind, the first non-empty of these and `other`.
    fn merged(&self, other: &Hints) -> Hints {
        let pick = |mine: &BTreeSet<String>, theirs: &BTreeSet<String>| {
            if mine.is_empty() { theirs } else { mine }.clone()
        };
        Hints::new(
            pick(self.zones(), other.zones()),
            pick(self.nodes(), other.nodes()),
        )
    }
}

/// An endpoint's conditions, as kube-proxy reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Conditions {
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl Conditions {
    pub const READY: Conditions = Conditions {
        ready: true,
        serving: true,
        terminating: false,
    };

    /// Either report counts (the same address in two slices during a rollout).
    fn merge(self, other: Conditions) -> Conditions {
        Conditions {
            ready: self.ready || other.ready,
            serving: self.serving || other.serving,
            terminating: self.terminating && other.terminating,
        }
    }
}

/// The joined desired state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    /// The IPv4 side of every Service with IPv4 in spec.ipFamilies.
    pub services: BTreeMap<ServiceName, Service>,
    /// The IPv6 side of every Service with IPv6 in spec.ipFamilies.
    pub services_v6: BTreeMap<ServiceName, Service<Ipv6Addr>>,
}

/// One family of a Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service<A: Family = Ipv4Addr> {
    pub cluster_ip: A,
    /// sessionAffinity ClientIP with this timeout; None: no affinity.
    pub affinity_timeout_s: Option<u32>,
    pub traffic: TrafficPolicies,
    /// From the annotation; None: the agent's default.
    pub scheduler: Option<Scheduler>,
    pub external: ExternalAddresses<A>,
    pub ports: Vec<ServicePort<A>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort<A: Family = Ipv4Addr> {
    pub name: PortName,
    pub protocol: Protocol,
    pub port: u16,
    /// Set when the port is exposed on the node.
    pub node_port: Option<u16>,
    pub target_port: TargetPort,
    /// Sorted by (addr, port), no duplicates.
    pub endpoints: Vec<Endpoint<A>>,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint<A: Family = Ipv4Addr> {
    pub addr: A,
    pub port: u16,
    pub conditions: Conditions,
    pub placement: Placement,
}

impl<A: Family> Endpoint<A> {
    pub fn ready(&self) -> bool {
        self.conditions.ready
    }

    /// Terminating but still serving: used when no endpoint is ready (kube-proxy's
    /// ProxyTerminatingEndpoints).
    pub fn serving_terminating(&self) -> bool {
        self.conditions.serving && self.conditions.terminating
    }

    pub fn on_node(&self, node_name: &str) -> bool {
        self.placement.node_name() == Some(node_name)
    }
}

/// kube-proxy's topology modes: which ready endpoints a node's Cluster traffic uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// Every one (no usable hints).
    All,
    /// Those hinted for this node.
    SameNode,
    /// Those hinted for this node's zone.
    SameZone,
}

impl<A: Family> Service<A> {
    /// Ready endpoints over its ports.
    pub fn ready_endpoints(&self) -> usize {
        self.ports
            .iter()
            .map(|p| p.endpoints.iter().filter(|e| e.ready()).count())
            .sum()
    }

    /// Whether it has a healthCheckNodePort to serve.
    pub fn has_health_check_node_port(&self) -> bool {
        self.traffic.health_check_node_port.is_some()
    }
}

impl<A: Family> ServicePort<A> {
    /// kube-proxy's CategorizeEndpoints: the endpoints traffic policy Cluster uses (ready ones,
    /// narrowed by [`ServicePort::topology`]; else serving terminating ones, without topology),
    /// and those Local uses (the same rule among the endpoints on `node_name`, without
    /// topology).
    pub fn policy_endpoints(
        &self,
        node_name: &str,
        zone: &str,
    ) -> (Vec<&Endpoint<A>>, Vec<&Endpoint<A>>) {
        let topology = self.topology(node_name, zone);
        let hinted_here = |e: &Endpoint<A>| match topology {
            Topology::All => true,
            Topology::SameNode => e.placement.hints().nodes().contains(node_name),
            Topology::SameZone => e.placement.hints().zones().contains(zone),
        };
        let usable = |local: bool| {
            let candidates = || {
                self.endpoints
                    .iter()
                    .filter(move |e| !local || e.on_node(node_name))
            };
            let ready: Vec<&Endpoint<A>> = candidates()
                .filter(|e| e.ready() && (local || hinted_here(e)))
                .collect();
            if ready.is_empty() {
                candidates().filter(|e| e.serving_terminating()).collect()
            } else {
                ready
            }
        };
        (usable(false), usable(true))
    }

    /// kube-proxy's topologyModeFromHints (with PreferSameTrafficDistribution, on by default
    /// since Kubernetes 1.34): SameNode when every ready endpoint has node
    /// hints and one is hinted for `node_name`; else SameZone when every ready endpoint has zone
    /// hints and one is hinted for `zone`; else All, so a node or zone without endpoints still
    /// gets all of them.
    pub fn topology(&self, node_name: &str, zone: &str) -> Topology {
        let ready = || self.endpoints.iter().filter(|e| e.ready());
        let hinted_for = |hints: fn(&Endpoint<A>) -> &BTreeSet<String>, place: &str| {
            ready().all(|e| !hints(e).is_empty()) && ready().any(|e| hints(e).contains(place))
        };
        if hinted_for(|e| e.placement.hints().nodes(), node_name) {
            Topology::SameNode
        } else if hinted_for(|e| e.placement.hints().zones(), zone) {
            Topology::SameZone
        } else {
            Topology::All
        }
    }
}

/// The desired state as a source holds it, indexed by service, so that a sync joins only the
/// services that changed.
#[derive(Debug, Default)]
pub struct Specs {
    pub services: BTreeMap<ServiceName, ServiceSpec>,
    /// Each service's slices in the source's order, which decides where two slices give one
    /// address different node names or hints.
    pub slices: BTreeMap<ServiceName, ServiceSlices>,
}

/// Where a slice comes from, which orders a service's slices: (file, document) for manifests,
/// (`namespace/name`, 0) for the apiserver.
pub type SliceKey = (String, usize);

/// One service's slices, ordered by [`SliceKey`]. A sorted Vec rather than a map: a service has
/// one slice or a few, and a map's node has room for eleven, which at 50k Services cost 1.5 KiB
/// each.
#[derive(Debug, Default)]
pub struct ServiceSlices(Vec<(SliceKey, SliceSpec)>);

impl ServiceSlices {
    /// Sets the slice at `key`; returns the one it replaces.
    pub fn insert(&mut self, key: SliceKey, spec: SliceSpec) -> Option<SliceSpec> {
        match self.0.binary_search_by(|(k, _)| k.cmp(&key)) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, spec)),
            Err(i) => {
                self.0.insert(i, (key, spec));
                None
            }
        }
    }

    pub fn remove(&mut self, key: &SliceKey) -> Option<SliceSpec> {
        let i = self.0.binary_search_by(|(k, _)| k.cmp(key)).ok()?;
        Some(self.0.remove(i).1)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The slices in order.
    pub fn values(&self) -> impl Iterator<Item = &SliceSpec> {
        self.0.iter().map(|(_, spec)| spec)
    }
}

impl FromIterator<(SliceKey, SliceSpec)> for ServiceSlices {
    /// A later slice of the same key replaces an earlier one, as in a map.
    fn from_iter<I: IntoIterator<Item = (SliceKey, SliceSpec)>>(slices: I) -> Self {
        let mut all = ServiceSlices::default();
        for (key, spec) in slices {
            all.insert(key, spec);
        }
        all.0.shrink_to_fit();
        all
    }
}

impl Specs {
    /// Rebuilds the maps with full nodes, after a bulk change ([`crate::compact`]).
    pub fn compact(&mut self) {
        compact(&mut self.services);
        compact(&mut self.slices);
    }

    /// From lists: a later service of the same name replaces an earlier one; slices keep their
    /// order.
    pub fn from_lists(services: Vec<ServiceSpec>, slices: Vec<SliceSpec>) -> Specs {
        let mut specs = Specs {
            services: services.into_iter().map(|s| (s.name.clone(), s)).collect(),
            slices: BTreeMap::new(),
        };
        for (i, slice) in slices.into_iter().enumerate() {
            specs
                .slices
                .entry(slice.service.clone())
                .or_default()
                .insert((String::new(), i), slice);
        }
        specs
    }
}

impl Model {
    /// Rebuilds the maps with full nodes, after a bulk change ([`crate::compact`]).
    pub fn compact(&mut self) {
        compact(&mut self.services);
        compact(&mut self.services_v6);
    }

    /// Joins slices to services (same namespace, `kubernetes.io/service-name`) and gives every
    /// node-exposed port without a nodePort one from `node_ports`.
    ///
    /// As in kube-proxy, a service port's endpoints come from the slice port with the same name
    /// and protocol; its number is the endpoint's port (targetPort only matters when the slice
    /// port leaves the number out).
    pub fn join(
        services: Vec<ServiceSpec>,
        slices: &[SliceSpec],
        node_ports: &mut NodePortAllocator,
    ) -> Model {
        let mut model = Model::default();
        model.update(
            &Specs::from_lists(services, slices.to_vec()),
            None,
            Some(node_ports),
        );
        model
    }

    /// Brings the model to `specs` as [`Model::join`] would, joining again only the services in
    /// `changed` (None: every one) and those whose allocated nodePort moved; returns the
    /// services joined again, each with what its IPv4 side was before (None: it is new or has
    /// no IPv4 side). Without
    /// `node_ports` (the apiserver allocates them) a port without a nodePort has none.
    pub fn update(
        &mut self,
        specs: &Specs,
        changed: Option<&BTreeSet<ServiceName>>,
        node_ports: Option<&mut NodePortAllocator>,
    ) -> BTreeMap<ServiceName, Option<Service>> {
        let (before, allocated) = match node_ports {
            Some(node_ports) => allocate_node_ports(specs, node_ports),
            None => Default::default(),
        };
        let mut dirty: BTreeSet<ServiceName> = match changed {
            Some(changed) => changed.clone(),
            None => specs
                .services
                .keys()
                .chain(self.services.keys())
                .chain(self.services_v6.keys())
                .cloned()
                .collect(),
        };
        let moved = |a: &BTreeMap<ServicePortId, u16>, b: &BTreeMap<ServicePortId, u16>| {
            a.iter()
                .filter(|(id, port)| b.get(*id) != Some(*port))
                .map(|(id, _)| id.service.clone())
                .collect::<Vec<_>>()
        };
        dirty.extend(moved(&before, &allocated));
        dirty.extend(moved(&allocated, &before));

        let mut previous = BTreeMap::new();
        for name in dirty {
            let spec = specs.services.get(&name);
            let slices: Vec<&SliceSpec> = specs
                .slices
                .get(&name)
                .map(|slices| slices.values().collect())
                .unwrap_or_default();
            let v4 = spec.and_then(|s| {
                let ip = s.cluster_ip?;
                Some(join_service(s, ip, &s.external, &slices, &allocated))
            });
            let v6 = spec.and_then(|s| {
                let ip = s.cluster_ip_v6?;
                Some(join_service(s, ip, &s.external_v6, &slices, &allocated))
            });
            let before = replace(&mut self.services, &name, v4);
            replace(&mut self.services_v6, &name, v6);
            previous.insert(name, before);
        }
        previous
    }

    /// The IPv6 frontends the model holds: per IPv6 service port, its ClusterIP, externalIPs,
    /// load balancer IPs, and its nodePort on each of `node_ips_v6`.
    pub fn ipv6_frontends(&self, node_ips_v6: usize) -> usize {
        self.services_v6
            .values()
            .flat_map(|s| {
                let addresses =
                    1 + s.external.external_ips.len() + s.external.load_balancer_ips.len();
                s.ports
                    .iter()
                    .map(move |p| addresses + p.node_port.map_or(0, |_| node_ips_v6))
            })
            .sum()
    }

    /// Every service port of the IPv4 side with its identity.
    pub fn ports(&self) -> impl Iterator<Item = (ServicePortId, &Service, &ServicePort)> {
        ports_of(&self.services)
    }

    /// Every service port of the IPv6 side with its identity (the same as its IPv4 side's, for
    /// a dual-stack Service).
    pub fn ports_v6(
        &self,
    ) -> impl Iterator<Item = (ServicePortId, &Service<Ipv6Addr>, &ServicePort<Ipv6Addr>)> {
        ports_of(&self.services_v6)
    }

    /// Ready endpoints over all service ports.
    pub fn ready_endpoints(&self) -> usize {
        self.services.values().map(Service::ready_endpoints).sum()
    }
}

/// Every port of `services` with its identity.
fn ports_of<A: Family>(
    services: &BTreeMap<ServiceName, Service<A>>,
) -> impl Iterator<Item = (ServicePortId, &Service<A>, &ServicePort<A>)> {
    services.iter().flat_map(|(name, service)| {
        service.ports.iter().map(move |port| {
            (
                ServicePortId {
                    service: name.clone(),
                    port_name: port.name.clone(),
                    protocol: port.protocol,
                },
                service,
                port,
            )
        })
    })
}

/// The nodePorts of the node-exposed ports that have none and want one, from `node_ports`:
/// (the assignment before, the assignment now).
fn allocate_node_ports(
    specs: &Specs,
    node_ports: &mut NodePortAllocator,
) -> (BTreeMap<ServicePortId, u16>, BTreeMap<ServicePortId, u16>) {
    let node_exposed = || specs.services.values().filter(|s| s.node_ports);
    let explicit: BTreeSet<u16> = node_exposed()
        .flat_map(|s| s.ports.iter().filter_map(|p| p.node_port))
        .collect();
    let wanted: Vec<ServicePortId> = node_exposed()
        .filter(|s| s.allocate_node_ports)
        .flat_map(|s| {
            s.ports
                .iter()
                .filter(|p| p.node_port.is_none())
                .map(|p| ServicePortId {
                    service: s.name.clone(),
                    port_name: p.name.clone(),
                    protocol: p.protocol,
                })
        })
        .collect();
    let before = node_ports.assigned().clone();
    let allocated = node_ports.assign(&explicit, &wanted);
    (before, allocated)
}

/// Sets or removes `name`'s entry; returns what it was.
fn replace<V>(
    services: &mut BTreeMap<ServiceName, V>,
    name: &ServiceName,
    now: Option<V>,
) -> Option<V> {
    match now {
        Some(service) => services.insert(name.clone(), service),
        None => services.remove(name),
    }
}

/// One family of a service, on `cluster_ip`, joined with its slices of that family.
fn join_service<A: Family>(
    spec: &ServiceSpec,
    cluster_ip: A,
    external: &ExternalAddresses<A>,
    slices: &[&SliceSpec],
    allocated: &BTreeMap<ServicePortId, u16>,
) -> Service<A> {
    // A slice of another family (a stale IPv4 slice of an IPv6-only Service) is not this
    // family's, as kube-proxy's per-family proxiers see it.
    let slices: Vec<&SliceSpec> = slices
        .iter()
        .copied()
        .filter(|slice| slice.family == A::FAMILY)
        .collect();
    let ports = spec
        .ports
        .iter()
        .map(|p| {
            let node_port = if spec.node_ports {
                p.node_port.or_else(|| {
                    allocated
                        .get(&ServicePortId {
                            service: spec.name.clone(),
                            port_name: p.name.clone(),
                            protocol: p.protocol,
                        })
                        .copied()
                })
            } else {
                None
            };
            ServicePort {
                name: p.name.clone(),
                protocol: p.protocol,
                port: p.port,
                node_port,
                target_port: p.target_port.clone(),
                endpoints: endpoints_of(p, &slices),
            }
        })
        .collect();
    Service {
        cluster_ip,
        affinity_timeout_s: spec.affinity_timeout_s,
        traffic: spec.traffic,
        scheduler: spec.scheduler,
        external: external.clone(),
        ports,
    }
}

/// The endpoints of `port` in `slices`, which are of family `A`.
fn endpoints_of<A: Family>(port: &PortSpec, slices: &[&SliceSpec]) -> Vec<Endpoint<A>> {
    let mut by_addr: BTreeMap<(A, u16), (Conditions, Placement)> = BTreeMap::new();
    for slice in slices {
        let Some(slice_port) = slice
            .ports
            .iter()
            .find(|sp| *sp.name == *port.name && sp.protocol == port.protocol)
        else {
            continue;
        };
        let number = match (slice_port.port, &port.target_port) {
            (Some(n), _) | (None, &TargetPort::Number(n)) => n,
            (None, TargetPort::Name(_)) => continue,
        };
        for e in &slice.endpoints {
            let Some(addr) = A::of(e.addr) else {
                continue;
            };
            by_addr
                .entry((addr, number))
                .and_modify(|(conditions, placement)| {
                    *conditions = conditions.merge(e.conditions);
                    placement.merge(&e.placement);
                })
                .or_insert_with(|| (e.conditions, e.placement.clone()));
        }
    }
    by_addr
        .into_iter()
        .map(|((addr, port), (conditions, placement))| Endpoint {
            addr,
            port,
            conditions,
            placement,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(n: &str) -> ServiceName {
        ServiceName {
            namespace: "default".into(),
            name: n.into(),
        }
    }

    fn web(node_ports: bool, node_port: Option<u16>) -> ServiceSpec {
        ServiceSpec {
            name: name("web"),
            cluster_ip: Some(Ipv4Addr::new(10, 96, 0, 10)),
            cluster_ip_v6: None,
            node_ports,
            allocate_node_ports: node_ports,
            affinity_timeout_s: None,
            traffic: TrafficPolicies::default(),
            scheduler: None,
            external: ExternalAddresses::default(),
            external_v6: ExternalAddresses::default(),
            ports: vec![
                PortSpec {
                    name: "http".into(),
                    protocol: Protocol::Tcp,
                    port: 80,
                    node_port,
                    target_port: TargetPort::Name("http".into()),
                },
                PortSpec {
                    name: "dns".into(),
                    protocol: Protocol::Udp,
                    port: 53,
                    node_port: None,
                    target_port: TargetPort::Number(5353),
                },
            ],
        }
    }

    fn ep(last: u8, ready: bool) -> SliceEndpoint {
        SliceEndpoint {
            addr: Ipv4Addr::new(10, 244, 1, last).into(),
            conditions: Conditions {
                ready,
                serving: ready,
                terminating: false,
            },
            placement: Placement::default(),
        }
    }

    fn slice(ports: Vec<SlicePort>, endpoints: Vec<SliceEndpoint>) -> SliceSpec {
        SliceSpec {
            service: name("web"),
            family: IpFamily::V4,
            ports,
            endpoints,
        }
    }

    fn sp(name: &str, protocol: Protocol, port: Option<u16>) -> SlicePort {
        SlicePort {
            name: name.into(),
            protocol,
            port,
        }
    }

    /// Kept for every port of every Service, in the spec and in the model (issue 21's memory
    /// goal, 50k Services): a size change here is a change of the agent's memory at scale.
    #[test]
    fn ports_stay_small() {
        // The name and a named targetPort behind shared pointers, not `String`s.
        assert_eq!(std::mem::size_of::<PortSpec>(), 40);
        assert_eq!(std::mem::size_of::<ServicePort>(), 64);
    }

    #[test]
    fn the_model_shares_the_specs_port_names() {
        let specs = Specs::from_lists(vec![web(false, None)], Vec::new());
        let mut model = Model::default();
        model.update(&specs, None, None);
        let spec = &specs.services[&name("web")].ports[0];
        let port = &model.services[&name("web")].ports[0];
        assert!(Arc::ptr_eq(&spec.name, &port.name));
        let (TargetPort::Name(in_spec), TargetPort::Name(in_model)) =
            (&spec.target_port, &port.target_port)
        else {
            panic!("web's http port has a named targetPort");
        };
        assert!(Arc::ptr_eq(in_spec, in_model));
    }

    #[test]
    fn endpoint_port_comes_from_the_slice_port_with_the_service_port_name() {
        let slices = [slice(
            vec![
                sp("http", Protocol::Tcp, Some(8080)),
                sp("dns", Protocol::Udp, Some(5353)),
            ],
            vec![ep(4, true), ep(2, true), ep(3, false)],
        )];
        let model = Model::join(
            vec![web(false, None)],
            &slices,
            &mut NodePortAllocator::new(30000..=32767),
        );
        let svc = &model.services[&name("web")];
        let http = &svc.ports[0];
        assert_eq!(
            http.endpoints
                .iter()
                .map(|e| (e.addr, e.port, e.ready()))
                .collect::<Vec<_>>(),
            vec![
                (Ipv4Addr::new(10, 244, 1, 2), 8080, true),
                (Ipv4Addr::new(10, 244, 1, 3), 8080, false),
                (Ipv4Addr::new(10, 244, 1, 4), 8080, true),
            ]
        );
        assert!(svc.ports[1].endpoints.iter().all(|e| e.port == 5353));
        assert_eq!(http.node_port, None);
        assert_eq!(model.ready_endpoints(), 4);
    }

    #[test]
    fn protocol_must_match_and_unmatched_ports_have_no_endpoints() {
        let slices = [slice(
            vec![sp("http", Protocol::Udp, Some(8080))],
            vec![ep(2, true)],
        )];
        let model = Model::join(
            vec![web(false, None)],
            &slices,
            &mut NodePortAllocator::new(30000..=32767),
        );
        assert!(model.services[&name("web")].ports[0].endpoints.is_empty());
        assert!(model.services[&name("web")].ports[1].endpoints.is_empty());
    }

    #[test]
    fn a_slice_port_without_number_uses_a_numeric_target_port_only() {
        let slices = [slice(
            vec![
                sp("http", Protocol::Tcp, None),
                sp("dns", Protocol::Udp, None),
            ],
            vec![ep(2, true)],
        )];
        let model = Model::join(
            vec![web(false, None)],
            &slices,
            &mut NodePortAllocator::new(30000..=32767),
        );
        let ports = &model.services[&name("web")].ports;
        assert!(ports[0].endpoints.is_empty());
        assert_eq!(ports[1].endpoints[0].port, 5353);
    }

    #[test]
    fn endpoints_in_several_slices_are_merged() {
        let slices = [
            slice(
                vec![sp("http", Protocol::Tcp, Some(80))],
                vec![ep(2, false)],
            ),
            slice(
                vec![sp("http", Protocol::Tcp, Some(80))],
                vec![ep(2, true), ep(3, true)],
            ),
        ];
        let model = Model::join(
            vec![web(false, None)],
            &slices,
            &mut NodePortAllocator::new(30000..=32767),
        );
        let eps = &model.services[&name("web")].ports[0].endpoints;
        assert_eq!(eps.len(), 2);
        assert!(eps.iter().all(Endpoint::ready));
    }

    fn endpoint(last: u8, conditions: Conditions, node: &str) -> Endpoint {
        Endpoint {
            addr: Ipv4Addr::new(10, 244, 1, last),
            port: 80,
            conditions,
            placement: Placement::new(Some(node), Hints::default()),
        }
    }

    const NOT_READY: Conditions = Conditions {
        ready: false,
        serving: false,
        terminating: false,
    };
    const SERVING_TERMINATING: Conditions = Conditions {
        ready: false,
        serving: true,
        terminating: true,
    };
    const TERMINATING: Conditions = Conditions {
        ready: false,
        serving: false,
        terminating: true,
    };

    /// The Cluster and Local lists on node "me" without a zone.
    fn categorized(endpoints: Vec<Endpoint>) -> (Vec<u8>, Vec<u8>) {
        categorized_in("", endpoints)
    }

    /// kube-proxy's rules: ready first; serving terminating ones only when none is ready, and
    /// for Local, "none" among this node's endpoints.
    #[test]
    fn endpoints_by_traffic_policy_and_termination() {
        use Conditions as C;
        assert_eq!(
            categorized(vec![
                endpoint(2, C::READY, "me"),
                endpoint(3, C::READY, "other"),
                endpoint(4, SERVING_TERMINATING, "me"),
                endpoint(5, NOT_READY, "me"),
            ]),
            (vec![2, 3], vec![2])
        );
        assert_eq!(
            categorized(vec![
                endpoint(3, C::READY, "other"),
                endpoint(4, SERVING_TERMINATING, "me"),
                endpoint(6, TERMINATING, "me"),
            ]),
            (vec![3], vec![4])
        );
        assert_eq!(
            categorized(vec![
                endpoint(4, SERVING_TERMINATING, "me"),
                endpoint(5, SERVING_TERMINATING, "other"),
                endpoint(6, TERMINATING, "other"),
            ]),
            (vec![4, 5], vec![4])
        );
        assert_eq!(
            categorized(vec![
                endpoint(3, C::READY, "other"),
                endpoint(6, TERMINATING, "me")
            ]),
            (vec![3], vec![])
        );
    }

    fn hinted(last: u8, conditions: Conditions, node: &str, zones: &[&str]) -> Endpoint {
        let mut e = endpoint(last, conditions, node);
        e.placement = e
            .placement
            .with_hints(Hints::new(names(zones), BTreeSet::new()));
        e
    }

    fn node_hinted(mut e: Endpoint, nodes: &[&str]) -> Endpoint {
        e.placement = with_nodes(&e.placement, nodes);
        e
    }

    fn names(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    /// `placement` with these node hints instead of its own.
    fn with_nodes(placement: &Placement, nodes: &[&str]) -> Placement {
        placement.with_hints(Hints::new(placement.hints().zones().clone(), names(nodes)))
    }

    /// `placement` with these zone hints instead of its own.
    fn with_zones(placement: &Placement, zones: &[&str]) -> Placement {
        placement.with_hints(Hints::new(names(zones), placement.hints().nodes().clone()))
    }

    /// The last address bytes of the Cluster and Local lists on node "me" in `zone`.
    fn categorized_in(zone: &str, endpoints: Vec<Endpoint>) -> (Vec<u8>, Vec<u8>) {
        let port = ServicePort {
            name: "".into(),
            protocol: Protocol::Tcp,
            port: 80,
            node_port: None,
            target_port: TargetPort::Number(80),
            endpoints,
        };
        let (cluster, local) = port.policy_endpoints("me", zone);
        let last = |e: &[&Endpoint]| e.iter().map(|e| e.addr.octets()[3]).collect();
        (last(&cluster), last(&local))
    }

    /// kube-proxy's topology-aware routing: the Cluster list keeps the endpoints hinted for this
    /// zone only when every ready endpoint has hints and one is for this zone; the Local list
    /// ignores hints.
    #[test]
    fn zone_hints_narrow_the_cluster_list() {
        use Conditions as C;
        let endpoints = || {
            vec![
                hinted(2, C::READY, "other", &["a"]),
                hinted(3, C::READY, "me", &["b"]),
                hinted(4, C::READY, "other", &["b", "c"]),
                hinted(5, NOT_READY, "other", &[]),
            ]
        };
        assert_eq!(categorized_in("b", endpoints()), (vec![3, 4], vec![3]));
        assert_eq!(categorized_in("a", endpoints()), (vec![2], vec![3]));
        assert_eq!(
            categorized_in("d", endpoints()),
            (vec![2, 3, 4], vec![3]),
            "no endpoint for this zone: hints ignored"
        );
        assert_eq!(
            categorized_in("", endpoints()),
            (vec![2, 3, 4], vec![3]),
            "zone unknown: hints ignored"
        );
        let mut partly = endpoints();
        partly[0].placement = with_zones(&partly[0].placement, &[]);
        assert_eq!(
            categorized_in("b", partly),
            (vec![2, 3, 4], vec![3]),
            "a ready endpoint without hints: hints ignored"
        );
        assert_eq!(
            categorized_in(
                "a",
                vec![
                    hinted(2, SERVING_TERMINATING, "other", &["a"]),
                    hinted(3, SERVING_TERMINATING, "me", &["b"]),
                ]
            ),
            (vec![2, 3], vec![3]),
            "no ready endpoint: serving terminating ones, without topology"
        );
    }

    /// trafficDistribution PreferSameNode: node hints come before zone hints, under the same
    /// all-or-nothing rule; without one for this node, the zone hints decide.
    #[test]
    fn node_hints_narrow_the_cluster_list_before_zone_hints() {
        use Conditions as C;
        let endpoints = || {
            vec![
                node_hinted(hinted(2, C::READY, "other", &["a"]), &["other"]),
                node_hinted(hinted(3, C::READY, "me", &["b"]), &["me"]),
                node_hinted(hinted(4, C::READY, "other", &["a"]), &["other", "me"]),
                hinted(5, NOT_READY, "other", &[]),
            ]
        };
        assert_eq!(categorized_in("a", endpoints()), (vec![3, 4], vec![3]));
        let mut elsewhere = endpoints();
        elsewhere[1].placement = with_nodes(&elsewhere[1].placement, &["other"]);
        elsewhere[2].placement = with_nodes(&elsewhere[2].placement, &["other"]);
        assert_eq!(
            categorized_in("a", elsewhere),
            (vec![2, 4], vec![3]),
            "no endpoint for this node: zone hints"
        );
        let mut partly = endpoints();
        partly[0].placement = with_nodes(&partly[0].placement, &[]);
        assert_eq!(
            categorized_in("a", partly.clone()),
            (vec![2, 4], vec![3]),
            "a ready endpoint without node hints: zone hints"
        );
        partly[0].placement = with_zones(&partly[0].placement, &[]);
        assert_eq!(
            categorized_in("a", partly),
            (vec![2, 3, 4], vec![3]),
            "and without zone hints: every ready endpoint"
        );
    }

    /// An address in two slices keeps the first slice's non-empty hints of each kind.
    #[test]
    fn hints_of_an_address_in_two_slices_merge_per_kind() {
        let port = || sp("http", Protocol::Tcp, Some(8080));
        let mut zoned = ep(2, true);
        zoned.placement = Placement::new(None, Hints::new(names(&["a"]), BTreeSet::new()));
        let mut noded = ep(2, true);
        noded.placement = Placement::new(None, Hints::new(names(&["b"]), names(&["me"])));
        let model = Model::join(
            vec![web(false, None)],
            &[
                slice(vec![port()], vec![zoned]),
                slice(vec![port()], vec![noded]),
            ],
            &mut NodePortAllocator::new(30000..=32767),
        );
        let hints = model.services[&name("web")].ports[0].endpoints[0]
            .placement
            .hints();
        assert_eq!(hints.zones(), &names(&["a"]));
        assert_eq!(hints.nodes(), &names(&["me"]));
    }

    #[test]
    fn node_ports_are_kept_or_allocated_only_for_node_exposed_services() {
        let mut alloc = NodePortAllocator::new(30000..=32767);
        let model = Model::join(vec![web(true, Some(30080))], &[], &mut alloc);
        let ports = &model.services[&name("web")].ports;
        assert_eq!(ports[0].node_port, Some(30080));
        let allocated = ports[1].node_port.expect("allocated");
        assert!((30000..=32767).contains(&allocated) && allocated != 30080);

        let again = Model::join(vec![web(true, Some(30080))], &[], &mut alloc);
        assert_eq!(again, model);

        let cluster_ip_only = Model::join(vec![web(false, Some(30080))], &[], &mut alloc);
        assert!(
            cluster_ip_only.services[&name("web")]
                .ports
                .iter()
                .all(|p| p.node_port.is_none())
        );
    }

    /// A dual-stack service is one per family, each joined with the slices of its family;
    /// an IPv6-only one ignores a (stale) IPv4 slice.
    #[test]
    fn families_join_their_own_slices() {
        let v6 = |last: u16| Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, last);
        let v6_slice = SliceSpec {
            family: IpFamily::V6,
            ..slice(
                vec![sp("http", Protocol::Tcp, Some(8080))],
                vec![SliceEndpoint {
                    addr: v6(7).into(),
                    ..ep(0, true)
                }],
            )
        };
        let v4_slice = slice(
            vec![sp("http", Protocol::Tcp, Some(8080))],
            vec![ep(2, true)],
        );
        let slices = [v4_slice, v6_slice];
        let mut dual = web(true, Some(30080));
        dual.cluster_ip_v6 = Some(v6(0x10));
        dual.external_v6.external_ips = vec![v6(0x20)];
        let mut alloc = NodePortAllocator::new(30000..=32767);
        let model = Model::join(vec![dual.clone()], &slices, &mut alloc);
        let v4 = &model.services[&name("web")];
        assert_eq!(v4.cluster_ip, Ipv4Addr::new(10, 96, 0, 10));
        let v4_addrs: Vec<Ipv4Addr> = v4.ports[0].endpoints.iter().map(|e| e.addr).collect();
        assert_eq!(v4_addrs, [Ipv4Addr::new(10, 244, 1, 2)]);
        let v6_service = &model.services_v6[&name("web")];
        assert_eq!(v6_service.cluster_ip, v6(0x10));
        let v6_http = &v6_service.ports[0];
        assert_eq!(
            v6_http.node_port,
            Some(30080),
            "one nodePort for both families"
        );
        let v6_addrs: Vec<Ipv6Addr> = v6_http.endpoints.iter().map(|e| e.addr).collect();
        assert_eq!(v6_addrs, [v6(7)]);
        // Two ports, each on the ClusterIP, the externalIP and the node (dns's nodePort
        // allocated).
        assert_eq!(model.ipv6_frontends(1), 2 * 3);
        assert_eq!(model.ipv6_frontends(0), 2 * 2);

        let mut v6_only = dual;
        v6_only.cluster_ip = None;
        let model = Model::join(vec![v6_only], &slices, &mut alloc);
        assert!(model.services.is_empty(), "no IPv4 side");
        let v6_addrs: Vec<Ipv6Addr> = model.services_v6[&name("web")].ports[0]
            .endpoints
            .iter()
            .map(|e| e.addr)
            .collect();
        assert_eq!(v6_addrs, [v6(7)], "the IPv4 slice is ignored");
    }
}
