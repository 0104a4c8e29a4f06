//! The IPv6 tc datapath (`lb_ingress` tail-calling `lb_ingress6`) run on crafted packets with
//! BPF_PROG_TEST_RUN, as datapath.rs does for IPv4: no interface, no pinned map, a private copy
//! of the object per test (lb_tests::test_run6). The packets are built byte by byte, extension
//! headers included, and the TCP/UDP checksums of what comes out are computed over the IPv6
//! pseudo-header (RFC 8200 8.1), independently of the datapath's incremental updates, as is the
//! ICMPv6 checksum of the errors it answers (REJECT). Run as root.
use std::net::{Ipv6Addr, SocketAddrV6};

use aya::{
    Ebpf,
    maps::{
        HashMap, PerCpuArray, PerCpuValues,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{SchedClassifier, Xdp},
};
use lb_common::{
    AffinityKey6, Backend6, CT_F_MASQUERADE, CT_F_REPLY, CT_UDP_UNREPLIED, Counter,
    FRONTEND_F_LOCAL, FRONTEND_F_MASQUERADE, FRONTEND_F_SOURCE_RANGES, Frontend, FrontendKey6,
    IPPROTO_TCP, IPPROTO_UDP, RejectLimit, SCHED_FLOW_HASH, SCHED_ROUND_ROBIN, SCHED_SOURCE_HASH,
    SNAT_PORT_MAX, SNAT_PORT_MIN, SourceRangeKey6, StickyBackend6, flow_hash6, map_name, port_be,
    program_name, source_hash6, tcp,
};
use lb_tests::{test_run::run_program, test_run6::*};

/// Without the IPv6 programs in the array, `lb_ingress`'s tail call fails: the packet passes
/// untouched, counted.
#[test]
fn failed_tail_call_passes_counted() {
    let datapath = Datapath::new(false);
    let syn = packet(Proto::Tcp, CLIENT, CLUSTER_IP, TCP_SYN, &[]);
    datapath.assert_untouched(&syn);
    assert_eq!(datapath.counter(Counter::PassedTailCallFailed), 1);
}

/// Neighbour discovery and the other ICMPv6 informational messages are not service traffic, even
/// about a ClusterIP.
#[test]
fn neighbour_discovery_passes_untouched() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let solicited_node = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 1, 0xff00, 0x10);
    // Neighbour solicitation (135) for the ClusterIP: type, code, checksum, reserved, target.
    let mut solicitation = vec![135, 0, 0, 0, 0, 0, 0, 0];
    solicitation.extend_from_slice(&CLUSTER_IP.ip().octets());
    let mut advertisement = vec![136, 0, 0, 0, 0x60, 0, 0, 0];
    advertisement.extend_from_slice(&CLUSTER_IP.ip().octets());
    let echo_request = [128, 0, 0, 0, 0, 1, 0, 1, 0xab, 0xcd];
    let router_solicitation = [133, 0, 0, 0, 0, 0, 0, 0];
    let messages = [
        frame(
            CLIENT.ip(),
            &solicited_node,
            &[],
            IPPROTO_ICMPV6,
            &solicitation,
        ),
        frame(
            ENDPOINTS[0].ip(),
            CLIENT.ip(),
            &[],
            IPPROTO_ICMPV6,
            &advertisement,
        ),
        frame(
            CLIENT.ip(),
            CLUSTER_IP.ip(),
            &[],
            IPPROTO_ICMPV6,
            &echo_request,
        ),
        frame(
            &addr(1),
            &Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2),
            &[IPPROTO_HOPOPTS],
            IPPROTO_ICMPV6,
            &router_solicitation,
        ),
    ];
    for message in &messages {
        datapath.assert_untouched(message);
    }
    assert_eq!(datapath.counter(Counter::Passed), messages.len() as u64);
    assert_eq!(datapath.counter(Counter::PassedTailCallFailed), 0);
    assert_eq!(datapath.conntrack_len(), 0);
}

/// Up to `MAX_EXTENSION_HEADERS` (6) extension headers are walked and the connection translated;
/// a longer chain, or AH before the transport header, passes untouched and is counted.
#[test]
fn extension_header_chains() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let walked = [
        IPPROTO_HOPOPTS,
        IPPROTO_DSTOPTS,
        IPPROTO_ROUTING,
        IPPROTO_FRAGMENT,
        IPPROTO_DSTOPTS,
        IPPROTO_DSTOPTS,
    ];
    let syn = packet(Proto::Tcp, CLIENT, CLUSTER_IP, TCP_SYN, &walked);
    let l4 = ETH_HLEN + IPV6_HLEN + 8 * walked.len();
    let (src, dst) = datapath.translate(&syn, Proto::Tcp, l4);
    assert_eq!(src, CLIENT);
    assert!(ENDPOINTS.contains(&dst), "DNAT to an endpoint: {dst}");

    let too_long = [IPPROTO_DSTOPTS; 7];
    let client = pod(0x11, 40001);
    datapath.assert_untouched(&packet(Proto::Tcp, client, CLUSTER_IP, TCP_SYN, &too_long));
    datapath.assert_untouched(&packet(Proto::Udp, client, CLUSTER_IP, 0, &too_long));
    let authenticated = [IPPROTO_DSTOPTS, IPPROTO_AH];
    datapath.assert_untouched(&packet(
        Proto::Tcp,
        client,
        CLUSTER_IP,
        TCP_SYN,
        &authenticated,
    ));
    assert_eq!(datapath.counter(Counter::PassedIpv6ExtensionHeader), 3);
    assert_eq!(datapath.counter(Counter::NewConnection), 1);
    assert_eq!(datapath.conntrack_len(), 2);
}

/// Every truncation of a SYN (and a datagram) to the ClusterIP with two extension headers, with
/// its payload length as sent, and, while the cut is within the headers, as fitting the cut:
/// untouched, untracked, no crash. (BPF_PROG_TEST_RUN refuses a frame shorter than the fixed
/// IPv6 header.)
#[test]
fn truncated_packets_pass_untouched() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let chain = [IPPROTO_DSTOPTS, IPPROTO_ROUTING];
    let l4 = ETH_HLEN + IPV6_HLEN + 8 * chain.len();
    for (proto, header_len) in [(Proto::Tcp, 20), (Proto::Udp, 8)] {
        let whole = packet(proto, CLIENT, CLUSTER_IP, TCP_SYN, &chain);
        for len in ETH_HLEN + IPV6_HLEN..whole.len() {
            let mut truncated = whole[..len].to_vec();
            datapath.assert_untouched(&truncated);
            if len < l4 + header_len {
                let payload_len = (len - ETH_HLEN - IPV6_HLEN) as u16;
                truncated[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&payload_len.to_be_bytes());
                datapath.assert_untouched(&truncated);
            }
        }
    }
    assert_eq!(datapath.conntrack_len(), 0);
    assert_eq!(datapath.counter(Counter::NewConnection), 0);
    assert!(datapath.counter(Counter::PassedIpv6ExtensionHeader) > 0);
    assert!(datapath.counter(Counter::PassedUnparsed) > 0);
}

/// A pod reaches the IPv6 ClusterIP: the destination becomes an endpoint, the reply's source the
/// ClusterIP, both with checksums right over the new pseudo-header; both entries are tracked.
#[test]
fn cluster_ip_from_pod() {
    for proto in [Proto::Tcp, Proto::Udp] {
        let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
        let l4 = ETH_HLEN + IPV6_HLEN;
        let flags = if proto == Proto::Tcp { TCP_SYN } else { 0 };
        let first = packet(proto, CLIENT, CLUSTER_IP, flags, &[]);
        let (src, backend) = datapath.translate(&first, proto, l4);
        assert_eq!(src, CLIENT, "source untouched");
        assert!(
            ENDPOINTS.contains(&backend),
            "DNAT to an endpoint: {backend}"
        );

        let original = datapath
            .conntrack(&ct_key(proto, CLIENT, CLUSTER_IP))
            .unwrap();
        assert_eq!(rewrite_of(&original), (CLIENT, backend));
        assert_eq!(original.service_id, SERVICE_ID);
        assert_eq!(original.flags & CT_F_REPLY, 0);
        let reply = datapath.conntrack(&ct_key(proto, backend, CLIENT)).unwrap();
        assert_eq!(rewrite_of(&reply), (CLUSTER_IP, CLIENT));
        assert_ne!(reply.flags & CT_F_REPLY, 0);
        let opened = if proto == Proto::Tcp {
            tcp::SYN_SENT
        } else {
            CT_UDP_UNREPLIED
        };
        assert_eq!((original.state, reply.state), (opened, opened));

        for _ in 0..10 {
            assert_eq!(
                datapath.translate(&first, proto, l4).1,
                backend,
                "same endpoint"
            );
        }
        let answer_flags = if proto == Proto::Tcp {
            TCP_SYN | TCP_ACK
        } else {
            0
        };
        let answer = packet(proto, backend, CLIENT, answer_flags, &[]);
        assert_eq!(
            datapath.translate(&answer, proto, l4),
            (CLUSTER_IP, CLIENT),
            "reply reverse-translated"
        );
        if proto == Proto::Tcp {
            let state = datapath
                .conntrack(&ct_key(proto, CLIENT, CLUSTER_IP))
                .unwrap()
                .state;
            assert_eq!(state, tcp::SYN_RECV);
        }
        assert_eq!(datapath.counter(Counter::NewConnection), 1);
        assert_eq!(datapath.conntrack_len(), 2);
    }
}

/// Masqueraded connections (hairpin, a client outside the cluster CIDR, a pod to a NodePort):
/// the backend sees them from the node address and a port of the SNAT range, the reply comes
/// back from the frontend; both rewrites with checksums right over the new pseudo-header.
#[test]
fn masqueraded_connections() {
    let hairpin = SocketAddrV6::new(*ENDPOINTS[0].ip(), 40000, 0, 0);
    for proto in [Proto::Tcp, Proto::Udp] {
        for (client, frontend) in [
            (hairpin, CLUSTER_IP),
            (EXTERNAL_CLIENT, CLUSTER_IP),
            (CLIENT, NODE_PORT),
        ] {
            let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS[..1]);
            datapath.set_node_and_cluster_cidr();
            let case = format!("{proto:?} {client} → {frontend}");
            let l4 = ETH_HLEN + IPV6_HLEN;
            let flags = if proto == Proto::Tcp { TCP_SYN } else { 0 };
            let first = packet(proto, client, frontend, flags, &[]);
            let (src, dst) = datapath.translate(&first, proto, l4);
            assert_eq!(*src.ip(), NODE, "{case}: masqueraded to the node");
            assert!(
                (SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&src.port()),
                "{case}: a port of the range: {src}"
            );
            assert_eq!(dst, ENDPOINTS[0], "{case}");
            let original = datapath
                .conntrack(&ct_key(proto, client, frontend))
                .unwrap();
            assert_eq!(original.flags, CT_F_MASQUERADE, "{case}");
            assert_eq!(rewrite_of(&original), (src, dst), "{case}");
            let reply = datapath.conntrack(&ct_key(proto, dst, src)).unwrap();
            assert_eq!(reply.flags, CT_F_REPLY | CT_F_MASQUERADE, "{case}");

            assert_eq!(datapath.translate(&first, proto, l4), (src, dst), "{case}");
            let answer_flags = if proto == Proto::Tcp {
                TCP_SYN | TCP_ACK
            } else {
                0
            };
            let answer = packet(proto, dst, src, answer_flags, &[]);
            assert_eq!(
                datapath.translate(&answer, proto, l4),
                (frontend, client),
                "{case}: reply reverse-translated"
            );
            assert_eq!(datapath.counter(Counter::NewConnection), 1, "{case}");
            assert_eq!(datapath.counter(Counter::Masqueraded), 1, "{case}");
            assert_eq!(datapath.conntrack_len(), 2, "{case}");
        }
    }
}

/// Two clients reaching one backend through the masquerade address get ports of their own.
#[test]
fn masquerade_ports_are_unique() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS[..1]);
    datapath.set_node_and_cluster_cidr();
    let l4 = ETH_HLEN + IPV6_HLEN;
    let mut seen = Vec::new();
    for port in 0..20 {
        let client = SocketAddrV6::new(*EXTERNAL_CLIENT.ip(), 50000 + port, 0, 0);
        let (src, _) = datapath.translate(
            &packet(Proto::Udp, client, CLUSTER_IP, 0, &[]),
            Proto::Udp,
            l4,
        );
        assert!(!seen.contains(&src), "{src} given twice");
        seen.push(src);
    }
    assert_eq!(datapath.counter(Counter::Masqueraded), 20);
}

/// A client's SYN on the tuple of a connection the backend reset opens a new connection, which
/// takes the closed one's entries over.
#[test]
fn syn_reopens_a_closed_connection() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS[..1]);
    let l4 = ETH_HLEN + IPV6_HLEN;
    let syn = packet(Proto::Tcp, CLIENT, CLUSTER_IP, TCP_SYN, &[]);
    let (_, backend) = datapath.translate(&syn, Proto::Tcp, l4);
    let reset = packet(Proto::Tcp, backend, CLIENT, TCP_RST | TCP_ACK, &[]);
    assert_eq!(
        datapath.translate(&reset, Proto::Tcp, l4),
        (CLUSTER_IP, CLIENT)
    );
    let original = ct_key(Proto::Tcp, CLIENT, CLUSTER_IP);
    assert_eq!(datapath.conntrack(&original).unwrap().state, tcp::CLOSE);
    assert_eq!(datapath.translate(&syn, Proto::Tcp, l4).1, backend);
    assert_eq!(datapath.conntrack(&original).unwrap().state, tcp::SYN_SENT);
    let reply = datapath
        .conntrack(&ct_key(Proto::Tcp, backend, CLIENT))
        .unwrap();
    assert_eq!(reply.state, tcp::SYN_SENT);
    assert_eq!(datapath.counter(Counter::NewConnection), 2);
    assert_eq!(datapath.counter(Counter::ConntrackTakenOver), 1);
    assert_eq!(datapath.conntrack_len(), 2);
}

/// A TCP SYN from `client` to the ClusterIP, translated: the endpoint it went to.
fn connect(datapath: &Datapath, client: SocketAddrV6) -> SocketAddrV6 {
    let syn = packet(Proto::Tcp, client, CLUSTER_IP, TCP_SYN, &[]);
    datapath.translate(&syn, Proto::Tcp, ETH_HLEN + IPV6_HLEN).1
}

/// `pod(last, port)`'s address with another port.
const fn from(client: &SocketAddrV6, port: u16) -> SocketAddrV6 {
    SocketAddrV6::new(*client.ip(), port, 0, 0)
}

/// sessionAffinity ClientIP: a client's new connections (other source ports) stick to its first
/// backend, remembered under its IPv6 address; other clients still spread; an expired entry, or
/// one whose slot holds another backend now, gives a fresh choice.
#[test]
fn session_affinity_sticks_until_expired_or_moved() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    datapath.change_tcp_cluster_ip(|frontend| frontend.affinity_timeout_s = 10);
    let first = connect(&datapath, from(&CLIENT, 10_000));
    for port in 10_001..10_050 {
        assert_eq!(connect(&datapath, from(&CLIENT, port)), first, "affine");
    }
    let others: std::collections::BTreeSet<_> = (0..60)
        .map(|i| connect(&datapath, pod(0x100 + i, 10_000)))
        .collect();
    assert_eq!(others.len(), ENDPOINTS.len(), "other clients spread");

    let key = AffinityKey6 {
        service_id: SERVICE_ID,
        client_addr: a6(CLIENT.ip()),
    };
    let remembered = datapath.affinity(&key).unwrap();
    assert_eq!(remembered.backend.addr, a6(first.ip()));
    assert_eq!(remembered.backend.port, port_be(first.port()));
    assert!(remembered.slot < ENDPOINTS.len() as u32);

    // Expired: some of 40 fresh choices differ from the first (each is 1/3 likely to match).
    let mut changed = false;
    for port in 20_000..20_040 {
        let ancient = StickyBackend6 {
            last_seen_ns: 1,
            ..remembered
        };
        datapath.set_affinity(key, ancient);
        changed |= connect(&datapath, from(&CLIENT, port)) != first;
    }
    assert!(changed, "an expired affinity is not used");

    // Moved: the slot the entry names holds another backend now.
    let gone = pod(0x99, 8080);
    let stale = StickyBackend6 {
        backend: Backend6 {
            addr: a6(gone.ip()),
            port: port_be(gone.port()),
            stats_slot: 0,
        },
        ..datapath.affinity(&key).unwrap()
    };
    datapath.set_affinity(key, stale);
    let fresh = connect(&datapath, from(&CLIENT, 30_000));
    assert_ne!(fresh, gone);
    assert_eq!(
        datapath.affinity(&key).unwrap().backend.addr,
        a6(fresh.ip()),
        "re-remembered"
    );
}

/// rr: consecutive new connections take the slots in turn. sh: one client address, one
/// backend, `source_hash6`'s. Flow hash (maglev): the slot is `flow_hash6(tuple) % count`, the
/// agent's Maglev table.
#[test]
fn schedulers_pick_slots() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    datapath.change_tcp_cluster_ip(|frontend| frontend.scheduler = SCHED_ROUND_ROBIN);
    let picks: Vec<_> = (10_000..10_030)
        .map(|port| connect(&datapath, from(&CLIENT, port)))
        .collect();
    for (i, pick) in picks.iter().enumerate() {
        assert_eq!(*pick, picks[i % ENDPOINTS.len()], "round robin: {picks:?}");
    }
    let first_three: std::collections::BTreeSet<_> = picks[..3].iter().collect();
    assert_eq!(first_three.len(), 3);

    datapath.change_tcp_cluster_ip(|frontend| frontend.scheduler = SCHED_SOURCE_HASH);
    let mut hashed = std::collections::BTreeSet::new();
    for client in 1..20 {
        let client = pod(0x200 + client, 0);
        let slot = source_hash6(&a6(client.ip())) % ENDPOINTS.len() as u32;
        for port in [20_000, 20_001, 20_002] {
            let backend = connect(&datapath, from(&client, port));
            assert_eq!(backend, ENDPOINTS[slot as usize], "source hash");
        }
        hashed.insert(slot);
    }
    assert_eq!(hashed.len(), ENDPOINTS.len(), "clients spread");

    datapath.change_tcp_cluster_ip(|frontend| frontend.scheduler = SCHED_FLOW_HASH);
    for port in 30_000..30_050 {
        let client = from(&CLIENT, port);
        let tuple = ct_key(Proto::Tcp, client, CLUSTER_IP);
        let slot = flow_hash6(&tuple) % ENDPOINTS.len() as u32;
        assert_eq!(
            connect(&datapath, client),
            ENDPOINTS[slot as usize],
            "flow hash"
        );
    }
}

/// Not the ClusterIP's port, or no service at all: passed untouched, untracked.
#[test]
fn other_traffic_passes_untouched() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let other_port = SocketAddrV6::new(*CLUSTER_IP.ip(), 81, 0, 0);
    datapath.assert_untouched(&packet(Proto::Tcp, CLIENT, other_port, TCP_SYN, &[]));
    datapath.assert_untouched(&packet(Proto::Udp, CLIENT, pod(0x99, 53), 0, &[]));
    assert_eq!(datapath.conntrack_len(), 0);
}

/// The ICMPv6 error's limits (RFC 4443 2.4): the quote fills what the IPv6 minimum MTU leaves.
const IPV6_MIN_MTU: usize = 1280;
const ICMPV6_HLEN: usize = 8;

/// `output` is the ICMPv6 port unreachable about `input` (Ethernet on), bounced back to its
/// sender: MACs swapped, from the address the client tried, the client's packet quoted from its
/// IPv6 header on as far as the error stays within 1280 bytes, the checksum right over the
/// pseudo-header.
fn assert_port_unreachable(input: &[u8], verdict: u32, output: &[u8]) {
    assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out");
    assert_eq!(output[..6], input[6..12], "to the sender's MAC");
    assert_eq!(output[6..12], input[..6], "from the MAC it was sent to");
    assert_eq!(output[12..ETH_HLEN], [0x86, 0xdd]);
    let quote_len = (input.len() - ETH_HLEN).min(IPV6_MIN_MTU - IPV6_HLEN - ICMPV6_HLEN);
    let ip = &output[ETH_HLEN..ETH_HLEN + IPV6_HLEN];
    let icmp = &output[ETH_HLEN + IPV6_HLEN..];
    assert_eq!(icmp.len(), ICMPV6_HLEN + quote_len, "trimmed");
    assert_eq!(ip[..4], [0x60, 0, 0, 0], "version 6");
    assert_eq!(usize::from(u16::from_be_bytes([ip[4], ip[5]])), icmp.len());
    assert_eq!(ip[6], IPPROTO_ICMPV6, "next header");
    assert!(ip[7] > 1, "hop limit {}", ip[7]);
    let addr = |bytes: &[u8]| Ipv6Addr::from(<[u8; 16]>::try_from(bytes).unwrap());
    let (src, dst) = (addr(&ip[8..24]), addr(&ip[24..40]));
    let (client, frontend) = (
        addr(&input[ETH_HLEN + 8..ETH_HLEN + 24]),
        addr(&input[ETH_HLEN + 24..ETH_HLEN + 40]),
    );
    assert_eq!((src, dst), (frontend, client), "from the address tried");
    assert_eq!(
        icmp[..2],
        [1, 4],
        "destination unreachable, port unreachable"
    );
    assert_eq!(icmp[4..8], [0; 4]);
    assert_eq!(
        icmp[ICMPV6_HLEN..],
        input[ETH_HLEN..ETH_HLEN + quote_len],
        "quote"
    );
    assert_eq!(
        pseudo_header_sum(&src, &dst, IPPROTO_ICMPV6, icmp),
        0xffff,
        "ICMPv6 checksum over the IPv6 pseudo-header"
    );
}

/// A UDP datagram from `src` to `dst` carrying `payload`.
fn datagram(src: SocketAddrV6, dst: SocketAddrV6, payload: &[u8]) -> Vec<u8> {
    let mut l4 = Vec::new();
    l4.extend_from_slice(&src.port().to_be_bytes());
    l4.extend_from_slice(&dst.port().to_be_bytes());
    l4.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    l4.extend_from_slice(&[0, 0]);
    l4.extend_from_slice(payload);
    frame(src.ip(), dst.ip(), &[], IPPROTO_UDP, &l4)
}

/// A service without endpoints answers a new connection with ICMPv6 port unreachable: a SYN, a
/// datagram, one after extension headers, one too long to quote whole (1400 bytes of payload:
/// the error stops at 1280 bytes), then one of odd length (its quote padded with zeros for the
/// checksum, not with what the long one left). Dropped, not tracked.
#[test]
fn service_without_endpoints_rejects() {
    let datapath = Datapath::with_cluster_ip(&[]);
    let long: Vec<u8> = (0..1400u32).map(|i| i as u8).collect();
    let packets = [
        packet(Proto::Tcp, CLIENT, CLUSTER_IP, TCP_SYN, &[]),
        packet(Proto::Udp, CLIENT, CLUSTER_IP, 0, &[]),
        packet(
            Proto::Udp,
            CLIENT,
            CLUSTER_IP,
            0,
            &[IPPROTO_HOPOPTS, IPPROTO_DSTOPTS],
        ),
        datagram(CLIENT, CLUSTER_IP, &long),
        datagram(CLIENT, CLUSTER_IP, b"odd"),
    ];
    for input in &packets {
        let (verdict, output) = datapath.run(input);
        assert_port_unreachable(input, verdict, &output);
    }
    let (_, long_error) = datapath.run(&packets[3]);
    assert_eq!(
        long_error.len(),
        ETH_HLEN + IPV6_MIN_MTU,
        "within the minimum MTU"
    );
    assert_eq!(
        datapath.counter(Counter::Rejected),
        packets.len() as u64 + 1
    );
    assert_eq!(datapath.counter(Counter::NewConnection), 0);
    assert_eq!(datapath.conntrack_len(), 0);
}

/// A ClusterIP's catch-all frontend rejects the ports the service does not define (TCP and UDP),
/// while its defined port is served.
#[test]
fn undefined_cluster_ip_port_rejects() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    datapath.set_frontend(
        FrontendKey6::any_port(a6(CLUSTER_IP.ip())),
        Frontend::default(),
    );
    let other_port = SocketAddrV6::new(*CLUSTER_IP.ip(), 81, 0, 0);
    for proto in [Proto::Tcp, Proto::Udp] {
        let input = packet(proto, CLIENT, other_port, TCP_SYN, &[]);
        let (verdict, output) = datapath.run(&input);
        assert_port_unreachable(&input, verdict, &output);
    }
    let syn = packet(Proto::Tcp, CLIENT, CLUSTER_IP, TCP_SYN, &[]);
    let (_, backend) = datapath.translate(&syn, Proto::Tcp, ETH_HLEN + IPV6_HLEN);
    assert!(ENDPOINTS.contains(&backend), "{backend}");
    assert_eq!(datapath.counter(Counter::Rejected), 2);
}

/// Traffic policy Local without an endpoint on this node drops (as IPv4 and kube-proxy do), it
/// does not reject.
#[test]
fn local_policy_without_local_endpoint_drops() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    datapath.change_tcp_cluster_ip(|frontend| {
        frontend.local_count = 0;
        frontend.flags = FRONTEND_F_LOCAL;
    });
    let syn = packet(Proto::Tcp, CLIENT, CLUSTER_IP, TCP_SYN, &[]);
    assert_eq!(datapath.run(&syn).0, TC_ACT_SHOT);
    assert_eq!(datapath.counter(Counter::DropNoLocalBackend), 1);
    assert_eq!(datapath.counter(Counter::Rejected), 0);
}

/// REJECT replies share IPv4's rate limit (`LB_REJECT_LIMIT_V1`): with no tokens the packet is
/// dropped and no error sent.
#[test]
fn rejects_over_the_rate_are_dropped() {
    let mut datapath = Datapath::with_cluster_ip(&[]);
    let cpus = aya::util::nr_cpus().unwrap();
    let mut limits: PerCpuArray<_, RejectLimit> = datapath
        .ebpf
        .map_mut(map_name::REJECT_LIMIT)
        .unwrap()
        .try_into()
        .unwrap();
    let none = PerCpuValues::try_from(vec![RejectLimit::new(0, 0, cpus as u32); cpus]).unwrap();
    limits.set(0, none, 0).unwrap();
    let syn = packet(Proto::Tcp, CLIENT, CLUSTER_IP, TCP_SYN, &[]);
    let (verdict, output) = datapath.run(&syn);
    assert_eq!((verdict, output), (TC_ACT_SHOT, syn));
    for c in Counter::ALL {
        let n = datapath.counter(c);
        if n != 0 {}
    }
    assert_eq!(datapath.counter(Counter::DropRejectRateLimited), 1);
    assert_eq!(datapath.counter(Counter::Rejected), 0);
}

/// loadBalancerSourceRanges over IPv6: a LoadBalancer IP with an allowed prefix serves a source
/// inside it (masqueraded, as external traffic with policy Cluster) and drops any other, counted
/// and without a conntrack entry.
#[test]
fn source_outside_load_balancer_source_ranges_is_dropped() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    datapath.set_node_and_cluster_cidr();
    let lb_ip = SocketAddrV6::new(addr(0x50), 80, 0, 0);
    let key = FrontendKey6 {
        addr: a6(lb_ip.ip()),
        port: port_be(lb_ip.port()),
        proto: IPPROTO_TCP,
        _pad: 0,
    };
    let frontend = Frontend {
        service_id: SERVICE_ID,
        backend_count: ENDPOINTS.len() as u32,
        flags: FRONTEND_F_MASQUERADE | FRONTEND_F_SOURCE_RANGES,
        ..Frontend::default()
    };
    datapath.set_frontend(key, frontend);
    let mut ranges: LpmTrie<_, SourceRangeKey6, u8> = datapath
        .ebpf
        .map_mut(map_name::SOURCE_RANGES6)
        .unwrap()
        .try_into()
        .unwrap();
    // 2001:db8:7::/48.
    let allowed = SourceRangeKey6 {
        service_id: SERVICE_ID,
        addr: a6(&Ipv6Addr::new(0x2001, 0xdb8, 7, 0, 0, 0, 0, 0)),
    };
    ranges
        .insert(
            &Key::new(SourceRangeKey6::SERVICE_ID_BITS + 48, allowed),
            1,
            0,
        )
        .unwrap();

    let l4 = ETH_HLEN + IPV6_HLEN;
    let inside = SocketAddrV6::new(Ipv6Addr::new(0x2001, 0xdb8, 7, 1, 0, 0, 0, 1), 50_000, 0, 0);
    let syn = packet(Proto::Tcp, inside, lb_ip, TCP_SYN, &[]);
    let (src, dst) = datapath.translate(&syn, Proto::Tcp, l4);
    assert_eq!(*src.ip(), NODE, "masqueraded");
    assert!(ENDPOINTS.contains(&dst), "{dst}");

    let outside = SocketAddrV6::new(Ipv6Addr::new(0x2001, 0xdb8, 8, 0, 0, 0, 0, 1), 50_000, 0, 0);
    let syn = packet(Proto::Tcp, outside, lb_ip, TCP_SYN, &[]);
    assert_eq!(datapath.run(&syn).0, TC_ACT_SHOT);
    assert_eq!(datapath.counter(Counter::DropSourceRange), 1);
    assert_eq!(
        datapath.conntrack_len(),
        2,
        "only the allowed connection's two entries"
    );
}

const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PACKET_TOO_BIG: u8 = 2;
const ICMPV6_TIME_EXCEEDED: u8 = 3;
/// Where an error's quote starts, and the quoted transport header, in a frame without
/// extension headers.
const QUOTE: usize = ETH_HLEN + IPV6_HLEN + ICMPV6_HLEN;
const QUOTED_L4: usize = QUOTE + IPV6_HLEN;
/// A router on the way, which sends errors from an address of its own.
const ROUTER: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x200, 0, 0, 0, 0, 1);

/// An ICMPv6 error of `icmp_type` (code 0; for Packet Too Big, MTU 1280) from `src` to `dst`
/// quoting the IPv6 packet of `frame_quoted` (an Ethernet frame), its checksum computed here.
fn icmp6_error(src: &Ipv6Addr, dst: &Ipv6Addr, icmp_type: u8, frame_quoted: &[u8]) -> Vec<u8> {
    let mut l4 = vec![icmp_type, 0, 0, 0];
    l4.extend_from_slice(&1280u32.to_be_bytes());
    l4.extend_from_slice(&frame_quoted[ETH_HLEN..]);
    frame(src, dst, &[], IPPROTO_ICMPV6, &l4)
}

/// What a reverse-translated error says: its outer source and destination, and the quoted
/// packet's source and destination.
#[derive(Debug, PartialEq)]
struct Error6 {
    src: Ipv6Addr,
    dst: Ipv6Addr,
    quoted_src: SocketAddrV6,
    quoted_dst: SocketAddrV6,
}

/// The error `output`, which must be `input` with only the outer and quoted addresses, the
/// quoted ports and the checksums rewritten, its ICMPv6 checksum right over the new outer
/// pseudo-header and, when the quote holds the whole `proto` packet, the quoted checksum right
/// over the quoted pseudo-header.
fn verify_error(input: &[u8], output: &[u8], proto: Proto, whole_quote: bool) -> Error6 {
    assert_eq!(output.len(), input.len());
    let check = QUOTED_L4 + proto.check_offset();
    let unchanged = |range: std::ops::Range<usize>| {
        assert_eq!(
            output[range.clone()],
            input[range.clone()],
            "bytes {range:?}"
        );
    };
    let icmp = ETH_HLEN + IPV6_HLEN;
    unchanged(0..ETH_HLEN + 8);
    unchanged(icmp..icmp + 2);
    unchanged(icmp + 4..QUOTE + 8);
    unchanged(QUOTED_L4 + 4..check.min(input.len()));
    if check + 2 < input.len() {
        unchanged(check + 2..input.len());
    }
    let ip = |at: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&output[at..at + 16]).unwrap());
    let (src, dst) = (ip(ETH_HLEN + 8), ip(ETH_HLEN + 24));
    assert_eq!(
        pseudo_header_sum(&src, &dst, IPPROTO_ICMPV6, &output[icmp..]),
        0xffff,
        "ICMPv6 checksum over the IPv6 pseudo-header"
    );
    let (quoted_src, quoted_dst) = (ip(QUOTE + 8), ip(QUOTE + 24));
    if whole_quote {
        assert_eq!(
            pseudo_header_sum(
                &quoted_src,
                &quoted_dst,
                proto.number(),
                &output[QUOTED_L4..]
            ),
            0xffff,
            "quoted {proto:?} checksum over the quoted pseudo-header"
        );
    }
    let port = |at: usize| u16::from_be_bytes([output[at], output[at + 1]]);
    Error6 {
        src,
        dst,
        quoted_src: SocketAddrV6::new(quoted_src, port(QUOTED_L4), 0, 0),
        quoted_dst: SocketAddrV6::new(quoted_dst, port(QUOTED_L4 + 2), 0, 0),
    }
}

/// Opens a connection from `client` to `frontend` and returns the first packet as translated,
/// and the reply to it as the backend sends it, translated back.
fn translated_flow(
    datapath: &Datapath,
    proto: Proto,
    client: SocketAddrV6,
    frontend: SocketAddrV6,
) -> (Vec<u8>, Vec<u8>) {
    let flags = if proto == Proto::Tcp { TCP_SYN } else { 0 };
    let (verdict, translated) = datapath.run(&packet(proto, client, frontend, flags, &[]));
    assert_eq!(verdict, TC_ACT_OK);
    let l4 = ETH_HLEN + IPV6_HLEN;
    let first = packet(proto, client, frontend, flags, &[]);
    let (src, backend) = verify(&first, &translated, proto, l4);
    let reply_flags = if proto == Proto::Tcp {
        TCP_SYN | TCP_ACK
    } else {
        0
    };
    let (verdict, reply) = datapath.run(&packet(proto, backend, src, reply_flags, &[]));
    assert_eq!(verdict, TC_ACT_OK);
    (translated, reply)
}

/// The source and destination of `frame`'s TCP/UDP packet.
fn endpoints_of(frame: &[u8]) -> (SocketAddrV6, SocketAddrV6) {
    let ip = |at: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&frame[at..at + 16]).unwrap());
    let l4 = ETH_HLEN + IPV6_HLEN;
    let port = |at: usize| u16::from_be_bytes([frame[at], frame[at + 1]]);
    (
        SocketAddrV6::new(ip(ETH_HLEN + 8), port(l4), 0, 0),
        SocketAddrV6::new(ip(ETH_HLEN + 24), port(l4 + 2), 0, 0),
    )
}

/// ICMPv6 errors about a translated connection's packets reach their sender as about the packet
/// it sent: a Packet Too Big, a destination unreachable and a time exceeded about the client's
/// packet as translated (from the backend, or a router on the way), and a Packet Too Big from a
/// router on the client's side about the backend's reply as translated. The outer destination
/// becomes the quoted packet's sender, the outer source the service address when the quoted
/// destination was translated, the quote the packet as sent; the ICMPv6 and quoted checksums
/// verified here over the pseudo-headers. Also masqueraded (an external client to a NodePort).
#[test]
fn icmpv6_errors_about_translated_flows_are_reverse_translated() {
    for proto in [Proto::Tcp, Proto::Udp] {
        for (client, frontend) in [(CLIENT, CLUSTER_IP), (EXTERNAL_CLIENT, NODE_PORT)] {
            let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS[..1]);
            datapath.set_node_and_cluster_cidr();
            let case = format!("{proto:?} {client} → {frontend}");
            let (translated, reply) = translated_flow(&datapath, proto, client, frontend);
            let (sent_from, backend) = endpoints_of(&translated);
            // About the client's packet: sent to where it came from (the masquerade address or
            // the client itself).
            for (from, icmp_type) in [
                (backend.ip(), ICMPV6_PACKET_TOO_BIG),
                (&ROUTER, ICMPV6_PACKET_TOO_BIG),
                (backend.ip(), ICMPV6_DEST_UNREACH),
                (&ROUTER, ICMPV6_TIME_EXCEEDED),
            ] {
                let error = icmp6_error(from, sent_from.ip(), icmp_type, &translated);
                let (verdict, output) = datapath.run(&error);
                assert_eq!(verdict, TC_ACT_OK, "{case}");
                assert_eq!(
                    verify_error(&error, &output, proto, true),
                    Error6 {
                        src: *frontend.ip(),
                        dst: *client.ip(),
                        quoted_src: client,
                        quoted_dst: frontend,
                    },
                    "{case}: type {icmp_type} from {from}"
                );
            }
            // About the backend's reply, from a router on the client's side.
            let error = icmp6_error(&ROUTER, frontend.ip(), ICMPV6_PACKET_TOO_BIG, &reply);
            let (verdict, output) = datapath.run(&error);
            assert_eq!(verdict, TC_ACT_OK, "{case}");
            let masqueraded = sent_from.ip() != client.ip();
            assert_eq!(
                verify_error(&error, &output, proto, true),
                Error6 {
                    src: if masqueraded { *sent_from.ip() } else { ROUTER },
                    dst: *backend.ip(),
                    quoted_src: backend,
                    quoted_dst: sent_from,
                },
                "{case}: about the reply"
            );
            assert_eq!(datapath.counter(Counter::IcmpErrorTranslated), 5, "{case}");
            assert_eq!(datapath.conntrack_len(), 2, "{case}");
        }
    }
}

/// Errors that are not about a translated connection, or cannot be read, pass untouched: every
/// truncation of a Packet Too Big (its payload length as sent, and fitting the cut while the
/// quote is shorter than the 8 transport bytes the ports need), one about an untracked flow,
/// one sent to another host than the quoted packet's sender, one whose quote has an extension
/// header. A quote of just the 8 bytes (no quoted checksum) is translated, its ICMPv6 checksum
/// right.
#[test]
fn malformed_icmpv6_errors_are_not_mistranslated() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS[..1]);
    datapath.set_node_and_cluster_cidr();
    let (translated, _) = translated_flow(&datapath, Proto::Tcp, CLIENT, CLUSTER_IP);
    let (_, backend) = endpoints_of(&translated);
    let whole = icmp6_error(
        backend.ip(),
        CLIENT.ip(),
        ICMPV6_PACKET_TOO_BIG,
        &translated,
    );
    for len in ETH_HLEN + IPV6_HLEN..whole.len() {
        datapath.assert_untouched(&whole[..len]);
        let quoted_len = len.saturating_sub(QUOTE);
        if (QUOTE..QUOTED_L4 + 8).contains(&len) {
            let cut = icmp6_error(
                backend.ip(),
                CLIENT.ip(),
                ICMPV6_PACKET_TOO_BIG,
                &translated[..ETH_HLEN + quoted_len],
            );
            datapath.assert_untouched(&cut);
        }
    }
    assert_eq!(datapath.counter(Counter::IcmpErrorTranslated), 0);

    let other_client = pod(0x11, 40001);
    let untracked = packet(Proto::Tcp, other_client, backend, TCP_SYN, &[]);
    datapath.assert_untouched(&icmp6_error(
        backend.ip(),
        other_client.ip(),
        ICMPV6_PACKET_TOO_BIG,
        &untracked,
    ));
    datapath.assert_untouched(&icmp6_error(
        backend.ip(),
        other_client.ip(),
        ICMPV6_PACKET_TOO_BIG,
        &translated,
    ));
    let (client, _) = endpoints_of(&translated);
    let with_extension = packet(Proto::Tcp, client, backend, TCP_SYN, &[IPPROTO_DSTOPTS]);
    datapath.assert_untouched(&icmp6_error(
        backend.ip(),
        CLIENT.ip(),
        ICMPV6_PACKET_TOO_BIG,
        &with_extension,
    ));
    assert_eq!(datapath.counter(Counter::IcmpErrorTranslated), 0);

    let shortest = icmp6_error(
        backend.ip(),
        CLIENT.ip(),
        ICMPV6_PACKET_TOO_BIG,
        &translated[..ETH_HLEN + IPV6_HLEN + 8],
    );
    let (verdict, output) = datapath.run(&shortest);
    assert_eq!(verdict, TC_ACT_OK);
    let error = verify_error(&shortest, &output, Proto::Tcp, false);
    assert_eq!((error.src, error.dst), (*CLUSTER_IP.ip(), *CLIENT.ip()));
    assert_eq!((error.quoted_src, error.quoted_dst), (CLIENT, CLUSTER_IP));
    assert_eq!(datapath.counter(Counter::IcmpErrorTranslated), 1);
    assert_eq!(datapath.conntrack_len(), 2);
}

/// Below the kernel's 1M limit, with room: the IPv6 programs are verified on their own.
#[test]
fn verifier_cost_is_bounded() {
    let mut datapath = Datapath::new(true);
    let program: &mut SchedClassifier = datapath
        .ebpf
        .program_mut(program_name::EGRESS)
        .unwrap()
        .try_into()
        .unwrap();
    lb_user::datapath::load_program(|| program.load()).unwrap();
    let xdp: &mut Xdp = datapath
        .ebpf
        .program_mut(program_name::XDP6)
        .unwrap()
        .try_into()
        .unwrap();
    lb_user::datapath::load_program(|| xdp.load()).expect("verifier accepts lb_xdp6");
    for name in [
        program_name::INGRESS,
        program_name::EGRESS,
        program_name::INGRESS6,
        program_name::EGRESS6,
        program_name::XDP6,
    ] {
        let program = datapath.ebpf.program(name).unwrap();
        let processed = program
            .info()
            .unwrap()
            .verified_instruction_count()
            .unwrap();
        eprintln!("{name}: {processed} instructions processed");
        assert!(
            processed < 300_000,
            "{name}: {processed} instructions processed"
        );
    }
}

const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;
/// The node's end of the link towards the pods in `xdp_forwards_tracked_flows`.
const PODS_LINK: &str = "lbx6";
/// The MAC the neighbours of `PODS_LINK` are given.
const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x21];

/// Runs `lb_xdp6` on `packet`.
fn run_xdp6(ebpf: &Ebpf, packet: &[u8]) -> (u32, Vec<u8>) {
    let program: &Xdp = ebpf
        .program(program_name::XDP6)
        .unwrap()
        .try_into()
        .unwrap();
    run_program(program, packet, None)
}

/// `lb_xdp6` in a namespace of its own, whose FIB routes the pods' prefix out of `PODS_LINK`
/// (its neighbours static, `POD_MAC`; forwarding on, as on a node): a connection's first packet
/// is tracked but passed untouched while `PODS_LINK` is not an XDP egress; once it is, the
/// client's packets and the backend's replies are rewritten (addresses, ports, the FIB's MACs,
/// the hop limit one less; the TCP/UDP checksum verified here over the new pseudo-header) and
/// redirected to it.
#[test]
fn xdp_forwards_tracked_flows() {
    let prefix = lb_tests::netns::unique_prefix();
    let node = lb_tests::netns::Netns::new(format!("{prefix}x6n")).unwrap();
    let pods = lb_tests::netns::Netns::new(format!("{prefix}x6p")).unwrap();
    node.add_veth(PODS_LINK, &pods, "eth0").unwrap();
    node.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
    node.ip(&["link", "set", "lo", "up"]).unwrap();
    node.ip(&["link", "set", PODS_LINK, "up"]).unwrap();
    let prefix_len = "fd00:10:244:1::1/64";
    node.ip(&["-6", "addr", "add", prefix_len, "dev", PODS_LINK, "nodad"])
        .unwrap();
    let lladdr = POD_MAC.map(|b| format!("{b:02x}")).join(":");
    for neighbour in [ENDPOINTS[0], CLIENT] {
        let addr = neighbour.ip().to_string();
        let neigh = [
            "-6", "neigh", "add", &addr, "lladdr", &lladdr, "dev", PODS_LINK,
        ];
        node.ip(&[&neigh[..], &["nud", "permanent"]].concat())
            .unwrap();
    }
    let link_mac = lb_tests::topology::mac(&node, PODS_LINK).unwrap();
    let link_mac: Vec<u8> = link_mac
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect();
    let ifindex = node
        .run(|| nix::net::if_::if_nametoindex(PODS_LINK))
        .unwrap()
        .unwrap();
    for proto in [Proto::Tcp, Proto::Udp] {
        let link_mac = link_mac.clone();
        let (passed, forwarded, answered, counters) = node
            .run(move || {
                let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS[..1]);
                let xdp: &mut Xdp = datapath
                    .ebpf
                    .program_mut(program_name::XDP6)
                    .unwrap()
                    .try_into()
                    .unwrap();
                xdp.load().unwrap();
                let flags = if proto == Proto::Tcp { TCP_SYN } else { 0 };
                let first = packet(proto, CLIENT, CLUSTER_IP, flags, &[]);
                let passed = run_xdp6(&datapath.ebpf, &first);
                let mut egress: HashMap<_, u32, u8> = datapath
                    .ebpf
                    .map_mut(map_name::XDP_EGRESS)
                    .unwrap()
                    .try_into()
                    .unwrap();
                egress.insert(ifindex, 1, 0).unwrap();
                let forwarded = (first.clone(), run_xdp6(&datapath.ebpf, &first));
                let answer_flags = if proto == Proto::Tcp {
                    TCP_SYN | TCP_ACK
                } else {
                    0
                };
                let answer = packet(proto, ENDPOINTS[0], CLIENT, answer_flags, &[]);
                let answered = (answer.clone(), run_xdp6(&datapath.ebpf, &answer));
                let counters = [
                    Counter::XdpPassed,
                    Counter::XdpForwarded,
                    Counter::NewConnection,
                ]
                .map(|counter| datapath.counter(counter));
                ((first, passed), forwarded, answered, counters)
            })
            .unwrap();
        let ((first, (verdict, output)), l4) = (passed, ETH_HLEN + IPV6_HLEN);
        assert_eq!(
            (verdict, &output),
            (XDP_PASS, &first),
            "{proto:?}: passed untouched"
        );
        // As the FIB forwards it: its MACs, the hop limit one less.
        let forwarded_as = |input: &[u8]| {
            let mut expected = input.to_vec();
            expected[..6].copy_from_slice(&POD_MAC);
            expected[6..12].copy_from_slice(&link_mac);
            expected[ETH_HLEN + 7] = 63;
            expected
        };
        for ((input, (verdict, output)), tuple) in [
            (forwarded, (CLIENT, ENDPOINTS[0])),
            (answered, (CLUSTER_IP, CLIENT)),
        ] {
            assert_eq!(verdict, XDP_REDIRECT, "{proto:?}");
            let expected = forwarded_as(&input);
            assert_eq!(
                output[..ETH_HLEN + 8],
                expected[..ETH_HLEN + 8],
                "{proto:?}"
            );
            let mut unchanged_header = output.clone();
            unchanged_header[..ETH_HLEN + 8].copy_from_slice(&input[..ETH_HLEN + 8]);
            assert_eq!(
                verify(&input, &unchanged_header, proto, l4),
                tuple,
                "{proto:?}"
            );
        }
        assert_eq!(
            counters,
            [1, 2, 1],
            "{proto:?}: xdp_passed, xdp_forwarded, new_connection"
        );
    }
}
