//! The one reconciler: model → desired map contents → the difference against what the maps hold
//! → writes, in an order where no packet sees a half-written service.
pub mod coalesce;
pub mod maglev;
pub mod sync_status;
pub mod udp_flush;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::Ipv6Net;

use lb_common::{
    Backend, Backend6, BackendKey, FRONTEND_F_LOCAL, FRONTEND_F_MASQUERADE,
    FRONTEND_F_PRESERVE_SOURCE, FRONTEND_F_SOURCE_RANGES, Frontend, FrontendKey, FrontendKey6,
    FrontendOrigin, KIND_CLUSTER_IP, KIND_EXTERNAL_IP, KIND_LOAD_BALANCER, KIND_NODE_PORT,
    LOCAL_SLOT, ServiceStatus, ipv4_be,
};
use tracing::{debug, error, warn};

use crate::compact::compact;
use crate::error_chain;
use crate::maps::contents::{
    BackendValue, Digest, Digests, FamilyContents, MapContents, MapContents6, MapFamily, Records,
    SourceRange,
};
use crate::maps::stats_slots::{FamilyBackend, PortEndpoint, StatsReset, StatsSlots};
use crate::maps::writer::{MapWriter, WriteFailure};
use crate::model::{
    Endpoint, Model, PortName, Protocol, Scheduler, Service, ServiceName, ServicePort,
    ServicePortId,
};
use crate::reconcile::udp_flush::UdpEndpoint;

/// Failed map writes of one sync logged as errors; the rest at debug level.
const LOGGED_FAILURES_PER_SYNC: usize = 10;

/// What one sync did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub frontends_added: usize,
    pub frontends_updated: usize,
    pub frontends_removed: usize,
    pub backends_added: usize,
    pub backends_updated: usize,
    pub backends_removed: usize,
    pub source_ranges_added: usize,
    pub source_ranges_removed: usize,
    /// Map writes that failed in this sync; they are retried by the next one.
    pub failed: usize,
    /// The services whose map writes failed in this sync, of those in the model (a failure to
    /// remove what a deleted service left, or a ClusterIP's catch-all, names none).
    pub failed_services: BTreeMap<ServiceName, WriteFailure>,
    /// Those failures by service id, until they are named.
    failed_ids: BTreeMap<u32, WriteFailure>,
    /// Writes refused for want of room, by operation and error (which names the flag that
    /// sizes the map): one error line each per sync, not one per entry.
    full: BTreeMap<(String, String), usize>,
    /// The endpoints of UDP service ports that this sync removed from the maps: their
    /// conntrack entries are to be flushed.
    pub removed_udp: BTreeSet<UdpEndpoint>,
    /// Endpoints of the services synced that have no counter slot (all in use): their traffic
    /// is not counted.
    pub uncounted: usize,
}

impl SyncReport {
    pub fn changed(&self) -> bool {
        self.frontends_added
            + self.frontends_updated
            + self.frontends_removed
            + self.backends_added
            + self.backends_updated
            + self.backends_removed
            + self.source_ranges_added
            + self.source_ranges_removed
            > 0
    }
}

/// What each service put in the maps at the last sync, so that the next one recomputes only the
/// services that changed. A sync without failures leaves the maps holding exactly the desired
/// contents, so these are the keys of `written`.
#[derive(Debug)]
struct LastSync {
    /// What every service's contents depend on besides the service.
    settings: Settings,
    services: BTreeMap<ServiceName, Contribution>,
    /// How many services have each ClusterIP catch-all (services may share a ClusterIP).
    catch_alls: BTreeMap<FrontendKey, usize>,
    /// A frontend was claimed by two services: which one has it depends on every service.
    conflicted: bool,
    /// The ports of each service's IPv6 side, whose ids a change releases as it does those of
    /// the IPv4 side's `Contribution`.
    v6_ports: BTreeMap<ServiceName, Box<[(PortName, Protocol)]>>,
}

impl LastSync {
    /// Counts a service with this ClusterIP; puts its catch-all in `desired`.
    fn add_catch_all(&mut self, cluster_ip: Ipv4Addr, desired: &mut MapContents) -> FrontendKey {
        let key = FrontendKey::any_port(ipv4_be(cluster_ip.octets()));
        *self.catch_alls.entry(key).or_default() += 1;
        desired.frontends.entry(key).or_default();
        key
    }

    /// The services whose IPv6 side has other ports than at this sync, or none any more.
    fn v6_ports_changed(&self, model: &Model) -> Vec<ServiceName> {
        let now = model
            .services_v6
            .iter()
            .filter(|(name, service)| self.v6_ports.get(*name) != Some(&port_names(*service)))
            .map(|(name, _)| name.clone());
        let gone = self
            .v6_ports
            .keys()
            .filter(|name| !model.services_v6.contains_key(*name))
            .cloned();
        now.chain(gone).collect()
    }

    /// Returns the key if no other service has it.
    fn remove_catch_all(&mut self, cluster_ip: Ipv4Addr) -> Option<FrontendKey> {
        let key = FrontendKey::any_port(ipv4_be(cluster_ip.octets()));
        let count = self.catch_alls.get_mut(&key)?;
        *count -= 1;
        if *count > 0 {
            return None;
        }
        self.catch_alls.remove(&key);
        Some(key)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Settings {
    node_port_addrs: Vec<Ipv4Addr>,
    node_name: String,
    zone: String,
    default_scheduler: Scheduler,
}

/// What the reconciler keeps of what it wrote to a family's maps: the entries a sync reads back
/// whole, the records (origins, status records) as digests, which is all a diff or an audit
/// needs of them.
pub type Written<A> = FamilyContents<A, Digests>;

/// A desired entry's value as the record of what was written holds it.
trait Recorded: Copy {
    type Record: PartialEq;
    fn record(&self) -> Self::Record;
}

impl Recorded for Frontend {
    type Record = Frontend;
    fn record(&self) -> Frontend {
        *self
    }
}

impl Recorded for Backend {
    type Record = Backend;
    fn record(&self) -> Backend {
        *self
    }
}

impl Recorded for Backend6 {
    type Record = Backend6;
    fn record(&self) -> Backend6 {
        *self
    }
}

impl Recorded for FrontendOrigin {
    type Record = Digest;
    fn record(&self) -> Digest {
        Digests::origin(self)
    }
}

impl Recorded for ServiceStatus {
    type Record = Digest;
    fn record(&self) -> Digest {
        Digests::status(self)
    }
}

/// What one service put into the desired contents of a family. Kept for every Service between
/// syncs: slices sized to what they hold (a `Vec` pushed to holds four of its first entry).
#[derive(Debug)]
struct Contribution<A: MapFamily = Ipv4Addr> {
    cluster_ip: A,
    /// Its ports' names and protocols.
    ports: Box<[(PortName, Protocol)]>,
    frontends: Box<[A::FrontendKey]>,
    /// Its ports' backend lists.
    lists: Box<[Lists]>,
    source_ranges: Box<[SourceRange<A::Net>]>,
}

/// What a service's ports put into the desired contents, while they are put.
struct PortEntries<A: MapFamily> {
    frontends: Vec<A::FrontendKey>,
    lists: Vec<Lists>,
    source_ranges: Vec<SourceRange<A::Net>>,
}

/// A service port's backend lists: slots `0..cluster` and `LOCAL_SLOT..LOCAL_SLOT + local` of
/// `service_id`. Counts rather than keys: a list is ten slots or a Maglev table of thousands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Lists {
    service_id: u32,
    cluster: u32,
    local: u32,
}

impl Lists {
    /// The keys of its slots, in order.
    fn keys(self) -> impl Iterator<Item = BackendKey> {
        let Lists {
            service_id,
            cluster,
            local,
        } = self;
        (0..cluster)
            .chain((0..local).map(|slot| LOCAL_SLOT + slot))
            .map(move |slot| BackendKey { service_id, slot })
    }
}

/// What the reconciler keeps of one family.
trait Side: MapFamily {
    /// The node addresses of this family NodePorts are served on.
    fn node_port_addrs(reconciler: &Reconciler) -> &[Self];
    /// What this family's maps hold, as far as the reconciler knows.
    fn written(reconciler: &Reconciler) -> &Written<Self>;
    /// `backend` with its counter slot of service port `service_id`.
    fn counted(stats: &mut StatsSlots, service_id: u32, backend: Self::Backend) -> Self::Backend;
}

impl Side for Ipv4Addr {
    fn node_port_addrs(reconciler: &Reconciler) -> &[Self] {
        &reconciler.node_port_addrs
    }
    fn written(reconciler: &Reconciler) -> &Written<Ipv4Addr> {
        &reconciler.written
    }
    fn counted(stats: &mut StatsSlots, service_id: u32, backend: Backend) -> Backend {
        Backend {
            stats_slot: stats.slot(PortEndpoint::new(service_id, &backend)),
            ..backend
        }
    }
}

impl Side for Ipv6Addr {
    fn node_port_addrs(reconciler: &Reconciler) -> &[Self] {
        &reconciler.node_port_addrs6
    }
    fn written(reconciler: &Reconciler) -> &Written<Ipv6Addr> {
        &reconciler.written6
    }
    fn counted(stats: &mut StatsSlots, service_id: u32, backend: Backend6) -> Backend6 {
        Backend6 {
            stats_slot: stats.slot(PortEndpoint::new(service_id, &backend)),
            ..backend
        }
    }
}

/// The keys a sync diffs.
#[derive(Debug, Default)]
struct Scope {
    frontends: BTreeSet<FrontendKey>,
    backends: BTreeSet<BackendKey>,
    source_ranges: BTreeSet<SourceRange>,
    /// The ports of the services that changed, by service id, and the ids they had before:
    /// their status records.
    ports: BTreeMap<u32, ServicePortId>,
    old_ids: BTreeSet<u32>,
}

impl Scope {
    fn add(&mut self, contribution: &Contribution) {
        self.frontends.extend(&contribution.frontends);
        let lists = contribution.lists.iter();
        self.backends.extend(lists.flat_map(|lists| lists.keys()));
        self.source_ranges.extend(&contribution.source_ranges);
    }
}

/// The keys of one map that a sync diffs: all of them (`None`), or the changed services' keys.
#[derive(Clone, Copy)]
struct Keys<'a, K>(Option<&'a BTreeSet<K>>);

/// The keys of each map that a sync diffs, from its scope (None: every key).
struct DiffKeys<'a> {
    frontends: Keys<'a, FrontendKey>,
    backends: Keys<'a, BackendKey>,
    source_ranges: Keys<'a, SourceRange>,
    /// The service ids whose status records may go.
    status_ids: Keys<'a, u32>,
}

impl<'a> DiffKeys<'a> {
    fn of(scope: Option<&'a Scope>) -> Self {
        DiffKeys {
            frontends: Keys(scope.map(|s| &s.frontends)),
            backends: Keys(scope.map(|s| &s.backends)),
            source_ranges: Keys(scope.map(|s| &s.source_ranges)),
            status_ids: Keys(scope.map(|s| &s.old_ids)),
        }
    }
}

/// A map's or a set's keys.
trait KeySet<K> {
    fn holds(&self, key: &K) -> bool;
    fn all<'s>(&'s self) -> Box<dyn Iterator<Item = &'s K> + 's>
    where
        K: 's;
}

impl<K: Ord, V> KeySet<K> for BTreeMap<K, V> {
    fn holds(&self, key: &K) -> bool {
        self.contains_key(key)
    }
    fn all<'s>(&'s self) -> Box<dyn Iterator<Item = &'s K> + 's>
    where
        K: 's,
    {
        Box::new(self.keys())
    }
}

impl<K: Ord> KeySet<K> for BTreeSet<K> {
    fn holds(&self, key: &K) -> bool {
        self.contains(key)
    }
    fn all<'s>(&'s self) -> Box<dyn Iterator<Item = &'s K> + 's>
    where
        K: 's,
    {
        Box::new(self.iter())
    }
}

impl<'a, K: Ord + Copy> Keys<'a, K> {
    /// The entries of `desired` among these keys that `written` does not hold as they are.
    fn changed<V: Recorded>(
        self,
        desired: &BTreeMap<K, V>,
        written: &BTreeMap<K, V::Record>,
    ) -> Vec<(K, V)> {
        match self.0 {
            None => changed(desired, written),
            Some(keys) => changed_in(keys, desired, written),
        }
    }

    /// These keys that `held` holds, in order.
    fn held_by<'b>(self, held: &'b impl KeySet<K>) -> Box<dyn Iterator<Item = &'b K> + 'b>
    where
        'a: 'b,
    {
        match self.0 {
            None => held.all(),
            Some(keys) => Box::new(keys.iter().filter(|k| held.holds(k))),
        }
    }
}

pub struct Reconciler {
    /// The node addresses NodePorts are served on.
    node_port_addrs: Vec<Ipv4Addr>,
    /// The node's IPv6 addresses NodePorts are served on.
    node_port_addrs6: Vec<Ipv6Addr>,
    /// This node's name: endpoints with this nodeName are local (traffic policy Local).
    node_name: String,
    /// This node's topology.kubernetes.io/zone, for topology hints; "" ignores them.
    zone: String,
    /// The scheduler of services without the annotation.
    default_scheduler: Scheduler,
    /// Service id of every service port of the last sync.
    ids: BTreeMap<ServicePortId, u32>,
    /// Never reused while the agent runs: a freed id may still sit in conntrack entries.
    next_id: u32,
    /// Until the first sync: a service port takes the id its frontend has in the maps, so an
    /// agent restart rewrites nothing.
    adopt_ids: bool,
    /// What the maps hold, as far as we know: read back at start, then what we wrote.
    written: Written<Ipv4Addr>,
    /// The same of the IPv6 maps, which each sync computes and diffs whole.
    written6: Written<Ipv6Addr>,
    /// Failed map writes since start.
    pub failed_total: u64,
    /// What the last sync put in the maps, when the next sync may start from it.
    last: Option<LastSync>,
    /// The endpoints' counter slots.
    stats: StatsSlots,
}

impl Reconciler {
    /// `existing`: the contents of the (pinned) maps at start.
    pub fn new(node_addr: Ipv4Addr, existing: MapContents) -> Self {
        let max_id = existing.max_service_id();
        Self {
            node_port_addrs: vec![node_addr],
            node_port_addrs6: Vec::new(),
            written6: Written::default(),
            node_name: String::new(),
            zone: String::new(),
            default_scheduler: Scheduler::default(),
            ids: BTreeMap::new(),
            next_id: max_id + 1,
            adopt_ids: true,
            written: existing.recorded(),
            failed_total: 0,
            last: None,
            stats: StatsSlots::default(),
        }
    }

    /// Serves the IPv6 side of services too, with NodePorts on `node_port_addrs`; `existing`:
    /// the contents of the (pinned) IPv6 maps at start, whose service ids are the same space as
    /// IPv4's.
    pub fn with_ipv6(mut self, node_port_addrs: Vec<Ipv6Addr>, existing: MapContents6) -> Self {
        self.next_id = self.next_id.max(existing.max_service_id() + 1);
        self.node_port_addrs6 = node_port_addrs;
        self.written6 = existing.recorded();
        self
    }

    /// Counts endpoints of both families in a `BACKEND_STATS` of `capacity` slots, keeping the
    /// slots the maps read at start give them (after [`Reconciler::with_ipv6`], IPv6's too);
    /// without it none is counted.
    pub fn with_stats_slots(mut self, capacity: u32) -> Self {
        self.stats = StatsSlots::adopt(capacity, &self.written.backends, &self.written6.backends);
        self
    }

    /// Counter slots that can count an endpoint, and those in use.
    pub fn stats_slots(&self) -> (u32, usize) {
        (self.stats.capacity(), self.stats.in_use())
    }

    /// This node's name, which makes endpoints local; without it none is.
    pub fn with_node_name(mut self, node_name: String) -> Self {
        self.node_name = node_name;
        self
    }

    /// This node's zone: Cluster lists prefer the endpoints hinted for it.
    pub fn set_zone(&mut self, zone: String) {
        self.zone = zone;
    }

    /// The scheduler of services that do not choose one.
    pub fn with_default_scheduler(mut self, scheduler: Scheduler) -> Self {
        self.default_scheduler = scheduler;
        self
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// Serves NodePorts on `addrs` instead of the node address alone.
    pub fn with_node_port_addresses(mut self, addrs: Vec<Ipv4Addr>) -> Self {
        self.node_port_addrs = addrs;
        self
    }

    /// Serves NodePorts on `addrs` from the next sync on; whether that is a change.
    pub fn set_node_port_addresses(&mut self, addrs: Vec<Ipv4Addr>) -> bool {
        let changed = self.node_port_addrs != addrs;
        self.node_port_addrs = addrs;
        changed
    }

    /// Rebuilds the records of what was written and of the last sync with full nodes, after a
    /// bulk change ([`crate::compact`]).
    pub fn compact(&mut self) {
        compact(&mut self.ids);
        self.written.compact();
        self.written6.compact();
        if let Some(last) = &mut self.last {
            compact(&mut last.services);
            compact(&mut last.catch_alls);
        }
        self.stats.compact();
    }

    /// Serves IPv6 NodePorts on `addrs` from the next sync on; whether that is a change. (The
    /// IPv6 side is computed whole at each sync: nothing else to redo.)
    pub fn set_node_port_addresses6(&mut self, addrs: Vec<Ipv6Addr>) -> bool {
        let changed = self.node_port_addrs6 != addrs;
        self.node_port_addrs6 = addrs;
        changed
    }

    /// What the maps hold, as far as the reconciler knows.
    pub fn written(&self) -> &Written<Ipv4Addr> {
        &self.written
    }

    /// What the IPv6 maps hold, as far as the reconciler knows.
    pub fn written6(&self) -> &Written<Ipv6Addr> {
        &self.written6
    }

    /// kube-proxy's periodic full sync, as an audit: `actual` is what the maps hold now. Returns
    /// how many entries differ from what this reconciler wrote (changed, lost or added behind
    /// its back); if any, it takes `actual` as written and makes the next sync a full one, which
    /// repairs them.
    pub fn audit(&mut self, actual: MapContents) -> usize {
        let differences = self.written.differences(&actual);
        if differences > 0 {
            self.written = actual.recorded();
            self.last = None;
        }
        differences
    }

    /// [`Reconciler::audit`] of the IPv6 maps. The next sync repairs what differs: each one
    /// diffs the whole IPv6 side.
    pub fn audit6(&mut self, actual: MapContents6) -> usize {
        let differences = self.written6.differences(&actual);
        if differences > 0 {
            self.written6 = actual.recorded();
        }
        differences
    }

    /// The map contents for `model`, with status records of a sync without failures; gives new
    /// service ports their ids.
    pub fn desired(&mut self, model: &Model) -> MapContents {
        let mut desired = self.full(model).0;
        let desired6 = self.desired6(model);
        desired.statuses = self.statuses(model, &desired, &desired6, None, &BTreeMap::new());
        desired
    }

    /// The map contents for `model` computed whole, and what each service put there.
    fn full(&mut self, model: &Model) -> (MapContents, LastSync) {
        let mut ids = BTreeMap::new();
        let mut taken = BTreeSet::new();
        let mut fresh = Vec::new();
        // Both families' ports, IPv4's first: a dual-stack port has one id, a port of one
        // family only an id of its own in the same space.
        let v4 = model.ports().map(|(id, service, port)| {
            let key = frontend_key(service.cluster_ip, port.port, port.protocol.ipproto());
            (id, self.written.frontends.get(&key))
        });
        let v6 = model.ports_v6().map(|(id, service, port)| {
            let key =
                Ipv6Addr::frontend_key(service.cluster_ip, port.port, port.protocol.ipproto());
            (id, self.written6.frontends.get(&key))
        });
        let mut seen = BTreeSet::new();
        for (id, written) in v4.chain(v6) {
            if !seen.insert(id.clone()) {
                continue;
            }
            let adopted = written.filter(|_| self.adopt_ids).map(|f| f.service_id);
            match self.ids.get(&id).copied().or(adopted) {
                Some(sid) if taken.insert(sid) => {
                    ids.insert(id, sid);
                }
                _ => fresh.push(id),
            }
        }
        for id in fresh {
            ids.insert(id, self.next_id);
            self.next_id += 1;
        }
        self.ids = ids;

        let mut desired = MapContents::default();
        let mut last = LastSync {
            settings: self.settings(),
            services: BTreeMap::new(),
            catch_alls: BTreeMap::new(),
            conflicted: false,
            v6_ports: model
                .services_v6
                .iter()
                .map(|(name, service)| (name.clone(), port_names(service)))
                .collect(),
        };
        for (name, service) in &model.services {
            let (contribution, conflicted) = self.put_service(name, service, &mut desired);
            last.conflicted |= conflicted;
            last.services.insert(name.clone(), contribution);
        }
        // Ports a ClusterIP does not define are rejected, as by kube-proxy.
        for service in model.services.values() {
            last.add_catch_all(service.cluster_ip, &mut desired);
        }
        (desired, last)
    }

    /// Puts the map contents of service `name` into `desired`; returns what it put there, and
    /// whether a frontend was skipped as another service's.
    fn put_service<A: Side>(
        &mut self,
        name: &ServiceName,
        service: &Service<A>,
        desired: &mut FamilyContents<A>,
    ) -> (Contribution<A>, bool) {
        let mut entries = PortEntries {
            frontends: Vec::new(),
            lists: Vec::with_capacity(service.ports.len()),
            source_ranges: Vec::new(),
        };
        let mut conflicted = false;
        for port in &service.ports {
            conflicted |= self.put_port(name, service, port, desired, &mut entries);
        }
        let contribution = Contribution {
            cluster_ip: service.cluster_ip,
            ports: port_names(service),
            frontends: entries.frontends.into_boxed_slice(),
            lists: entries.lists.into_boxed_slice(),
            source_ranges: entries.source_ranges.into_boxed_slice(),
        };
        (contribution, conflicted)
    }

    /// Puts one port's backend lists, frontends and source ranges into `desired`; whether a
    /// frontend of it was taken by another service port (then skipped).
    fn put_port<A: Side>(
        &mut self,
        name: &ServiceName,
        service: &Service<A>,
        port: &ServicePort<A>,
        desired: &mut FamilyContents<A>,
        entries: &mut PortEntries<A>,
    ) -> bool {
        let id = ServicePortId {
            service: name.clone(),
            port_name: port.name.clone(),
            protocol: port.protocol,
        };
        let service_id = self.ids[&id];
        let traffic = &service.traffic;
        let external = &service.external;
        // kube-proxy applies externalTrafficPolicy to externally accessible services only.
        let external_local =
            traffic.external_local && (port.node_port.is_some() || !external.is_empty());
        let scheduler = service.scheduler.unwrap_or(self.default_scheduler);
        let maglev = scheduler == Scheduler::Maglev;
        let (cluster, local) = port.policy_endpoints(&self.node_name, &self.zone);
        let backend_count = self.list(service_id, 0, &cluster, maglev, desired);
        // The Local list is only written for a port whose traffic uses it.
        let local_count = if traffic.internal_local || external_local {
            self.list(service_id, LOCAL_SLOT, &local, maglev, desired)
        } else {
            0
        };
        entries.lists.push(Lists {
            service_id,
            cluster: backend_count,
            local: local_count,
        });
        if !external.source_ranges.is_empty() && !external.load_balancer_ips.is_empty() {
            for &net in &external.source_ranges {
                let range = SourceRange { service_id, net };
                if desired.source_ranges.insert(range) {
                    entries.source_ranges.push(range);
                }
            }
        }
        let mut conflicted = false;
        for (key, flags, kind) in self.port_frontends(service, port, external_local) {
            let value = Frontend {
                service_id,
                backend_count,
                local_count,
                flags,
                affinity_timeout_s: service.affinity_timeout_s.unwrap_or(0),
                scheduler: scheduler.datapath(),
            };
            if let Some(other) = desired.frontends.get(&key) {
                warn!(service_port = %id, addr = %A::frontend_addr(&key), port = A::frontend_port(&key), other_service_id = other.service_id, "frontend already taken by another service port: skipped");
                conflicted = true;
                continue;
            }
            desired.frontends.insert(key, value);
            let origin = FrontendOrigin::new(&name.namespace, &name.name, &port.name, kind);
            desired.origins.insert(key, origin);
            entries.frontends.push(key);
        }
        conflicted
    }

    /// The frontends of one port, with their flags and kinds: its ClusterIP, then its
    /// NodePorts, externalIPs and load balancer IPs.
    fn port_frontends<A: Side>(
        &self,
        service: &Service<A>,
        port: &ServicePort<A>,
        external_local: bool,
    ) -> Vec<(A::FrontendKey, u32, u32)> {
        let traffic = &service.traffic;
        let external = &service.external;
        let proto = port.protocol.ipproto();
        let cluster_ip_flags = if traffic.internal_local {
            FRONTEND_F_LOCAL
        } else {
            0
        };
        let mut frontends = vec![(
            A::frontend_key(service.cluster_ip, port.port, proto),
            cluster_ip_flags,
            KIND_CLUSTER_IP,
        )];
        // NodePorts, externalIPs and load balancer IPs are kube-proxy's external
        // destinations: one policy, one set of flags.
        let external_flags = if external_local {
            FRONTEND_F_LOCAL | FRONTEND_F_PRESERVE_SOURCE
        } else {
            FRONTEND_F_MASQUERADE
        };
        if let Some(node_port) = port.node_port {
            for addr in A::node_port_addrs(self) {
                frontends.push((
                    A::frontend_key(*addr, node_port, proto),
                    external_flags,
                    KIND_NODE_PORT,
                ));
            }
        }
        for addr in &external.external_ips {
            frontends.push((
                A::frontend_key(*addr, port.port, proto),
                external_flags,
                KIND_EXTERNAL_IP,
            ));
        }
        let load_balancer_flags = if external.source_ranges.is_empty() {
            external_flags
        } else {
            external_flags | FRONTEND_F_SOURCE_RANGES
        };
        for addr in &external.load_balancer_ips {
            frontends.push((
                A::frontend_key(*addr, port.port, proto),
                load_balancer_flags,
                KIND_LOAD_BALANCER,
            ));
        }
        frontends
    }

    /// Updates `last` to `model`, where only the services in `changed` differ from the last
    /// sync's; returns their desired contents and the keys they had or have, or None when the
    /// whole state must be recomputed (a frontend claimed by two services).
    fn update(
        &mut self,
        model: &Model,
        changed: &BTreeSet<ServiceName>,
        last: &mut LastSync,
    ) -> Option<(MapContents, Scope)> {
        let mut desired = MapContents::default();
        let mut scope = Scope::default();
        for name in changed {
            let mut old_ports: Vec<_> = last
                .v6_ports
                .remove(name)
                .map(Vec::from)
                .unwrap_or_default();
            if let Some(old) = last.services.remove(name) {
                if let Some(key) = last.remove_catch_all(old.cluster_ip) {
                    scope.frontends.insert(key);
                }
                old_ports.extend(old.ports.iter().cloned());
                scope.add(&old);
            }
            let mut old_ids = BTreeMap::new();
            for (port_name, protocol) in old_ports {
                let id = ServicePortId {
                    service: name.clone(),
                    port_name,
                    protocol,
                };
                if let Some(sid) = self.ids.remove(&id) {
                    scope.old_ids.insert(sid);
                    old_ids.insert(id, sid);
                }
            }
            let service = model.services.get(name);
            let service_v6 = model.services_v6.get(name);
            if let Some(service_v6) = service_v6 {
                last.v6_ports.insert(name.clone(), port_names(service_v6));
            }
            // Both families' ports, IPv4's first, as `full` gives them ids.
            let ports = service
                .map(port_names)
                .into_iter()
                .chain(service_v6.map(port_names))
                .flatten();
            for (port_name, protocol) in ports {
                let id = ServicePortId {
                    service: name.clone(),
                    port_name,
                    protocol,
                };
                if self.ids.contains_key(&id) {
                    continue;
                }
                let sid = old_ids.get(&id).copied().unwrap_or_else(|| {
                    self.next_id += 1;
                    self.next_id - 1
                });
                scope.ports.insert(sid, id.clone());
                self.ids.insert(id, sid);
            }
            let Some(service) = service else {
                continue;
            };
            let (contribution, conflicted) = self.put_service(name, service, &mut desired);
            // Another service's frontend: unchanged services are not in `desired`.
            let taken = contribution.frontends.iter().any(|key| {
                self.written
                    .frontends
                    .get(key)
                    .is_some_and(|f| !scope.frontends.contains(key) && f.service_id != 0)
            });
            if conflicted || taken {
                return None;
            }
            scope.add(&contribution);
            scope
                .frontends
                .insert(last.add_catch_all(service.cluster_ip, &mut desired));
            last.services.insert(name.clone(), contribution);
        }
        Some((desired, scope))
    }

    fn settings(&self) -> Settings {
        Settings {
            node_port_addrs: self.node_port_addrs.clone(),
            node_name: self.node_name.clone(),
            zone: self.zone.clone(),
            default_scheduler: self.default_scheduler,
        }
    }

    /// Puts the list of `service_id` at slots `base..` (0 or `LOCAL_SLOT`) into `desired`: the
    /// Maglev table of the endpoints, or the endpoints with every one that stays in the slot it
    /// has in the maps; returns its length.
    fn list<A: Side>(
        &mut self,
        service_id: u32,
        base: u32,
        endpoints: &[&Endpoint<A>],
        maglev: bool,
        desired: &mut FamilyContents<A>,
    ) -> u32 {
        let mut wanted: Vec<A::Backend> = endpoints
            .iter()
            .map(|e| A::counted(&mut self.stats, service_id, A::backend(e.addr, e.port)))
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        let first = BackendKey {
            service_id,
            slot: base,
        };
        let previous: Vec<A::Backend> = A::written(self)
            .backends
            .range(first..)
            .take_while(|(k, _)| k.service_id == service_id && k.slot & LOCAL_SLOT == base)
            .map(|(_, b)| *b)
            .collect();
        let slots = if maglev {
            maglev::table(&wanted, maglev::table_size(wanted.len(), previous.len()))
        } else {
            assign_slots(&previous, &wanted)
        };
        let count = slots.len() as u32;
        for (slot, backend) in (base..).zip(slots) {
            desired
                .backends
                .insert(BackendKey { service_id, slot }, backend);
        }
        count
    }

    /// Brings the maps to `model`. Order: new/changed backend slots and new source ranges, then
    /// frontends (whose backend_count then covers only written slots, and whose source ranges
    /// are in place before the flag that checks them), then removed frontends, then source
    /// ranges and slots no frontend uses any more. A service whose backend or source range
    /// writes failed keeps its old frontend and old slots, so it stays consistent; the next sync
    /// retries.
    ///
    /// Only the services that changed since the last sync are recomputed and diffed against the
    /// maps, unless what every service's contents depend on changed (node addresses, name,
    /// zone, default scheduler), the last sync had failed writes (to retry them) or two
    /// services claimed one frontend (the first in order keeps it).
    pub fn sync<W: MapWriter>(&mut self, model: &Model, maps: &mut W) -> SyncReport {
        self.sync_changed(model, None, maps)
    }

    /// [`Reconciler::sync`] when only the services in `changed` may differ from the last
    /// sync's model (None: any, which computes the whole state).
    pub fn sync_changed<W: MapWriter>(
        &mut self,
        model: &Model,
        changed: Option<&BTreeSet<ServiceName>>,
        maps: &mut W,
    ) -> SyncReport {
        let settings = self.settings();
        let mut last = self
            .last
            .take()
            .filter(|last| last.settings == settings && !last.conflicted);
        let partial = match (&mut last, changed) {
            (Some(last), Some(changed)) => {
                // A change of the IPv6 side alone gives or takes port ids too.
                let mut changed = changed.clone();
                changed.extend(last.v6_ports_changed(model));
                // The status record of a port counts both families' entries, and every IPv6
                // port's is written at each sync (the IPv6 side is computed whole): the
                // services with an IPv6 side are recomputed too, so that their IPv4 side is in
                // the desired contents the records are made of.
                changed.extend(model.services_v6.keys().cloned());
                self.update(model, &changed, last)
            }
            _ => None,
        };
        let (desired, last, scope) = match (last, partial) {
            (Some(last), Some((desired, scope))) => (desired, last, Some(scope)),
            _ => {
                let (desired, last) = self.full(model);
                (desired, last, None)
            }
        };
        self.adopt_ids = false;
        let udp_endpoints = |written: &Written<Ipv4Addr>| match &scope {
            None => udp_flush::udp_endpoints(written),
            Some(scope) => udp_flush::udp_endpoints_of(written, &scope.frontends),
        };
        let endpoints = |written: &Written<Ipv4Addr>| match &scope {
            None => endpoints_of(written, written.backends.keys()),
            Some(scope) => endpoints_of(written, &scope.backends),
        };
        let udp_before = udp_endpoints(&self.written);
        // The IPv6 side is diffed whole: all its UDP endpoints.
        let udp6_before = udp_flush::udp_endpoints(&self.written6);
        // The IPv6 side is diffed whole: all its endpoints.
        let endpoints6 =
            |written: &Written<Ipv6Addr>| endpoints_of(written, written.backends.keys());
        let mut endpoints_before = endpoints(&self.written);
        endpoints_before.extend(endpoints6(&self.written6));
        // Before the claims: the new slots of IPv6 endpoints are claimed with IPv4's.
        let desired6 = self.desired6(model);
        let mut report = SyncReport::default();
        // The services some of whose claims failed: their frontends keep what they had.
        let unclaimed = self.claim_slots(&mut report, maps);
        self.apply(
            &desired,
            scope.as_ref(),
            unclaimed.clone(),
            &mut report,
            maps,
        );
        let udp_after = udp_endpoints(&self.written);
        report.removed_udp = udp_before.difference(&udp_after).copied().collect();
        self.apply6(&desired6, unclaimed, &mut report, maps);
        let udp6_after = udp_flush::udp_endpoints(&self.written6);
        report
            .removed_udp
            .extend(udp6_before.difference(&udp6_after).copied());
        // The endpoints that left their service ports, and those given a slot this sync whose
        // backends could not be written.
        let mut endpoints_after = endpoints(&self.written);
        endpoints_after.extend(endpoints6(&self.written6));
        let assigned = self.stats.take_assigned();
        let releases: Vec<StatsReset> = endpoints_before
            .iter()
            .chain(&assigned)
            .filter(|e| !endpoints_after.contains(e))
            .filter_map(|e| self.stats.release(e))
            .collect();
        let failures = maps.reset_stats(&releases);
        // A slot that kept its counts is reset again when it is next claimed.
        self.failures(
            &mut report,
            "backend stats release",
            &releases,
            failures,
            |_, reset| reset.service_id,
        );
        report.uncounted = self.stats.take_uncounted();
        self.record_statuses(
            model,
            &desired,
            &desired6,
            scope.as_ref(),
            &mut report,
            maps,
        );
        self.name_failures(&mut report);
        log_full_maps(&report);
        if report.failed == 0 {
            self.last = Some(last);
        }
        report
    }

    /// Writes the difference between `desired` and the maps, for the keys in `scope` (None:
    /// every key; else `desired` holds what the keys of the scope are to hold). Inserts first
    /// (backends, source ranges, then frontends; the counter slots were claimed before),
    /// removals after, so that no packet meets a frontend whose backends are not written yet.
    /// `broken`: the services whose claims failed, whose frontends keep what they had.
    fn apply<W: MapWriter>(
        &mut self,
        desired: &MapContents,
        scope: Option<&Scope>,
        mut broken: BTreeSet<u32>,
        report: &mut SyncReport,
        maps: &mut W,
    ) {
        let keys = DiffKeys::of(scope);
        self.insert_backends(desired, &keys, &mut broken, report, maps);
        self.insert_source_ranges(desired, &keys, &mut broken, report, maps);
        self.insert_frontends(desired, &keys, &broken, report, maps);
        self.remove_frontends(desired, &keys, report, maps);
        self.remove_source_ranges(desired, &keys, report, maps);
        self.remove_backends(desired, &keys, report, maps);
    }

    /// The IPv6 maps' contents for `model`'s IPv6 side, with the service ids the last
    /// [`Reconciler::full`] or [`Reconciler::update`] gave its ports.
    fn desired6(&mut self, model: &Model) -> MapContents6 {
        let mut desired = MapContents6::default();
        for (name, service) in &model.services_v6 {
            self.put_service(name, service, &mut desired);
        }
        for service in model.services_v6.values() {
            let catch_all = Ipv6Addr::any_port(service.cluster_ip);
            desired.frontends.entry(catch_all).or_default();
        }
        desired
    }

    /// Brings the IPv6 maps to `desired`, in the order of [`Reconciler::apply`]: new
    /// backends and source ranges, origins, frontends (catch-alls last); then the frontends,
    /// origins, source ranges and slots no longer wanted. A service whose counter slot claims
    /// (`broken`), backend or source range writes failed keeps its old frontends. The IPv6 side is computed and diffed whole
    /// at each sync: few services have one yet, and a change of the IPv4 side alone writes
    /// nothing here.
    fn apply6<W: MapWriter>(
        &mut self,
        desired: &MapContents6,
        mut broken: BTreeSet<u32>,
        report: &mut SyncReport,
        maps: &mut W,
    ) {
        let backends: Vec<(BackendKey, Backend6)> =
            changed(&desired.backends, &self.written6.backends)
                .into_iter()
                .filter(|(key, _)| !broken.contains(&key.service_id))
                .collect();
        let failures = maps.insert_backends6(&backends);
        let failed = self.failures(
            report,
            "IPv6 backend insert",
            &backends,
            failures,
            |_, (key, _)| key.service_id,
        );
        broken.extend(failed.iter().map(|&i| backends[i].0.service_id));
        for (key, value) in skip_indices(&backends, &failed) {
            match self.written6.backends.insert(*key, *value) {
                Some(_) => report.backends_updated += 1,
                None => report.backends_added += 1,
            }
        }

        let missing: Vec<SourceRange<Ipv6Net>> = desired
            .source_ranges
            .difference(&self.written6.source_ranges)
            .copied()
            .collect();
        for range in missing {
            match maps.insert_source_range6(range) {
                Ok(()) => {
                    self.written6.source_ranges.insert(range);
                    report.source_ranges_added += 1;
                }
                Err(err) => {
                    let key = format!("{range:?}");
                    let op = "IPv6 source range insert";
                    self.failed(report, range.service_id, op, &key, &err);
                    broken.insert(range.service_id);
                }
            }
        }

        let service_of =
            |key: &FrontendKey6| desired.frontends.get(key).map_or(0, |f| f.service_id);
        let origins: Vec<(FrontendKey6, FrontendOrigin)> =
            changed(&desired.origins, &self.written6.origins)
                .into_iter()
                .filter(|(key, _)| !broken.contains(&service_of(key)))
                .collect();
        let failures = maps.insert_origins6(&origins);
        let failed = self.failures(
            report,
            "IPv6 frontend origin insert",
            &origins,
            failures,
            |_, (key, _)| service_of(key),
        );
        for (key, value) in skip_indices(&origins, &failed) {
            self.written6.origins.insert(*key, value.record());
        }

        let (ports, catch_alls): (Vec<_>, Vec<_>) =
            changed(&desired.frontends, &self.written6.frontends)
                .into_iter()
                .filter(|(_, value)| !broken.contains(&value.service_id))
                .partition(|(key, _)| key.port != 0);
        let frontends: Vec<(FrontendKey6, Frontend)> =
            ports.into_iter().chain(catch_alls).collect();
        let failures = maps.insert_frontends6(&frontends);
        let failed = self.failures(
            report,
            "IPv6 frontend insert",
            &frontends,
            failures,
            |_, (_, value)| value.service_id,
        );
        for (key, value) in skip_indices(&frontends, &failed) {
            match self.written6.frontends.insert(*key, *value) {
                Some(_) => report.frontends_updated += 1,
                None => report.frontends_added += 1,
            }
        }

        let stale = gone(&desired.frontends, self.written6.frontends.keys());
        let failures = maps.remove_frontends6(&stale);
        let failed = self.failures(report, "IPv6 frontend remove", &stale, failures, |_, _| 0);
        for key in skip_indices(&stale, &failed) {
            self.written6.frontends.remove(key);
            report.frontends_removed += 1;
        }
        let stale_origins: Vec<FrontendKey6> = gone(&desired.origins, self.written6.origins.keys())
            .into_iter()
            .filter(|key| !self.written6.frontends.contains_key(key))
            .collect();
        let failures = maps.remove_origins6(&stale_origins);
        let op = "IPv6 frontend origin remove";
        let failed = self.failures(report, op, &stale_origins, failures, |_, _| 0);
        for key in skip_indices(&stale_origins, &failed) {
            self.written6.origins.remove(key);
        }

        let stale_ranges: Vec<SourceRange<Ipv6Net>> = self
            .written6
            .source_ranges
            .difference(&desired.source_ranges)
            .copied()
            .collect();
        for range in stale_ranges {
            match maps.remove_source_range6(range) {
                Ok(()) => {
                    self.written6.source_ranges.remove(&range);
                    report.source_ranges_removed += 1;
                }
                Err(err) => {
                    let key = format!("{range:?}");
                    let op = "IPv6 source range remove";
                    self.failed(report, range.service_id, op, &key, &err);
                }
            }
        }

        let counted = SlotsCounted::by(self.written6.frontends.values());
        let stale: Vec<BackendKey> = self
            .written6
            .backends
            .keys()
            .filter(|k| !desired.backends.contains_key(k) && !counted.holds(k))
            .copied()
            .collect();
        let failures = maps.remove_backends6(&stale);
        let failed = self.failures(report, "IPv6 backend remove", &stale, failures, |_, key| {
            key.service_id
        });
        for key in skip_indices(&stale, &failed) {
            self.written6.backends.remove(key);
            report.backends_removed += 1;
        }
    }

    /// Claims the new counter slots, before any backend refers to them: a new connection takes
    /// its slot's owner as it finds it. Returns the services whose claims failed.
    fn claim_slots<W: MapWriter>(
        &mut self,
        report: &mut SyncReport,
        maps: &mut W,
    ) -> BTreeSet<u32> {
        let claims = self.stats.unclaimed();
        let failures = maps.reset_stats(&claims);
        let failed = self.failures(
            report,
            "backend stats claim",
            &claims,
            failures,
            |_, reset| reset.service_id,
        );
        for claim in skip_indices(&claims, &failed) {
            self.stats.claimed(claim.slot);
        }
        failed.iter().map(|&i| claims[i].service_id).collect()
    }

    /// Writes the backends that changed, but those of `broken` services; adds the services whose
    /// writes failed to `broken`.
    fn insert_backends<W: MapWriter>(
        &mut self,
        desired: &MapContents,
        keys: &DiffKeys,
        broken: &mut BTreeSet<u32>,
        report: &mut SyncReport,
        maps: &mut W,
    ) {
        let backends: Vec<(BackendKey, Backend)> = keys
            .backends
            .changed(&desired.backends, &self.written.backends)
            .into_iter()
            .filter(|(key, _)| !broken.contains(&key.service_id))
            .collect();
        let failures = maps.insert_backends(&backends);
        let failed = self.failures(
            report,
            "backend insert",
            &backends,
            failures,
            |_, (key, _)| key.service_id,
        );
        broken.extend(failed.iter().map(|&i| backends[i].0.service_id));
        for (key, value) in skip_indices(&backends, &failed) {
            match self.written.backends.insert(*key, *value) {
                Some(_) => report.backends_updated += 1,
                None => report.backends_added += 1,
            }
        }
    }

    /// Writes the source ranges the maps lack; adds the services whose writes failed to
    /// `broken`.
    fn insert_source_ranges<W: MapWriter>(
        &mut self,
        desired: &MapContents,
        keys: &DiffKeys,
        broken: &mut BTreeSet<u32>,
        report: &mut SyncReport,
        maps: &mut W,
    ) {
        let missing: Vec<SourceRange> = keys
            .source_ranges
            .held_by(&desired.source_ranges)
            .filter(|range| !self.written.source_ranges.contains(range))
            .copied()
            .collect();
        for range in missing {
            match maps.insert_source_range(range) {
                Ok(()) => {
                    self.written.source_ranges.insert(range);
                    report.source_ranges_added += 1;
                }
                Err(err) => {
                    let key = format!("{range:?}");
                    self.failed(report, range.service_id, "source range insert", &key, &err);
                    broken.insert(range.service_id);
                }
            }
        }
    }

    /// Writes the frontends that changed, but those of `broken` services, each after its
    /// origin (so that `lb services` names every frontend it shows); the catch-alls last, so
    /// that a new service's ports are not rejected while it is being written.
    fn insert_frontends<W: MapWriter>(
        &mut self,
        desired: &MapContents,
        keys: &DiffKeys,
        broken: &BTreeSet<u32>,
        report: &mut SyncReport,
        maps: &mut W,
    ) {
        let (ports, catch_alls): (Vec<_>, Vec<_>) = keys
            .frontends
            .changed(&desired.frontends, &self.written.frontends)
            .into_iter()
            .filter(|(_, value)| !broken.contains(&value.service_id))
            .partition(|(key, _)| key.port != 0);
        let frontends: Vec<(FrontendKey, Frontend)> = ports.into_iter().chain(catch_alls).collect();

        let service_of = |key: &FrontendKey| desired.frontends.get(key).map_or(0, |f| f.service_id);
        let origins: Vec<(FrontendKey, FrontendOrigin)> = keys
            .frontends
            .changed(&desired.origins, &self.written.origins)
            .into_iter()
            .filter(|(key, _)| !broken.contains(&service_of(key)))
            .collect();
        let failures = maps.insert_origins(&origins);
        let failed = self.failures(
            report,
            "frontend origin insert",
            &origins,
            failures,
            |_, (key, _)| service_of(key),
        );
        for (key, value) in skip_indices(&origins, &failed) {
            self.written.origins.insert(*key, value.record());
        }

        let failures = maps.insert_frontends(&frontends);
        let failed = self.failures(
            report,
            "frontend insert",
            &frontends,
            failures,
            |_, (_, value)| value.service_id,
        );
        for (key, value) in skip_indices(&frontends, &failed) {
            match self.written.frontends.insert(*key, *value) {
                Some(_) => report.frontends_updated += 1,
                None => report.frontends_added += 1,
            }
        }
    }

    /// Removes the frontends no longer wanted, then their origins.
    fn remove_frontends<W: MapWriter>(
        &mut self,
        desired: &MapContents,
        keys: &DiffKeys,
        report: &mut SyncReport,
        maps: &mut W,
    ) {
        let stale = gone(
            &desired.frontends,
            keys.frontends.held_by(&self.written.frontends),
        );
        let failures = maps.remove_frontends(&stale);
        let failed = self.failures(
            report,
            "frontend remove",
            &stale,
            failures,
            |written, key| written.frontends.get(key).map_or(0, |f| f.service_id),
        );
        for key in skip_indices(&stale, &failed) {
            self.written.frontends.remove(key);
            report.frontends_removed += 1;
        }

        let stale_origins: Vec<FrontendKey> = gone(
            &desired.origins,
            keys.frontends.held_by(&self.written.origins),
        )
        .into_iter()
        .filter(|key| !self.written.frontends.contains_key(key))
        .collect();
        let failures = maps.remove_origins(&stale_origins);
        let failed = self.failures(
            report,
            "frontend origin remove",
            &stale_origins,
            failures,
            |_, _| 0,
        );
        for key in skip_indices(&stale_origins, &failed) {
            self.written.origins.remove(key);
        }
    }

    /// Removes the source ranges no longer wanted. A range that is no longer wanted only
    /// narrows who is served: removed even while a frontend of its service could not be updated.
    fn remove_source_ranges<W: MapWriter>(
        &mut self,
        desired: &MapContents,
        keys: &DiffKeys,
        report: &mut SyncReport,
        maps: &mut W,
    ) {
        let stale: Vec<SourceRange> = keys
            .source_ranges
            .held_by(&self.written.source_ranges)
            .filter(|range| !desired.source_ranges.contains(range))
            .copied()
            .collect();
        for range in stale {
            match maps.remove_source_range(range) {
                Ok(()) => {
                    self.written.source_ranges.remove(&range);
                    report.source_ranges_removed += 1;
                }
                Err(err) => {
                    let key = format!("{range:?}");
                    self.failed(report, range.service_id, "source range remove", &key, &err);
                }
            }
        }
    }

    /// Removes the backends no longer wanted. A slot stays while any frontend we could not
    /// update still counts it. A service port's frontends are all in the scope when its slots
    /// are.
    fn remove_backends<W: MapWriter>(
        &mut self,
        desired: &MapContents,
        keys: &DiffKeys,
        report: &mut SyncReport,
        maps: &mut W,
    ) {
        let counted = SlotsCounted::by(
            keys.frontends
                .held_by(&self.written.frontends)
                .filter_map(|k| self.written.frontends.get(k)),
        );
        let stale: Vec<BackendKey> = keys
            .backends
            .held_by(&self.written.backends)
            .filter(|k| !desired.backends.contains_key(k) && !counted.holds(k))
            .copied()
            .collect();
        let failures = maps.remove_backends(&stale);
        let failed = self.failures(report, "backend remove", &stale, failures, |_, key| {
            key.service_id
        });
        for key in skip_indices(&stale, &failed) {
            self.written.backends.remove(key);
            report.backends_removed += 1;
        }
    }

    /// The status record of every port in `scope` (None: every port) and of every IPv6 port
    /// (the IPv6 side is computed whole at each sync), from its entries in `desired` and
    /// `desired6` and its failed writes in `failures`.
    fn statuses(
        &self,
        model: &Model,
        desired: &MapContents,
        desired6: &MapContents6,
        scope: Option<&Scope>,
        failures: &BTreeMap<u32, WriteFailure>,
    ) -> BTreeMap<u32, ServiceStatus> {
        let mut ports: BTreeMap<u32, &ServicePortId> = match scope {
            None => self.ids.iter().map(|(port, &sid)| (sid, port)).collect(),
            Some(scope) => scope.ports.iter().map(|(&sid, port)| (sid, port)).collect(),
        };
        if scope.is_some() {
            let v6 = model
                .ports_v6()
                .filter_map(|(id, _, _)| self.ids.get_key_value(&id));
            ports.extend(v6.map(|(port, &sid)| (sid, port)));
        }
        // Looked up once per port: the model is keyed by name. An IPv6-only port has no IPv4
        // ClusterIP.
        let ports: BTreeMap<u32, (&ServicePortId, Option<Ipv4Addr>)> = ports
            .into_iter()
            .filter_map(|(sid, port)| match model.services.get(&port.service) {
                Some(service) => Some((sid, (port, Some(service.cluster_ip)))),
                None => model
                    .services_v6
                    .contains_key(&port.service)
                    .then_some((sid, (port, None))),
            })
            .collect();
        let tallies = sync_status::tallies(desired, desired6, |sid| {
            let (_, ip) = ports.get(&sid)?;
            ip.map(|ip| ipv4_be(ip.octets()))
        });
        ports
            .iter()
            .map(|(&sid, &(port, cluster_ip))| {
                let tally = tallies.get(&sid).copied().unwrap_or_default();
                let record = sync_status::record(port, cluster_ip, tally, failures.get(&sid));
                (sid, record)
            })
            .collect()
    }

    /// Writes the status records of the ports in `scope` (None: every port) that changed, with
    /// the failures of this sync so far, and removes those of ports gone. Last, so that a record
    /// never says a port is in sync before its entries are written.
    fn record_statuses<W: MapWriter>(
        &mut self,
        model: &Model,
        desired: &MapContents,
        desired6: &MapContents6,
        scope: Option<&Scope>,
        report: &mut SyncReport,
        maps: &mut W,
    ) {
        let wanted = self.statuses(model, desired, desired6, scope, &report.failed_ids);
        let records = changed(&wanted, &self.written.statuses);
        let failures = maps.insert_statuses(&records);
        let failed = self.failures(report, "status insert", &records, failures, |_, r| r.0);
        for (sid, record) in skip_indices(&records, &failed) {
            self.written.statuses.insert(*sid, record.record());
        }
        let gone: Vec<u32> = DiffKeys::of(scope)
            .status_ids
            .held_by(&self.written.statuses)
            .filter(|sid| !wanted.contains_key(sid))
            .copied()
            .collect();
        let failures = maps.remove_statuses(&gone);
        let failed = self.failures(report, "status remove", &gone, failures, |_, _| 0);
        for sid in skip_indices(&gone, &failed) {
            self.written.statuses.remove(sid);
        }
    }

    /// Logs and counts the entries of `entries` that failed, each for the service id
    /// `service_id` gives it (from the entry, or what the maps hold for it); returns their
    /// indices.
    fn failures<T: std::fmt::Debug, E: std::error::Error + 'static>(
        &mut self,
        report: &mut SyncReport,
        op: &str,
        entries: &[T],
        failures: Vec<(usize, E)>,
        service_id: impl Fn(&Written<Ipv4Addr>, &T) -> u32,
    ) -> BTreeSet<usize> {
        failures
            .into_iter()
            .map(|(index, err)| {
                let entry = &entries[index];
                let id = service_id(&self.written, entry);
                self.failed(report, id, op, &format!("{entry:?}"), &err);
                index
            })
            .collect()
    }

    /// A failed write of an entry of service id `service_id` (0: of no one service).
    fn failed(
        &mut self,
        report: &mut SyncReport,
        service_id: u32,
        op: &str,
        key: &str,
        err: &(dyn std::error::Error + 'static),
    ) {
        report.failed += 1;
        self.failed_total += 1;
        let error = error_chain(err);
        // A full map fails every write after the first (500k lines for a large cluster): it is
        // said once per sync, with the count; of other failures the first few of a sync say why,
        // and its `sync done` line counts them all.
        if is_full(err) {
            *report
                .full
                .entry((op.to_owned(), error.clone()))
                .or_default() += 1;
            debug!(op, key, service_id, %error, "map write failed");
        } else if report.failed <= LOGGED_FAILURES_PER_SYNC {
            error!(op, key, service_id, %error, failed_total = self.failed_total, "map write failed");
        } else {
            debug!(op, key, service_id, %error, "map write failed");
        }
        if service_id != 0 {
            report
                .failed_ids
                .entry(service_id)
                .or_insert_with(|| WriteFailure {
                    writes: 0,
                    error: format!("{op}: {error}"),
                })
                .writes += 1;
        }
    }

    /// Names the services of the failures by id, by the service ports of the last sync.
    fn name_failures(&self, report: &mut SyncReport) {
        let by_id = std::mem::take(&mut report.failed_ids);
        if by_id.is_empty() {
            return;
        }
        for (port, service_id) in &self.ids {
            let Some(failure) = by_id.get(service_id) else {
                continue;
            };
            report
                .failed_services
                .entry(port.service.clone())
                .and_modify(|f| f.writes += failure.writes)
                .or_insert_with(|| failure.clone());
        }
    }
}

/// Whether a write failed for want of room in the map.
fn is_full(err: &(dyn std::error::Error + 'static)) -> bool {
    err.downcast_ref::<std::io::Error>()
        .is_some_and(|e| e.kind() == std::io::ErrorKind::StorageFull)
}

/// One error line per full map of the sync, with the writes it refused.
fn log_full_maps(report: &SyncReport) {
    for ((op, error), refused) in &report.full {
        error!(op, refused, %error, "map full: writes refused");
    }
}

/// The backend slots of each service port that frontends count, the Cluster and the Local list's.
struct SlotsCounted(BTreeMap<u32, (u32, u32)>);

impl SlotsCounted {
    fn by<'a>(frontends: impl Iterator<Item = &'a Frontend>) -> Self {
        let mut counted: BTreeMap<u32, (u32, u32)> = BTreeMap::new();
        for f in frontends {
            let c = counted.entry(f.service_id).or_default();
            *c = (c.0.max(f.backend_count), c.1.max(f.local_count));
        }
        SlotsCounted(counted)
    }

    /// Some frontend counts slot `key`.
    fn holds(&self, key: &BackendKey) -> bool {
        self.0
            .get(&key.service_id)
            .is_some_and(|&(cluster, local)| {
                let count = if key.slot & LOCAL_SLOT == 0 {
                    cluster
                } else {
                    local
                };
                key.slot & !LOCAL_SLOT < count
            })
    }
}

/// The names and protocols of a service's ports.
fn port_names<A: MapFamily>(service: &Service<A>) -> Box<[(PortName, Protocol)]> {
    service
        .ports
        .iter()
        .map(|p| (p.name.clone(), p.protocol))
        .collect()
}

/// The endpoints of the service ports of the slots `keys` in `contents`.
fn endpoints_of<'a, A: MapFamily, R: Records>(
    contents: &FamilyContents<A, R>,
    keys: impl IntoIterator<Item = &'a BackendKey>,
) -> BTreeSet<PortEndpoint>
where
    for<'b> &'b A::Backend: Into<FamilyBackend>,
{
    keys.into_iter()
        .filter_map(|key| {
            contents
                .backends
                .get(key)
                .map(|backend| PortEndpoint::new(key.service_id, backend))
        })
        .collect()
}

/// The entries of `desired` that `written` does not hold as they are.
fn changed<K: Ord + Copy, V: Recorded>(
    desired: &BTreeMap<K, V>,
    written: &BTreeMap<K, V::Record>,
) -> Vec<(K, V)> {
    desired
        .iter()
        .filter(|(key, value)| written.get(key) != Some(&value.record()))
        .map(|(key, value)| (*key, *value))
        .collect()
}

/// The entries of `desired` among `keys` that `written` does not hold as they are.
fn changed_in<K: Ord + Copy, V: Recorded>(
    keys: &BTreeSet<K>,
    desired: &BTreeMap<K, V>,
    written: &BTreeMap<K, V::Record>,
) -> Vec<(K, V)> {
    keys.iter()
        .filter_map(|key| desired.get(key).map(|value| (*key, *value)))
        .filter(|(key, value)| written.get(key) != Some(&value.record()))
        .collect()
}

/// The keys among `written` that `desired` does not hold.
fn gone<'a, K: Ord + Copy + 'a, V>(
    desired: &BTreeMap<K, V>,
    written: impl Iterator<Item = &'a K>,
) -> Vec<K> {
    written
        .filter(|k| !desired.contains_key(k))
        .copied()
        .collect()
}

/// `entries` but those at the indices in `skip`.
fn skip_indices<'a, T>(entries: &'a [T], skip: &'a BTreeSet<usize>) -> impl Iterator<Item = &'a T> {
    entries
        .iter()
        .enumerate()
        .filter(|(i, _)| !skip.contains(i))
        .map(|(_, entry)| entry)
}

/// The slots of `wanted` (sorted, no duplicates) given the slots `previous` held: an endpoint
/// that stays keeps its slot while the slot still exists, the others fill the holes. So an
/// endpoint's sessionAffinity clients (which remember the slot) only move with the endpoint.
fn assign_slots<B: BackendValue>(previous: &[B], wanted: &[B]) -> Vec<B> {
    // By endpoint: one that got another counter slot keeps its place.
    let mut slots: Vec<Option<B>> = previous
        .iter()
        .take(wanted.len())
        .map(|b| {
            wanted
                .binary_search_by_key(&b.endpoint(), BackendValue::endpoint)
                .ok()
                .map(|i| wanted[i])
        })
        .collect();
    slots.resize(wanted.len(), None);
    let mut placed: Vec<B> = slots.iter().flatten().copied().collect();
    placed.sort_unstable();
    let mut unplaced = wanted.iter().filter(|b| placed.binary_search(b).is_err());
    slots
        .into_iter()
        .map(|slot| {
            slot.or_else(|| unplaced.next().copied())
                .expect("as many slots as wanted backends")
        })
        .collect()
}

fn frontend_key(addr: Ipv4Addr, port: u16, proto: u8) -> FrontendKey {
    Ipv4Addr::frontend_key(addr, port, proto)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{
        Conditions, Placement, Protocol, Service, ServiceName, ServicePort, TargetPort,
    };
    use ipnet::Ipv4Net;
    use lb_common::port_be;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Op {
        InsertBackend(BackendKey, Backend),
        RemoveBackend(BackendKey),
        InsertFrontend(FrontendKey, Frontend),
        RemoveFrontend(FrontendKey),
        InsertSourceRange(SourceRange),
        RemoveSourceRange(SourceRange),
        ResetStats(u16, u32),
    }

    /// What the agent's map writer returns for a full map.
    fn full() -> std::io::Error {
        std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            "the map is full: raise --backends-max",
        )
    }

    /// Records every operation and keeps the resulting contents; `fail_backends_of` makes
    /// backend inserts of one service id fail.
    #[derive(Default)]
    struct FakeMaps {
        ops: Vec<Op>,
        contents: MapContents,
        contents6: MapContents6,
        fail_backends_of: Option<u32>,
    }

    impl MapWriter for FakeMaps {
        type Error = std::io::Error;
        fn reset_stats(&mut self, resets: &[StatsReset]) -> Vec<(usize, std::io::Error)> {
            for reset in resets {
                self.ops.push(Op::ResetStats(reset.slot, reset.owner));
            }
            Vec::new()
        }
        fn insert_backends(
            &mut self,
            entries: &[(BackendKey, Backend)],
        ) -> Vec<(usize, std::io::Error)> {
            let mut failed = Vec::new();
            for (i, &(key, value)) in entries.iter().enumerate() {
                if self.fail_backends_of == Some(key.service_id) {
                    failed.push((i, full()));
                    continue;
                }
                self.ops.push(Op::InsertBackend(key, value));
                self.contents.backends.insert(key, value);
            }
            failed
        }
        fn remove_backends(&mut self, keys: &[BackendKey]) -> Vec<(usize, std::io::Error)> {
            for &key in keys {
                self.ops.push(Op::RemoveBackend(key));
                self.contents.backends.remove(&key);
            }
            Vec::new()
        }
        fn insert_frontends(
            &mut self,
            entries: &[(FrontendKey, Frontend)],
        ) -> Vec<(usize, std::io::Error)> {
            for &(key, value) in entries {
                self.ops.push(Op::InsertFrontend(key, value));
                self.contents.frontends.insert(key, value);
            }
            Vec::new()
        }
        fn remove_frontends(&mut self, keys: &[FrontendKey]) -> Vec<(usize, std::io::Error)> {
            for &key in keys {
                self.ops.push(Op::RemoveFrontend(key));
                self.contents.frontends.remove(&key);
            }
            Vec::new()
        }
        fn insert_origins(
            &mut self,
            entries: &[(FrontendKey, FrontendOrigin)],
        ) -> Vec<(usize, std::io::Error)> {
            self.contents.origins.extend(entries.iter().copied());
            Vec::new()
        }
        fn insert_statuses(
            &mut self,
            entries: &[(u32, ServiceStatus)],
        ) -> Vec<(usize, std::io::Error)> {
            self.contents.statuses.extend(entries.iter().copied());
            Vec::new()
        }
        fn remove_statuses(&mut self, service_ids: &[u32]) -> Vec<(usize, std::io::Error)> {
            for service_id in service_ids {
                self.contents.statuses.remove(service_id);
            }
            Vec::new()
        }
        fn remove_origins(&mut self, keys: &[FrontendKey]) -> Vec<(usize, std::io::Error)> {
            for key in keys {
                self.contents.origins.remove(key);
            }
            Vec::new()
        }
        fn insert_source_range(&mut self, range: SourceRange) -> Result<(), std::io::Error> {
            self.ops.push(Op::InsertSourceRange(range));
            self.contents.source_ranges.insert(range);
            Ok(())
        }
        fn remove_source_range(&mut self, range: SourceRange) -> Result<(), std::io::Error> {
            self.ops.push(Op::RemoveSourceRange(range));
            self.contents.source_ranges.remove(&range);
            Ok(())
        }
        fn insert_backends6(
            &mut self,
            entries: &[(BackendKey, Backend6)],
        ) -> Vec<(usize, std::io::Error)> {
            let mut failed = Vec::new();
            for (i, &(key, value)) in entries.iter().enumerate() {
                if self.fail_backends_of == Some(key.service_id) {
                    failed.push((i, full()));
                    continue;
                }
                self.contents6.backends.insert(key, value);
            }
            failed
        }
        fn remove_backends6(&mut self, keys: &[BackendKey]) -> Vec<(usize, std::io::Error)> {
            for key in keys {
                self.contents6.backends.remove(key);
            }
            Vec::new()
        }
        fn insert_frontends6(
            &mut self,
            entries: &[(FrontendKey6, Frontend)],
        ) -> Vec<(usize, std::io::Error)> {
            self.contents6.frontends.extend(entries.iter().copied());
            Vec::new()
        }
        fn remove_frontends6(&mut self, keys: &[FrontendKey6]) -> Vec<(usize, std::io::Error)> {
            for key in keys {
                self.contents6.frontends.remove(key);
            }
            Vec::new()
        }
        fn insert_origins6(
            &mut self,
            entries: &[(FrontendKey6, FrontendOrigin)],
        ) -> Vec<(usize, std::io::Error)> {
            self.contents6.origins.extend(entries.iter().copied());
            Vec::new()
        }
        fn remove_origins6(&mut self, keys: &[FrontendKey6]) -> Vec<(usize, std::io::Error)> {
            for key in keys {
                self.contents6.origins.remove(key);
            }
            Vec::new()
        }
        fn insert_source_range6(
            &mut self,
            range: SourceRange<Ipv6Net>,
        ) -> Result<(), std::io::Error> {
            self.contents6.source_ranges.insert(range);
            Ok(())
        }
        fn remove_source_range6(
            &mut self,
            range: SourceRange<Ipv6Net>,
        ) -> Result<(), std::io::Error> {
            self.contents6.source_ranges.remove(&range);
            Ok(())
        }
    }

    const NODE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

    fn endpoint(last: u8, ready: bool) -> Endpoint {
        Endpoint {
            addr: Ipv4Addr::new(10, 244, 1, last),
            port: 8080,
            conditions: Conditions {
                ready,
                serving: ready,
                terminating: false,
            },
            placement: Default::default(),
        }
    }

    fn model(services: &[(&str, u8, Option<u16>, Vec<Endpoint>)]) -> Model {
        let mut m = Model::default();
        for (name, ip, node_port, endpoints) in services {
            m.services.insert(
                ServiceName {
                    namespace: "default".into(),
                    name: (*name).into(),
                },
                Service {
                    cluster_ip: Ipv4Addr::new(10, 96, 0, *ip),
                    affinity_timeout_s: None,
                    traffic: Default::default(),
                    scheduler: None,
                    external: Default::default(),
                    ports: vec![ServicePort {
                        name: "http".into(),
                        protocol: Protocol::Tcp,
                        port: 80,
                        node_port: *node_port,
                        target_port: TargetPort::Name("http".into()),
                        endpoints: endpoints.clone(),
                    }],
                },
            );
        }
        m
    }

    fn name(n: &str) -> ServiceName {
        ServiceName {
            namespace: "default".into(),
            name: n.into(),
        }
    }

    fn fk(ip: Ipv4Addr, port: u16) -> FrontendKey {
        frontend_key(ip, port, lb_common::IPPROTO_TCP)
    }

    fn backend(last: u8) -> Backend {
        Backend {
            addr: ipv4_be([10, 244, 1, last]),
            port: port_be(8080),
            stats_slot: 0,
        }
    }

    /// The first frontend of a port (not a catch-all).
    fn port_frontend(contents: &MapContents) -> Option<&Frontend> {
        contents
            .frontends
            .iter()
            .find(|(k, _)| k.port != 0)
            .map(|(_, f)| f)
    }

    #[test]
    fn node_ports_are_served_on_every_node_port_address() {
        let addrs = vec![Ipv4Addr::new(198, 51, 100, 1), Ipv4Addr::new(192, 0, 2, 1)];
        let mut r =
            Reconciler::new(NODE, MapContents::default()).with_node_port_addresses(addrs.clone());
        let model = model(&[("a", 10, Some(30080), vec![endpoint(2, true)])]);
        let desired = r.desired(&model);
        for addr in addrs {
            assert!(desired.frontends.contains_key(&fk(addr, 30080)), "{addr}");
        }
        assert_eq!(
            desired.frontends.len(),
            4,
            "ClusterIP port, catch-all, two NodePorts"
        );
    }

    /// externalIPs and load balancer IPs are frontends on the service port with the NodePort's
    /// flags; only load balancer IPs check loadBalancerSourceRanges, whose entries are written
    /// before the frontends that check them and removed after.
    #[test]
    fn external_and_load_balancer_ips_share_the_external_policy() {
        let external_ip = Ipv4Addr::new(203, 0, 113, 10);
        let lb_ip = Ipv4Addr::new(203, 0, 113, 20);
        let range: Ipv4Net = "198.51.100.0/24".parse().unwrap();
        let mut m = model(&[("web", 10, Some(30080), vec![endpoint(2, true)])]);
        let web = m.services.values_mut().next().expect("web");
        web.external = crate::model::ExternalAddresses {
            external_ips: vec![external_ip],
            load_balancer_ips: vec![lb_ip],
            source_ranges: vec![range],
        };
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        let report = r.sync(&m, &mut maps);
        let contents = &maps.contents;
        assert_eq!(
            contents.frontends[&fk(external_ip, 80)].flags,
            FRONTEND_F_MASQUERADE
        );
        assert_eq!(
            contents.frontends[&fk(lb_ip, 80)].flags,
            FRONTEND_F_MASQUERADE | FRONTEND_F_SOURCE_RANGES
        );
        assert_eq!(
            contents.frontends[&fk(NODE, 30080)].flags,
            FRONTEND_F_MASQUERADE
        );
        let allowed = SourceRange {
            service_id: 1,
            net: range,
        };
        assert_eq!(contents.source_ranges, BTreeSet::from([allowed]));
        assert_eq!(report.source_ranges_added, 1);
        let position = |wanted: &Op| maps.ops.iter().position(|op| op == wanted);
        let range_at = position(&Op::InsertSourceRange(allowed)).expect("range written");
        let lb_at = maps
            .ops
            .iter()
            .position(|op| matches!(op, Op::InsertFrontend(k, _) if *k == fk(lb_ip, 80)))
            .expect("LB frontend written");
        assert!(range_at < lb_at, "{:?}", maps.ops);

        let web = m.services.values_mut().next().expect("web");
        web.traffic.external_local = true;
        web.external.source_ranges.clear();
        maps.ops.clear();
        let report = r.sync(&m, &mut maps);
        let local = FRONTEND_F_LOCAL | FRONTEND_F_PRESERVE_SOURCE;
        for key in [fk(external_ip, 80), fk(lb_ip, 80), fk(NODE, 30080)] {
            assert_eq!(maps.contents.frontends[&key].flags, local, "{key:?}");
        }
        assert_eq!(maps.contents.frontends[&fk(lb_ip, 80)].local_count, 0);
        assert!(maps.contents.source_ranges.is_empty());
        assert_eq!(report.source_ranges_removed, 1);
        assert_eq!(maps.ops.last(), Some(&Op::RemoveSourceRange(allowed)));
        assert_eq!(maps.contents.recorded(), r.written);
    }

    /// A ClusterIP service with externalIPs is externally accessible: externalTrafficPolicy
    /// Local applies to them.
    #[test]
    fn external_ips_of_a_cluster_ip_service_honour_external_local() {
        let external_ip = Ipv4Addr::new(203, 0, 113, 10);
        let local_endpoint = Endpoint {
            placement: Placement::new(Some("me"), Default::default()),
            ..endpoint(2, true)
        };
        let mut m = model(&[("web", 10, None, vec![local_endpoint, endpoint(3, true)])]);
        let web = m.services.values_mut().next().expect("web");
        web.traffic.external_local = true;
        web.external.external_ips = vec![external_ip];
        let mut r = Reconciler::new(NODE, MapContents::default()).with_node_name("me".into());
        let desired = r.desired(&m);
        let frontend = desired.frontends[&fk(external_ip, 80)];
        assert_eq!(
            frontend.flags,
            FRONTEND_F_LOCAL | FRONTEND_F_PRESERVE_SOURCE
        );
        assert_eq!((frontend.backend_count, frontend.local_count), (2, 1));
        assert_eq!(
            desired.frontends[&fk(Ipv4Addr::new(10, 96, 0, 10), 80)].flags,
            0
        );
    }

    #[test]
    fn catch_all_rejects_undefined_ports_of_each_cluster_ip_once() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let desired = r.desired(&model(&[
            ("a", 10, Some(30080), vec![endpoint(2, true)]),
            ("b", 11, None, vec![]),
        ]));
        for ip in [10, 11] {
            let key = FrontendKey::any_port(ipv4_be([10, 96, 0, ip]));
            assert_eq!(desired.frontends.get(&key), Some(&Frontend::default()));
        }
        assert_eq!(
            desired.frontends.keys().filter(|k| k.port == 0).count(),
            2,
            "no catch-all for the node address"
        );
    }

    /// A sync after a change writes only what the changed service needs, and leaves the maps
    /// as a sync computed whole would, across additions, removals, a ClusterIP shared by two
    /// services and a frontend claimed twice.
    #[test]
    fn a_change_writes_only_the_changed_service_and_matches_a_whole_sync() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        let mut m = model(&[
            ("a", 10, None, vec![endpoint(2, true)]),
            ("b", 11, Some(30080), vec![endpoint(3, true)]),
            ("c", 12, None, vec![endpoint(4, true)]),
        ]);
        let check = |r: &mut Reconciler, maps: &FakeMaps, m: &Model| {
            assert_eq!(&maps.contents.recorded(), r.written());
            let whole = r.desired(m);
            assert_eq!(r.written(), &whole.recorded());
        };
        r.sync(&m, &mut maps);
        check(&mut r, &maps, &m);
        let changed = |names: &[&str]| names.iter().map(|n| name(n)).collect::<BTreeSet<_>>();

        // One endpoint more for a: its new slot, then its frontend with the new count.
        maps.ops.clear();
        let a = name("a");
        m.services.get_mut(&a).unwrap().ports[0]
            .endpoints
            .push(endpoint(5, true));
        let report = r.sync_changed(&m, Some(&changed(&["a"])), &mut maps);
        let a_id = r
            .ids
            .iter()
            .find(|(id, _)| id.service == a)
            .map(|(_, sid)| *sid);
        let a_id = a_id.expect("a has an id");
        assert_eq!(
            maps.ops,
            [
                Op::InsertBackend(
                    BackendKey {
                        service_id: a_id,
                        slot: 1
                    },
                    backend(5)
                ),
                Op::InsertFrontend(
                    fk(Ipv4Addr::new(10, 96, 0, 10), 80),
                    Frontend {
                        service_id: a_id,
                        backend_count: 2,
                        ..Frontend::default()
                    }
                ),
            ]
        );
        assert_eq!((report.backends_added, report.frontends_updated), (1, 1));
        check(&mut r, &maps, &m);

        // b goes, d comes with c's ClusterIP (another port), then c goes: the catch-all stays
        // while d has it.
        m.services.remove(&name("b"));
        let mut d = m.services[&name("c")].clone();
        d.ports[0].port = 8080;
        m.services.insert(name("d"), d);
        r.sync_changed(&m, Some(&changed(&["b", "d"])), &mut maps);
        check(&mut r, &maps, &m);
        m.services.remove(&name("c"));
        r.sync_changed(&m, Some(&changed(&["c"])), &mut maps);
        check(&mut r, &maps, &m);
        assert!(
            maps.contents
                .frontends
                .contains_key(&FrontendKey::any_port(ipv4_be([10, 96, 0, 12])))
        );

        // e claims d's frontend: d, first in order, keeps it; once e moves, both are served.
        let mut e = m.services[&name("d")].clone();
        e.ports[0].endpoints = vec![endpoint(9, true)];
        m.services.insert(name("e"), e);
        r.sync_changed(&m, Some(&changed(&["e"])), &mut maps);
        check(&mut r, &maps, &m);
        let d_frontend = maps.contents.frontends[&fk(Ipv4Addr::new(10, 96, 0, 12), 8080)];
        let d_id = r
            .ids
            .iter()
            .find(|(id, _)| id.service == name("d"))
            .map(|(_, sid)| *sid);
        assert_eq!(Some(d_frontend.service_id), d_id);
        m.services.get_mut(&name("e")).unwrap().cluster_ip = Ipv4Addr::new(10, 96, 0, 13);
        r.sync_changed(&m, Some(&changed(&["e"])), &mut maps);
        check(&mut r, &maps, &m);
        assert!(
            maps.contents
                .frontends
                .contains_key(&fk(Ipv4Addr::new(10, 96, 0, 13), 8080))
        );
    }

    /// A write that failed is retried by the next sync, though nothing changed.
    #[test]
    fn failed_writes_are_retried_by_the_next_sync() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        let mut m = model(&[("a", 10, None, vec![endpoint(2, true)])]);
        r.sync(&m, &mut maps);
        let a_id = r.ids.values().copied().next().expect("a has an id");
        m.services.get_mut(&name("a")).unwrap().ports[0]
            .endpoints
            .push(endpoint(3, true));
        maps.fail_backends_of = Some(a_id);
        let a = BTreeSet::from([name("a")]);
        assert!(r.sync_changed(&m, Some(&a), &mut maps).failed > 0);
        maps.fail_backends_of = None;
        let report = r.sync_changed(&m, Some(&BTreeSet::new()), &mut maps);
        assert_eq!((report.failed, report.backends_added), (0, 1));
        assert_eq!(&maps.contents.recorded(), r.written());
        let whole = r.desired(&m);
        assert_eq!(r.written(), &whole.recorded());
    }

    #[test]
    fn endpoints_that_stay_keep_their_slots() {
        let b = |last| backend(last);
        assert_eq!(assign_slots(&[], &[b(2), b(3)]), [b(2), b(3)]);
        // 3 leaves: 4 moves into its hole, 2 stays.
        assert_eq!(
            assign_slots(&[b(2), b(3), b(4)], &[b(2), b(4)]),
            [b(2), b(4)]
        );
        // 5 joins: everyone stays, 5 takes the new slot.
        assert_eq!(
            assign_slots(&[b(4), b(2)], &[b(2), b(4), b(5)]),
            [b(4), b(2), b(5)]
        );
        // 2 leaves and 1 joins: 1 takes 2's slot.
        assert_eq!(assign_slots(&[b(2), b(4)], &[b(1), b(4)]), [b(1), b(4)]);
        assert!(assign_slots(&[b(2)], &[]).is_empty());
    }

    #[test]
    fn session_affinity_timeout_goes_to_every_frontend_of_the_service() {
        let mut m = model(&[("web", 10, Some(30080), vec![endpoint(2, true)])]);
        for service in m.services.values_mut() {
            service.affinity_timeout_s = Some(10800);
        }
        let mut r = Reconciler::new(NODE, MapContents::default());
        let desired = r.desired(&m);
        let ports: Vec<_> = desired
            .frontends
            .iter()
            .filter(|(k, _)| k.port != 0)
            .collect();
        assert_eq!(ports.len(), 2);
        assert!(ports.iter().all(|(_, f)| f.affinity_timeout_s == 10800));
    }

    #[test]
    fn traffic_policy_local_gets_a_list_of_this_nodes_endpoints() {
        let on = |last, node: &str| Endpoint {
            placement: Placement::new(Some(node), Default::default()),
            ..endpoint(last, true)
        };
        let mut m = model(&[(
            "web",
            10,
            Some(30080),
            vec![on(2, "me"), on(3, "other"), on(4, "other")],
        )]);
        let mut r = Reconciler::new(NODE, MapContents::default()).with_node_name("me".into());
        let plain = r.desired(&m);
        assert!(plain.backends.keys().all(|k| k.slot & LOCAL_SLOT == 0));
        assert_eq!(
            plain.frontends[&fk(NODE, 30080)].flags,
            FRONTEND_F_MASQUERADE
        );

        for service in m.services.values_mut() {
            service.traffic.external_local = true;
        }
        let local = r.desired(&m);
        let node_port = local.frontends[&fk(NODE, 30080)];
        assert_eq!(
            node_port.flags,
            FRONTEND_F_LOCAL | FRONTEND_F_PRESERVE_SOURCE
        );
        assert_eq!((node_port.backend_count, node_port.local_count), (3, 1));
        let local_slot = BackendKey {
            service_id: 1,
            slot: LOCAL_SLOT,
        };
        assert_eq!(local.backends[&local_slot], backend(2));
        let cluster_ip = local.frontends[&fk(Ipv4Addr::new(10, 96, 0, 10), 80)];
        assert_eq!(cluster_ip.flags, 0, "eTP does not change the ClusterIP");

        for service in m.services.values_mut() {
            service.traffic = crate::model::TrafficPolicies {
                internal_local: true,
                ..Default::default()
            };
        }
        let internal = r.desired(&m);
        let cluster_ip = internal.frontends[&fk(Ipv4Addr::new(10, 96, 0, 10), 80)];
        assert_eq!(cluster_ip.flags, FRONTEND_F_LOCAL);
        assert_eq!(cluster_ip.local_count, 1);
        assert_eq!(
            internal.frontends[&fk(NODE, 30080)].flags,
            FRONTEND_F_MASQUERADE
        );

        // Local slots are kept while a frontend that could not be updated still counts them.
        let mut maps = FakeMaps::default();
        r.sync(&m, &mut maps);
        let report = r.sync(&model(&[("web", 10, Some(30080), vec![])]), &mut maps);
        assert_eq!(report.failed, 0);
        assert!(maps.contents.backends.is_empty());
    }

    #[test]
    fn schedulers_from_annotation_or_default_and_maglev_tables() {
        let mut m = model(&[
            ("a", 10, None, vec![endpoint(2, true), endpoint(3, true)]),
            ("b", 11, None, vec![endpoint(4, true)]),
        ]);
        m.services.values_mut().next().expect("a").scheduler = Some(Scheduler::Maglev);
        let mut r =
            Reconciler::new(NODE, MapContents::default()).with_default_scheduler(Scheduler::Rr);
        let desired = r.desired(&m);
        let a = desired.frontends[&fk(Ipv4Addr::new(10, 96, 0, 10), 80)];
        let b = desired.frontends[&fk(Ipv4Addr::new(10, 96, 0, 11), 80)];
        assert_eq!(a.scheduler, lb_common::SCHED_FLOW_HASH);
        assert_eq!(a.backend_count, 211, "the smallest prime >= 200");
        let table: Vec<Backend> = (0..a.backend_count)
            .map(|slot| {
                desired.backends[&BackendKey {
                    service_id: a.service_id,
                    slot,
                }]
            })
            .collect();
        assert_eq!(table, maglev::table(&[backend(2), backend(3)], 211));
        assert_eq!(
            (b.scheduler, b.backend_count),
            (lb_common::SCHED_ROUND_ROBIN, 1)
        );
    }

    #[test]
    fn first_sync_writes_backends_then_frontends() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        let m = model(&[(
            "web",
            10,
            Some(30080),
            vec![endpoint(2, true), endpoint(3, true), endpoint(9, false)],
        )]);
        let report = r.sync(&m, &mut maps);
        let cluster = fk(Ipv4Addr::new(10, 96, 0, 10), 80);
        let node = fk(NODE, 30080);
        let fe = |flags| Frontend {
            service_id: 1,
            backend_count: 2,
            local_count: 0,
            flags,
            affinity_timeout_s: 0,
            scheduler: 0,
        };
        assert_eq!(
            maps.ops[..2],
            [
                Op::InsertBackend(
                    BackendKey {
                        service_id: 1,
                        slot: 0
                    },
                    backend(2)
                ),
                Op::InsertBackend(
                    BackendKey {
                        service_id: 1,
                        slot: 1
                    },
                    backend(3)
                ),
            ]
        );
        let expected: BTreeMap<_, _> =
            BTreeMap::from([(cluster, fe(0)), (node, fe(FRONTEND_F_MASQUERADE))]);
        let mut expected: Vec<_> = expected
            .into_iter()
            .map(|(k, v)| Op::InsertFrontend(k, v))
            .collect();
        // The ClusterIP's catch-all (rejecting other ports) comes after the ports.
        expected.push(Op::InsertFrontend(
            FrontendKey::any_port(cluster.addr),
            Frontend::default(),
        ));
        assert_eq!(maps.ops[2..], expected);
        assert_eq!(report.backends_added, 2);
        assert_eq!(report.frontends_added, 3);

        let again = r.sync(&m, &mut maps);
        assert!(!again.changed());
        assert_eq!(maps.ops.len(), 5);
    }

    #[test]
    fn counter_slots_are_claimed_before_their_backends_released_after_and_kept_on_restart() {
        // Slots 1 and 2.
        let mut r = Reconciler::new(NODE, MapContents::default()).with_stats_slots(3);
        let mut maps = FakeMaps::default();
        let owner = |last| PortEndpoint::new(1, &backend(last)).owner();
        let counted = |last, stats_slot| Backend {
            stats_slot,
            ..backend(last)
        };
        let three = model(&[(
            "web",
            10,
            None,
            vec![endpoint(2, true), endpoint(3, true), endpoint(4, true)],
        )]);
        let report = r.sync(&three, &mut maps);
        assert_eq!(report.uncounted, 1, "two slots for three endpoints");
        assert_eq!(
            maps.ops[..2],
            [Op::ResetStats(1, owner(2)), Op::ResetStats(2, owner(3))],
            "claimed first: {:?}",
            maps.ops
        );
        let slots: Vec<Backend> = maps.contents.backends.values().copied().collect();
        assert_eq!(slots, [counted(2, 1), counted(3, 2), counted(4, 0)]);

        // Endpoint 3 leaves: its slot is reset once its backend is gone.
        maps.ops.clear();
        let two = model(&[("web", 10, None, vec![endpoint(2, true), endpoint(4, true)])]);
        let report = r.sync(&two, &mut maps);
        assert_eq!(report.uncounted, 1, "the slot is free only after the sync");
        assert_eq!(
            maps.ops.last(),
            Some(&Op::ResetStats(2, 0)),
            "{:?}",
            maps.ops
        );
        // The next sync gives it to endpoint 4.
        maps.ops.clear();
        let report = r.sync(&two, &mut maps);
        assert_eq!(report.uncounted, 0);
        assert_eq!(
            maps.ops,
            [
                Op::ResetStats(2, owner(4)),
                Op::InsertBackend(
                    BackendKey {
                        service_id: 1,
                        slot: 1
                    },
                    counted(4, 2)
                )
            ]
        );
        assert_eq!(r.stats_slots(), (2, 2));

        // A restarted agent keeps every slot: it writes nothing.
        let mut r = Reconciler::new(NODE, maps.contents.clone()).with_stats_slots(3);
        maps.ops.clear();
        let report = r.sync(&two, &mut maps);
        assert!(maps.ops.is_empty(), "{:?}", maps.ops);
        assert!(!report.changed());
        assert_eq!(r.stats_slots(), (2, 2));
    }

    #[test]
    fn shrinking_updates_frontend_before_deleting_slots() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        r.sync(
            &model(&[(
                "web",
                10,
                None,
                vec![endpoint(2, true), endpoint(3, true), endpoint(4, true)],
            )]),
            &mut maps,
        );
        maps.ops.clear();
        let report = r.sync(
            &model(&[("web", 10, None, vec![endpoint(2, true), endpoint(4, true)])]),
            &mut maps,
        );
        let cluster = fk(Ipv4Addr::new(10, 96, 0, 10), 80);
        assert_eq!(
            maps.ops,
            vec![
                Op::InsertBackend(
                    BackendKey {
                        service_id: 1,
                        slot: 1
                    },
                    backend(4)
                ),
                Op::InsertFrontend(
                    cluster,
                    Frontend {
                        service_id: 1,
                        backend_count: 2,
                        local_count: 0,
                        flags: 0,
                        affinity_timeout_s: 0,
                        scheduler: 0,
                    }
                ),
                Op::RemoveBackend(BackendKey {
                    service_id: 1,
                    slot: 2
                }),
            ]
        );
        assert_eq!(
            report,
            SyncReport {
                backends_updated: 1,
                frontends_updated: 1,
                backends_removed: 1,
                ..Default::default()
            }
        );
    }

    #[test]
    fn removed_service_deletes_frontends_then_backends_and_ids_are_not_reused() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        r.sync(
            &model(&[
                ("a", 10, Some(30080), vec![endpoint(2, true)]),
                ("b", 11, None, vec![endpoint(3, true)]),
            ]),
            &mut maps,
        );
        maps.ops.clear();
        r.sync(
            &model(&[("b", 11, None, vec![endpoint(3, true)])]),
            &mut maps,
        );
        let kinds: Vec<_> = maps
            .ops
            .iter()
            .map(|op| match op {
                Op::RemoveFrontend(k) => (0, k.addr, 0),
                Op::RemoveBackend(k) => (1, k.service_id, k.slot),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(kinds.len(), 4);
        assert!(kinds[..3].iter().all(|k| k.0 == 0));
        assert_eq!(kinds[3], (1, 1, 0));

        maps.ops.clear();
        r.sync(
            &model(&[
                ("b", 11, None, vec![endpoint(3, true)]),
                ("c", 12, None, vec![endpoint(4, true)]),
            ]),
            &mut maps,
        );
        assert!(maps.ops.contains(&Op::InsertBackend(
            BackendKey {
                service_id: 3,
                slot: 0
            },
            backend(4)
        )));
        assert_eq!(maps.contents.recorded(), r.written);
    }

    #[test]
    fn no_ready_endpoints_gives_an_empty_frontend() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        r.sync(
            &model(&[("web", 10, None, vec![endpoint(2, false)])]),
            &mut maps,
        );
        assert!(maps.contents.backends.is_empty());
        assert_eq!(
            port_frontend(&maps.contents).map(|f| f.backend_count),
            Some(0)
        );
    }

    const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10);

    fn cluster_ip6(last: u16) -> Ipv6Addr {
        Ipv6Addr::new(0x2001, 0xdb8, 0x96, 0, 0, 0, 0, last)
    }

    fn endpoint6(last: u16) -> Endpoint<Ipv6Addr> {
        Endpoint {
            addr: Ipv6Addr::new(0x2001, 0xdb8, 0x244, 0, 0, 0, 0, last),
            port: 8080,
            conditions: Conditions {
                ready: true,
                serving: true,
                terminating: false,
            },
            placement: Default::default(),
        }
    }

    /// The IPv6 side of `m`'s service `service` (its ports, with `endpoints`), on ClusterIP
    /// `cluster_ip6(ip)`.
    fn add_ipv6_side(m: &mut Model, service: &str, ip: u16, endpoints: Vec<Endpoint<Ipv6Addr>>) {
        let ports = m.services.get(&name(service)).map_or_else(
            || {
                vec![ServicePort {
                    name: "http".into(),
                    protocol: Protocol::Tcp,
                    port: 80,
                    node_port: None,
                    target_port: TargetPort::Name("http".into()),
                    endpoints: Vec::new(),
                }]
            },
            |v4| {
                v4.ports
                    .iter()
                    .map(|p| ServicePort {
                        endpoints: Vec::new(),
                        ..p.clone()
                    })
                    .collect()
            },
        );
        let ports = ports
            .into_iter()
            .map(|p| ServicePort {
                name: p.name,
                protocol: p.protocol,
                port: p.port,
                node_port: p.node_port,
                target_port: p.target_port,
                endpoints: endpoints.clone(),
            })
            .collect();
        m.services_v6.insert(
            name(service),
            Service {
                cluster_ip: cluster_ip6(ip),
                affinity_timeout_s: None,
                traffic: Default::default(),
                scheduler: None,
                external: Default::default(),
                ports,
            },
        );
    }

    fn fk6(ip: Ipv6Addr, port: u16) -> FrontendKey6 {
        Ipv6Addr::frontend_key(ip, port, lb_common::IPPROTO_TCP)
    }

    #[test]
    fn ipv6_side_is_written_to_the_ipv6_maps_with_the_ipv4_sides_service_id() {
        let mut m = model(&[("web", 10, Some(30080), vec![endpoint(2, true)])]);
        add_ipv6_side(&mut m, "web", 0x10, vec![endpoint6(0xc), endpoint6(0xb)]);
        // IPv6-only: an id of its own in the same space.
        add_ipv6_side(&mut m, "web6", 0x11, vec![endpoint6(0xd)]);
        let mut r = Reconciler::new(NODE, MapContents::default())
            .with_ipv6(vec![NODE6], MapContents6::default());
        let mut maps = FakeMaps::default();
        let report = r.sync(&m, &mut maps);
        assert_eq!(report.failed, 0);

        let v4_id = maps.contents.frontends[&fk(Ipv4Addr::new(10, 96, 0, 10), 80)].service_id;
        let v6 = &maps.contents6;
        let cluster_ip = v6.frontends[&fk6(cluster_ip6(0x10), 80)];
        let node_port = v6.frontends[&fk6(NODE6, 30080)];
        assert_eq!(
            cluster_ip.service_id, v4_id,
            "one id space, one id per port"
        );
        assert_eq!((cluster_ip.backend_count, cluster_ip.flags), (2, 0));
        assert_eq!(
            (node_port.service_id, node_port.flags),
            (v4_id, FRONTEND_F_MASQUERADE)
        );
        assert!(
            v6.frontends
                .contains_key(&Ipv6Addr::any_port(cluster_ip6(0x10)))
        );
        let only_v6 = v6.frontends[&fk6(cluster_ip6(0x11), 80)].service_id;
        assert!(only_v6 != v4_id && only_v6 != 0);
        assert!(
            maps.contents
                .frontends
                .values()
                .all(|f| f.service_id != only_v6)
        );

        let backends: Vec<(BackendKey, Ipv6Addr)> = v6
            .backends
            .iter()
            .map(|(k, b)| (*k, Ipv6Addr::from(b.addr.octets())))
            .collect();
        let key = |service_id, slot| BackendKey { service_id, slot };
        assert_eq!(
            backends,
            [
                (key(v4_id, 0), endpoint6(0xb).addr),
                (key(v4_id, 1), endpoint6(0xc).addr),
                (key(only_v6, 0), endpoint6(0xd).addr),
            ]
        );
        assert!(v6.backends.values().all(|b| b.port == port_be(8080)));
        let kinds: Vec<(Ipv6Addr, u32)> = v6
            .origins
            .iter()
            .map(|(k, o)| (Ipv6Addr::from(k.addr.octets()), o.kind))
            .collect();
        assert!(kinds.contains(&(cluster_ip6(0x10), KIND_CLUSTER_IP)));
        assert!(kinds.contains(&(NODE6, KIND_NODE_PORT)));
        assert_eq!(r.written6(), &maps.contents6.recorded());
        // The IPv4 maps hold no IPv6 entry: the IPv6-only service has no IPv4 frontend.
        assert_eq!(
            maps.contents.frontends.len(),
            3,
            "{:?}",
            maps.contents.frontends
        );
    }

    #[test]
    fn ipv6_side_gone_or_changed_is_removed_or_rewritten() {
        let mut m = model(&[("web", 10, Some(30080), vec![endpoint(2, true)])]);
        add_ipv6_side(&mut m, "web", 0x10, vec![endpoint6(0xb), endpoint6(0xc)]);
        let mut r = Reconciler::new(NODE, MapContents::default())
            .with_ipv6(vec![NODE6], MapContents6::default());
        let mut maps = FakeMaps::default();
        r.sync(&m, &mut maps);
        let v4_before = maps.contents.clone();
        let web: BTreeSet<ServiceName> = [name("web")].into();

        // One IPv6 endpoint leaves: its slot goes, the frontends count one.
        m.services_v6.get_mut(&name("web")).unwrap().ports[0]
            .endpoints
            .retain(|e| e.addr != endpoint6(0xc).addr);
        let report = r.sync_changed(&m, Some(&web), &mut maps);
        assert_eq!(report.failed, 0);
        assert_eq!(maps.contents6.backends.len(), 1);
        assert_eq!(
            maps.contents6.frontends[&fk6(NODE6, 30080)].backend_count,
            1
        );

        // IPv4-only again: every IPv6 entry goes, the IPv4 ones stay as they were.
        m.services_v6.clear();
        let report = r.sync_changed(&m, Some(&web), &mut maps);
        assert_eq!(report.failed, 0);
        assert_eq!(maps.contents6, MapContents6::default());
        assert_eq!(r.written6(), &Written::default());
        assert_eq!(maps.contents.frontends, v4_before.frontends);
        assert_eq!(maps.contents.backends, v4_before.backends);

        // An IPv6-only service comes and goes while no IPv4 side changes (the agent then
        // names no service as changed): its ports get an id, then lose it.
        let none = BTreeSet::new();
        add_ipv6_side(&mut m, "web6", 0x11, vec![endpoint6(0xd)]);
        let report = r.sync_changed(&m, Some(&none), &mut maps);
        assert_eq!(report.failed, 0);
        let web6 = maps.contents6.frontends[&fk6(cluster_ip6(0x11), 80)].service_id;
        assert!(
            maps.contents
                .frontends
                .values()
                .all(|f| f.service_id != web6)
        );
        m.services_v6.clear();
        r.sync_changed(&m, Some(&none), &mut maps);
        assert_eq!(maps.contents6, MapContents6::default());
        assert!(r.ids.values().all(|&id| id != web6));
    }

    #[test]
    fn restart_adopts_ipv6_only_ids_and_writes_nothing() {
        let mut m = model(&[("web", 10, None, vec![endpoint(2, true)])]);
        add_ipv6_side(&mut m, "web", 0x10, vec![endpoint6(0xb)]);
        add_ipv6_side(&mut m, "web6", 0x11, vec![endpoint6(0xd)]);
        let mut first = Reconciler::new(NODE, MapContents::default())
            .with_ipv6(vec![NODE6], MapContents6::default());
        let mut maps = FakeMaps::default();
        first.next_id = 7;
        first.sync(&m, &mut maps);

        let mut restarted = Reconciler::new(NODE, maps.contents.clone())
            .with_ipv6(vec![NODE6], maps.contents6.clone());
        let before = (maps.contents.clone(), maps.contents6.clone());
        maps.ops.clear();
        let report = restarted.sync(&m, &mut maps);
        assert!(!report.changed(), "{report:?}");
        assert_eq!((maps.contents.clone(), maps.contents6.clone()), before);
        assert_eq!(restarted.next_id, first.next_id);
    }

    #[test]
    fn ipv6_endpoints_get_counter_slots_released_when_gone_and_kept_on_restart() {
        let mut m = model(&[("web", 10, None, vec![endpoint(2, true)])]);
        add_ipv6_side(&mut m, "web", 0x10, vec![endpoint6(0xb), endpoint6(0xc)]);
        let mut r = Reconciler::new(NODE, MapContents::default())
            .with_ipv6(vec![NODE6], MapContents6::default())
            .with_stats_slots(8);
        let mut maps = FakeMaps::default();
        r.sync(&m, &mut maps);
        let slots6 = |maps: &FakeMaps| -> Vec<u16> {
            let backends = maps.contents6.backends.values();
            backends.map(|b| b.stats_slot).collect()
        };
        let v4: Vec<u16> = maps
            .contents
            .backends
            .values()
            .map(|b| b.stats_slot)
            .collect();
        assert_eq!(v4, [1]);
        assert_eq!(slots6(&maps), [2, 3], "a slot of its own per IPv6 endpoint");
        assert_eq!(r.stats_slots(), (7, 3));
        let sid = maps.contents6.backends.keys().next().unwrap().service_id;
        let owner = |last| {
            let backend = Ipv6Addr::backend(endpoint6(last).addr, 8080);
            PortEndpoint::new(sid, &backend).owner()
        };
        assert!(
            maps.ops.contains(&Op::ResetStats(2, owner(0xb)))
                && maps.ops.contains(&Op::ResetStats(3, owner(0xc))),
            "claimed with their owners: {:?}",
            maps.ops
        );

        // 0xc leaves: its slot is released.
        add_ipv6_side(&mut m, "web", 0x10, vec![endpoint6(0xb)]);
        maps.ops.clear();
        r.sync(&m, &mut maps);
        assert_eq!(maps.ops, [Op::ResetStats(3, 0)]);
        assert_eq!(slots6(&maps), [2]);
        assert_eq!(r.stats_slots(), (7, 2));

        // A restarted agent keeps the IPv6 endpoints' slots.
        let mut r = Reconciler::new(NODE, maps.contents.clone())
            .with_ipv6(vec![NODE6], maps.contents6.clone())
            .with_stats_slots(8);
        maps.ops.clear();
        r.sync(&m, &mut maps);
        assert_eq!(maps.ops, [], "nothing rewritten, no slot reset");
        assert_eq!(slots6(&maps), [2]);
        assert_eq!(r.stats_slots(), (7, 2));
    }

    #[test]
    fn removed_ipv6_udp_endpoints_are_reported_for_the_conntrack_flush() {
        let mut m = Model::default();
        add_ipv6_side(&mut m, "dns", 0x12, vec![endpoint6(0xb), endpoint6(0xc)]);
        add_ipv6_side(&mut m, "web", 0x13, vec![endpoint6(0xb), endpoint6(0xc)]);
        m.services_v6.get_mut(&name("dns")).unwrap().ports[0].protocol = Protocol::Udp;
        let mut r = Reconciler::new(NODE, MapContents::default())
            .with_ipv6(vec![NODE6], MapContents6::default());
        let mut maps = FakeMaps::default();
        assert!(r.sync(&m, &mut maps).removed_udp.is_empty());
        let dns = maps.contents6.frontends
            [&Ipv6Addr::frontend_key(cluster_ip6(0x12), 80, lb_common::IPPROTO_UDP)]
            .service_id;

        // 0xc leaves both: only the UDP port's endpoint is flushed.
        for service in ["dns", "web"] {
            let ports = &mut m.services_v6.get_mut(&name(service)).unwrap().ports;
            ports[0].endpoints.retain(|e| e.addr == endpoint6(0xb).addr);
        }
        let report = r.sync_changed(&m, Some(&BTreeSet::new()), &mut maps);
        let gone = Ipv6Addr::backend(endpoint6(0xc).addr, 8080);
        assert_eq!(
            report.removed_udp,
            BTreeSet::from([UdpEndpoint {
                service_id: dns,
                backend: FamilyBackend::from(&gone),
            }])
        );
    }

    #[test]
    fn restart_adopts_ids_from_the_maps_and_writes_nothing() {
        let m = model(&[("web", 10, Some(30080), vec![endpoint(2, true)])]);
        let mut first = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        // Push the id away from 1 so adoption is visible.
        first.next_id = 7;
        first.sync(&m, &mut maps);
        let pinned = std::mem::take(&mut maps.contents);

        let mut restarted = Reconciler::new(NODE, pinned.clone());
        let mut maps = FakeMaps {
            contents: pinned,
            ..Default::default()
        };
        let report = restarted.sync(&m, &mut maps);
        assert!(!report.changed(), "{report:?}");
        assert!(maps.ops.is_empty());
        assert_eq!(restarted.next_id, 8);
    }

    #[test]
    fn audit_finds_what_changed_behind_the_writer_and_the_next_sync_repairs_it() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        let m = model(&[("web", 10, None, vec![endpoint(2, true), endpoint(3, true)])]);
        r.sync_changed(&m, None, &mut maps);
        let wanted = maps.contents.clone();
        assert_eq!(r.audit(wanted.clone()), 0);

        // Behind the agent's back: a frontend lost, a backend changed, a stray frontend added.
        let lost = *maps.contents.frontends.keys().next().unwrap();
        maps.contents.frontends.remove(&lost);
        maps.contents.backends.values_mut().next().unwrap().port ^= 1;
        let stray = frontend_key(Ipv4Addr::new(10, 96, 9, 9), 80, lb_common::IPPROTO_TCP);
        maps.contents.frontends.insert(stray, Frontend::default());
        assert_eq!(r.audit(maps.contents.clone()), 3);

        // The next sync, though nothing changed in the model, repairs all three.
        let report = r.sync_changed(&m, Some(&BTreeSet::new()), &mut maps);
        assert!(report.changed(), "{report:?}");
        assert_eq!(maps.contents, wanted);
        assert_eq!(r.audit(maps.contents.clone()), 0);
    }

    #[test]
    fn audit_finds_records_changed_behind_the_writer_by_their_digests() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        let m = model(&[("web", 10, Some(30080), vec![endpoint(2, true)])]);
        r.sync(&m, &mut maps);
        let wanted = maps.contents.clone();

        // Same keys, other values: an origin of another kind, a status record with another
        // checksum.
        maps.contents.origins.values_mut().next().unwrap().kind ^= 1;
        maps.contents.statuses.values_mut().next().unwrap().digest ^= 1;
        assert_eq!(r.audit(maps.contents.clone()), 2);

        r.sync_changed(&m, Some(&BTreeSet::new()), &mut maps);
        assert_eq!(maps.contents, wanted);
        assert_eq!(r.audit(maps.contents.clone()), 0);
    }

    #[test]
    fn lists_give_the_keys_of_both_lists_slots() {
        let key = |slot| BackendKey {
            service_id: 7,
            slot,
        };
        let lists = Lists {
            service_id: 7,
            cluster: 2,
            local: 1,
        };
        assert_eq!(
            lists.keys().collect::<Vec<_>>(),
            vec![key(0), key(1), key(LOCAL_SLOT)]
        );
        let empty = Lists {
            service_id: 7,
            cluster: 0,
            local: 0,
        };
        assert_eq!(empty.keys().count(), 0);
    }

    #[test]
    fn restart_cleans_up_what_is_gone() {
        let mut first = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        first.sync(
            &model(&[("web", 10, None, vec![endpoint(2, true)])]),
            &mut maps,
        );
        let mut restarted = Reconciler::new(NODE, std::mem::take(&mut maps.contents));
        let report = restarted.sync(&Model::default(), &mut maps);
        assert_eq!((report.frontends_removed, report.backends_removed), (2, 1));
    }

    #[test]
    fn failed_backend_writes_keep_the_old_frontend_and_are_counted() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        r.sync(
            &model(&[("web", 10, None, vec![endpoint(2, true), endpoint(3, true)])]),
            &mut maps,
        );
        maps.fail_backends_of = Some(1);
        maps.ops.clear();
        let report = r.sync(
            &model(&[("web", 10, None, vec![endpoint(4, true)])]),
            &mut maps,
        );
        assert_eq!(report.failed, 1);
        assert_eq!(r.failed_total, 1);
        assert_eq!(
            report.failed_services,
            BTreeMap::from([(
                name("web"),
                WriteFailure {
                    writes: 1,
                    error: "backend insert: the map is full: raise --backends-max".into()
                }
            )])
        );
        // Nothing touched: the old frontend still counts 2 slots, both still there.
        assert!(maps.ops.is_empty(), "{:?}", maps.ops);

        maps.fail_backends_of = None;
        let report = r.sync(
            &model(&[("web", 10, None, vec![endpoint(4, true)])]),
            &mut maps,
        );
        assert_eq!(report.failed, 0);
        assert!(report.failed_services.is_empty());
        assert_eq!(maps.contents.backends.len(), 1);
        assert_eq!(
            port_frontend(&maps.contents).map(|f| f.backend_count),
            Some(1)
        );
    }

    /// What the reconciler keeps for every service port between syncs (issue 21's memory goal,
    /// 50k Services): a size change here is a change of the agent's memory at scale.
    #[test]
    fn what_is_kept_per_service_port_stays_small() {
        // The name, the port name (shared with the model) and the protocol.
        assert_eq!(std::mem::size_of::<ServicePortId>(), 56);
        // Sized slices: a `Vec` is 24 bytes and four entries of room at its first push.
        assert_eq!(std::mem::size_of::<Contribution>(), 72);
    }

    #[test]
    fn service_port_ids_and_contributions_share_the_models_port_names() {
        let m = model(&[("web", 1, None, vec![endpoint(2, true)])]);
        let mut r = Reconciler::new(NODE, MapContents::default());
        r.sync(&m, &mut FakeMaps::default());
        let port_name = &m.services[&name("web")].ports[0].name;
        let (id, _) = r.ids.first_key_value().expect("the port's id");
        assert!(std::sync::Arc::ptr_eq(&id.port_name, port_name));
        let last = r.last.as_ref().expect("a sync without failures");
        let contribution = &last.services[&name("web")];
        assert_eq!(contribution.lists.len(), 1);
        assert!(std::sync::Arc::ptr_eq(&contribution.ports[0].0, port_name));
    }

    #[test]
    fn one_endpoint_change_among_many_services_writes_only_what_changed() {
        let names: Vec<String> = (0..200).map(|i| format!("svc-{i}")).collect();
        let services = |extra: bool| -> Vec<(&str, u8, Option<u16>, Vec<Endpoint>)> {
            names
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    let mut endpoints = vec![endpoint(2, true)];
                    if extra && i == 7 {
                        endpoints.push(endpoint(3, true));
                    }
                    (name.as_str(), i as u8, None, endpoints)
                })
                .collect()
        };
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        r.sync(&model(&services(false)), &mut maps);
        maps.ops.clear();
        let report = r.sync(&model(&services(true)), &mut maps);
        let service_id = port_frontend_of(&maps.contents, 7).service_id;
        assert_eq!(
            maps.ops,
            [
                Op::InsertBackend(
                    BackendKey {
                        service_id,
                        slot: 1
                    },
                    backend(3)
                ),
                Op::InsertFrontend(
                    fk(Ipv4Addr::new(10, 96, 0, 7), 80),
                    Frontend {
                        backend_count: 2,
                        ..*port_frontend_of(&maps.contents, 7)
                    }
                ),
            ]
        );
        assert_eq!((report.backends_added, report.frontends_updated), (1, 1));
        maps.ops.clear();
        r.sync(&model(&services(false)), &mut maps);
        assert_eq!(
            maps.ops.len(),
            2,
            "frontend back to one slot, slot 1 removed: {:?}",
            maps.ops
        );
    }

    fn port_frontend_of(contents: &MapContents, ip: u8) -> &Frontend {
        &contents.frontends[&fk(Ipv4Addr::new(10, 96, 0, ip), 80)]
    }

    #[test]
    fn frontend_collisions_keep_the_first_service_port() {
        let mut r = Reconciler::new(NODE, MapContents::default());
        let desired = r.desired(&model(&[
            ("a", 10, None, vec![endpoint(2, true)]),
            ("b", 10, None, vec![endpoint(3, true)]),
        ]));
        assert_eq!(desired.frontends.len(), 2, "one port and one catch-all");
        assert_eq!(port_frontend(&desired).map(|f| f.service_id), Some(1));
    }

    /// What `lb status` says of the fake maps, by service name and port state.
    fn status_of(maps: &FakeMaps) -> Vec<(String, sync_status::SyncState)> {
        sync_status::compare(&maps.contents.statuses, &maps.contents, &maps.contents6)
            .into_iter()
            .map(|p| {
                let record = p.record.expect("a record");
                (lb_common::field_text(&record.name).to_owned(), p.state)
            })
            .collect()
    }

    #[test]
    fn status_records_count_the_ipv6_side_and_see_its_entries_lost() {
        use sync_status::SyncState::{InSync, Missing};
        let mut m = model(&[("web", 10, Some(30080), vec![endpoint(2, true)])]);
        add_ipv6_side(&mut m, "web", 0x10, vec![endpoint6(0xb), endpoint6(0xc)]);
        add_ipv6_side(&mut m, "web6", 0x11, vec![endpoint6(0xd)]);
        let mut r = Reconciler::new(NODE, MapContents::default())
            .with_ipv6(vec![NODE6], MapContents6::default());
        let mut maps = FakeMaps::default();
        r.sync(&m, &mut maps);
        let in_sync = vec![("web".to_owned(), InSync), ("web6".to_owned(), InSync)];
        assert_eq!(status_of(&maps), in_sync);
        let counts = |maps: &FakeMaps, name: &str| {
            let record = maps
                .contents
                .statuses
                .values()
                .find(|s| lb_common::field_text(&s.name) == name)
                .expect("a record");
            (record.frontends, record.backends, record.origins)
        };
        // web: its IPv4 ClusterIP, NodePort and catch-all and 1 slot, and as many of IPv6's
        // with 2 slots; web6: its IPv6 ClusterIP and catch-all, 1 slot.
        assert_eq!(counts(&maps, "web"), (6, 3, 4));
        assert_eq!(counts(&maps, "web6"), (2, 1, 1));

        // An IPv6 entry lost behind the agent's back: the port is missing.
        let mut lost = maps.contents6.clone();
        lost.backends.pop_last();
        let states: Vec<_> = sync_status::compare(&maps.contents.statuses, &maps.contents, &lost)
            .into_iter()
            .map(|p| p.state)
            .collect();
        assert_eq!(states, [InSync, Missing]);
        let mut lost = maps.contents6.clone();
        lost.frontends
            .remove(&Ipv6Addr::any_port(cluster_ip6(0x10)));
        let states: Vec<_> = sync_status::compare(&maps.contents.statuses, &maps.contents, &lost)
            .into_iter()
            .map(|p| p.state)
            .collect();
        assert_eq!(states, [Missing, InSync]);

        // A change of the IPv6 side alone follows in the records.
        add_ipv6_side(&mut m, "web6", 0x11, vec![endpoint6(0xd), endpoint6(0xe)]);
        let changed = BTreeSet::from([name("web6")]);
        r.sync_changed(&m, Some(&changed), &mut maps);
        assert_eq!(status_of(&maps), in_sync);
        assert_eq!(counts(&maps, "web6"), (2, 2, 1));
        add_ipv6_side(&mut m, "web", 0x10, vec![endpoint6(0xb)]);
        r.sync_changed(&m, Some(&BTreeSet::new()), &mut maps);
        assert_eq!(status_of(&maps), in_sync);
        assert_eq!(counts(&maps, "web"), (6, 2, 4));
        m.services_v6.remove(&name("web6"));
        r.sync_changed(&m, Some(&BTreeSet::new()), &mut maps);
        assert_eq!(status_of(&maps), in_sync[..1]);
    }

    #[test]
    fn status_records_follow_every_sync_and_name_failed_writes() {
        use sync_status::SyncState::{Failed, InSync};
        let mut r = Reconciler::new(NODE, MapContents::default());
        let mut maps = FakeMaps::default();
        let mut m = model(&[
            ("a", 10, None, vec![endpoint(2, true)]),
            ("b", 11, Some(30080), vec![endpoint(3, true)]),
        ]);
        r.sync(&m, &mut maps);
        let in_sync = |names: &[&str]| -> Vec<(String, sync_status::SyncState)> {
            names.iter().map(|n| (n.to_string(), InSync)).collect()
        };
        assert_eq!(status_of(&maps), in_sync(&["a", "b"]));
        let whole = r.desired(&m);
        assert_eq!(r.written(), &whole.recorded());

        // A partial sync rewrites a's record only; c comes, b goes with its record.
        let a = name("a");
        let b_record = maps.contents.statuses.values().nth(1).copied();
        m.services.get_mut(&a).unwrap().ports[0]
            .endpoints
            .push(endpoint(5, true));
        let mut c = m.services[&name("b")].clone();
        c.cluster_ip = Ipv4Addr::new(10, 96, 0, 12);
        c.ports[0].node_port = None;
        m.services.insert(name("c"), c);
        let changed = BTreeSet::from([a.clone(), name("c")]);
        r.sync_changed(&m, Some(&changed), &mut maps);
        assert_eq!(status_of(&maps), in_sync(&["a", "b", "c"]));
        assert_eq!(maps.contents.statuses.values().nth(1).copied(), b_record);
        m.services.remove(&name("b"));
        r.sync_changed(&m, Some(&BTreeSet::from([name("b")])), &mut maps);
        assert_eq!(status_of(&maps), in_sync(&["a", "c"]));
        assert_eq!(maps.contents.statuses.len(), 2);
        let whole = r.desired(&m);
        assert_eq!(r.written(), &whole.recorded());

        // a's new slot cannot be written: failed, with the error; in sync once retried.
        let a_id = r
            .ids
            .iter()
            .find(|(id, _)| id.service == a)
            .map(|(_, sid)| *sid);
        maps.fail_backends_of = a_id;
        m.services.get_mut(&a).unwrap().ports[0]
            .endpoints
            .push(endpoint(6, true));
        r.sync_changed(&m, Some(&BTreeSet::from([a.clone()])), &mut maps);
        let status = status_of(&maps);
        assert_eq!(
            status[0],
            (
                "a".to_owned(),
                Failed("backend insert: the map is full: raise --backends-max".into())
            )
        );
        assert_eq!(status[1], ("c".to_owned(), InSync));
        maps.fail_backends_of = None;
        r.sync_changed(&m, Some(&BTreeSet::new()), &mut maps);
        assert_eq!(status_of(&maps), in_sync(&["a", "c"]));

        // Changed behind the writer's back: the audit repairs the record too.
        maps.contents.statuses.clear();
        assert_eq!(r.audit(maps.contents.clone()), 2);
        r.sync(&m, &mut maps);
        assert_eq!(status_of(&maps), in_sync(&["a", "c"]));
    }
}
