//! The hooks of the node's IPv6 sockets, as sock.rs's of IPv4 ones: connect6 and sendmsg6
//! point a socket at a backend of the IPv6 service it connects or sends to, recvmsg6 and
//! getpeername6 show it the service address back.
//!
//! An IPv4-mapped address (`::ffff:10.96.0.10`), with which an IPv6 socket reaches IPv4 (Java's
//! default), is an IPv4 service address: looked up in the IPv4 frontends by sock.rs, rewritten
//! to the IPv4-mapped backend (the kernel then connects the socket over IPv4) and remembered in
//! the IPv4 maps. Unconnected UDP to an IPv4-mapped address passes through sendmsg4, not
//! sendmsg6; its answers through recvmsg6, which reverses them here.
use aya_ebpf::bindings::bpf_sock_addr;
use aya_ebpf::programs::SockAddrContext;
use lb_common::{
    Addr6, Backend6, Config, ConntrackKey6, Counter, SockRevNat6, SockRevNatKey6, ipv4_be,
};

use crate::{
    family::Ipv6,
    maps,
    sock::{self, PROCEED, Untouched},
    translate6,
};

/// The third word of an IPv4-mapped address (`::ffff:0:0/96`), its first two being zero.
const IPV4_MAPPED_W2: u32 = ipv4_be([0, 0, 0xff, 0xff]);

/// connect6 and sendmsg6: a service address becomes a backend of that service.
pub fn translate(ctx: &SockAddrContext) -> i32 {
    sock::verdict(try_translate(ctx))
}

fn try_translate(ctx: &SockAddrContext) -> Result<(), Untouched> {
    let (config, proto) = sock::node_socket(ctx)?;
    // SAFETY: the kernel hands the program a valid bpf_sock_addr for its whole run.
    let addr = unsafe { &mut *ctx.sock_addr };
    let dst_addr = user_addr(addr);
    let dst_port = addr.user_port as u16;
    if let Some(ipv4) = ipv4_mapped(&dst_addr) {
        let backend = sock::ipv4_backend(ctx, config, proto, ipv4, dst_port)?;
        addr.user_ip6[3] = backend.addr;
        addr.user_port = u32::from(backend.port);
        return Ok(());
    }
    let backend = ipv6_backend(ctx, config, proto, &dst_addr, dst_port)?;
    set_user_addr(addr, &backend.addr);
    addr.user_port = u32::from(backend.port);
    Ok(())
}

/// recvmsg6 and getpeername6: a backend this socket was pointed to shows as the service
/// address it used (IPv4-mapped for an IPv4 one). Only translated sockets have entries.
pub fn reverse(ctx: &SockAddrContext) -> i32 {
    // SAFETY: as in `try_translate`.
    let addr = unsafe { &mut *ctx.sock_addr };
    let peer = user_addr(addr);
    let port = addr.user_port as u16;
    if let Some(ipv4) = ipv4_mapped(&peer) {
        if let Some(service) = sock::ipv4_service(ctx, ipv4, port) {
            addr.user_ip6[3] = service.addr;
            addr.user_port = u32::from(service.port);
        }
        return PROCEED;
    }
    let key = SockRevNatKey6 {
        cookie: sock::socket_cookie(ctx),
        backend: Backend6 {
            addr: peer,
            port,
            stats_slot: 0,
        },
        _pad: 0,
    };
    if let Some(service) = maps::sock_revnat6(&key) {
        set_user_addr(addr, &service.addr);
        addr.user_port = u32::from(service.port);
    }
    PROCEED
}

/// The backend the socket's connect or send to IPv6 address `dst_addr:dst_port` goes to, if
/// that is a service address; remembered for [`reverse`].
// Inlined: a BPF function call takes at most five arguments, the result's pointer among them.
#[inline(always)]
fn ipv6_backend(
    ctx: &SockAddrContext,
    config: &Config,
    proto: u8,
    dst_addr: &Addr6,
    dst_port: u16,
) -> Result<Backend6, Untouched> {
    let config6 = maps::config6().ok_or(Untouched::NotService)?;
    let cookie = sock::socket_cookie(ctx);
    let tuple = ConntrackKey6 {
        // As sock.rs's: the node's address stands for the source not chosen yet.
        src_addr: config6.node_addr,
        dst_addr: *dst_addr,
        src_port: cookie as u16,
        dst_port,
        proto,
        _pad0: 0,
        _pad1: 0,
    };
    let frontend = translate6::frontend(&tuple).map_err(Untouched::of_frontend_lookup)?;
    let backend = sock::node_backend::<Ipv6>(cookie, &frontend, &tuple, maps::now_ns(config))?;
    let key = SockRevNatKey6 {
        cookie,
        backend: backend.endpoint(),
        _pad: 0,
    };
    let service = SockRevNat6 {
        addr: *dst_addr,
        port: dst_port,
        _pad: 0,
    };
    // A failed insert only leaves the application seeing the backend as its peer.
    maps::sock_revnat6_insert(&key, &service);
    maps::count(Counter::NewConnection);
    Ok(backend)
}

/// The IPv4 address of an IPv4-mapped one.
fn ipv4_mapped(addr: &Addr6) -> Option<u32> {
    (addr.w0 == 0 && addr.w1 == 0 && addr.w2 == IPV4_MAPPED_W2).then_some(addr.w3)
}

/// The socket's IPv6 address (its words as they sit in the sockaddr, network byte order).
fn user_addr(addr: &bpf_sock_addr) -> Addr6 {
    Addr6 {
        w0: addr.user_ip6[0],
        w1: addr.user_ip6[1],
        w2: addr.user_ip6[2],
        w3: addr.user_ip6[3],
    }
}

fn set_user_addr(addr: &mut bpf_sock_addr, to: &Addr6) {
    addr.user_ip6 = [to.w0, to.w1, to.w2, to.w3];
}
