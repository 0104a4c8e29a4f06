//! What the service maps hold, as the reconciler wants them and as `lb status` reads them: the
//! type every side of a sync shares, in a leaf so that none of them imports another for it.
//! Each family has its own maps (docs/ipv6.md): [`MapContents`] for IPv4, [`MapContents6`] for
//! IPv6, one type over [`MapFamily`].
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{DefaultHasher, Hasher};
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::Ipv4Net;
use lb_common::{
    Addr6, Backend, Backend6, BackendKey, Frontend, FrontendKey, FrontendKey6, FrontendOrigin,
    ServiceStatus, ipv4_be, port_be,
};

use crate::compact::compact;
use crate::model::Family;

/// An entry of `SOURCE_RANGES` (`SOURCE_RANGES6` for an `Ipv6Net`): sources in `net` may reach
/// the load balancer IPs of service port `service_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SourceRange<N = Ipv4Net> {
    pub service_id: u32,
    pub net: N,
}

/// An endpoint as a `BACKENDS` or `BACKENDS6` value holds it.
pub trait BackendValue: Copy + Ord + fmt::Debug {
    /// The endpoint alone, without its counter slot.
    fn endpoint(&self) -> Self;
    /// The bytes the Maglev permutation of the endpoint hashes: its address and port as they
    /// sit in the map.
    fn maglev_name(&self) -> Vec<u8>;
}

impl BackendValue for Backend {
    fn endpoint(&self) -> Self {
        Backend::endpoint(self)
    }
    fn maglev_name(&self) -> Vec<u8> {
        [self.addr.to_ne_bytes().as_slice(), &self.port.to_ne_bytes()].concat()
    }
}

impl BackendValue for Backend6 {
    fn endpoint(&self) -> Self {
        Backend6::endpoint(self)
    }
    fn maglev_name(&self) -> Vec<u8> {
        [self.addr.octets().as_slice(), &self.port.to_ne_bytes()].concat()
    }
}

/// The service map entries of one family: `FRONTENDS` and `BACKENDS` for IPv4, their twins
/// for IPv6.
pub trait MapFamily: Family {
    type FrontendKey: Copy + Ord + fmt::Debug;
    type Backend: BackendValue;
    fn frontend_key(addr: Self, port: u16, proto: u8) -> Self::FrontendKey;
    /// The catch-all key of a ClusterIP.
    fn any_port(addr: Self) -> Self::FrontendKey;
    /// The key's address.
    fn frontend_addr(key: &Self::FrontendKey) -> Self;
    /// The key's port, host byte order (0: a catch-all).
    fn frontend_port(key: &Self::FrontendKey) -> u16;
    /// The key's `IPPROTO_*` (0: a catch-all).
    fn frontend_proto(key: &Self::FrontendKey) -> u8;
    /// The endpoint `addr`:`port`, not counted.
    fn backend(addr: Self, port: u16) -> Self::Backend;
}

impl MapFamily for Ipv4Addr {
    type FrontendKey = FrontendKey;
    type Backend = Backend;
    fn frontend_key(addr: Self, port: u16, proto: u8) -> FrontendKey {
        FrontendKey {
            addr: ipv4_be(addr.octets()),
            port: port_be(port),
            proto,
            _pad: 0,
        }
    }
    fn any_port(addr: Self) -> FrontendKey {
        FrontendKey::any_port(ipv4_be(addr.octets()))
    }
    fn frontend_addr(key: &FrontendKey) -> Self {
        Ipv4Addr::from(key.addr.to_ne_bytes())
    }
    fn frontend_port(key: &FrontendKey) -> u16 {
        u16::from_be(key.port)
    }
    fn frontend_proto(key: &FrontendKey) -> u8 {
        key.proto
    }
    fn backend(addr: Self, port: u16) -> Backend {
        Backend {
            addr: ipv4_be(addr.octets()),
            port: port_be(port),
            stats_slot: 0,
        }
    }
}

impl MapFamily for Ipv6Addr {
    type FrontendKey = FrontendKey6;
    type Backend = Backend6;
    fn frontend_key(addr: Self, port: u16, proto: u8) -> FrontendKey6 {
        FrontendKey6 {
            addr: Addr6::from_octets(addr.octets()),
            port: port_be(port),
            proto,
            _pad: 0,
        }
    }
    fn any_port(addr: Self) -> FrontendKey6 {
        FrontendKey6::any_port(Addr6::from_octets(addr.octets()))
    }
    fn frontend_addr(key: &FrontendKey6) -> Self {
        Ipv6Addr::from(key.addr.octets())
    }
    fn frontend_port(key: &FrontendKey6) -> u16 {
        u16::from_be(key.port)
    }
    fn frontend_proto(key: &FrontendKey6) -> u8 {
        key.proto
    }
    fn backend(addr: Self, port: u16) -> Backend6 {
        Backend6 {
            addr: Addr6::from_octets(addr.octets()),
            port: port_be(port),
            stats_slot: 0,
        }
    }
}

/// How a [`FamilyContents`] holds the records that only `lb services` and `lb status` read
/// (origins and status records): [`Whole`], as the maps hold them, or as [`Digests`].
pub trait Records: Clone + fmt::Debug + PartialEq + Eq {
    type Origin: Copy + fmt::Debug + PartialEq + Eq;
    type Status: Copy + fmt::Debug + PartialEq + Eq;
    fn origin(origin: &FrontendOrigin) -> Self::Origin;
    fn status(status: &ServiceStatus) -> Self::Status;
}

/// Records as the maps hold them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Whole;

impl Records for Whole {
    type Origin = FrontendOrigin;
    type Status = ServiceStatus;
    fn origin(origin: &FrontendOrigin) -> FrontendOrigin {
        *origin
    }
    fn status(status: &ServiceStatus) -> ServiceStatus {
        *status
    }
}

/// Records as digests of their bytes: what the reconciler keeps of what it wrote, to tell
/// whether a record changed (16 bytes an entry instead of 156 for an origin, 308 for a status
/// record).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Digests;

impl Records for Digests {
    type Origin = Digest;
    type Status = Digest;
    fn origin(origin: &FrontendOrigin) -> Digest {
        Digest::of(bytemuck::bytes_of(origin))
    }
    fn status(status: &ServiceStatus) -> Digest {
        Digest::of(bytemuck::bytes_of(status))
    }
}

/// A 64-bit hash of a record's bytes. Never leaves the process, so the hash need not be stable
/// across builds; two different records share one with odds of 2^-64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Digest(u64);

impl Digest {
    pub fn of(bytes: &[u8]) -> Digest {
        let mut hasher = DefaultHasher::new();
        hasher.write(bytes);
        Digest(hasher.finish())
    }
}

/// Contents of one family's service maps, desired or read back; with [`Digests`], what the
/// reconciler wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FamilyContents<A: MapFamily, R: Records = Whole> {
    pub frontends: BTreeMap<A::FrontendKey, Frontend>,
    pub backends: BTreeMap<BackendKey, A::Backend>,
    pub source_ranges: BTreeSet<SourceRange<A::Net>>,
    /// The Service port and kind of each frontend but the catch-alls (for `lb services`).
    pub origins: BTreeMap<A::FrontendKey, R::Origin>,
    /// What each service port wants the other maps to hold, by service id (for `lb status`);
    /// written after them at each sync. IPv4's only (one record per service id counts both
    /// families' entries): an IPv6 contents' is empty.
    pub statuses: BTreeMap<u32, R::Status>,
}

/// The IPv4 service maps' contents.
pub type MapContents = FamilyContents<Ipv4Addr>;
/// The IPv6 service maps' contents.
pub type MapContents6 = FamilyContents<Ipv6Addr>;

impl<A: MapFamily, R: Records> Default for FamilyContents<A, R> {
    fn default() -> Self {
        FamilyContents {
            frontends: BTreeMap::new(),
            backends: BTreeMap::new(),
            source_ranges: BTreeSet::new(),
            origins: BTreeMap::new(),
            statuses: BTreeMap::new(),
        }
    }
}

impl<A: MapFamily> FamilyContents<A> {
    /// These contents with their records as `R` holds them.
    pub fn recorded<R: Records>(&self) -> FamilyContents<A, R> {
        FamilyContents {
            frontends: self.frontends.clone(),
            backends: self.backends.clone(),
            source_ranges: self.source_ranges.clone(),
            origins: self
                .origins
                .iter()
                .map(|(k, o)| (*k, R::origin(o)))
                .collect(),
            statuses: self
                .statuses
                .iter()
                .map(|(k, s)| (*k, R::status(s)))
                .collect(),
        }
    }
}

impl<A: MapFamily, R: Records> FamilyContents<A, R> {
    /// How many entries of `self` and `other` differ: in one only, or with other values.
    pub fn differences(&self, other: &FamilyContents<A>) -> usize {
        fn differing<K: Ord, V, W: PartialEq>(
            a: &BTreeMap<K, W>,
            b: &BTreeMap<K, V>,
            recorded: impl Fn(&V) -> W,
        ) -> usize {
            let changed_or_lost = a
                .iter()
                .filter(|(k, w)| b.get(k).map(&recorded).as_ref() != Some(*w))
                .count();
            changed_or_lost + b.keys().filter(|k| !a.contains_key(k)).count()
        }
        differing(&self.frontends, &other.frontends, |f| *f)
            + differing(&self.backends, &other.backends, |b| *b)
            + differing(&self.origins, &other.origins, R::origin)
            + differing(&self.statuses, &other.statuses, R::status)
            + self
                .source_ranges
                .symmetric_difference(&other.source_ranges)
                .count()
    }

    /// Rebuilds the maps with full nodes, after a bulk change ([`crate::compact`]).
    pub fn compact(&mut self) {
        compact(&mut self.frontends);
        compact(&mut self.backends);
        compact(&mut self.source_ranges);
        compact(&mut self.origins);
        compact(&mut self.statuses);
    }

    /// The largest service id the entries hold (0: none).
    pub fn max_service_id(&self) -> u32 {
        self.frontends
            .values()
            .map(|f| f.service_id)
            .chain(self.backends.keys().map(|k| k.service_id))
            .max()
            .unwrap_or(0)
    }
}
