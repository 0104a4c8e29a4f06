//! IPv6 reaches its own programs by a tail call (docs/ipv6.md): `lb_ingress` and `lb_egress` read
//! the EtherType and jump to `lb_ingress6` and `lb_egress6` through `TC_IPV6_PROGRAMS`. A tail
//! call starts with a fresh stack and is verified on its own, so IPv4's programs grow by the jump
//! only and IPv6 gets the stack its 16-byte addresses need.
use aya_ebpf::{
    bindings::TC_ACT_OK,
    macros::{classifier, map},
    maps::ProgramArray,
    programs::TcContext,
};
use lb_common::{Counter, tc_ipv6_slot};

use crate::{maps, packet::PacketAccess};

const ETH_TYPE_OFFSET: usize = 12;
const ETH_P_IPV6: u16 = 0x86dd;

/// Filled by the agent at load (`tc_ipv6_slot`); pinned, so that its entries outlive the agent
/// as the attached programs do.
#[map(name = "LB_TC_IPV6_PROGRAMS_V1")]
static TC_IPV6_PROGRAMS: ProgramArray = ProgramArray::with_max_entries(tc_ipv6_slot::COUNT, 0);

/// The frame carries IPv6 (EtherType 0x86DD, no VLAN tag: tc sees the tag stripped).
#[inline(always)]
pub fn is_ipv6(ctx: &TcContext) -> bool {
    // Direct access, not TcContext's own `load` (a helper call).
    PacketAccess::load::<u16>(ctx, ETH_TYPE_OFFSET)
        .is_ok_and(|ether_type| u16::from_be(ether_type) == ETH_P_IPV6)
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
pub fn lb_ingress6(_ctx: TcContext) -> i32 {
    maps::count(Counter::Passed);
    TC_ACT_OK as i32
}

#[classifier]
pub fn lb_egress6(_ctx: TcContext) -> i32 {
    TC_ACT_OK as i32
}
