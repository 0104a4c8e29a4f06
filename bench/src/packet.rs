//! Ethernet + IPv4/IPv6 + TCP/UDP frames for BPF_PROG_TEST_RUN (B1) and the live-frames flood (B4).
use std::net::{SocketAddrV4, SocketAddrV6};

pub const ETH_HLEN: usize = 14;
pub const IPV4_HLEN: usize = 20;
pub const UDP_HLEN: usize = 8;
pub const IPV6_HLEN: usize = 40;
/// Offsets in the frame.
const IP_SRC: usize = ETH_HLEN + 12;
const L4_SRC_PORT: usize = ETH_HLEN + IPV4_HLEN;
const IP6_SRC: usize = ETH_HLEN + 8;
const L4_SRC_PORT6: usize = ETH_HLEN + IPV6_HLEN;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;

pub struct Frame {
    pub bytes: Vec<u8>,
}

impl Frame {
    /// TCP with `flags`, no payload; the TCP checksum as a sender would leave it to offload (the
    /// datapath updates it incrementally and never verifies it).
    pub fn tcp(src: SocketAddrV4, dst: SocketAddrV4, flags: u8) -> Self {
        let l4 = tcp_header(src.port(), dst.port(), flags);
        Self::ipv4(
            [0x02, 0, 0, 0, 0, 2],
            [0x02, 0, 0, 0, 0, 1],
            src,
            dst,
            6,
            &l4,
        )
    }

    /// The IPv6 twin of `tcp`.
    pub fn tcp6(src: SocketAddrV6, dst: SocketAddrV6, flags: u8) -> Self {
        let l4 = tcp_header(src.port(), dst.port(), flags);
        let mut bytes = Vec::with_capacity(ETH_HLEN + IPV6_HLEN + l4.len());
        bytes.extend_from_slice(&[0x02, 0, 0, 0, 0, 2]);
        bytes.extend_from_slice(&[0x02, 0, 0, 0, 0, 1]);
        bytes.extend_from_slice(&0x86ddu16.to_be_bytes());
        let mut ip = [0u8; IPV6_HLEN];
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
        ip[6] = 6;
        ip[7] = 64;
        ip[8..24].copy_from_slice(&src.ip().octets());
        ip[24..40].copy_from_slice(&dst.ip().octets());
        bytes.extend_from_slice(&ip);
        bytes.extend_from_slice(&l4);
        Frame { bytes }
    }

    /// UDP with `payload` zero bytes and no checksum (allowed for IPv4), between real MACs.
    pub fn udp(
        src_mac: [u8; 6],
        dst_mac: [u8; 6],
        src: SocketAddrV4,
        dst: SocketAddrV4,
        payload: usize,
    ) -> Self {
        let mut l4 = vec![0u8; UDP_HLEN + payload];
        l4[0..2].copy_from_slice(&src.port().to_be_bytes());
        l4[2..4].copy_from_slice(&dst.port().to_be_bytes());
        l4[4..6].copy_from_slice(&((UDP_HLEN + payload) as u16).to_be_bytes());
        Self::ipv4(dst_mac, src_mac, src, dst, 17, &l4)
    }

    fn ipv4(
        dst_mac: [u8; 6],
        src_mac: [u8; 6],
        src: SocketAddrV4,
        dst: SocketAddrV4,
        proto: u8,
        l4: &[u8],
    ) -> Self {
        let mut bytes = Vec::with_capacity(ETH_HLEN + IPV4_HLEN + l4.len());
        bytes.extend_from_slice(&dst_mac);
        bytes.extend_from_slice(&src_mac);
        bytes.extend_from_slice(&0x0800u16.to_be_bytes());
        let mut ip = [0u8; IPV4_HLEN];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&((IPV4_HLEN + l4.len()) as u16).to_be_bytes());
        ip[6] = 0x40; // DF
        ip[8] = 64;
        ip[9] = proto;
        ip[12..16].copy_from_slice(&src.ip().octets());
        ip[16..20].copy_from_slice(&dst.ip().octets());
        let checksum = ipv4_checksum(&ip);
        ip[10..12].copy_from_slice(&checksum.to_be_bytes());
        bytes.extend_from_slice(&ip);
        bytes.extend_from_slice(l4);
        Frame { bytes }
    }

    /// Rewrites the source (a new flow), with the IPv4 checksum the datapath verifies (the
    /// TCP/UDP checksum it never does).
    pub fn set_source(&mut self, src: SocketAddrV4) {
        self.bytes[IP_SRC..IP_SRC + 4].copy_from_slice(&src.ip().octets());
        self.bytes[L4_SRC_PORT..L4_SRC_PORT + 2].copy_from_slice(&src.port().to_be_bytes());
        let ip = &mut self.bytes[ETH_HLEN..ETH_HLEN + IPV4_HLEN];
        ip[10..12].fill(0);
        let checksum = ipv4_checksum(ip);
        ip[10..12].copy_from_slice(&checksum.to_be_bytes());
    }

    /// The IPv6 twin of `set_source` (IPv6 has no header checksum).
    pub fn set_source6(&mut self, src: SocketAddrV6) {
        self.bytes[IP6_SRC..IP6_SRC + 16].copy_from_slice(&src.ip().octets());
        self.bytes[L4_SRC_PORT6..L4_SRC_PORT6 + 2].copy_from_slice(&src.port().to_be_bytes());
    }
}

/// A TCP header without options, its checksum left to offload.
fn tcp_header(src_port: u16, dst_port: u16, flags: u8) -> Vec<u8> {
    let mut l4 = vec![0u8; 20];
    l4[0..2].copy_from_slice(&src_port.to_be_bytes());
    l4[2..4].copy_from_slice(&dst_port.to_be_bytes());
    l4[12] = 5 << 4;
    l4[13] = flags;
    l4[14..16].copy_from_slice(&65535u16.to_be_bytes());
    l4
}

fn ipv4_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}
