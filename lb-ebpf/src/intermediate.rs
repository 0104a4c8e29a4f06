//! The intermediate tuple: what a packet of a translated connection carries between `lb_ingress`
//! and `lb_egress` when the stack forwards (or delivers) it. As with netfilter's NAT, the
//! destination is translated before routing (DNAT of the client's packets, de-masquerade of
//! replies) and the source after it (masquerade, and the service address as a reply's source):
//!
//! ```text
//! client's packet  client:cport → svc:sport     ingress → client:q → backend:bport   egress → src:q → backend:bport
//! reply            backend:bport → src:q        ingress → backend:bport → client:q   egress → svc:sport → client:cport
//! ```
//!
//! `src` is the client's address or, masqueraded, the node's; `q` the source port the backend
//! sees (the client's own, or one of the range: masquerade, or a clash remap). The port is
//! rewritten at ingress so that intermediate tuples are as unique as translated ones: a new
//! connection claims both of its intermediate tuples, and is dropped (`DropTupleClash`) if a live
//! connection holds one, which makes `lb_egress`'s lookup find exactly one connection. Unlike netfilter, the stack's own
//! conntrack and FORWARD rules then see a remapped (or masquerade) source port, never another
//! address than the client's.
//!
//! `LB_INTERMEDIATE_V1` maps each intermediate tuple to the conntrack key of the same direction;
//! `LB_INTERMEDIATE_UNCONFIRMED_V1` holds those of connections not yet confirmed, as the conntrack
//! tables do, so that a flood of new connections never evicts an established one's.
//! Its entries are never removed: one counts only while the conntrack entry it names is live and
//! still translates to this very tuple, so an expired or replaced connection's are dead at once
//! and taken over by the next claim.
use lb_common::{CT_F_REPLY, ConntrackKey};

use crate::{
    conntrack::{self, Connection},
    maps,
};

/// The intermediate tuple of a packet that arrived as `arrived` and translates to `to`;
/// `reply`: it is a reply (its conntrack entry has `CT_F_REPLY`).
pub fn of(arrived: &ConntrackKey, to: &ConntrackKey, reply: bool) -> ConntrackKey {
    let (src_port, dst_port) = if reply {
        (arrived.src_port, arrived.dst_port)
    } else {
        (to.src_port, to.dst_port)
    };
    ConntrackKey {
        src_addr: arrived.src_addr,
        dst_addr: to.dst_addr,
        src_port,
        dst_port,
        proto: arrived.proto,
        _pad0: 0,
        _pad1: 0,
    }
}

/// The live connection whose intermediate tuple `tuple` is: the conntrack key of its direction
/// (the packet as its sender sent it) and what that translates to (as its receiver gets it).
// Inlined: as a subprogram, returning the copied-out key's padding leaves a stack pointer in r0,
// which the verifier refuses.
#[inline(always)]
pub fn connection(tuple: &ConntrackKey, now: u64) -> Option<(ConntrackKey, ConntrackKey)> {
    let key = maps::intermediate(tuple)?;
    let entry = maps::conntrack(&key)?;
    let timeouts = &maps::config()?.timeouts;
    if conntrack::expired(entry, key.proto, timeouts, now) {
        return None;
    }
    let to = conntrack::rewrite_of(entry, key.proto);
    let reply = entry.flags & CT_F_REPLY != 0;
    (of(&key, &to, reply) == *tuple).then_some((key, to))
}

/// Claims the intermediate tuples of `connection`, whose reply is tracked from the source in
/// `to` (its translated tuple), for it: false when a live connection of another flow holds
/// either. Once the source is chosen, not for every port tried: the verifier would not follow
/// the port search with it. A clash is rare: it takes a client's port (or a masquerade port
/// standing in for one) that another connection of that client to the same backend uses.
// Inlined: as a subprogram taking `to` by reference, LLVM reuses that pointer's stack slot for a
// later value of the caller in a way the verifier does not follow.
#[inline(always)]
pub fn claim(connection: &Connection, to: &ConntrackKey) -> bool {
    let client = connection.client();
    // Field by field: a struct update copies the padding through a stack pointer left in r0,
    // which the verifier refuses a subprogram to return.
    let forward = ConntrackKey {
        src_addr: client.src_addr,
        dst_addr: to.dst_addr,
        src_port: to.src_port,
        dst_port: to.dst_port,
        proto: to.proto,
        _pad0: 0,
        _pad1: 0,
    };
    let now = connection.now();
    claim_one(
        &conntrack::reversed(&forward),
        &conntrack::reversed(to),
        now,
    ) && claim_one(&forward, client, now)
}

/// Maps intermediate tuple `tuple` to conntrack key `key` (in the unconfirmed table, as the
/// connection is) unless a live connection of another flow holds it. A dead connection's entry in
/// the main table goes first: the main table is looked up first.
fn claim_one(tuple: &ConntrackKey, key: &ConntrackKey, now: u64) -> bool {
    // A holder whose other entry is gone (evicted from the unconfirmed table by a flood) is dead
    // too: it can never be confirmed.
    if let Some((held, held_to)) = connection(tuple, now)
        && held != *key
        && maps::conntrack(&conntrack::reversed(&held_to)).is_some()
    {
        return false;
    }
    maps::intermediate_remove(tuple);
    maps::intermediate_unconfirmed_insert(tuple, key)
}

/// Moves intermediate tuple `tuple` of the connection being confirmed, whose entry of that
/// direction is `key`, to the main table (`conntrack::lookup`).
pub fn confirm(tuple: &ConntrackKey, key: &ConntrackKey) {
    if maps::intermediate_unconfirmed(tuple).is_some_and(|held| held == *key)
        && maps::intermediate_insert(tuple, key)
    {
        maps::intermediate_unconfirmed_remove(tuple);
    }
}
