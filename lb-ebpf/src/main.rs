//! The datapath: `lb_ingress`, a tc classifier at the ingress of every interface where traffic
//! enters the node, `lb_egress` at the egress of the same interfaces, and `lb_xdp`, a fast path
//! on the external interface. With `--forwarding stack` (CONFIG_F_STACK_FORWARDING) `lb_ingress`
//! translates destinations and hands service traffic to the stack, which routes and filters it
//! (FORWARD, POSTROUTING) as under kube-proxy, and `lb_egress` translates sources (egress.rs,
//! intermediate.rs). With `--forwarding redirect`, `lb_ingress` translates fully and redirects
//! to the egress interface, as does `lb_xdp`; what the FIB does not forward (a node endpoint)
//! still takes the stack's path. ICMP errors about service traffic that arrive are
//! reverse-translated and forwarded by tc; everything else passes untouched. `lb_ingress` and
//! `lb_xdp` run the same translation core (translate.rs) over their own packet access
//! (packet.rs). The node's own sockets are translated at connect and send time by the cgroup
//! socket hooks (`sock`, `sock6`). IPv6 packets jump to programs of their own, `lb_ingress6`,
//! `lb_egress6` and `lb_xdp6` (ipv6.rs).
#![no_std]
#![no_main]

mod affinity;
mod conntrack;
mod conntrack6;
mod egress;
mod family;
mod forward;
mod forward6;
mod fragment;
mod fragment6;
mod icmp;
mod icmp6;
mod intermediate;
mod ipv6;
mod maps;
mod masquerade;
mod nat;
mod nat6;
mod packet;
mod parse;
mod parse6;
mod reject;
mod reject6;
mod service;
mod sock;
mod sock6;
mod tcp;
mod translate;
mod translate6;
mod zero;

use aya_ebpf::{
    bindings::{
        TC_ACT_OK, TC_ACT_SHOT,
        xdp_action::{XDP_DROP, XDP_PASS},
    },
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};
use lb_common::{
    CONFIG_F_STACK_FORWARDING, CT_F_MASQUERADE, CT_F_REPLY, ConntrackKey, Counter, tc_ipv6_slot,
};

use crate::{
    forward::{Caching, NextHop, Oversize},
    parse::{Fragment, Packet},
    translate::Translation,
};

#[classifier]
pub fn lb_ingress(ctx: TcContext) -> i32 {
    if ipv6::is_ipv6(&ctx) {
        return ipv6::tail_call(&ctx, tc_ipv6_slot::INGRESS);
    }
    match try_ingress(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            maps::count(reason);
            if passes(reason) {
                TC_ACT_OK
            } else {
                TC_ACT_SHOT
            }
        }
    }
}

fn try_ingress(ctx: &TcContext) -> Result<i32, Counter> {
    packet::pull_headers(ctx);
    match translate::translation(ctx)? {
        Translation::To {
            packet,
            to,
            route,
            ct_flags,
        } => {
            // Fragments take the stack's path in both modes: its reassembly (nf_defrag) must see
            // every fragment of a datagram, and it fragments again for the egress link.
            if stack_forwarding() || packet.fragment != Fragment::Whole {
                return to_stack(ctx, &packet, &to, ct_flags);
            }
            let hop = forward::route(ctx, &packet, &to, Caching::On(route));
            match forward::oversize(ctx, &hop) {
                // Answered before the rewrite: the error quotes the packet as the client sent it.
                Some(Oversize::FragmentationNeeded { mtu }) => {
                    maps::count(Counter::FragmentationNeeded);
                    return reject::fragmentation_needed(ctx, &packet, mtu);
                }
                // Redirected, the link would drop it: the stack's forwarding fragments it, and
                // lb_egress translates the fragments' source, as with stack forwarding.
                Some(Oversize::Fragmentable) => {
                    maps::count(Counter::FibFallback);
                    return to_stack(ctx, &packet, &to, ct_flags);
                }
                None => {}
            }
            if let NextHop::Local = hop {
                // A node endpoint: the stack delivers it, as with stack forwarding.
                maps::count(Counter::FibFallback);
                return to_stack(ctx, &packet, &to, ct_flags);
            }
            nat::rewrite(ctx, &packet, &to)?;
            forward::send_tc(ctx, &packet, hop)
        }
        Translation::Reject(packet) => {
            reject::allowed()?;
            reject::port_unreachable(ctx, &packet)
        }
        Translation::Icmp(packet) => {
            let config = maps::config().ok_or(Counter::Passed)?;
            let to = icmp::reverse_error(ctx, &packet, |quoted| {
                conntrack::related(quoted, &config.timeouts, maps::now_ns(config))
            })?;
            maps::count(Counter::IcmpErrorTranslated);
            forward::forward_tc(ctx, &packet, &to, Caching::Off)
        }
    }
}

pub(crate) fn stack_forwarding() -> bool {
    maps::config().is_some_and(|config| config.flags & CONFIG_F_STACK_FORWARDING != 0)
}

/// Translates the packet's destination (intermediate.rs) and hands it to the stack to route;
/// `lb_egress` translates its source once routed. `ct_flags`: those of its conntrack entry.
// A frame of its own: inlined, LLVM's reuse of the translation's stack slots is more than the
// verifier follows.
#[inline(never)]
fn to_stack(
    ctx: &TcContext,
    packet: &Packet,
    to: &ConntrackKey,
    ct_flags: u8,
) -> Result<i32, Counter> {
    let reply = ct_flags & CT_F_REPLY != 0;
    nat::rewrite(ctx, packet, &intermediate::of(&packet.tuple, to, reply))?;
    if ct_flags & (CT_F_MASQUERADE | CT_F_REPLY) == CT_F_MASQUERADE {
        mark_masqueraded(ctx);
    }
    Ok(TC_ACT_OK)
}

/// Sets the masquerade mark (`Config::masquerade_mark`) as kube-proxy's KUBE-MARK-MASQ does, for
/// the agent's FORWARD rule (`LB-FORWARD`): on every client packet rather than the first only,
/// so that a packet netfilter's conntrack sees as new (its entry expired before ours) is still
/// accepted.
fn mark_masqueraded(ctx: &TcContext) {
    if let Some(config) = maps::config() {
        // SAFETY: the context pointer is the kernel's __sk_buff for this run, readable throughout.
        let mark = unsafe { (*ctx.skb.skb).mark };
        ctx.set_mark(mark | config.masquerade_mark);
    }
}

#[classifier]
pub fn lb_egress(ctx: TcContext) -> i32 {
    if ipv6::is_ipv6(&ctx) {
        return ipv6::tail_call(&ctx, tc_ipv6_slot::EGRESS);
    }
    match egress::translate(&ctx) {
        Err(Counter::DropRewriteFailed) => {
            maps::count(Counter::DropRewriteFailed);
            TC_ACT_SHOT
        }
        Ok(()) | Err(_) => TC_ACT_OK,
    }
}

/// What `lb_xdp` does not finish goes to the stack untouched, where `lb_ingress` (attached to the
/// same interface) handles it and counts why; XDP counts only that it passed.
#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    if ipv6::is_ipv6_frame(&ctx) {
        return ipv6::tail_call_xdp(&ctx);
    }
    xdp_verdict(try_xdp(&ctx), passes)
}

/// An XDP program's verdict: what it did not finish goes on to tc untouched, counted only as
/// `XdpPassed` (tc counts why) when `passes` says so; the rest is dropped, counted by reason.
pub fn xdp_verdict(result: Result<u32, Counter>, passes: fn(Counter) -> bool) -> u32 {
    match result {
        Ok(action) => action,
        Err(reason) if passes(reason) => {
            maps::count(Counter::XdpPassed);
            XDP_PASS
        }
        Err(reason) => {
            maps::count(reason);
            XDP_DROP
        }
    }
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    sock6::translate(&ctx)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock6::translate(&ctx)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock6::reverse(&ctx)
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    sock6::reverse(&ctx)
}

fn try_xdp(ctx: &XdpContext) -> Result<u32, Counter> {
    match translate::translation(ctx)? {
        Translation::To {
            packet, to, route, ..
        } => {
            // Decided before the packet is touched. Passing it translated would be wrong twice:
            // tc's conntrack lookup of the translated tuple misses (entries are keyed by the
            // tuples packets arrive with), and the stack drops a masqueraded source, its own
            // address, as a martian. Passed untouched, tc's lookup finds the entry this run
            // refreshed, applies the same rewrite and resolves the neighbour itself.
            let NextHop::Resolved { ifindex, macs } =
                forward::route(ctx, &packet, &to, Caching::On(route))
            else {
                return Err(Counter::XdpPassed);
            };
            if !maps::xdp_egress(ifindex) {
                return Err(Counter::XdpPassed);
            }
            nat::rewrite(ctx, &packet, &to)?;
            let action = forward::redirect(ctx, &packet, ifindex, &macs)?;
            maps::count(Counter::XdpForwarded);
            Ok(action as u32)
        }
        // Not XDP's: it opens no connection (translate.rs), and a REJECT is built by tc, which
        // can resize the packet's skb.
        Translation::Reject(_) => Err(Counter::XdpPassed),
        // ICMP errors are few: tc reverse-translates them, XDP has no fast path for them.
        Translation::Icmp(_) => Err(Counter::XdpPassed),
    }
}

/// Whether a packet that is not translated goes on (to the stack) rather than being dropped.
fn passes(reason: Counter) -> bool {
    matches!(
        reason,
        Counter::Passed
            | Counter::PassedUnparsed
            | Counter::PassedFragment
            | Counter::PassedBadIpChecksum
            | Counter::PassedTcpNoConnection
            | Counter::XdpPassed
    )
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
