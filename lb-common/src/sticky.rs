//! Remembered endpoint choices of either family ([`StickyBackend`], [`StickyBackend6`]), which
//! sessionAffinity and the node's unconnected UDP sockets keep: whether one still holds for a new
//! flow, pure so that host tests run it; the datapath's affinity.rs runs it over its maps.

use crate::{Backend, Backend6, StickyBackend, StickyBackend6};

/// An endpoint of either family ([`Backend`], [`Backend6`]).
pub trait Endpoint: Copy + Default + PartialEq {
    /// The endpoint alone, without its counter slot (`Backend::endpoint`).
    fn identity(&self) -> Self;
}

impl Endpoint for Backend {
    fn identity(&self) -> Self {
        self.endpoint()
    }
}

impl Endpoint for Backend6 {
    fn identity(&self) -> Self {
        self.endpoint()
    }
}

/// A remembered choice: the endpoint a flow went to, the slot it sat in, and when it was last
/// used.
pub trait Sticky {
    type Backend: Endpoint;

    /// What remembers that a flow went to `backend` in `slot` at `now`.
    fn new(slot: u32, backend: Self::Backend, now: u64) -> Self;
    fn slot(&self) -> u32;
    fn backend(&self) -> &Self::Backend;
    fn last_seen_ns(&self) -> u64;
    fn touch(&mut self, now: u64);

    /// The remembered slot and the endpoint it holds now, if the choice was used at most
    /// `timeout_ns` before `now` and the slot still holds its endpoint; refreshed to `now`.
    /// `holding` gives the endpoint in a slot of the list the new flow uses, `None` for a slot
    /// outside that list or empty.
    // Inlined: the datapath's BPF functions cannot return a result larger than a register.
    #[inline(always)]
    fn reuse(
        &mut self,
        timeout_ns: u64,
        now: u64,
        holding: impl FnOnce(u32) -> Option<Self::Backend>,
    ) -> Option<(u32, Self::Backend)> {
        // Saturating: another CPU may have stored a later timestamp than our `now`.
        if now.saturating_sub(self.last_seen_ns()) > timeout_ns {
            return None;
        }
        let slot = self.slot();
        let current = holding(slot)?;
        // By endpoint: one whose counter slot changed (an agent upgrade gives every endpoint one)
        // keeps its flows.
        if current.identity() != self.backend().identity() {
            return None;
        }
        self.touch(now);
        Some((slot, current))
    }
}

impl Sticky for StickyBackend {
    type Backend = Backend;

    fn new(slot: u32, backend: Backend, now: u64) -> Self {
        StickyBackend {
            last_seen_ns: now,
            backend,
            slot,
            _pad: 0,
        }
    }

    fn slot(&self) -> u32 {
        self.slot
    }

    fn backend(&self) -> &Backend {
        &self.backend
    }

    fn last_seen_ns(&self) -> u64 {
        self.last_seen_ns
    }

    fn touch(&mut self, now: u64) {
        self.last_seen_ns = now;
    }
}

impl Sticky for StickyBackend6 {
    type Backend = Backend6;

    fn new(slot: u32, backend: Backend6, now: u64) -> Self {
        StickyBackend6 {
            last_seen_ns: now,
            backend,
            slot,
        }
    }

    fn slot(&self) -> u32 {
        self.slot
    }

    fn backend(&self) -> &Backend6 {
        &self.backend
    }

    fn last_seen_ns(&self) -> u64 {
        self.last_seen_ns
    }

    fn touch(&mut self, now: u64) {
        self.last_seen_ns = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Addr6;

    const SECOND: u64 = 1_000_000_000;

    fn backend6(last: u8, stats_slot: u16) -> Backend6 {
        let mut octets = [0u8; 16];
        octets[..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
        octets[15] = last;
        Backend6 {
            addr: Addr6::from_octets(octets),
            port: 8080u16.to_be(),
            stats_slot,
        }
    }

    /// Both families decide alike: within the timeout the slot's endpoint is reused and the
    /// entry refreshed; past it, or once the slot holds another endpoint or is outside the
    /// list, it is not, and the entry is left as it was.
    fn decides<S: Sticky + Copy>(endpoint: S::Backend, other: S::Backend)
    where
        S::Backend: core::fmt::Debug,
    {
        let remembered = S::new(2, endpoint, 10 * SECOND);
        let timeout = 5 * SECOND;

        let mut fresh = remembered;
        assert_eq!(
            fresh.reuse(timeout, 15 * SECOND, |slot| (slot == 2).then_some(endpoint)),
            Some((2, endpoint)),
            "at the timeout"
        );
        assert_eq!(fresh.last_seen_ns(), 15 * SECOND, "refreshed");

        for (now, holding, case) in [
            (15 * SECOND + 1, Some(endpoint), "expired"),
            (11 * SECOND, Some(other), "moved"),
            (11 * SECOND, None, "out of the list"),
        ] {
            let mut entry = remembered;
            assert_eq!(entry.reuse(timeout, now, |_| holding), None, "{case}");
            assert_eq!(entry.last_seen_ns(), 10 * SECOND, "{case}: not refreshed");
        }

        // Another CPU stored a later use than this one's clock.
        let mut ahead = remembered;
        assert_eq!(
            ahead.reuse(timeout, 9 * SECOND, |_| Some(endpoint)),
            Some((2, endpoint))
        );
    }

    #[test]
    fn a_choice_holds_within_its_timeout_while_its_slot_holds_its_endpoint() {
        decides::<StickyBackend6>(backend6(0xb, 0), backend6(0xc, 0));
        let v4 = |addr: u32| Backend {
            addr,
            port: 8080u16.to_be(),
            stats_slot: 0,
        };
        decides::<StickyBackend>(v4(0x0a00_000b), v4(0x0a00_000c));
    }

    /// The endpoint is compared without its counter slot: one that got a new slot keeps its
    /// clients, and the new slot is what comes back.
    #[test]
    fn a_new_counter_slot_keeps_the_choice() {
        let mut entry = StickyBackend6::new(1, backend6(0xb, 3), SECOND);
        let renumbered = backend6(0xb, 9);
        assert_eq!(
            entry.reuse(SECOND, 2 * SECOND, |_| Some(renumbered)),
            Some((1, renumbered))
        );
    }
}
