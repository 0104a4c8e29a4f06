//! Forwarding a translated packet straight to its egress interface (`--forwarding redirect`).
//!
//! Redirecting is required for a fully translated packet: after masquerade the source is the
//! node's own address, which the stack would drop on input as a martian. A local destination (a
//! node endpoint) goes to the stack translated to its intermediate tuple instead
//! (intermediate.rs), as in `--forwarding stack`.
use core::mem::{self, MaybeUninit};

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_NOT_FWDED,
        BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK, bpf_check_mtu_flags::BPF_MTU_CHK_SEGS, bpf_fib_lookup,
        bpf_redir_neigh,
    },
    helpers::{bpf_check_mtu, bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use lb_common::{CachedHop, ConntrackEntry, ConntrackKey, Counter};

use crate::{
    maps,
    nat::IP_CHECK_OFFSET,
    packet::{Change, PacketAccess},
    parse::{ETH_HLEN, IP_FRAG_OFF, IP_TTL, Packet},
    zero,
};

pub const AF_INET: u8 = 2;
pub const AF_INET6: u8 = 10;
/// Don't fragment, in the host-order fragment offset word.
const IP_DF: u16 = 0x4000;

/// Where the FIB sends the translated packet; `A`: the family's address (`u32` for IPv4, the
/// words of an IPv6 address).
pub enum NextHop<A = u32> {
    /// Out of `ifindex` with these destination and source MACs.
    Resolved { ifindex: u32, macs: [u8; 12] },
    /// Out of `ifindex` to `addr`, whose MAC the kernel does not know yet.
    Unresolved { ifindex: u32, addr: A },
    /// A local destination (a node endpoint): the stack delivers it.
    Local,
    /// Longer than the egress interface's MTU `mtu` (the FIB's check of the skb).
    TooBig { mtu: u16 },
    /// No forwarding answer (no route, forwarding disabled): the stack's business.
    Stack,
}

/// What Linux's `ip_forward` does with a packet too big for its egress link.
pub enum Oversize {
    /// DF set (`ip_exceeds_mtu`): answered with ICMP fragmentation needed carrying `mtu`.
    FragmentationNeeded { mtu: u16 },
    /// DF clear: fragmented to the link's MTU.
    Fragmentable,
}

/// Whether the packet is too big for its way out to `hop`, and what that calls for; `None` when
/// it fits. The FIB lookup, asked without a length in tc (see `fib_tot_len`), checks the skb
/// itself against the egress MTU (`TooBig`), but only once it has resolved the neighbour, and
/// passes a GSO packet whatever its segments' size: those two are checked here.
pub fn oversize(ctx: &TcContext, hop: &NextHop) -> Option<Oversize> {
    let mtu = match *hop {
        NextHop::TooBig { mtu } => mtu,
        NextHop::Unresolved { ifindex, .. } => exceeded_link_mtu(ctx, ifindex)?,
        NextHop::Resolved { ifindex, .. } if ctx.is_gso() => exceeded_link_mtu(ctx, ifindex)?,
        _ => return None,
    };
    let frag_off: u16 = ctx.load(ETH_HLEN + IP_FRAG_OFF).ok()?;
    Some(if u16::from_be(frag_off) & IP_DF != 0 {
        Oversize::FragmentationNeeded { mtu }
    } else {
        Oversize::Fragmentable
    })
}

/// The MTU of `ifindex` if the packet is too big for it: a GSO packet's segments, any other
/// packet whole.
pub fn exceeded_link_mtu(ctx: &TcContext, ifindex: u32) -> Option<u16> {
    let mut mtu = 0u32;
    // SAFETY: the context's skb and a u32 out value; a zero `mtu` and length difference check
    // the skb as it is (a GSO packet segment by segment).
    let ret = unsafe {
        bpf_check_mtu(
            ctx.as_ptr(),
            ifindex,
            &raw mut mtu,
            0,
            u64::from(BPF_MTU_CHK_SEGS),
        )
    };
    (ret > 0).then_some(mtu as u16)
}

/// The FIB lookup's parameter block, aligned for zeroing in words.
#[repr(C, align(8))]
pub struct FibParams(pub bpf_fib_lookup);

/// Asks the FIB with the parameter block `fib` and `flags` (`BPF_FIB_LOOKUP_*`): its
/// `BPF_FIB_LKUP_RET_*` answer, `None` for a refused call.
#[inline(always)]
pub fn fib_lookup<P: PacketAccess>(ctx: &P, fib: &mut bpf_fib_lookup, flags: u32) -> Option<u32> {
    // SAFETY: `fib` is a valid, exclusively borrowed parameter block of the size passed.
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            &raw mut *fib,
            mem::size_of::<bpf_fib_lookup>() as i32,
            flags,
        )
    };
    u32::try_from(ret).ok()
}

/// Looks up the route of `packet` translated to `to`. Reads nothing of the packet itself, so it
/// may come before the rewrite.
// A frame of its own, as reject::port_unreachable's, for the 512-byte stack.
#[inline(never)]
pub fn next_hop<P: PacketAccess>(ctx: &P, packet: &Packet, to: &ConntrackKey) -> NextHop {
    let mut fib = MaybeUninit::<FibParams>::uninit();
    // SAFETY: bpf_fib_lookup is plain old data; all-zero is its "no options" state.
    let fib = unsafe { &mut zero::zeroed(&mut fib).0 };
    fib.family = AF_INET;
    fib.l4_protocol = to.proto;
    fib.sport = to.src_port;
    fib.dport = to.dst_port;
    fib.__bindgen_anon_1.tot_len = ctx.fib_tot_len(packet.tot_len);
    fib.__bindgen_anon_2.tos = packet.tos;
    fib.__bindgen_anon_3.ipv4_src = to.src_addr;
    fib.__bindgen_anon_4.ipv4_dst = to.dst_addr;
    fib.ifindex = ctx.ingress_ifindex();
    // SAFETY: for an AF_INET lookup the FIB wrote the IPv4 next hop into ipv4_dst.
    forward_answer(ctx, fib, |fib| unsafe { fib.__bindgen_anon_4.ipv4_dst })
}

/// Asks the FIB to forward with the filled-in parameter block `fib`; `next_hop` reads the next
/// hop's address the FIB wrote into the block.
#[inline(always)]
pub fn forward_answer<P: PacketAccess, A>(
    ctx: &P,
    fib: &mut bpf_fib_lookup,
    next_hop: impl FnOnce(&bpf_fib_lookup) -> A,
) -> NextHop<A> {
    match fib_lookup(ctx, fib, 0) {
        Some(BPF_FIB_LKUP_RET_SUCCESS) => {
            let mut macs = [0u8; 12];
            macs[..6].copy_from_slice(&fib.dmac);
            macs[6..].copy_from_slice(&fib.smac);
            NextHop::Resolved {
                ifindex: fib.ifindex,
                macs,
            }
        }
        Some(BPF_FIB_LKUP_RET_NO_NEIGH) => NextHop::Unresolved {
            ifindex: fib.ifindex,
            addr: next_hop(fib),
        },
        Some(BPF_FIB_LKUP_RET_NOT_FWDED) => NextHop::Local,
        Some(BPF_FIB_LKUP_RET_FRAG_NEEDED) => NextHop::TooBig {
            // SAFETY: for a lookup without a length the kernel writes the egress MTU here.
            mtu: unsafe { fib.__bindgen_anon_1.mtu_result },
        },
        _ => NextHop::Stack,
    }
}

/// A connection's route as its conntrack entry caches it (`ConntrackEntry::hop`), copied out.
#[derive(Clone, Copy)]
pub struct CachedRoute {
    len: u16,
    hop: CachedHop,
}

impl CachedRoute {
    /// No route cached: a new connection's. `Some(NONE)` rather than `None`: `None`'s undefined
    /// payload, copied, let LLVM spill whatever register it liked as the length, a stack pointer
    /// once, which the verifier refuses.
    pub const NONE: CachedRoute = CachedRoute {
        len: 0,
        hop: CachedHop {
            ifindex: 0,
            iif: 0,
            macs0: 0,
            macs1: 0,
            macs2: 0,
        },
    };

    /// The entry's route, if it caches one.
    pub fn of(entry: &ConntrackEntry) -> Option<Self> {
        (entry.hop_len != 0).then_some(CachedRoute {
            len: entry.hop_len,
            hop: entry.hop,
        })
    }

    /// The FIB's answer (out of `ifindex` with `macs`) for a packet of IPv4 total length
    /// `tot_len` that came in on `iif`.
    fn resolved(tot_len: u16, iif: u32, ifindex: u32, macs: &[u8; 12]) -> Self {
        // SAFETY: any 12 bytes are three words.
        let [macs0, macs1, macs2] = unsafe { mem::transmute::<[u8; 12], [u32; 3]>(*macs) };
        CachedRoute {
            len: tot_len,
            hop: CachedHop {
                ifindex,
                iif,
                macs0,
                macs1,
                macs2,
            },
        }
    }

    fn write_to(&self, entry: &mut ConntrackEntry) {
        entry.hop = self.hop;
        // After the route: another CPU that sees the length sees the route it belongs to.
        entry.hop_len = self.len;
    }

    /// The route for a packet of IPv4 total length `tot_len` that came in on `iif`, if it holds
    /// (never for `NONE`: no packet is 0 bytes long).
    fn for_packet(&self, tot_len: u16, iif: u32) -> Option<NextHop> {
        let hop = &self.hop;
        (tot_len <= self.len && hop.iif == iif).then(|| NextHop::Resolved {
            ifindex: hop.ifindex,
            // SAFETY: any 12 bytes are a pair of MACs.
            macs: unsafe {
                mem::transmute::<[u32; 3], [u8; 12]>([hop.macs0, hop.macs1, hop.macs2])
            },
        })
    }
}

/// How `route` uses the conntrack entry of the packet's tuple.
pub enum Caching {
    /// Not a tracked packet (an ICMP error): the FIB decides, nothing is cached.
    Off,
    /// Tracked, with the route its entry caches, if any.
    On(Option<CachedRoute>),
}

/// The route of `packet` translated to `to`: the one its conntrack entry caches while that holds
/// (same ingress interface, the packet no longer than the one the FIB checked), else the FIB's,
/// then cached in the entry. A GSO packet (tc) neither takes nor leaves a cached route: its
/// length is not what the egress sends, so the kernel checks the skb itself.
pub fn route<P: PacketAccess>(
    ctx: &P,
    packet: &Packet,
    to: &ConntrackKey,
    caching: Caching,
) -> NextHop {
    let cached = match caching {
        Caching::On(cached) if !ctx.is_gso() => cached,
        _ => return next_hop(ctx, packet, to),
    };
    let iif = ctx.ingress_ifindex();
    if let Some(hop) = cached.and_then(|route| route.for_packet(packet.tot_len, iif)) {
        return hop;
    }
    let next = next_hop(ctx, packet, to);
    // Looked up again rather than carried here: once a second per connection, and LLVM's reuse
    // of a carried map-value pointer's stack slot is more than the verifier follows.
    if let NextHop::Resolved { ifindex, macs } = &next
        && let Some(entry) = maps::conntrack(&packet.tuple)
    {
        CachedRoute::resolved(packet.tot_len, iif, *ifindex, macs).write_to(entry);
    }
    next
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
    Ok(redirect_to(ifindex))
}

/// The program type's verdict that redirects the packet out of `ifindex`.
#[inline(always)]
pub fn redirect_to(ifindex: u32) -> i32 {
    // SAFETY: the helper only records the target; flags 0 means egress.
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}

/// tc: redirects the packet out of `ifindex` to the neighbour `neigh` (`nh_family` and address
/// set), whose MAC the kernel resolves on egress.
#[inline(always)]
pub fn redirect_neigh(ifindex: u32, mut neigh: bpf_redir_neigh) -> i32 {
    // SAFETY: `neigh` is a valid parameter block of the size passed.
    unsafe {
        bpf_redirect_neigh(
            ifindex,
            &raw mut neigh,
            mem::size_of::<bpf_redir_neigh>() as i32,
            0,
        ) as i32
    }
}

/// tc: redirects the translated packet along its route (see `route`); an unresolved neighbour is
/// resolved by the kernel on egress; without a route the stack gets it.
pub fn forward_tc(
    ctx: &TcContext,
    packet: &Packet,
    to: &ConntrackKey,
    caching: Caching,
) -> Result<i32, Counter> {
    send_tc(ctx, packet, route(ctx, packet, to, caching))
}

/// tc: sends the translated packet to `hop` (see `forward_tc`).
pub fn send_tc(ctx: &TcContext, packet: &Packet, hop: NextHop) -> Result<i32, Counter> {
    match hop {
        NextHop::Resolved { ifindex, macs } => redirect(ctx, packet, ifindex, &macs),
        NextHop::Unresolved { ifindex, addr } => {
            decrement_ttl(ctx, packet)?;
            // SAFETY: bpf_redir_neigh is plain old data, fully written below.
            let mut neigh: bpf_redir_neigh = unsafe { mem::zeroed() };
            neigh.nh_family = u32::from(AF_INET);
            neigh.__bindgen_anon_1.ipv4_nh = addr;
            Ok(redirect_neigh(ifindex, neigh))
        }
        NextHop::Local | NextHop::TooBig { .. } | NextHop::Stack => {
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
    ctx.store(ETH_HLEN + IP_TTL, &ttl)
        .and_then(|()| ctx.replace_l3_checksum(IP_CHECK_OFFSET, change))
        .map_err(|_| Counter::DropRewriteFailed)
}
