//! Crafted packets sent from a raw socket: what no socket of the namespace would send.
use std::{
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use etherparse::{PacketBuilder, PacketBuilderStep, TcpHeader};
use nix::{
    libc,
    sys::socket::{MsgFlags, SockaddrIn, sendto},
};

/// Sends the IPv4 packet `packet` (header included; the kernel fills in its checksum) to `to`.
/// Call inside a namespace.
pub fn send_ipv4(packet: &[u8], to: Ipv4Addr) -> Result<()> {
    send_on(&raw_socket()?, packet, to)
}

/// A socket that sends IPv4 packets, header included.
fn raw_socket() -> Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    ensure!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn send_on(socket: &OwnedFd, packet: &[u8], to: Ipv4Addr) -> Result<()> {
    let addr = SockaddrIn::from(SocketAddrV4::new(to, 0));
    sendto(socket.as_raw_fd(), packet, &addr, MsgFlags::empty()).context("sendto")?;
    Ok(())
}

/// A SYN flood's spoofed sources: 64 addresses of the client's link (198.51.100.64/26, a
/// documentation range) that no namespace holds, so the SYN-ACKs to them are never answered;
/// ports from SPOOFED_FIRST_PORT up.
const SPOOFED_BASE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 64);
const SPOOFED_ADDRESSES: u32 = 64;
const SPOOFED_FIRST_PORT: u16 = 20_000;
/// The most SYNs `spoofed_syns` makes: distinct source addresses and ports.
pub const MAX_SPOOFED_SYNS: u32 = SPOOFED_ADDRESSES * (u16::MAX - SPOOFED_FIRST_PORT) as u32;

/// `count` SYNs to `to`, each from a spoofed source of its own (a new connection each).
pub fn spoofed_syns(to: SocketAddrV4, count: u32) -> Result<Vec<Vec<u8>>> {
    ensure!(count <= MAX_SPOOFED_SYNS, "{count} spoofed SYNs");
    (0..count)
        .map(|i| {
            let addr = Ipv4Addr::from(u32::from(SPOOFED_BASE) + i % SPOOFED_ADDRESSES);
            let port = SPOOFED_FIRST_PORT + (i / SPOOFED_ADDRESSES) as u16;
            tcp_segment(
                SocketAddrV4::new(addr, port),
                to,
                i.wrapping_mul(7919),
                |b| b.syn(),
            )
        })
        .collect()
}

/// Sends `packets` (IPv4, header included) to `to` from one raw socket, `batch` at a time with
/// `pause` after each batch, which spreads a flood over `packets / batch × pause`. Returns how
/// many were sent. Call inside a namespace.
pub fn send_paced(packets: &[Vec<u8>], to: Ipv4Addr, batch: usize, pause: Duration) -> Result<u32> {
    let socket = raw_socket()?;
    let mut sent = 0;
    for chunk in packets.chunks(batch) {
        for packet in chunk {
            send_on(&socket, packet, to)?;
            sent += 1;
        }
        std::thread::sleep(pause);
    }
    Ok(sent)
}

/// A TCP segment without payload from `from` to `to` with sequence number `seq`, its flags set
/// by `flags` (e.g. `|b| b.syn()`), as IPv4 packet bytes.
pub fn tcp_segment(
    from: SocketAddrV4,
    to: SocketAddrV4,
    seq: u32,
    flags: impl FnOnce(PacketBuilderStep<TcpHeader>) -> PacketBuilderStep<TcpHeader>,
) -> Result<Vec<u8>> {
    let builder = PacketBuilder::ipv4(from.ip().octets(), to.ip().octets(), 64).tcp(
        from.port(),
        to.port(),
        seq,
        64_240,
    );
    let builder = flags(builder);
    let mut packet = Vec::with_capacity(builder.size(0));
    builder.write(&mut packet, &[])?;
    Ok(packet)
}
