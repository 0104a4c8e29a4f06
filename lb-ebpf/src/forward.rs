//! Forwarding a translated packet straight to its egress interface.
//!
//! Redirecting is required: after masquerade the source is the node's own address, which the
//! stack would drop on input as a martian.
use core::mem;

use aya_ebpf::{
    EbpfContext,
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
    parse::{ETH_HLEN, Packet},
};

const AF_INET: u8 = 2;
const IP_TTL_OFFSET: usize = ETH_HLEN + 8;

/// Looks up the route of the translated packet `to` and redirects it there; when the FIB has no
/// forwarding answer (local destination, no route, forwarding disabled, MTU) the stack gets it.
/// The caller has checked that the TTL is above 1.
pub fn forward(ctx: &TcContext, packet: &Packet, to: &ConntrackKey) -> Result<i32, Counter> {
    // SAFETY: bpf_fib_lookup is plain old data; all-zero is its "no options" state.
    let mut fib: bpf_fib_lookup = unsafe { mem::zeroed() };
    fib.family = AF_INET;
    fib.l4_protocol = to.proto;
    fib.sport = to.src_port;
    fib.dport = to.dst_port;
    fib.__bindgen_anon_1.tot_len = packet.tot_len;
    fib.__bindgen_anon_2.tos = packet.tos;
    fib.__bindgen_anon_3.ipv4_src = to.src_addr;
    fib.__bindgen_anon_4.ipv4_dst = to.dst_addr;
    fib.ifindex = ingress_ifindex(ctx);
    // SAFETY: `fib` is a valid, exclusively borrowed parameter block of the size passed.
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            &raw mut fib,
            mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    match u32::try_from(ret) {
        Ok(BPF_FIB_LKUP_RET_SUCCESS) => {
            let mut macs = [0u8; 12];
            macs[..6].copy_from_slice(&fib.dmac);
            macs[6..].copy_from_slice(&fib.smac);
            ctx.store(0, &macs, 0)
                .map_err(|_| Counter::DropRewriteFailed)?;
            decrement_ttl(ctx, packet)?;
            // SAFETY: the helper only records the target; flags 0 means egress.
            Ok(unsafe { bpf_redirect(fib.ifindex, 0) } as i32)
        }
        Ok(BPF_FIB_LKUP_RET_NO_NEIGH) => {
            decrement_ttl(ctx, packet)?;
            // SAFETY: bpf_redir_neigh is plain old data, fully written below.
            let mut neigh: bpf_redir_neigh = unsafe { mem::zeroed() };
            neigh.nh_family = u32::from(AF_INET);
            // SAFETY: for an AF_INET lookup the FIB wrote the IPv4 next hop into ipv4_dst.
            neigh.__bindgen_anon_1.ipv4_nh = unsafe { fib.__bindgen_anon_4.ipv4_dst };
            // SAFETY: `neigh` is a valid parameter block of the size passed; the kernel resolves
            // the neighbour and fills in the MACs on egress.
            Ok(unsafe {
                bpf_redirect_neigh(
                    fib.ifindex,
                    &raw mut neigh,
                    mem::size_of::<bpf_redir_neigh>() as i32,
                    0,
                )
            } as i32)
        }
        _ => {
            maps::count(Counter::FibFallback);
            Ok(TC_ACT_OK)
        }
    }
}

pub fn ingress_ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context pointer is the kernel's __sk_buff for this run, readable throughout.
    unsafe { (*ctx.skb.skb).ingress_ifindex }
}

/// The stack is bypassed, so it cannot decrement the TTL for us.
fn decrement_ttl(ctx: &TcContext, packet: &Packet) -> Result<(), Counter> {
    let ttl = packet.ttl.saturating_sub(1);
    // The TTL shares its checksum word with the protocol byte.
    let old = u16::from_ne_bytes([packet.ttl, packet.tuple.proto]);
    let new = u16::from_ne_bytes([ttl, packet.tuple.proto]);
    ctx.store(IP_TTL_OFFSET, &ttl, 0)
        .and_then(|()| ctx.l3_csum_replace(IP_CHECK_OFFSET, old.into(), new.into(), 2))
        .map_err(|_| Counter::DropRewriteFailed)
}
