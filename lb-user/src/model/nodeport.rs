//! nodePorts for NodePort/LoadBalancer service ports whose source gave none (the manifest
//! directory: no apiserver allocated them).
//!
//! The first choice is derived from a hash of the port's identity, so it is the same across agent
//! restarts as long as nothing else holds that port; once given, a port stays with its service
//! port across syncs unless a manifest claims it explicitly.
use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;

use tracing::warn;

use crate::model::id::ServicePortId;

#[derive(Debug)]
pub struct NodePortAllocator {
    range: RangeInclusive<u16>,
    assigned: BTreeMap<ServicePortId, u16>,
}

impl NodePortAllocator {
    pub fn new(range: RangeInclusive<u16>) -> Self {
        Self {
            range,
            assigned: BTreeMap::new(),
        }
    }

    /// The ports given by the last [`NodePortAllocator::assign`].
    pub fn assigned(&self) -> &BTreeMap<ServicePortId, u16> {
        &self.assigned
    }

    /// Gives each of `wanted` a port in the range that is not in `explicit` (the nodePorts the
    /// manifests name) nor given to another. Ports of service ports no longer wanted are freed.
    /// A port that cannot get one (range exhausted) is left out, with a warning.
    pub fn assign(
        &mut self,
        explicit: &BTreeSet<u16>,
        wanted: &[ServicePortId],
    ) -> BTreeMap<ServicePortId, u16> {
        let mut used = explicit.clone();
        let mut assigned = BTreeMap::new();
        let mut fresh = Vec::new();
        for id in wanted {
            match self.assigned.get(id) {
                Some(&port) if self.range.contains(&port) && used.insert(port) => {
                    assigned.insert(id.clone(), port);
                }
                _ => fresh.push(id),
            }
        }
        let start = u32::from(*self.range.start());
        let size = u32::from(*self.range.end()) - start + 1;
        for id in fresh {
            let first = fnv1a(&id.to_string()) % size;
            let free = (0..size)
                .map(|i| (start + (first + i) % size) as u16)
                .find(|port| !used.contains(port));
            match free {
                Some(port) => {
                    used.insert(port);
                    assigned.insert(id.clone(), port);
                }
                None => {
                    warn!(service_port = %id, "nodePort range exhausted: not exposed on the node")
                }
            }
        }
        self.assigned = assigned.clone();
        assigned
    }
}

/// FNV-1a: a stable hash (std's hashers may change between Rust releases).
fn fnv1a(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::id::{Protocol, ServiceName};

    fn id(name: &str) -> ServicePortId {
        ServicePortId {
            service: ServiceName {
                namespace: "default".into(),
                name: name.into(),
            },
            port_name: "http".into(),
            protocol: Protocol::Tcp,
        }
    }

    #[test]
    fn allocation_is_deterministic_and_in_range() {
        let wanted = [id("a"), id("b"), id("c")];
        let first = NodePortAllocator::new(30000..=32767).assign(&BTreeSet::new(), &wanted);
        let second = NodePortAllocator::new(30000..=32767).assign(&BTreeSet::new(), &wanted);
        assert_eq!(first, second);
        assert_eq!(first.len(), 3);
        let ports: BTreeSet<u16> = first.values().copied().collect();
        assert_eq!(ports.len(), 3);
        assert!(ports.iter().all(|p| (30000..=32767).contains(p)));
    }

    #[test]
    fn a_given_port_is_kept_while_others_come_and_go() {
        let mut alloc = NodePortAllocator::new(30000..=32767);
        let a = alloc.assign(&BTreeSet::new(), &[id("a")])[&id("a")];
        let b = alloc.assign(&BTreeSet::new(), &[id("b"), id("a")]);
        assert_eq!(b[&id("a")], a);
        let c = alloc.assign(&BTreeSet::new(), &[id("a")]);
        assert_eq!(c[&id("a")], a);
    }

    #[test]
    fn explicit_ports_are_never_handed_out_and_collisions_probe() {
        let mut alloc = NodePortAllocator::new(30000..=30001);
        let explicit = BTreeSet::from([30000]);
        let got = alloc.assign(&explicit, &[id("a"), id("b")]);
        assert_eq!(got.len(), 1);
        assert_eq!(got.values().next(), Some(&30001));

        let mut alloc = NodePortAllocator::new(30000..=30000);
        let first = alloc.assign(&BTreeSet::new(), &[id("a")]);
        assert_eq!(first[&id("a")], 30000);
        let taken = alloc.assign(&BTreeSet::from([30000]), &[id("a")]);
        assert!(taken.is_empty());
    }
}
