//! Network-namespace topologies, echo servers and the agent process, for the integration tests
//! and the demo. Everything here creates only namespaces of its own and removes them on drop.
pub mod agent;
pub mod bpf_objects;
pub mod bpffs;
pub mod cgroup;
pub mod echo;
pub mod fake_apiserver;
pub mod flows;
pub mod legacy_conntrack;
pub mod manifests;
pub mod multinode;
pub mod netns;
pub mod node;
pub mod overlay;
pub mod paths;
pub mod raw;
pub mod test_run;
pub mod test_run6;
pub mod topology;
pub mod transfer;
