//! IPv6 reaches its own programs by a tail call (docs/ipv6.md): `lb_ingress`, `lb_egress` and
//! `lb_xdp` read the EtherType and jump to `lb_ingress6`, `lb_egress6` and `lb_xdp6` through
//! `TC_IPV6_PROGRAMS` and `XDP_IPV6_PROGRAMS` (a program array holds programs of one type). A
//! tail call starts with a fresh stack and is verified on its own, so IPv4's programs grow by the
//! jump only and IPv6 gets the stack its 16-byte addresses need.
use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, xdp_action::XDP_PASS},
    macros::{classifier, map, xdp},
    maps::ProgramArray,
    programs::{TcContext, XdpContext},
};
use lb_common::{Counter, tc_ipv6_slot, xdp_ipv6_slot};

use crate::{
    forward::NextHop,
    forward6, maps, packet,
    packet::PacketAccess,
    parse::Fragment,
    parse6::IPPROTO_ICMPV6,
    reject, reject6,
    translate6::{self, Translation6},
};

const ETH_P_IPV6: u16 = 0x86dd;

/// Filled by the agent at load (`tc_ipv6_slot`); pinned, so that its entries outlive the agent
/// as the attached programs do.
#[map(name = "LB_TC_IPV6_PROGRAMS_V1")]
static TC_IPV6_PROGRAMS: ProgramArray = ProgramArray::with_max_entries(tc_ipv6_slot::COUNT, 0);

/// `lb_xdp6`'s array (`xdp_ipv6_slot`), as `TC_IPV6_PROGRAMS`.
#[map(name = "LB_XDP_IPV6_PROGRAMS_V1")]
static XDP_IPV6_PROGRAMS: ProgramArray = ProgramArray::with_max_entries(xdp_ipv6_slot::COUNT, 0);

/// The Ethernet header's EtherType.
const ETH_TYPE: usize = 12;

/// The packet is IPv6: the skb's protocol, the EtherType (a VLAN tag is stripped before tc).
/// Read from the context: no packet access is needed to tell.
#[inline(always)]
pub fn is_ipv6(ctx: &TcContext) -> bool {
    // SAFETY: the context pointer is the kernel's __sk_buff for this run, readable throughout.
    let protocol = unsafe { (*ctx.skb.skb).protocol };
    // The 16-bit field as it sits in the skb (network order), widened.
    u16::from_be(protocol as u16) == ETH_P_IPV6
}

/// Jumps to the IPv6 program in `slot`. Returns only if the jump failed (the slot is empty until
/// the agent fills it): the packet then passes untouched, counted.
#[inline(always)]
pub fn tail_call(ctx: &TcContext, slot: u32) -> i32 {
    // SAFETY: the programs in the array are tc classifiers taking the same context; on success
    // control never returns here, and nothing is held that needs dropping.
    unsafe { TC_IPV6_PROGRAMS.tail_call(ctx, slot) };
    maps::count(Counter::PassedTailCallFailed);
    TC_ACT_OK as i32
}

/// The frame is IPv6: its EtherType (XDP sees a VLAN tag, which is not IPv6 to it).
#[inline(always)]
pub fn is_ipv6_frame(ctx: &XdpContext) -> bool {
    ctx.load::<u16>(ETH_TYPE)
        .is_ok_and(|ether_type| u16::from_be(ether_type) == ETH_P_IPV6)
}

/// Jumps to `lb_xdp6`, as `tail_call`: a failed jump passes the frame to tc, counted.
#[inline(always)]
pub fn tail_call_xdp(ctx: &XdpContext) -> u32 {
    // SAFETY: the program in the array is an XDP program taking the same context; on success
    // control never returns here, and nothing is held that needs dropping.
    unsafe { XDP_IPV6_PROGRAMS.tail_call(ctx, xdp_ipv6_slot::XDP) };
    maps::count(Counter::PassedTailCallFailed);
    XDP_PASS
}

#[classifier]
pub fn lb_ingress6(ctx: TcContext) -> i32 {
    packet::pull_headers(&ctx);
    match try_ingress6(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            maps::count(reason);
            if passes(reason) {
                TC_ACT_OK as i32
            } else {
                TC_ACT_SHOT as i32
            }
        }
    }
}

fn try_ingress6(ctx: &TcContext) -> Result<i32, Counter> {
    match translate6::translation(ctx)? {
        // Fragments take the stack's path in both modes, as IPv4's (main.rs): its reassembly
        // must see every fragment of a datagram.
        Translation6::Tracked if crate::stack_forwarding() || is_fragment()? => {
            // Handed to the stack, which routes the rewritten packet.
            translate6::rewrite(ctx)?;
            Ok(TC_ACT_OK as i32)
        }
        Translation6::Tracked => forward(ctx),
        // Handed to the stack; ICMPv6 errors are few.
        Translation6::Icmp => Ok(TC_ACT_OK as i32),
        Translation6::Reject => {
            reject::allowed()?;
            reject6::port_unreachable(ctx, translate6::parsed()?)
        }
    }
}

/// `--forwarding redirect`: routes the packet as translated, then rewrites it and redirects it
/// to its egress interface (forward6.rs). One too big for the egress link gets Packet Too Big,
/// answered before the rewrite: the error quotes the packet as the client sent it. What the FIB
/// does not forward (a node endpoint, no route) goes to the stack translated, as with stack
/// forwarding: IPv6 has no martian source check to stop a masqueraded source there.
fn forward(ctx: &TcContext) -> Result<i32, Counter> {
    let packet = translate6::parsed()?;
    let hop = forward6::next_hop(ctx, packet, translate6::rewrite_to()?);
    if let Some(mtu) = forward6::exceeded_mtu(ctx, &hop) {
        maps::count(Counter::FragmentationNeeded);
        return reject6::packet_too_big(ctx, packet, mtu);
    }
    translate6::rewrite(ctx)?;
    forward6::send_tc(ctx, packet, hop)
}

/// `lb_xdp`'s IPv6 twin: what it does not finish goes to tc untouched, counted `XdpPassed`, as
/// `lb_xdp`'s.
#[xdp]
pub fn lb_xdp6(ctx: XdpContext) -> u32 {
    crate::xdp_verdict(try_xdp6(&ctx), passes)
}

fn try_xdp6(ctx: &XdpContext) -> Result<u32, Counter> {
    // ICMPv6 errors are few: tc reverse-translates them, XDP has no fast path for them.
    if translate6::parse(ctx)? == IPPROTO_ICMPV6 {
        return Err(Counter::XdpPassed);
    }
    // XDP leaves fragments to tc, as `lb_xdp` does.
    if is_fragment()? {
        return Err(Counter::XdpPassed);
    }
    // A REJECT is built by tc, which can resize the packet's skb.
    let Translation6::Tracked = translate6::connection(ctx)? else {
        return Err(Counter::XdpPassed);
    };
    // Decided before the packet is touched, as `lb_xdp` does: passed translated, tc's conntrack
    // lookup of the translated tuple would miss (entries are keyed by the tuples packets arrive
    // with). Passed untouched, tc's lookup finds the entry this run created or refreshed and
    // applies the same rewrite.
    let packet = translate6::parsed()?;
    let NextHop::Resolved { ifindex, macs } =
        forward6::next_hop(ctx, packet, translate6::rewrite_to()?)
    else {
        return Err(Counter::XdpPassed);
    };
    if !maps::xdp_egress(ifindex) {
        return Err(Counter::XdpPassed);
    }
    translate6::rewrite(ctx)?;
    let action = forward6::redirect(ctx, packet, ifindex, &macs)?;
    maps::count(Counter::XdpForwarded);
    Ok(action as u32)
}

/// Whether the packet parsed is a fragment.
fn is_fragment() -> Result<bool, Counter> {
    Ok(translate6::parsed()?.fragment != Fragment::Whole)
}

/// `main::passes`, and IPv6's own reason to pass, which the IPv4 programs never give.
fn passes(reason: Counter) -> bool {
    reason == Counter::PassedIpv6ExtensionHeader || crate::passes(reason)
}

/// Nothing to do yet: what `lb_ingress6` translates (connections not masqueraded) needs no
/// source rewrite after routing.
#[classifier]
pub fn lb_egress6(_ctx: TcContext) -> i32 {
    TC_ACT_OK as i32
}
