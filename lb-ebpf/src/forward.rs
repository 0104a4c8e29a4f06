//! Forwarding a translated packet straight to its egress interface.
//!
//! Redirecting is required: after masquerade the source is the node's own address, which the
//! stack would drop on input as a martian.
use core::mem::{self, MaybeUninit};

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK, bpf_fib_lookup,
        bpf_redir_neigh,
    },
    helpers::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use lb_common::{ConntrackKey, Counter};

use crate::{
    maps,
    nat::IP_CHECK_OFFSET,
    packet::{Change, PacketAccess},
    parse::{ETH_HLEN, Packet},
};

const AF_INET: u8 = 2;
const IP_TTL_OFFSET: usize = ETH_HLEN + 8;

/// Where the FIB sends the translated packet.
pub enum NextHop {
    /// Out of `ifindex` with these destination and source MACs.
    Resolved { ifindex: u32, macs: [u8; 12] },
    /// Out of `ifindex` to `addr`, whose MAC the kernel does not know yet.
    Unresolved { ifindex: u32, addr: u32 },
    /// No forwarding answer (local destination, no route, forwarding disabled, MTU): the
    /// stack's business.
    Stack,
}

/// The FIB lookup's parameter block, aligned for zeroing in words.
#[repr(C, align(8))]
struct FibParams(bpf_fib_lookup);

/// Looks up the route of `packet` translated to `to`. Reads nothing of the packet itself, so it
/// may come before the rewrite.
// A frame of its own, as reject::port_unreachable's, for the 512-byte stack.
#[inline(never)]
pub fn next_hop<P: PacketAccess>(ctx: &P, packet: &Packet, to: &ConntrackKey) -> NextHop {
    let mut fib = MaybeUninit::<FibParams>::uninit();
    // All-zero is its "no options" state. Word by word, volatile: LLVM would otherwise make it a
    // call to the BPF target's byte-loop memset, a cost on every packet.
    let words = fib.as_mut_ptr().cast::<u64>();
    for i in 0..mem::size_of::<FibParams>() / 8 {
        // SAFETY: within `fib`, whose size is a multiple of 8 and alignment 8.
        unsafe { words.add(i).write_volatile(0) };
    }
    // SAFETY: bpf_fib_lookup is plain old data, now all zero.
    let fib = unsafe { &mut fib.assume_init_mut().0 };
    fib.family = AF_INET;
    fib.l4_protocol = to.proto;
    fib.sport = to.src_port;
    fib.dport = to.dst_port;
    fib.__bindgen_anon_1.tot_len = ctx.fib_tot_len(packet.tot_len);
    fib.__bindgen_anon_2.tos = packet.tos;
    fib.__bindgen_anon_3.ipv4_src = to.src_addr;
    fib.__bindgen_anon_4.ipv4_dst = to.dst_addr;
    fib.ifindex = ctx.ingress_ifindex();
    // SAFETY: `fib` is a valid, exclusively borrowed parameter block of the size passed.
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            &raw mut *fib,
            mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    match u32::try_from(ret) {
        Ok(BPF_FIB_LKUP_RET_SUCCESS) => {
            let mut macs = [0u8; 12];
            macs[..6].copy_from_slice(&fib.dmac);
            macs[6..].copy_from_slice(&fib.smac);
            NextHop::Resolved {
                ifindex: fib.ifindex,
                macs,
            }
        }
        Ok(BPF_FIB_LKUP_RET_NO_NEIGH) => NextHop::Unresolved {
            ifindex: fib.ifindex,
            // SAFETY: for an AF_INET lookup the FIB wrote the IPv4 next hop into ipv4_dst.
            addr: unsafe { fib.__bindgen_anon_4.ipv4_dst },
        },
        _ => NextHop::Stack,
    }
}

/// Sends the (translated) packet out of `ifindex` to the MACs `macs`. The caller has checked that
/// the TTL is above 1. Returns the program type's redirect verdict.
pub fn redirect<P: PacketAccess>(
    ctx: &P,
    packet: &Packet,
    ifindex: u32,
    macs: &[u8; 12],
) -> Result<i32, Counter> {
    ctx.store(0, macs).map_err(|_| Counter::DropRewriteFailed)?;
    decrement_ttl(ctx, packet)?;
    // SAFETY: the helper only records the target; flags 0 means egress.
    Ok(unsafe { bpf_redirect(ifindex, 0) } as i32)
}

/// tc: redirects the translated packet along its route; an unresolved neighbour is resolved by
/// the kernel on egress; without a route the stack gets it.
pub fn forward_tc(ctx: &TcContext, packet: &Packet, to: &ConntrackKey) -> Result<i32, Counter> {
    match next_hop(ctx, packet, to) {
        NextHop::Resolved { ifindex, macs } => redirect(ctx, packet, ifindex, &macs),
        NextHop::Unresolved { ifindex, addr } => {
            decrement_ttl(ctx, packet)?;
            // SAFETY: bpf_redir_neigh is plain old data, fully written below.
            let mut neigh: bpf_redir_neigh = unsafe { mem::zeroed() };
            neigh.nh_family = u32::from(AF_INET);
            neigh.__bindgen_anon_1.ipv4_nh = addr;
            // SAFETY: `neigh` is a valid parameter block of the size passed; the kernel resolves
            // the neighbour and fills in the MACs on egress.
            Ok(unsafe {
                bpf_redirect_neigh(
                    ifindex,
                    &raw mut neigh,
                    mem::size_of::<bpf_redir_neigh>() as i32,
                    0,
                )
            } as i32)
        }
        NextHop::Stack => {
            maps::count(Counter::FibFallback);
            Ok(TC_ACT_OK)
        }
    }
}

/// The stack is bypassed, so it cannot decrement the TTL for us.
fn decrement_ttl<P: PacketAccess>(ctx: &P, packet: &Packet) -> Result<(), Counter> {
    let ttl = packet.ttl.saturating_sub(1);
    // The TTL shares its checksum word with the protocol byte.
    let old = u16::from_ne_bytes([packet.ttl, packet.tuple.proto]);
    let new = u16::from_ne_bytes([ttl, packet.tuple.proto]);
    let change = Change {
        old: old.into(),
        new: new.into(),
        size: 2,
    };
    ctx.store(IP_TTL_OFFSET, &ttl)
        .and_then(|()| ctx.replace_l3_checksum(IP_CHECK_OFFSET, change))
        .map_err(|_| Counter::DropRewriteFailed)
}
