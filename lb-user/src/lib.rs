//! The agent: desired state from manifests, one reconciler into the eBPF maps.
pub mod apiserver;
pub mod bpf_link;
pub mod bpffs;
pub mod cgroup_hooks;
pub mod cgroup_mount;
pub mod change_tracker;
pub mod coalesce;
pub mod connections;
pub mod datapath;
pub mod events;
pub mod forward_rules;
pub mod health;
pub mod k8s;
pub mod link_pins;
pub mod links;
pub mod maglev;
pub mod manifests;
pub mod map_batch;
pub mod map_pins;
pub mod metrics;
pub mod model;
pub mod node_addresses;
pub mod node_sysctls;
pub mod nodeport;
pub mod pins;
pub mod reconcile;
pub mod service_health;
pub mod stats_slots;
pub mod sync_status;
pub mod udp_flush;
pub mod xdp_targets;

/// `error: cause: cause`: aya's errors keep the OS error in their source, not their message.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
