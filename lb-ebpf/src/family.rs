//! The two address families, for the code written once over both: backend selection and
//! sessionAffinity (service.rs, affinity.rs), the node sockets' UDP flows (sock.rs) and the
//! records of fragmented datagrams (fragment.rs). Each
//! family names its types and maps here; the shared code is monomorphised per family, as it is
//! per program type over `PacketAccess`.
use lb_common::{
    Addr6, AffinityKey, AffinityKey6, Backend, Backend6, BackendKey, ConntrackKey, ConntrackKey6,
    FirstFragment, FragmentKey, FragmentKey6, FrontendKey, FrontendKey6, IPPROTO_UDP,
    SockBackendKey, SockBackendKey6, StickyBackend, StickyBackend6, flow_hash, flow_hash6,
    source_hash, source_hash6,
    sticky::{Endpoint, Sticky},
};

use crate::maps;

pub trait Family {
    /// A client address.
    type Addr;
    /// A connection's 5-tuple as it arrives.
    type Tuple;
    type Backend: Endpoint;
    /// A remembered choice (sessionAffinity's, a node socket's UDP flow's).
    type Sticky: Sticky<Backend = Self::Backend> + 'static;
    /// Key of a node socket's UDP flow to a service port.
    type SockFlow;
    /// What names the fragments of one datagram.
    type FragmentKey;

    fn backend(key: &BackendKey) -> Option<Self::Backend>;
    fn client(tuple: &Self::Tuple) -> &Self::Addr;
    fn proto(tuple: &Self::Tuple) -> u8;
    /// The `sh` scheduler's hash of `client`.
    fn source_hash(client: &Self::Addr) -> u32;
    /// The Maglev scheduler's hash of `tuple`.
    fn flow_hash(tuple: &Self::Tuple) -> u32;
    /// sessionAffinity's choice for `client` of service port `service_id`.
    fn affinity(service_id: u32, client: &Self::Addr) -> Option<&'static mut Self::Sticky>;
    fn affinity_insert(service_id: u32, client: &Self::Addr, entry: &Self::Sticky);
    /// The key of socket `cookie`'s UDP flow to the service port `tuple` is addressed to.
    fn sock_flow(cookie: u64, tuple: &Self::Tuple) -> Self::SockFlow;
    fn sock_backend(key: &Self::SockFlow) -> Option<&'static mut Self::Sticky>;
    fn sock_backend_insert(key: &Self::SockFlow, entry: &Self::Sticky);
    /// What the first fragment of datagram `key` told (fragment.rs).
    fn first_fragment(key: &Self::FragmentKey) -> Option<FirstFragment>;
    fn remember_first_fragment(key: &Self::FragmentKey, first: &FirstFragment);
}

pub enum Ipv4 {}

pub enum Ipv6 {}

impl Family for Ipv4 {
    type Addr = u32;
    type Tuple = ConntrackKey;
    type Backend = Backend;
    type Sticky = StickyBackend;
    type SockFlow = SockBackendKey;
    type FragmentKey = FragmentKey;

    fn backend(key: &BackendKey) -> Option<Backend> {
        maps::backend(key)
    }

    fn client(tuple: &ConntrackKey) -> &u32 {
        &tuple.src_addr
    }

    fn proto(tuple: &ConntrackKey) -> u8 {
        tuple.proto
    }

    fn source_hash(client: &u32) -> u32 {
        source_hash(*client)
    }

    fn flow_hash(tuple: &ConntrackKey) -> u32 {
        flow_hash(tuple)
    }

    fn affinity(service_id: u32, client: &u32) -> Option<&'static mut StickyBackend> {
        maps::affinity(&AffinityKey {
            service_id,
            client_addr: *client,
        })
    }

    fn affinity_insert(service_id: u32, client: &u32, entry: &StickyBackend) {
        let key = AffinityKey {
            service_id,
            client_addr: *client,
        };
        maps::affinity_insert(&key, entry);
    }

    fn sock_flow(cookie: u64, tuple: &ConntrackKey) -> SockBackendKey {
        SockBackendKey {
            cookie,
            frontend: FrontendKey {
                addr: tuple.dst_addr,
                port: tuple.dst_port,
                proto: IPPROTO_UDP,
                _pad: 0,
            },
        }
    }

    fn sock_backend(key: &SockBackendKey) -> Option<&'static mut StickyBackend> {
        maps::sock_backend(key)
    }

    fn sock_backend_insert(key: &SockBackendKey, entry: &StickyBackend) {
        maps::sock_backend_insert(key, entry);
    }

    fn first_fragment(key: &FragmentKey) -> Option<FirstFragment> {
        maps::first_fragment(key)
    }

    fn remember_first_fragment(key: &FragmentKey, first: &FirstFragment) {
        maps::remember_first_fragment(key, first);
    }
}

impl Family for Ipv6 {
    type Addr = Addr6;
    type Tuple = ConntrackKey6;
    type Backend = Backend6;
    type Sticky = StickyBackend6;
    type SockFlow = SockBackendKey6;
    type FragmentKey = FragmentKey6;

    fn backend(key: &BackendKey) -> Option<Backend6> {
        maps::backend6(key)
    }

    fn client(tuple: &ConntrackKey6) -> &Addr6 {
        &tuple.src_addr
    }

    fn proto(tuple: &ConntrackKey6) -> u8 {
        tuple.proto
    }

    fn source_hash(client: &Addr6) -> u32 {
        source_hash6(client)
    }

    fn flow_hash(tuple: &ConntrackKey6) -> u32 {
        flow_hash6(tuple)
    }

    fn affinity(service_id: u32, client: &Addr6) -> Option<&'static mut StickyBackend6> {
        maps::affinity6(&AffinityKey6 {
            service_id,
            client_addr: *client,
        })
    }

    fn affinity_insert(service_id: u32, client: &Addr6, entry: &StickyBackend6) {
        let key = AffinityKey6 {
            service_id,
            client_addr: *client,
        };
        maps::affinity6_insert(&key, entry);
    }

    fn sock_flow(cookie: u64, tuple: &ConntrackKey6) -> SockBackendKey6 {
        SockBackendKey6 {
            cookie,
            frontend: FrontendKey6 {
                addr: tuple.dst_addr,
                port: tuple.dst_port,
                proto: IPPROTO_UDP,
                _pad: 0,
            },
            _pad: 0,
        }
    }

    fn sock_backend(key: &SockBackendKey6) -> Option<&'static mut StickyBackend6> {
        maps::sock_backend6(key)
    }

    fn sock_backend_insert(key: &SockBackendKey6, entry: &StickyBackend6) {
        maps::sock_backend6_insert(key, entry);
    }

    fn first_fragment(key: &FragmentKey6) -> Option<FirstFragment> {
        maps::first_fragment6(key)
    }

    fn remember_first_fragment(key: &FragmentKey6, first: &FirstFragment) {
        maps::remember_first_fragment6(key, first);
    }
}
