//! The agent: desired state from manifests, one reconciler into the eBPF maps.
pub mod datapath;
pub mod k8s;
pub mod manifests;
pub mod model;
pub mod nodeport;
pub mod reconcile;
