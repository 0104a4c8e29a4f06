//! What the datapath checks of a packet's headers before it translates or tracks it: what
//! Linux's IP input (`ip_rcv`) and conntrack (`tcp_error`, `udp_error`) hold invalid. Pure
//! functions, so that host tests exercise them.

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;
pub const TCP_URG: u8 = 0x20;
pub const TCP_ECE: u8 = 0x40;
pub const TCP_CWR: u8 = 0x80;

/// Linux's `tcp_valid_flags` as a bit set: bit `n` is set when the flags `n` (PSH, ECE and CWR
/// left out) are a valid combination.
const VALID_TCP_FLAGS: u64 = 1 << TCP_SYN
    | 1 << (TCP_SYN | TCP_URG)
    | 1 << (TCP_SYN | TCP_ACK)
    | 1 << TCP_RST
    | 1 << (TCP_RST | TCP_ACK)
    | 1 << (TCP_FIN | TCP_ACK)
    | 1 << (TCP_FIN | TCP_ACK | TCP_URG)
    | 1 << TCP_ACK
    | 1 << (TCP_ACK | TCP_URG);

/// A TCP flag combination Linux's conntrack accepts: not none, SYN+FIN, FIN without ACK, "xmas"
/// (FIN, URG and PSH), and the like. PSH, ECE and CWR go with any.
pub const fn tcp_flags(flags: u8) -> bool {
    VALID_TCP_FLAGS >> (flags & !(TCP_PSH | TCP_ECE | TCP_CWR)) & 1 != 0
}

/// A TCP data offset (`data_offset` 32-bit words, the header's length) that covers at least the
/// fixed header and lies within the `segment_len` bytes of TCP header and payload.
pub const fn tcp_data_offset(data_offset: u8, segment_len: usize) -> bool {
    data_offset >= 5 && data_offset as usize * 4 <= segment_len
}

/// A UDP length (`udp_len`, header included) that covers at least the header and, for a whole
/// datagram (`whole`: not the first of its fragments), lies within its `ip_payload_len` bytes.
/// A shorter length is valid: the rest of the IP payload is padding.
pub const fn udp_length(udp_len: u16, ip_payload_len: usize, whole: bool) -> bool {
    udp_len >= 8 && (!whole || udp_len as usize <= ip_payload_len)
}

/// A header whose words (any width, as loaded) add up to `sum` has a valid Internet checksum
/// (RFC 1071): the sum folds to all ones. `sum` must not have wrapped (it holds fewer than 2^32
/// words of 32 bits).
pub const fn checksum(sum: u64) -> bool {
    let sum = (sum & 0xffff_ffff) + (sum >> 32);
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = (sum & 0xffff) + (sum >> 16);
    sum == 0xffff
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_flags_as_linux_conntrack() {
        let valid = [
            TCP_SYN,
            TCP_SYN | TCP_ACK,
            TCP_SYN | TCP_URG,
            TCP_ACK,
            TCP_ACK | TCP_PSH,
            TCP_ACK | TCP_URG,
            TCP_FIN | TCP_ACK,
            TCP_FIN | TCP_ACK | TCP_PSH,
            TCP_FIN | TCP_ACK | TCP_URG,
            TCP_RST,
            TCP_RST | TCP_ACK,
            TCP_SYN | TCP_ECE | TCP_CWR,
            TCP_ACK | TCP_ECE,
        ];
        for flags in valid {
            assert!(tcp_flags(flags), "{flags:#04x}");
        }
        let count = (0..=u8::MAX).filter(|&flags| tcp_flags(flags)).count();
        // 9 combinations, each with any of PSH, ECE and CWR.
        assert_eq!(count, 9 * 8);
        let invalid = [
            0,
            TCP_FIN | TCP_URG | TCP_PSH,
            TCP_FIN | TCP_SYN | TCP_RST | TCP_PSH | TCP_ACK | TCP_URG,
            TCP_SYN | TCP_FIN,
            TCP_SYN | TCP_FIN | TCP_ACK,
            TCP_SYN | TCP_RST,
            TCP_FIN,
            TCP_PSH,
            TCP_URG,
            TCP_SYN | TCP_ACK | TCP_URG,
            TCP_RST | TCP_FIN | TCP_ACK,
        ];
        for flags in invalid {
            assert!(!tcp_flags(flags), "{flags:#04x}");
        }
    }

    #[test]
    fn tcp_data_offset_within_the_segment() {
        assert!(tcp_data_offset(5, 20));
        assert!(tcp_data_offset(15, 60));
        assert!(tcp_data_offset(8, 100));
        assert!(!tcp_data_offset(4, 100));
        assert!(!tcp_data_offset(0, 100));
        assert!(!tcp_data_offset(6, 20));
        assert!(!tcp_data_offset(15, 59));
    }

    #[test]
    fn udp_length_within_the_ip_payload() {
        assert!(udp_length(8, 8, true));
        assert!(udp_length(22, 22, true));
        assert!(udp_length(20, 22, true), "padding after the datagram");
        assert!(!udp_length(7, 22, true));
        assert!(!udp_length(0, 22, true));
        assert!(!udp_length(23, 22, true));
        assert!(udp_length(3008, 1480, false), "a first fragment");
        assert!(!udp_length(7, 1480, false));
    }

    #[test]
    fn checksum_of_a_real_ipv4_header() {
        // RFC 1071's example header (Wikipedia's "IPv4 header checksum"), checksum 0xb861.
        let header: [u8; 20] = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        let sum = |bytes: &[u8]| -> u64 {
            bytes
                .chunks(4)
                .map(|w| u64::from(u32::from_ne_bytes(w.try_into().unwrap())))
                .sum()
        };
        assert!(checksum(sum(&header)));
        for (byte, bit) in [(10, 0x01), (0, 0x10), (19, 0x80), (8, 0x01)] {
            let mut broken = header;
            broken[byte] ^= bit;
            assert!(!checksum(sum(&broken)), "byte {byte}");
        }
        // Headers with options whose 32-bit words carry a lot, checksummed 16 bits at a time
        // as RFC 1071 does.
        for seed in 1u32..50 {
            let mut header = [0u8; 60];
            let mut x = seed;
            for byte in &mut header {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                *byte = (x >> 16) as u8 | 0xc0;
            }
            header[10..12].fill(0);
            let mut reference: u32 = header
                .chunks(2)
                .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
                .sum();
            while reference > 0xffff {
                reference = (reference & 0xffff) + (reference >> 16);
            }
            header[10..12].copy_from_slice(&(!(reference as u16)).to_be_bytes());
            assert!(checksum(sum(&header)), "seed {seed}");
            header[59] ^= 1;
            assert!(!checksum(sum(&header)), "seed {seed}");
        }
    }
}
