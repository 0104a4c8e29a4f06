//! IPv6 fragments (issue 22): a datagram's first fragment is translated as a whole packet and
//! its ports kept by the fragment header's identification, its later fragments take them up and
//! go to the same endpoint, addresses rewritten only.
//!
//! BPF_PROG_TEST_RUN (lb_tests::test_run6): the fragments of UDP datagrams built here, their
//! translation checked byte by byte and the UDP checksum of the datagram they reassemble into
//! computed here over the new pseudo-header; fragments that must not be translated come out
//! untouched (or dropped) and keep nothing. Then a real node namespace: a UDP datagram larger
//! than the links' MTU leaves a pod in fragments for an IPv6 ClusterIP, its endpoint reassembles
//! it, and its answer, fragmented by the endpoint's kernel, comes back from the ClusterIP whole.
use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};

use anyhow::{Result, ensure};
use aya::maps::{HashMap, MapData};
use lb_common::{Counter, FirstFragment, FragmentKey6, IPPROTO_TCP, IPPROTO_UDP, map_name};
use lb_tests::{
    agent::counter,
    echo::{LARGE_DATAGRAM, Proto as EchoProto, large_exchange, serve_large},
    manifests,
    node::{Node, PORT},
    test_run6::*,
    topology::pod_ip_v6,
};

const FRAGMENT_HLEN: usize = 8;
/// Where a fragment's data starts in the frames built here (no other extension header).
const DATA: usize = ETH_HLEN + IPV6_HLEN + FRAGMENT_HLEN;
const ID: u32 = 0x1234_5678;
/// A datagram of 8 + 56 bytes, cut into fragments of 24, 24 and 16 bytes.
const CUTS: [usize; 2] = [24, 48];

/// A UDP datagram `src` → `dst` of 56 bytes of payload, its checksum computed over the whole.
fn udp_datagram(src: SocketAddrV6, dst: SocketAddrV6) -> Vec<u8> {
    let payload: Vec<u8> = (0..56u8).collect();
    let mut udp = Vec::new();
    udp.extend_from_slice(&src.port().to_be_bytes());
    udp.extend_from_slice(&dst.port().to_be_bytes());
    udp.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(&payload);
    let check = !pseudo_header_sum(src.ip(), dst.ip(), IPPROTO_UDP, &udp);
    udp[6..8].copy_from_slice(&check.to_be_bytes());
    udp
}

/// One fragment of datagram `id` from `src` to `dst`: `data` at byte `offset` of the
/// fragmentable part, `more` fragments after it or not; `next` the fragment header's next header.
fn fragment(
    (src, dst): (&Ipv6Addr, &Ipv6Addr),
    (id, next): (u32, u8),
    offset: usize,
    more: bool,
    data: &[u8],
) -> Vec<u8> {
    let offset_and_more = offset as u16 | u16::from(more);
    let mut header = vec![next, 0];
    header.extend_from_slice(&offset_and_more.to_be_bytes());
    header.extend_from_slice(&id.to_be_bytes());
    header.extend_from_slice(data);
    // No checksum in a fragment header: `frame` leaves the payload as it is.
    frame(src, dst, &[], IPPROTO_FRAGMENT, &header)
}

/// `datagram` (a `proto` header and its payload) from `src` to `dst` cut at `cuts` into the
/// fragments of datagram `id`.
fn fragments(
    (src, dst): (&Ipv6Addr, &Ipv6Addr),
    (id, proto): (u32, Proto),
    datagram: &[u8],
    cuts: &[usize],
) -> Vec<Vec<u8>> {
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(datagram.len());
    bounds
        .windows(2)
        .map(|w| {
            let more = w[1] != datagram.len();
            fragment(
                (src, dst),
                (id, proto.number()),
                w[0],
                more,
                &datagram[w[0]..w[1]],
            )
        })
        .collect()
}

/// The source and destination of a frame.
fn addresses(frame: &[u8]) -> (Ipv6Addr, Ipv6Addr) {
    let ip = |at: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&frame[at..at + 16]).unwrap());
    (ip(ETH_HLEN + 8), ip(ETH_HLEN + 24))
}

/// Runs `fragments` of one datagram, in order, through `datapath`: each must be handed on with
/// its addresses rewritten (and, in the first, the ports and checksum) and nothing else changed,
/// and every fragment must carry the same addresses. Returns the datagram's new tuple, having
/// checked the `proto` checksum of the reassembled datagram over its new pseudo-header.
fn translate_fragments(
    datapath: &Datapath,
    proto: Proto,
    fragments: &[Vec<u8>],
) -> (SocketAddrV6, SocketAddrV6) {
    let check = DATA + proto.check_offset();
    let mut reassembled = Vec::new();
    let mut translated = None;
    for (index, input) in fragments.iter().enumerate() {
        let (verdict, output) = datapath.run(input);
        assert_eq!(verdict, TC_ACT_OK, "fragment {index}");
        assert_eq!(output.len(), input.len(), "fragment {index}");
        assert_eq!(
            output[..ETH_HLEN + 8],
            input[..ETH_HLEN + 8],
            "fragment {index}"
        );
        assert_eq!(output[ETH_HLEN + 40..DATA], input[ETH_HLEN + 40..DATA]);
        let addresses = addresses(&output);
        assert_eq!(
            *translated.get_or_insert(addresses),
            addresses,
            "fragment {index}"
        );
        if index == 0 {
            // The ports and the checksum may change, nothing else.
            assert_eq!(output[DATA + 4..check], input[DATA + 4..check]);
            assert_eq!(output[check + 2..], input[check + 2..]);
        } else {
            assert_eq!(
                output[DATA..],
                input[DATA..],
                "fragment {index}: data unchanged"
            );
        }
        reassembled.extend_from_slice(&output[DATA..]);
    }
    let (src, dst) = translated.expect("fragments");
    assert_eq!(
        pseudo_header_sum(&src, &dst, proto.number(), &reassembled),
        0xffff,
        "the reassembled datagram's {proto:?} checksum over the new pseudo-header"
    );
    let port = |at: usize| u16::from_be_bytes([reassembled[at], reassembled[at + 1]]);
    (
        SocketAddrV6::new(src, port(0), 0, 0),
        SocketAddrV6::new(dst, port(2), 0, 0),
    )
}

fn fragment_records(datapath: &Datapath) -> Vec<(FragmentKey6, FirstFragment)> {
    let map = datapath.ebpf.map(map_name::FRAGMENTS6).unwrap();
    let records: HashMap<&MapData, FragmentKey6, FirstFragment> = map.try_into().unwrap();
    records.iter().map(Result::unwrap).collect()
}

/// A pod's fragmented datagram to the ClusterIP: every fragment to the one endpoint its first
/// chose, the pod's address kept; the endpoint's fragmented answer back from the ClusterIP. The
/// masqueraded NodePort the same, its later fragments from the masquerade address and port.
#[test]
fn fragments_follow_their_first_fragment() {
    let mut datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    datapath.set_node_and_cluster_cidr();
    let request = udp_datagram(CLIENT, CLUSTER_IP);
    let (src, backend) = translate_fragments(
        &datapath,
        Proto::Udp,
        &fragments(
            (CLIENT.ip(), CLUSTER_IP.ip()),
            (ID, Proto::Udp),
            &request,
            &CUTS,
        ),
    );
    assert_eq!(src, CLIENT);
    assert!(ENDPOINTS.contains(&backend), "{backend}");
    assert_eq!(datapath.counter(Counter::NewConnection), 1);
    assert_eq!(datapath.counter(Counter::Translated), 2);

    let answer = udp_datagram(backend, CLIENT);
    let reply = fragments(
        (backend.ip(), CLIENT.ip()),
        (ID, Proto::Udp),
        &answer,
        &CUTS,
    );
    assert_eq!(
        translate_fragments(&datapath, Proto::Udp, &reply),
        (CLUSTER_IP, CLIENT)
    );

    let request = udp_datagram(EXTERNAL_CLIENT, NODE_PORT);
    let to_node_port = fragments(
        (EXTERNAL_CLIENT.ip(), &NODE),
        (ID, Proto::Udp),
        &request,
        &CUTS,
    );
    let (masqueraded, backend) = translate_fragments(&datapath, Proto::Udp, &to_node_port);
    assert_eq!(*masqueraded.ip(), NODE);
    assert_ne!(masqueraded.port(), EXTERNAL_CLIENT.port());
    assert!(ENDPOINTS.contains(&backend), "{backend}");
    let answer = udp_datagram(backend, masqueraded);
    let reply = fragments((backend.ip(), &NODE), (ID, Proto::Udp), &answer, &CUTS);
    assert_eq!(
        translate_fragments(&datapath, Proto::Udp, &reply),
        (NODE_PORT, EXTERNAL_CLIENT)
    );

    // One record per datagram: its first fragment's ports and where its data ends.
    let records = fragment_records(&datapath);
    assert_eq!(records.len(), 4, "{records:?}");
    let (key, first) = records
        .iter()
        .find(|(key, _)| key.src_addr == a6(CLIENT.ip()))
        .expect("the pod's datagram");
    assert_eq!((key.id, key.proto), (ID.to_be(), IPPROTO_UDP));
    assert_eq!(
        (u16::from_be(first.dst_port), first.end),
        (CLUSTER_IP.port(), CUTS[0] as u16)
    );
    assert_eq!(datapath.counter(Counter::PassedFragment), 0);
}

/// A fragmented TCP segment (a SYN with data, cut after its header) to the ClusterIP: both
/// fragments to the endpoint the first chose, the TCP checksum right over the new pseudo-header.
#[test]
fn fragmented_tcp_segment_follows_its_first_fragment() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let syn = packet(Proto::Tcp, CLIENT, CLUSTER_IP, TCP_SYN, &[]);
    let segment = &syn[ETH_HLEN + IPV6_HLEN..];
    let pieces = fragments(
        (CLIENT.ip(), CLUSTER_IP.ip()),
        (ID, Proto::Tcp),
        segment,
        &[24],
    );
    let (src, backend) = translate_fragments(&datapath, Proto::Tcp, &pieces);
    assert_eq!(src, CLIENT);
    assert!(ENDPOINTS.contains(&backend), "{backend}");
    assert_eq!(datapath.counter(Counter::NewConnection), 1);
    assert_eq!(datapath.counter(Counter::Translated), 1);
}

/// A later fragment whose first was not seen, or was not a service's, passes untouched.
#[test]
fn later_fragments_without_a_translated_first_pass_untouched() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let request = udp_datagram(CLIENT, CLUSTER_IP);
    let pieces = fragments(
        (CLIENT.ip(), CLUSTER_IP.ip()),
        (ID, Proto::Udp),
        &request,
        &CUTS,
    );
    datapath.assert_untouched(&pieces[1]);
    datapath.assert_untouched(&pieces[2]);
    assert_eq!(datapath.counter(Counter::PassedFragment), 2);

    let other = pod(0x99, 9999);
    let not_a_service = udp_datagram(CLIENT, other);
    for piece in fragments(
        (CLIENT.ip(), other.ip()),
        (ID, Proto::Udp),
        &not_a_service,
        &CUTS,
    ) {
        datapath.assert_untouched(&piece);
    }
    assert_eq!(datapath.counter(Counter::PassedFragment), 4);
    assert_eq!(datapath.conntrack_len(), 0);
}

/// A first fragment that does not hold the whole UDP (TCP) header passes untouched and keeps
/// nothing, and so do the fragments after it.
#[test]
fn first_fragment_shorter_than_its_transport_header_passes_untouched() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let request = udp_datagram(CLIENT, CLUSTER_IP);
    let (src, dst) = (CLIENT.ip(), CLUSTER_IP.ip());
    datapath.assert_untouched(&fragment(
        (src, dst),
        (ID, IPPROTO_UDP),
        0,
        true,
        &request[..4],
    ));
    datapath.assert_untouched(&fragment(
        (src, dst),
        (ID, IPPROTO_UDP),
        8,
        false,
        &request[8..],
    ));
    let syn = packet(Proto::Tcp, CLIENT, CLUSTER_IP, TCP_SYN, &[]);
    let tcp = &syn[ETH_HLEN + IPV6_HLEN..];
    datapath.assert_untouched(&fragment(
        (src, dst),
        (ID, IPPROTO_TCP),
        0,
        true,
        &tcp[..16],
    ));
    assert!(fragment_records(&datapath).is_empty());
    assert_eq!(datapath.conntrack_len(), 0);
    assert_eq!(datapath.counter(Counter::PassedUnparsed), 2);
    assert_eq!(datapath.counter(Counter::PassedFragment), 1);
}

/// Fragment headers the datapath must not follow: truncated, two in a chain, an extension header
/// or ICMPv6 in the fragmentable part (untouched); and fragments overlapping their datagram's
/// first fragment, which Linux's reassembly discards (RFC 5722), dropped.
#[test]
fn malformed_fragment_headers_are_not_mistranslated() {
    let datapath = Datapath::with_cluster_ip(&ENDPOINTS);
    let (src, dst) = (CLIENT.ip(), CLUSTER_IP.ip());
    let request = udp_datagram(CLIENT, CLUSTER_IP);
    let first = fragment((src, dst), (ID, IPPROTO_UDP), 0, true, &request[..24]);
    let truncated = &first[..ETH_HLEN + IPV6_HLEN + 4];
    let mut truncated = truncated.to_vec();
    truncated[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&4u16.to_be_bytes());
    datapath.assert_untouched(&truncated);
    let mut twice = vec![IPPROTO_UDP, 0, 0, 1];
    twice.extend_from_slice(&ID.to_be_bytes());
    twice.extend_from_slice(&request[..24]);
    datapath.assert_untouched(&fragment(
        (src, dst),
        (ID, IPPROTO_FRAGMENT),
        0,
        true,
        &twice,
    ));
    let mut options = vec![IPPROTO_UDP, 0, 1, 4, 0, 0, 0, 0];
    options.extend_from_slice(&request[..24]);
    datapath.assert_untouched(&fragment(
        (src, dst),
        (ID, IPPROTO_DSTOPTS),
        0,
        true,
        &options,
    ));
    datapath.assert_untouched(&fragment(
        (src, dst),
        (ID, IPPROTO_DSTOPTS),
        32,
        false,
        &request[24..],
    ));
    let echo = [128, 0, 0, 0, 0, 0, 0, 0];
    datapath.assert_untouched(&fragment((src, dst), (ID, IPPROTO_ICMPV6), 0, true, &echo));
    assert!(fragment_records(&datapath).is_empty());
    assert_eq!(datapath.conntrack_len(), 0);

    // A later fragment over its first's data, another first fragment of another length.
    let (verdict, _) = datapath.run(&first);
    assert_eq!(verdict, TC_ACT_OK);
    let over = fragment((src, dst), (ID, IPPROTO_UDP), 16, false, &request[16..]);
    let longer = fragment((src, dst), (ID, IPPROTO_UDP), 0, true, &request[..32]);
    for overlapping in [over, longer] {
        assert_eq!(datapath.run(&overlapping).0, TC_ACT_SHOT);
    }
    assert_eq!(datapath.counter(Counter::DropFragmentOverlap), 2);
    // The datagram's own fragments still follow its first.
    let rest = fragment((src, dst), (ID, IPPROTO_UDP), 24, false, &request[24..]);
    let (verdict, output) = datapath.run(&rest);
    assert_eq!(verdict, TC_ACT_OK);
    assert!(ENDPOINTS.iter().any(|e| addresses(&output).1 == *e.ip()));
}

/// The IPv6-only Service's ClusterIP, in the fixture's service range.
const CLUSTER_IP_V6: &str = "2001:db8:96::12";
/// Not the fixture's echo servers' port (their IPv4 sockets hold it on 0.0.0.0).
const LARGE_PORT_V6: u16 = 8093;

/// pod-a → an IPv6 ClusterIP → pod-b, a LARGE_DATAGRAM-byte datagram each way (three fragments
/// at MTU 1500): the endpoint sees pod-a's own address, pod-a the ClusterIP answer with its
/// datagram whole; no fragment passed untranslated. With IPv6 fragments passed untouched, the
/// datagram reaches no endpoint and the exchange times out.
#[test]
fn fragmented_udp_through_an_ipv6_cluster_ip() -> Result<()> {
    let mut node = Node::start_dual_stack(2, &[])?;
    node.add_pod_ipv6()?;
    let cluster_ip: Ipv6Addr = CLUSTER_IP_V6.parse()?;
    let endpoints = [pod_ip_v6(1).to_string()];
    let slice = ("large6-v6", "IPv6", LARGE_PORT_V6);
    let service = manifests::ipv6_only_service(
        "large6",
        (cluster_ip, PORT),
        EchoProto::Udp,
        slice,
        &endpoints,
    );
    node.agent.update_manifests(&service)?;
    let local = SocketAddr::from((Ipv6Addr::UNSPECIFIED, LARGE_PORT_V6));
    let server = serve_large(node.pod_ns("pod-b"), local, 1)?;
    let to = SocketAddr::from((cluster_ip, PORT));
    let (seen, peer) = large_exchange(node.pod_ns("pod-a"), to, LARGE_DATAGRAM)?;
    ensure!(seen.ip() == pod_ip_v6(0), "the endpoint saw {seen}");
    ensure!(peer == to, "answer from {peer}");
    server.join().expect("server thread")?;
    let passed = counter(&node.topology.node, "passed_fragment")?;
    ensure!(passed == 0, "passed_fragment {passed}");
    Ok(())
}
