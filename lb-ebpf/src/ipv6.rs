//! IPv6 reaches its own programs by a tail call (docs/ipv6.md): `lb_ingress` and `lb_egress` read
//! the EtherType and jump to `lb_ingress6` and `lb_egress6` through `TC_IPV6_PROGRAMS`. A tail
//! call starts with a fresh stack and is verified on its own, so IPv4's programs grow by the jump
//! only and IPv6 gets the stack its 16-byte addresses need.
use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::{classifier, map},
    maps::ProgramArray,
    programs::TcContext,
};
use lb_common::{Counter, tc_ipv6_slot};

use crate::{
    maps, packet, reject, reject6,
    translate6::{self, Translation6},
};

const ETH_P_IPV6: u16 = 0x86dd;

/// Filled by the agent at load (`tc_ipv6_slot`); pinned, so that its entries outlive the agent
/// as the attached programs do.
#[map(name = "LB_TC_IPV6_PROGRAMS_V1")]
static TC_IPV6_PROGRAMS: ProgramArray = ProgramArray::with_max_entries(tc_ipv6_slot::COUNT, 0);

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
        // Handed to the stack, which routes the rewritten packet.
        Translation6::Translated => Ok(TC_ACT_OK as i32),
        Translation6::Reject => {
            reject::allowed()?;
            reject6::port_unreachable(ctx, translate6::parsed()?)
        }
    }
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
