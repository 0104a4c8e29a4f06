//! Crafted packets sent from a raw socket: what no socket of the namespace would send.
use std::{
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
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
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    ensure!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let addr = SockaddrIn::from(SocketAddrV4::new(to, 0));
    sendto(socket.as_raw_fd(), packet, &addr, MsgFlags::empty()).context("sendto")?;
    Ok(())
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
