//! The apiserver as a source: kube-runtime watchers (with backoff) on Services, EndpointSlices
//! and this node's Node. Each new version of a Service or slice is converted through convert.rs as
//! it arrives and the object dropped: the specs are the only copy of the cluster's state kept
//! (k8s objects cost ~10× their specs: 3.4 KB per slice of 10 endpoints), and the change tracker
//! keeps each object's resourceVersion and owner.
//!
//! Services whose map writes failed get an Event (events.rs).
//!
//! The specs are only brought up to date whole: from the first complete lists on, and never
//! while one relists (converted changes wait in `pending` until then), so a watch that fails
//! halfway never deletes a live service.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::path::Path;

use futures::StreamExt as _;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::core::v1::{Node, NodeStatus, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource as _, ResourceExt as _};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::maps::writer::WriteFailure;
use crate::model::{Family, ServiceName, ServiceSlices, ServiceSpec, SliceSpec, Specs};
use crate::source::change_tracker::{ChangeTracker, Kind, ObjectVersion};
use crate::source::convert::{self, InvalidField};
use crate::source::events::WriteFailureEvents;

/// The EndpointSlice annotation network programming latency is measured from.
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// The cluster autoscaler's taint on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";
/// As kube-proxy: services (and their slices) that another proxy handles, and headless ones, are
/// filtered out by the apiserver already.
pub const PROXY_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// The reports the watchers may queue ahead of the agent's loop: enough to keep a list streaming
/// while the loop converts, few enough that a list's objects never wait in memory all at once
/// (unbounded, a 50k-Service cold start queued them all: their memory stayed with the agent).
const REPORTS_QUEUED: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        source: kube::config::KubeconfigError,
    },
    #[error("in-cluster config (use --kubeconfig outside a pod): {0}")]
    InCluster(#[from] kube::config::InClusterError),
    #[error("kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Resource {
    Services,
    EndpointSlices,
    Node,
}

impl Resource {
    fn index(self) -> usize {
        self as usize
    }

    /// The kind of object whose changes the tracker follows; the Node is not one.
    fn tracked(self) -> Option<Kind> {
        match self {
            Resource::Services => Some(Kind::Service),
            Resource::EndpointSlices => Some(Kind::EndpointSlice),
            Resource::Node => None,
        }
    }
}

/// An object a watcher received.
#[derive(Debug)]
enum Object {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
    Node(Box<Node>),
}

impl From<Service> for Object {
    fn from(svc: Service) -> Self {
        Object::Service(Box::new(svc))
    }
}

impl From<EndpointSlice> for Object {
    fn from(slice: EndpointSlice) -> Self {
        Object::Slice(Box::new(slice))
    }
}

impl From<Node> for Object {
    fn from(node: Node) -> Self {
        Object::Node(Box::new(node))
    }
}

/// What a watcher reported.
#[derive(Debug)]
enum Report {
    Relisting,
    Listed,
    Applied {
        version: ObjectVersion,
        trigger: Option<Timestamp>,
        object: Object,
    },
    Deleted {
        key: String,
    },
    Failed(String),
}

/// What the caller should do after [`ApiSource::next`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// The desired state may have changed.
    Changed,
    /// Nothing to do (an error was logged, or a relist started).
    Nothing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ListState {
    NeverListed,
    Whole,
    Relisting,
}

/// What [`ApiSource::update`] brought into the specs.
#[derive(Debug, Default)]
pub struct Update {
    /// The services whose Service or EndpointSlices changed.
    pub changed: BTreeSet<ServiceName>,
    /// Trigger times of the slice changes since the last update.
    pub triggers: Vec<Timestamp>,
}

/// Converted changes not yet in the specs; None: the object has no spec (ignored or invalid).
#[derive(Debug, Default)]
struct Pending {
    services: HashMap<ServiceName, Option<ServiceSpec>>,
    /// By slice key, `namespace/name`.
    slices: HashMap<String, Option<SliceSpec>>,
}

pub struct ApiSource {
    /// This node's Node, trimmed to what is used.
    node: Option<Node>,
    /// While the Node relists: what the relist has listed so far (it replaces `node` when
    /// complete, as a reflector's store would).
    node_relist: Option<Option<Node>>,
    /// The uid of each Service, which its Events name.
    uids: HashMap<ServiceName, String>,
    pending: Pending,
    node_name: String,
    reports: mpsc::Receiver<(Resource, Report)>,
    lists: [ListState; 3],
    started: Timestamp,
    /// The last trigger time seen per slice: a relist replays unchanged slices, which are no
    /// new change.
    trigger_seen: HashMap<String, Timestamp>,
    triggers: Vec<Timestamp>,
    tracker: ChangeTracker,
    write_failure_events: WriteFailureEvents,
}

impl ApiSource {
    /// Connects (in-cluster config, or `kubeconfig`) and starts the watchers; returns at once,
    /// without waiting for the apiserver.
    pub async fn start(kubeconfig: Option<&Path>, node_name: &str) -> Result<Self, ApiError> {
        let config = match kubeconfig {
            Some(path) => {
                let err = |source| ApiError::Kubeconfig {
                    path: path.display().to_string(),
                    source,
                };
                let file = kube::config::Kubeconfig::read_from(path).map_err(err)?;
                kube::Config::from_custom_kubeconfig(file, &Default::default())
                    .await
                    .map_err(err)?
            }
            None => kube::Config::incluster()?,
        };
        info!(apiserver = %config.cluster_url, node = node_name, "watching the apiserver");
        let client = Client::try_from(config)?;
        let (tx, reports) = mpsc::channel(REPORTS_QUEUED);
        let proxied = || watcher::Config::default().labels(PROXY_LABEL_SELECTOR);

        spawn_watch(
            Api::<Service>::all(client.clone()),
            proxied(),
            Resource::Services,
            tx.clone(),
            service_of_service,
        );
        spawn_watch(
            Api::<EndpointSlice>::all(client.clone()),
            proxied(),
            Resource::EndpointSlices,
            tx.clone(),
            service_of_slice,
        );
        let write_failure_events = WriteFailureEvents::start(client.clone(), node_name);
        spawn_watch(
            Api::<Node>::all(client),
            watcher::Config::default().fields(&format!("metadata.name={node_name}")),
            Resource::Node,
            tx,
            |_| None,
        );
        Ok(Self {
            node: None,
            node_relist: None,
            uids: HashMap::new(),
            pending: Pending::default(),
            node_name: node_name.to_owned(),
            reports,
            lists: [ListState::NeverListed; 3],
            started: Timestamp::now(),
            trigger_seen: HashMap::new(),
            triggers: Vec::new(),
            tracker: ChangeTracker::default(),
            write_failure_events,
        })
    }

    /// Waits for the next report of a watcher.
    pub async fn next(&mut self) -> Next {
        let Some((resource, report)) = self.reports.recv().await else {
            // The watchers never end while their receiver lives.
            return std::future::pending().await;
        };
        let list = &mut self.lists[resource.index()];
        let tracked = resource.tracked();
        match report {
            Report::Relisting => {
                match tracked {
                    Some(kind) => self.tracker.relisting(kind),
                    None => self.node_relist = Some(None),
                }
                if *list == ListState::Whole {
                    info!(
                        ?resource,
                        "relisting; the maps keep the last synced state until it completes"
                    );
                    *list = ListState::Relisting;
                }
                Next::Nothing
            }
            Report::Listed => {
                match tracked {
                    Some(kind) => self.tracker.relisted(kind),
                    None => {
                        if let Some(listed) = self.node_relist.take() {
                            self.node = listed;
                        }
                    }
                }
                let first = *list == ListState::NeverListed;
                *list = ListState::Whole;
                info!(?resource, first, "list complete");
                Next::Changed
            }
            Report::Applied {
                version,
                trigger,
                object,
            } => {
                if let Some(at) = trigger
                    && at >= self.started
                    && self.trigger_seen.insert(version.key.clone(), at) != Some(at)
                {
                    self.triggers.push(at);
                }
                self.applied(version, object);
                Next::Changed
            }
            Report::Deleted { key } => {
                self.trigger_seen.remove(&key);
                match tracked {
                    Some(kind) => self.tracker.deleted(kind, &key),
                    None => self.node = None,
                }
                Next::Changed
            }
            Report::Failed(error) => {
                warn!(?resource, %error, "watch failed; retrying with backoff, the maps stay as they are");
                Next::Nothing
            }
        }
    }

    /// A new version of `object`: converted if the tracker sees a change (once per version, so
    /// its warnings are too), else dropped.
    fn applied(&mut self, version: ObjectVersion, object: Object) {
        let events = &self.write_failure_events;
        match object {
            Object::Node(mut node) => {
                if node.metadata.name.as_deref() != Some(&self.node_name) {
                    return;
                }
                trim_node(&mut node);
                match &mut self.node_relist {
                    Some(listed) => *listed = Some(*node),
                    None => self.node = Some(*node),
                }
            }
            Object::Service(svc) => {
                let Some(name) = version.service.clone() else {
                    return;
                };
                if !self.tracker.applied(Kind::Service, version) {
                    return;
                }
                let name = self.tracker.service_name(&name).unwrap_or(name);
                if let Some(uid) = &svc.metadata.uid {
                    self.uids.insert(name.clone(), uid.clone());
                }
                let spec =
                    convert(svc.as_ref(), convert::service, events).map(|spec| ServiceSpec {
                        name: name.clone(),
                        ..spec
                    });
                self.pending.services.insert(name, spec);
            }
            Object::Slice(slice) => {
                let key = version.key.clone();
                if !self.tracker.applied(Kind::EndpointSlice, version) {
                    return;
                }
                let spec = convert(slice.as_ref(), convert::endpoint_slice, events).map(|spec| {
                    let service = self.tracker.service_name(&spec.service);
                    SliceSpec {
                        service: service.unwrap_or(spec.service),
                        ..spec
                    }
                });
                self.pending.slices.insert(key, spec);
            }
        }
    }

    /// Every watcher has a complete list and none is relisting.
    pub fn whole(&self) -> bool {
        self.lists.iter().all(|l| *l == ListState::Whole)
    }

    /// This node's object, once listed.
    pub fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }

    /// The Node's first list is complete.
    pub fn node_listed(&self) -> bool {
        self.lists[Resource::Node.index()] != ListState::NeverListed
    }

    /// See [`node_eligible`]; a node that does not exist (any more) is not eligible.
    pub fn node_eligible(&self) -> bool {
        match self.node() {
            Some(node) => node_eligible(node),
            None => !self.node_listed(),
        }
    }

    /// An Event on each Service of `failed` (whose map writes failed), at most every few
    /// minutes while they keep failing.
    pub fn report_write_failures(&mut self, failed: &BTreeMap<ServiceName, WriteFailure>) {
        let uids = &self.uids;
        self.write_failure_events.report(failed, |name| {
            // No resourceVersion: one Event series across the Service's changes.
            Some(ObjectReference {
                api_version: Some(Service::api_version(&()).into_owned()),
                kind: Some(Service::kind(&()).into_owned()),
                namespace: Some(name.namespace.to_string()),
                name: Some(name.name.to_string()),
                uid: Some(uids.get(name)?.clone()),
                ..Default::default()
            })
        });
    }

    /// Brings into `specs` the Services whose Service or slices changed since the last update
    /// (converted as they arrived; objects convert.rs rejected were warned about then).
    pub fn update(&mut self, specs: &mut Specs) -> Update {
        let changed = self.tracker.take_changed();
        for name in &changed {
            self.update_service(name, specs);
            self.update_slices(name, specs);
        }
        // The rest belong to no changed Service: slices of no Service, or gone before this update.
        self.pending = Pending::default();
        Update {
            changed,
            triggers: std::mem::take(&mut self.triggers),
        }
    }

    fn update_service(&mut self, name: &ServiceName, specs: &mut Specs) {
        let spec = if self.tracker.knows(Kind::Service, &service_key(name)) {
            match self.pending.services.remove(name) {
                Some(spec) => spec,
                // Only its slices changed.
                None => return,
            }
        } else {
            self.uids.remove(name);
            None
        };
        match spec {
            Some(spec) => specs.services.insert(name.clone(), spec),
            None => specs.services.remove(name),
        };
    }

    /// The slices of `name` as the tracker has them now: a new version converted, else the
    /// spec it had.
    fn update_slices(&mut self, name: &ServiceName, specs: &mut Specs) {
        let mut before = specs.slices.remove(name).unwrap_or_default();
        let slices: ServiceSlices = self
            .tracker
            .slices_of(name)
            .filter_map(|key| {
                let key = (key.to_owned(), 0);
                let spec = match self.pending.slices.remove(&key.0) {
                    Some(spec) => spec,
                    None => before.remove(&key),
                }?;
                Some((key, spec))
            })
            .collect();
        if !slices.is_empty() {
            specs.slices.insert(name.clone(), slices);
        }
    }
}

/// The object as a spec; None, with a warning, if convert.rs rejects it. The fields it skipped are
/// warned about, and told on the object as an Event.
fn convert<K, T>(
    object: &K,
    to_spec: impl Fn(&K, &mut Vec<InvalidField>) -> Result<Option<T>, InvalidField>,
    events: &WriteFailureEvents,
) -> Option<T>
where
    K: kube::Resource<DynamicType = ()>,
{
    let name = format!("{} {}", K::kind(&()), object_key(object));
    let version = object
        .meta()
        .resource_version
        .as_deref()
        .unwrap_or_default();
    let mut skipped = Vec::new();
    let spec = to_spec(object, &mut skipped);
    for field in &skipped {
        warn!(object = %name, version, field = %field.field, error = %field.reason, "invalid field skipped; the rest is served");
    }
    if !skipped.is_empty() {
        events.fields_skipped(object.object_ref(&()), &skipped);
    }
    match spec {
        Ok(spec) => spec,
        Err(err) => {
            warn!(object = %name, version, error = %err, "ignored: invalid");
            None
        }
    }
}

/// The Node label that names its zone, which topology hints refer to.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The Node's zone, if labelled.
pub fn node_zone(node: &Node) -> Option<&str> {
    node.metadata
        .labels
        .as_ref()?
        .get(ZONE_LABEL)
        .map(String::as_str)
}

/// The node address of family `A`: its first InternalIP of that family, else its first
/// ExternalIP of it (as kube-proxy picks the node's host IP).
pub fn node_ip<A: Family>(node: &Node) -> Option<A> {
    let addresses = node.status.as_ref()?.addresses.as_ref()?;
    ["InternalIP", "ExternalIP"].into_iter().find_map(|kind| {
        addresses
            .iter()
            .filter(|a| a.type_ == kind)
            .find_map(|a| a.address.parse::<IpAddr>().ok().and_then(A::of))
    })
}

/// A node is eligible for traffic unless it is being deleted or the autoscaler marked it for
/// deletion (kube-proxy's /healthz rule).
pub fn node_eligible(node: &Node) -> bool {
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    node.metadata.deletion_timestamp.is_none() && !tainted
}

fn service_key(name: &ServiceName) -> String {
    format!("{}/{}", name.namespace, name.name)
}

fn object_key<K: kube::Resource>(object: &K) -> String {
    format!(
        "{}/{}",
        object.meta().namespace.as_deref().unwrap_or_default(),
        object.meta().name.as_deref().unwrap_or_default()
    )
}

fn spawn_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    resource: Resource,
    tx: mpsc::Sender<(Resource, Report)>,
    service_of: fn(&K) -> Option<ServiceName>,
) where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    Object: From<K>,
{
    tokio::spawn(async move {
        let stream = watcher::watcher(api, config).default_backoff();
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            let report = match item {
                Ok(Event::Init) => Report::Relisting,
                Ok(Event::InitDone) => Report::Listed,
                Ok(Event::Apply(object) | Event::InitApply(object)) => Report::Applied {
                    version: ObjectVersion {
                        key: object_key(&object),
                        resource_version: object.resource_version().unwrap_or_default(),
                        service: service_of(&object),
                    },
                    trigger: trigger_time(&object),
                    object: object.into(),
                },
                Ok(Event::Delete(object)) => Report::Deleted {
                    key: object_key(&object),
                },
                Err(err) => Report::Failed(crate::error_chain(&err)),
            };
            if tx.send((resource, report)).await.is_err() {
                break;
            }
        }
    });
}

fn service_of_service(svc: &Service) -> Option<ServiceName> {
    Some(ServiceName {
        namespace: svc.metadata.namespace.as_deref().unwrap_or_default().into(),
        name: svc.metadata.name.as_deref()?.into(),
    })
}

/// The Service a slice belongs to, by its `kubernetes.io/service-name` label.
fn service_of_slice(slice: &EndpointSlice) -> Option<ServiceName> {
    let name = slice
        .metadata
        .labels
        .as_ref()?
        .get(convert::SERVICE_NAME_LABEL)?;
    Some(ServiceName {
        namespace: slice
            .metadata
            .namespace
            .as_deref()
            .unwrap_or_default()
            .into(),
        name: name.as_str().into(),
    })
}

fn trigger_time<K: kube::Resource>(object: &K) -> Option<Timestamp> {
    let value = object
        .meta()
        .annotations
        .as_ref()?
        .get(TRIGGER_TIME_ANNOTATION)?;
    match value.parse() {
        Ok(at) => Some(at),
        Err(err) => {
            debug!(object = %object_key(object), value, error = %err, "unparsable {TRIGGER_TIME_ANNOTATION}");
            None
        }
    }
}

/// The Node keeps only what health and topology read: a node's object carries much more.
fn trim_node(node: &mut Node) {
    node.metadata.managed_fields = None;
    node.metadata.annotations = None;
    if let Some(labels) = &mut node.metadata.labels {
        labels.retain(|k, _| k == ZONE_LABEL);
    }
    node.status = node.status.take().map(|s| NodeStatus {
        addresses: s.addresses,
        ..Default::default()
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn node(yaml: &str) -> Node {
        yaml_serde::from_str(yaml).unwrap()
    }

    #[test]
    fn node_ip_prefers_internal_ipv4() {
        let n = node(
            "metadata: {name: n1}\nstatus:\n  addresses:\n  - {type: Hostname, address: n1}\n  - {type: ExternalIP, address: 203.0.113.7}\n  - {type: InternalIP, address: 'fd00::1'}\n  - {type: InternalIP, address: 192.0.2.10}\n  - {type: InternalIP, address: 'fd00::2'}\n",
        );
        assert_eq!(node_ip(&n), Some(Ipv4Addr::new(192, 0, 2, 10)));
        assert_eq!(node_ip(&n), Some("fd00::1".parse::<Ipv6Addr>().unwrap()));
        let external_only = node(
            "metadata: {name: n1}\nstatus: {addresses: [{type: ExternalIP, address: 203.0.113.7}]}\n",
        );
        assert_eq!(node_ip(&external_only), Some(Ipv4Addr::new(203, 0, 113, 7)));
        assert_eq!(node_ip::<Ipv6Addr>(&external_only), None);
        assert_eq!(node_ip::<Ipv4Addr>(&node("metadata: {name: n1}\n")), None);
    }

    #[test]
    fn deleted_or_autoscaler_tainted_nodes_are_not_eligible() {
        assert!(node_eligible(&node("metadata: {name: n1}\n")));
        assert!(!node_eligible(&node(
            "metadata: {name: n1, deletionTimestamp: '2025-03-01T10:00:00Z'}\n"
        )));
        assert!(!node_eligible(&node(
            "metadata: {name: n1}\nspec: {taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]}\n"
        )));
    }

    #[test]
    fn trimming_keeps_what_is_used() {
        let mut n = node(
            "metadata:\n  name: n1\n  labels: {topology.kubernetes.io/zone: zone-b, other: x}\n",
        );
        trim_node(&mut n);
        assert_eq!(n.metadata.labels.as_ref().unwrap().len(), 1);
        assert_eq!(node_zone(&n), Some("zone-b"));
    }
}
