//! The apiserver as a source: kube-runtime watchers (with backoff) on Services, EndpointSlices
//! and this node's Node feed reflector stores; a snapshot of the stores converts to the same specs
//! as the manifest source, through k8s.rs.
//!
//! Services whose map writes failed get an Event (events.rs).
//!
//! A store is only used whole: from its first complete list on, and never while it relists (the
//! reflector swaps a relist in atomically at its end, and we do not sync until then), so a watch
//! that fails halfway never deletes a live service.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt as _;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, NodeStatus, Service, ServiceStatus};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt as _, reflector::store::Writer};
use kube::{Api, Client, Resource as _, ResourceExt as _};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::change_tracker::{ChangeTracker, Kind, ObjectVersion};
use crate::events::WriteFailureEvents;
use crate::k8s::{self, InvalidField};
use crate::model::{ServiceName, Specs};
use crate::reconcile::WriteFailure;

/// The EndpointSlice annotation network programming latency is measured from.
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// The cluster autoscaler's taint on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";
/// As kube-proxy: services (and their slices) that another proxy handles, and headless ones, are
/// filtered out by the apiserver already.
pub const PROXY_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

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

/// What a watcher reported.
#[derive(Debug)]
enum Report {
    Relisting,
    Listed,
    Applied {
        object: ObjectVersion,
        trigger: Option<Timestamp>,
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

pub struct ApiSource {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    nodes: Store<Node>,
    node_name: String,
    reports: mpsc::UnboundedReceiver<(Resource, Report)>,
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
        let (tx, reports) = mpsc::unbounded_channel();
        let proxied = || watcher::Config::default().labels(PROXY_LABEL_SELECTOR);

        let (services, writer) = reflector::store();
        spawn_watch(
            Api::<Service>::all(client.clone()),
            proxied(),
            writer,
            Resource::Services,
            tx.clone(),
            trim_service,
            service_of_service,
        );
        let (slices, writer) = reflector::store();
        spawn_watch(
            Api::<EndpointSlice>::all(client.clone()),
            proxied(),
            writer,
            Resource::EndpointSlices,
            tx.clone(),
            trim_slice,
            service_of_slice,
        );
        let write_failure_events = WriteFailureEvents::start(client.clone(), node_name);
        let (nodes, writer) = reflector::store();
        spawn_watch(
            Api::<Node>::all(client),
            watcher::Config::default().fields(&format!("metadata.name={node_name}")),
            writer,
            Resource::Node,
            tx,
            trim_node,
            |_| None,
        );
        Ok(Self {
            services,
            slices,
            nodes,
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
                if let Some(kind) = tracked {
                    self.tracker.relisting(kind);
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
                if let Some(kind) = tracked {
                    self.tracker.relisted(kind);
                }
                let first = *list == ListState::NeverListed;
                *list = ListState::Whole;
                info!(?resource, first, "list complete");
                Next::Changed
            }
            Report::Applied { object, trigger } => {
                if let Some(at) = trigger
                    && at >= self.started
                    && self.trigger_seen.insert(object.key.clone(), at) != Some(at)
                {
                    self.triggers.push(at);
                }
                if let Some(kind) = tracked {
                    self.tracker.applied(kind, object);
                }
                Next::Changed
            }
            Report::Deleted { key } => {
                self.trigger_seen.remove(&key);
                if let Some(kind) = tracked {
                    self.tracker.deleted(kind, &key);
                }
                Next::Changed
            }
            Report::Failed(error) => {
                warn!(?resource, %error, "watch failed; retrying with backoff, the maps stay as they are");
                Next::Nothing
            }
        }
    }

    /// Every store holds a complete list and none is relisting.
    pub fn whole(&self) -> bool {
        self.lists.iter().all(|l| *l == ListState::Whole)
    }

    /// This node's object, once listed.
    pub fn node(&self) -> Option<Arc<Node>> {
        self.nodes
            .state()
            .into_iter()
            .find(|n| n.metadata.name.as_deref() == Some(&self.node_name))
    }

    /// The Node's first list is complete.
    pub fn node_listed(&self) -> bool {
        self.lists[Resource::Node.index()] != ListState::NeverListed
    }

    /// See [`node_eligible`]; a node that does not exist (any more) is not eligible.
    pub fn node_eligible(&self) -> bool {
        match self.node() {
            Some(node) => node_eligible(&node),
            None => !self.node_listed(),
        }
    }

    /// An Event on each Service of `failed` (whose map writes failed), at most every few
    /// minutes while they keep failing.
    pub fn report_write_failures(&mut self, failed: &BTreeMap<ServiceName, WriteFailure>) {
        let services = &self.services;
        self.write_failure_events.report(failed, |name| {
            let service = services.get(&ObjectRef::new(&name.name).within(&name.namespace))?;
            let mut reference = service.object_ref(&());
            // One Event series across the Service's changes.
            reference.resource_version = None;
            Some(reference)
        });
    }

    /// Converts the Services whose Service or slices changed since the last update into
    /// `specs`; objects k8s.rs rejects are skipped with a warning (once per version: unchanged
    /// objects are not converted again).
    pub fn update(&mut self, specs: &mut Specs) -> Update {
        let changed = self.tracker.take_changed();
        for name in &changed {
            let service = self
                .services
                .get(&ObjectRef::new(&name.name).within(&name.namespace))
                .and_then(|svc| convert(svc.as_ref(), k8s::service, &self.write_failure_events));
            match service {
                Some(spec) => specs.services.insert(name.clone(), spec),
                None => specs.services.remove(name),
            };
            let slices: BTreeMap<_, _> = self
                .tracker
                .slices_of(name)
                .filter_map(|key| {
                    let (namespace, slice) = key.split_once('/')?;
                    let object = self.slices.get(&ObjectRef::new(slice).within(namespace))?;
                    let spec = convert(
                        object.as_ref(),
                        k8s::endpoint_slice,
                        &self.write_failure_events,
                    )?;
                    Some(((key.to_owned(), 0), spec))
                })
                .collect();
            if slices.is_empty() {
                specs.slices.remove(name);
            } else {
                specs.slices.insert(name.clone(), slices);
            }
        }
        Update {
            changed,
            triggers: std::mem::take(&mut self.triggers),
        }
    }
}

/// The object as a spec; None, with a warning, if k8s.rs rejects it. The fields it skipped are
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

/// The node address: its first IPv4 InternalIP, else its first IPv4 ExternalIP (as kube-proxy
/// picks the node's host IP).
pub fn node_ip(node: &Node) -> Option<Ipv4Addr> {
    let addresses = node.status.as_ref()?.addresses.as_ref()?;
    ["InternalIP", "ExternalIP"].into_iter().find_map(|kind| {
        addresses
            .iter()
            .filter(|a| a.type_ == kind)
            .find_map(|a| match a.address.parse() {
                Ok(IpAddr::V4(ip)) => Some(ip),
                _ => None,
            })
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
    writer: Writer<K>,
    resource: Resource,
    tx: mpsc::UnboundedSender<(Resource, Report)>,
    trim: fn(&mut K),
    service_of: fn(&K) -> Option<ServiceName>,
) where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    tokio::spawn(async move {
        let stream = watcher::watcher(api, config)
            .default_backoff()
            .modify(trim)
            .reflect(writer);
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            let report = match item {
                Ok(Event::Init) => Report::Relisting,
                Ok(Event::InitDone) => Report::Listed,
                Ok(Event::Apply(object) | Event::InitApply(object)) => Report::Applied {
                    object: ObjectVersion {
                        key: object_key(&object),
                        resource_version: object.resource_version().unwrap_or_default(),
                        service: service_of(&object),
                    },
                    trigger: trigger_time(&object),
                },
                Ok(Event::Delete(object)) => Report::Deleted {
                    key: object_key(&object),
                },
                Err(err) => Report::Failed(crate::error_chain(&err)),
            };
            if tx.send((resource, report)).is_err() {
                break;
            }
        }
    });
}

fn service_of_service(svc: &Service) -> Option<ServiceName> {
    Some(ServiceName {
        namespace: svc.metadata.namespace.clone().unwrap_or_default(),
        name: svc.metadata.name.clone()?,
    })
}

/// The Service a slice belongs to, by its `kubernetes.io/service-name` label.
fn service_of_slice(slice: &EndpointSlice) -> Option<ServiceName> {
    let name = slice
        .metadata
        .labels
        .as_ref()?
        .get(k8s::SERVICE_NAME_LABEL)?;
    Some(ServiceName {
        namespace: slice.metadata.namespace.clone().unwrap_or_default(),
        name: name.clone(),
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

// The stores keep only what the model and health need: a cluster's objects carry much more.

fn trim_service(svc: &mut Service) {
    svc.metadata.managed_fields = None;
    if let Some(annotations) = &mut svc.metadata.annotations {
        annotations.retain(|k, _| k == k8s::SCHEDULER_ANNOTATION);
    }
    // The load balancer ingress IPs are served; the conditions are not read.
    svc.status = svc.status.take().map(|status| ServiceStatus {
        load_balancer: status.load_balancer,
        conditions: None,
    });
}

fn trim_slice(slice: &mut EndpointSlice) {
    slice.metadata.managed_fields = None;
    if let Some(annotations) = &mut slice.metadata.annotations {
        annotations.retain(|k, _| k == TRIGGER_TIME_ANNOTATION);
    }
}

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

    fn node(yaml: &str) -> Node {
        yaml_serde::from_str(yaml).unwrap()
    }

    #[test]
    fn node_ip_prefers_internal_ipv4() {
        let n = node(
            "metadata: {name: n1}\nstatus:\n  addresses:\n  - {type: Hostname, address: n1}\n  - {type: ExternalIP, address: 203.0.113.7}\n  - {type: InternalIP, address: 'fd00::1'}\n  - {type: InternalIP, address: 192.0.2.10}\n",
        );
        assert_eq!(node_ip(&n), Some(Ipv4Addr::new(192, 0, 2, 10)));
        let external_only = node(
            "metadata: {name: n1}\nstatus: {addresses: [{type: ExternalIP, address: 203.0.113.7}]}\n",
        );
        assert_eq!(node_ip(&external_only), Some(Ipv4Addr::new(203, 0, 113, 7)));
        assert_eq!(node_ip(&node("metadata: {name: n1}\n")), None);
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
        let mut slice: EndpointSlice = yaml_serde::from_str(
            "metadata:\n  name: s\n  annotations: {endpoints.kubernetes.io/last-change-trigger-time: '2025-03-01T10:00:00Z', other: x}\n  managedFields: [{manager: kcm}]\naddressType: IPv4\nendpoints: []\n",
        )
        .unwrap();
        trim_slice(&mut slice);
        assert!(slice.metadata.managed_fields.is_none());
        assert_eq!(
            trigger_time(&slice),
            Some("2025-03-01T10:00:00Z".parse().unwrap())
        );
        assert_eq!(slice.metadata.annotations.unwrap().len(), 1);

        let mut svc: Service = yaml_serde::from_str(
            "metadata:\n  name: web\n  annotations: {lb.kubernetes.io/scheduler: maglev, other: x}\n",
        )
        .unwrap();
        trim_service(&mut svc);
        let annotations = svc.metadata.annotations.unwrap();
        assert_eq!(annotations.len(), 1);
        assert_eq!(annotations[k8s::SCHEDULER_ANNOTATION], "maglev");

        let mut n = node(
            "metadata:\n  name: n1\n  labels: {topology.kubernetes.io/zone: zone-b, other: x}\n",
        );
        trim_node(&mut n);
        assert_eq!(n.metadata.labels.as_ref().unwrap().len(), 1);
        assert_eq!(node_zone(&n), Some("zone-b"));
    }
}
