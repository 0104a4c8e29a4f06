//! Which `BACKEND_STATS` slot counts each endpoint of a service port (`Backend::stats_slot`).
//!
//! The datapath finds an established packet's counters by the index its conntrack entry holds,
//! so the agent hands the indexes out: one per (service port, endpoint), written into every
//! backend slot of the endpoint. A slot is claimed (written zeroed with its owner tag, on every
//! CPU) before any backend refers to it, and released when the endpoint leaves its service port.
//! The assignment lives in the pinned backends themselves: a restarted agent reads it back and
//! keeps it, so the counters survive it.
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use lb_common::{Backend, Backend6, BackendKey, mix32};

use crate::compact::compact;

/// The counter slots `slots` (the backends' `stats_slot`s, of either family) refer to (slot 0,
/// "not counted", left out).
pub fn in_use(slots: impl IntoIterator<Item = u16>) -> BTreeSet<u16> {
    slots.into_iter().filter(|&slot| slot != 0).collect()
}

/// An endpoint of either family, without its counter slot: the slots of `BACKEND_STATS` are
/// shared by both families' backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FamilyBackend {
    V4(Backend),
    V6(Backend6),
}

impl From<&Backend> for FamilyBackend {
    fn from(backend: &Backend) -> Self {
        FamilyBackend::V4(backend.endpoint())
    }
}

impl From<&Backend6> for FamilyBackend {
    fn from(backend: &Backend6) -> Self {
        FamilyBackend::V6(backend.endpoint())
    }
}

/// An endpoint of one service port: what a counter slot counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PortEndpoint {
    pub service_id: u32,
    pub backend: FamilyBackend,
}

impl PortEndpoint {
    pub fn new(service_id: u32, backend: impl Into<FamilyBackend>) -> Self {
        Self {
            service_id,
            backend: backend.into(),
        }
    }

    /// The `BackendStats::owner` of its slot: a hash of the endpoint, never 0. A pure function of
    /// the endpoint, so that a restarted agent needs no other state to know it. Two endpoints
    /// that follow one another in a slot share a tag with odds of 2^-32; the first one's
    /// lingering connections would then count for the second.
    pub fn owner(&self) -> u32 {
        let h = mix32(self.service_id ^ 0x9e37_79b9);
        let (h, port) = match self.backend {
            FamilyBackend::V4(backend) => (mix32(h ^ backend.addr), backend.port),
            FamilyBackend::V6(backend) => {
                let a = backend.addr;
                let h = [a.w0, a.w1, a.w2, a.w3]
                    .into_iter()
                    .fold(h, |h, word| mix32(h ^ word));
                (h, backend.port)
            }
        };
        mix32(h ^ u32::from(port)).max(1)
    }
}

/// A slot to write, zeroed, with `owner` on every CPU: 0 for a released one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatsReset {
    pub slot: u16,
    pub owner: u32,
    /// The service port it is or was claimed for (to name a failed write).
    pub service_id: u32,
}

#[derive(Debug, Default)]
pub struct StatsSlots {
    /// Slots `1..capacity` are handed out; 0 is "not counted".
    capacity: u32,
    assigned: BTreeMap<PortEndpoint, u16>,
    /// Released slots, oldest first: a slot is handed out again as late as possible.
    free: VecDeque<u16>,
    /// Slots from here up have never been handed out.
    next: u32,
    /// Assigned, not yet claimed in the map.
    unclaimed: BTreeMap<u16, PortEndpoint>,
    /// Assigned since [`StatsSlots::take_assigned`].
    assigned_since: Vec<PortEndpoint>,
    /// Endpoints that found no free slot since [`StatsSlots::take_uncounted`].
    uncounted: BTreeSet<PortEndpoint>,
}

impl StatsSlots {
    /// `capacity`: the map's size (at most `MAX_BACKEND_STATS`). Keeps the slots `backends` and
    /// `backends6` (the pinned backends at start) already give their endpoints; a slot claimed
    /// twice stays the first endpoint's (IPv4's first), the other gets a new one.
    pub fn adopt(
        capacity: u32,
        backends: &BTreeMap<BackendKey, Backend>,
        backends6: &BTreeMap<BackendKey, Backend6>,
    ) -> Self {
        let capacity = capacity.min(lb_common::MAX_BACKEND_STATS);
        let mut slots = StatsSlots {
            capacity,
            next: 1,
            ..Default::default()
        };
        let mut taken = BTreeSet::new();
        let v4 = backends
            .iter()
            .map(|(key, b)| (b.stats_slot, PortEndpoint::new(key.service_id, b)));
        let v6 = backends6
            .iter()
            .map(|(key, b)| (b.stats_slot, PortEndpoint::new(key.service_id, b)));
        for (slot, endpoint) in v4.chain(v6) {
            if slot == 0
                || u32::from(slot) >= capacity
                || slots.assigned.contains_key(&endpoint)
                || !taken.insert(slot)
            {
                continue;
            }
            slots.assigned.insert(endpoint, slot);
        }
        slots.next = taken.last().map_or(1, |&last| u32::from(last) + 1);
        slots.free = (1..slots.next)
            .filter_map(|s| u16::try_from(s).ok())
            .filter(|s| !taken.contains(s))
            .collect();
        slots
    }

    /// The slot of `endpoint`, handed out now if it has none; 0 when none is free.
    pub fn slot(&mut self, endpoint: PortEndpoint) -> u16 {
        if let Some(&slot) = self.assigned.get(&endpoint) {
            return slot;
        }
        let fresh = self.free.pop_front().or_else(|| {
            let slot = u16::try_from(self.next)
                .ok()
                .filter(|_| self.next < self.capacity)?;
            self.next += 1;
            Some(slot)
        });
        let Some(slot) = fresh else {
            // Without a map (capacity 0) nothing is counted by design, not for want of room.
            if self.capacity() > 0 {
                self.uncounted.insert(endpoint);
            }
            return 0;
        };
        self.assigned.insert(endpoint, slot);
        self.unclaimed.insert(slot, endpoint);
        self.assigned_since.push(endpoint);
        slot
    }

    /// Rebuilds the assignment with full nodes, after a bulk change ([`crate::compact`]).
    pub fn compact(&mut self) {
        compact(&mut self.assigned);
    }

    /// The slots to claim before the backends that refer to them are written.
    pub fn unclaimed(&self) -> Vec<StatsReset> {
        self.unclaimed
            .iter()
            .map(|(&slot, endpoint)| StatsReset {
                slot,
                owner: endpoint.owner(),
                service_id: endpoint.service_id,
            })
            .collect()
    }

    pub fn claimed(&mut self, slot: u16) {
        self.unclaimed.remove(&slot);
    }

    /// Frees `endpoint`'s slot, if it has one; returns the reset that stops its counting.
    pub fn release(&mut self, endpoint: &PortEndpoint) -> Option<StatsReset> {
        let slot = self.assigned.remove(endpoint)?;
        self.free.push_back(slot);
        // Never claimed: nothing in the map to reset.
        if self.unclaimed.remove(&slot).is_some() {
            return None;
        }
        Some(StatsReset {
            slot,
            owner: 0,
            service_id: endpoint.service_id,
        })
    }

    /// The endpoints given a slot since the last call.
    pub fn take_assigned(&mut self) -> Vec<PortEndpoint> {
        std::mem::take(&mut self.assigned_since)
    }

    /// How many endpoints found no free slot since the last call.
    pub fn take_uncounted(&mut self) -> usize {
        std::mem::take(&mut self.uncounted).len()
    }

    /// Slots that can count an endpoint (the map's size but slot 0).
    pub fn capacity(&self) -> u32 {
        self.capacity.saturating_sub(1)
    }

    pub fn in_use(&self) -> usize {
        self.assigned.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{ipv4_be, port_be};

    fn backend(last: u8) -> Backend {
        Backend {
            addr: ipv4_be([10, 244, 1, last]),
            port: port_be(8080),
            stats_slot: 0,
        }
    }

    fn endpoint(service_id: u32, last: u8) -> PortEndpoint {
        PortEndpoint::new(service_id, &backend(last))
    }

    fn backend6(last: u8) -> Backend6 {
        let mut octets = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        octets[15] = last;
        Backend6 {
            addr: lb_common::Addr6::from_octets(octets),
            port: port_be(8080),
            stats_slot: 0,
        }
    }

    #[test]
    fn slots_are_handed_out_once_per_endpoint_and_reused_last() {
        let mut slots = StatsSlots::adopt(4, &BTreeMap::new(), &BTreeMap::new());
        assert_eq!(slots.capacity(), 3);
        assert_eq!(slots.slot(endpoint(1, 2)), 1);
        assert_eq!(slots.slot(endpoint(1, 2)), 1, "the same endpoint");
        assert_eq!(slots.slot(endpoint(2, 2)), 2, "another service port");
        assert_eq!(slots.slot(endpoint(1, 3)), 3);
        assert_eq!(slots.slot(endpoint(1, 4)), 0, "none left: not counted");
        assert_eq!(slots.take_uncounted(), 1);
        let claims: Vec<u16> = slots.unclaimed().iter().map(|r| r.slot).collect();
        assert_eq!(claims, [1, 2, 3]);
        for slot in claims {
            slots.claimed(slot);
        }
        assert_eq!(
            slots.release(&endpoint(1, 2)),
            Some(StatsReset {
                slot: 1,
                owner: 0,
                service_id: 1
            })
        );
        assert_eq!(slots.release(&endpoint(1, 2)), None, "released once");
        assert_eq!(slots.slot(endpoint(1, 4)), 1, "the freed slot");
        assert_eq!(
            slots.unclaimed(),
            [StatsReset {
                slot: 1,
                owner: endpoint(1, 4).owner(),
                service_id: 1
            }]
        );
        assert_ne!(endpoint(1, 4).owner(), endpoint(1, 2).owner());
        // Released before it was claimed: nothing to reset.
        assert_eq!(slots.release(&endpoint(1, 4)), None);
        assert!(slots.unclaimed().is_empty());
        assert_eq!(slots.in_use(), 2);
    }

    #[test]
    fn a_restarted_agent_keeps_the_pinned_assignment() {
        let key = |service_id, slot| BackendKey { service_id, slot };
        let with_slot = |last, stats_slot| Backend {
            stats_slot,
            ..backend(last)
        };
        let pinned = BTreeMap::from([
            // One endpoint in two slots of its list.
            (key(1, 0), with_slot(2, 3)),
            (key(1, 1), with_slot(2, 3)),
            (key(1, 2), with_slot(3, 5)),
            // Claims a slot already taken: gets another.
            (key(2, 0), with_slot(2, 5)),
            // Beyond the map (it was resized): gets another.
            (key(3, 0), with_slot(2, 9)),
        ]);
        let mut slots = StatsSlots::adopt(8, &pinned, &BTreeMap::new());
        assert_eq!(slots.slot(endpoint(1, 2)), 3);
        assert_eq!(slots.slot(endpoint(1, 3)), 5);
        assert!(slots.unclaimed().is_empty(), "kept slots are not reset");
        assert_eq!(slots.slot(endpoint(2, 2)), 1, "the lowest free one");
        assert_eq!(slots.slot(endpoint(3, 2)), 2);
        assert_eq!(slots.slot(endpoint(3, 3)), 4);
        assert_eq!(slots.slot(endpoint(3, 4)), 6, "then past the highest kept");
        assert_eq!(slots.slot(endpoint(3, 5)), 7);
        assert_eq!(slots.slot(endpoint(3, 6)), 0);
    }

    #[test]
    fn ipv6_endpoints_share_the_slots_and_a_restart_keeps_theirs() {
        let mut slots = StatsSlots::adopt(5, &BTreeMap::new(), &BTreeMap::new());
        let v6 = |service_id, last| PortEndpoint::new(service_id, &backend6(last));
        assert_eq!(slots.slot(endpoint(1, 2)), 1);
        assert_eq!(
            slots.slot(v6(1, 2)),
            2,
            "an IPv6 endpoint gets a slot of its own"
        );
        assert_eq!(slots.slot(v6(1, 2)), 2);
        assert_eq!(slots.slot(v6(2, 2)), 3, "another service port");
        assert_ne!(v6(1, 2).owner(), endpoint(1, 2).owner());
        assert_ne!(v6(1, 2).owner(), v6(1, 3).owner());
        assert_ne!(v6(1, 2).owner(), 0);

        let key = |slot| BackendKey {
            service_id: 1,
            slot,
        };
        let pinned = BTreeMap::from([(
            key(0),
            Backend {
                stats_slot: 1,
                ..backend(2)
            },
        )]);
        let pinned6 = BTreeMap::from([
            (
                key(0),
                Backend6 {
                    stats_slot: 4,
                    ..backend6(2)
                },
            ),
            // IPv4's slot: IPv4's it stays.
            (
                key(1),
                Backend6 {
                    stats_slot: 1,
                    ..backend6(3)
                },
            ),
        ]);
        let mut slots = StatsSlots::adopt(5, &pinned, &pinned6);
        assert_eq!(slots.slot(v6(1, 2)), 4);
        assert_eq!(slots.slot(endpoint(1, 2)), 1);
        assert!(slots.unclaimed().is_empty(), "kept slots are not reset");
        assert_eq!(slots.slot(v6(1, 3)), 2);
    }
}
