//! `lb_egress`, the source half of a translation the stack forwarded (intermediate.rs): at tc
//! egress of the interfaces `lb_ingress` is on, a packet whose tuple is a live connection's
//! intermediate tuple gets that connection's source (the masquerade address and port of a
//! client's packet; the service address of a reply) and its client's port back. It runs after
//! the stack's routing, FORWARD and POSTROUTING, as netfilter's source NAT does; a node
//! endpoint's replies come here from the node's own sockets (OUTPUT). ICMP errors the node sends
//! about such packets are reverse-translated as `lb_ingress` does those that arrive (icmp.rs).
//!
//! Everything else, and whatever cannot be parsed, leaves untouched and uncounted: `lb_ingress`
//! counted what it passed on, and the node's own traffic is not the datapath's to count.
use aya_ebpf::programs::TcContext;
use lb_common::{CONFIG_F_READY, Counter, IPPROTO_ICMP};

use crate::{fragment, icmp, intermediate, maps, nat, packet, parse};

/// `Err` carries the counter of why the packet is not translated; only `DropRewriteFailed` drops.
#[inline(always)]
pub fn translate(ctx: &TcContext) -> Result<(), Counter> {
    packet::pull_headers(ctx);
    let mut packet = parse::packet(ctx)?;
    let config = maps::config()
        .filter(|config| config.flags & CONFIG_F_READY != 0)
        .ok_or(Counter::Passed)?;
    let now = maps::now_ns(config);
    if packet.tuple.proto == IPPROTO_ICMP {
        // The outer destination stays: the error already goes to the quoted packet's sender,
        // whose address the intermediate tuple keeps.
        icmp::reverse_error(ctx, &packet, |quoted| {
            intermediate::connection(quoted, now).map(|(sent, _)| sent)
        })?;
        maps::count(Counter::IcmpErrorTranslated);
        return Ok(());
    }
    fragment::follow(ctx, &mut packet, now)?;
    let (_, to) = intermediate::connection(&packet.tuple, now).ok_or(Counter::Passed)?;
    // A client's packet not masqueraded has nothing left to change.
    if to != packet.tuple {
        nat::rewrite(ctx, &packet, &to)?;
        maps::count(Counter::EgressTranslated);
    }
    Ok(())
}
