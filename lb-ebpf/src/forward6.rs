//! Forwarding a translated IPv6 packet straight to its egress interface (`--forwarding redirect`
//! in tc, and `lb_xdp6`), as forward.rs does for IPv4, whose FIB parameter block, FIB answer and
//! redirect helpers it shares. IPv6 has no header checksum: the hop limit is decremented alone.
//!
//! The route is the FIB's for every packet: IPv4's route cache lives in `ConntrackEntry`, its
//! IPv6 twin's is not used yet.
use core::mem::{self, MaybeUninit};

use aya_ebpf::{
    bindings::{TC_ACT_OK, bpf_redir_neigh},
    programs::TcContext,
};
use lb_common::{Addr6, ConntrackKey6, Counter};

use crate::{
    forward::{self, AF_INET6, FibParams, NextHop},
    maps,
    packet::PacketAccess,
    parse::ETH_HLEN,
    parse6::Packet6,
    zero,
};

/// The hop limit's offset in the IPv6 header.
const IPV6_HOP_LIMIT: usize = 7;

/// An IPv6 next hop: the words of its address.
pub type NextHop6 = NextHop<[u32; 4]>;

/// Looks up the route of `packet` translated to `to`. Reads nothing of the packet itself, so it
/// may come before the rewrite.
// A frame of its own, as forward::next_hop's, for the 512-byte stack.
#[inline(never)]
pub fn next_hop<P: PacketAccess>(ctx: &P, packet: &Packet6, to: &ConntrackKey6) -> NextHop6 {
    let mut fib = MaybeUninit::<FibParams>::uninit();
    // SAFETY: bpf_fib_lookup is plain old data; all-zero is its "no options" state.
    let fib = unsafe { &mut zero::zeroed(&mut fib).0 };
    fib.family = AF_INET6;
    fib.l4_protocol = to.proto;
    fib.sport = to.src_port;
    fib.dport = to.dst_port;
    fib.__bindgen_anon_1.tot_len = ctx.fib_tot_len(packet.len);
    fib.__bindgen_anon_3.ipv6_src = words(&to.src_addr);
    fib.__bindgen_anon_4.ipv6_dst = words(&to.dst_addr);
    fib.ifindex = ctx.ingress_ifindex();
    // SAFETY: for an AF_INET6 lookup the FIB wrote the IPv6 next hop into ipv6_dst.
    forward::forward_answer(ctx, fib, |fib| unsafe { fib.__bindgen_anon_4.ipv6_dst })
}

fn words(addr: &Addr6) -> [u32; 4] {
    [addr.w0, addr.w1, addr.w2, addr.w3]
}

/// The MTU a packet going to `hop` exceeds, as Linux's `ip6_pkt_too_big` decides for a forwarded
/// packet (IPv6 routers never fragment); `None` when it fits. As forward::oversize: the FIB
/// checks the skb, but only once it has resolved the neighbour, and passes a GSO packet whatever
/// its segments' size: those two are checked here.
pub fn exceeded_mtu(ctx: &TcContext, hop: &NextHop6) -> Option<u16> {
    match *hop {
        NextHop::TooBig { mtu } => Some(mtu),
        NextHop::Unresolved { ifindex, .. } => forward::exceeded_link_mtu(ctx, ifindex),
        NextHop::Resolved { ifindex, .. } if ctx.is_gso() => {
            forward::exceeded_link_mtu(ctx, ifindex)
        }
        _ => None,
    }
}

/// Sends the translated packet out of `ifindex` to the MACs `macs`. The parser passed packets
/// whose hop limit `packet.hop_limit` is 1 or less to the stack. Returns the program type's
/// redirect verdict.
pub fn redirect<P: PacketAccess>(
    ctx: &P,
    packet: &Packet6,
    ifindex: u32,
    macs: &[u8; 12],
) -> Result<i32, Counter> {
    ctx.store(0, macs).map_err(|_| Counter::DropRewriteFailed)?;
    decrement_hop_limit(ctx, packet)?;
    Ok(forward::redirect_to(ifindex))
}

/// tc: sends the translated packet to `hop`; an unresolved neighbour is resolved by the kernel
/// on egress; what the FIB does not forward goes to the stack (a node endpoint, no route).
pub fn send_tc(ctx: &TcContext, packet: &Packet6, hop: NextHop6) -> Result<i32, Counter> {
    match hop {
        NextHop::Resolved { ifindex, macs } => redirect(ctx, packet, ifindex, &macs),
        NextHop::Unresolved { ifindex, addr } => {
            decrement_hop_limit(ctx, packet)?;
            // SAFETY: bpf_redir_neigh is plain old data, fully written below.
            let mut neigh: bpf_redir_neigh = unsafe { mem::zeroed() };
            neigh.nh_family = u32::from(AF_INET6);
            neigh.__bindgen_anon_1.ipv6_nh = addr;
            Ok(forward::redirect_neigh(ifindex, neigh))
        }
        NextHop::Local | NextHop::TooBig { .. } | NextHop::Stack => {
            maps::count(Counter::FibFallback);
            Ok(TC_ACT_OK as i32)
        }
    }
}

/// The stack is bypassed, so it cannot decrement the hop limit for us.
fn decrement_hop_limit<P: PacketAccess>(ctx: &P, packet: &Packet6) -> Result<(), Counter> {
    let hop_limit = packet.hop_limit.saturating_sub(1);
    ctx.store_uncovered(ETH_HLEN + IPV6_HOP_LIMIT, &hop_limit)
        .map_err(|_| Counter::DropRewriteFailed)
}
