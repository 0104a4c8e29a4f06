//! The agent: desired state from manifests, one reconciler into the eBPF maps.
pub mod datapath;
