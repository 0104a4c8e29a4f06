//! To which source address a masqueraded connection (SNAT to a node address) is translated, and
//! which source port it gets; when it is masqueraded is `lb_common::masquerade::needed`.
use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SKIP_NEIGH,
        BPF_FIB_LOOKUP_SRC,
    },
    cty::c_void,
    helpers::bpf_loop,
};
use lb_common::{Addr6, Config, Config6, ConntrackKey, Counter, masquerade::PortSearch};

use crate::{
    conntrack::{Claim, Connection},
    forward::{AF_INET, AF_INET6, FibParams, fib_lookup},
    maps,
    packet::PacketAccess,
    zero,
};

/// The masquerade address of a connection from `client` to `backend`: the source address the
/// route to the backend selects (the FIB's preferred source, Linux 6.7+), as MASQUERADE takes
/// the egress interface's. Over an overlay that is the tunnel device's address, so replies come
/// back through the tunnel; `--node-ip` where routing picks it, and when the FIB has no answer
/// (a local destination, forwarding off on the ingress interface).
// A frame of its own for the lookup's parameter block, as forward::next_hop's.
#[inline(never)]
pub fn source<P: PacketAccess>(ctx: &P, config: &Config, client: u32, backend: u32) -> u32 {
    let mut fib = MaybeUninit::<FibParams>::uninit();
    // SAFETY: bpf_fib_lookup is plain old data; all-zero is its "no options" state.
    let fib = unsafe { &mut zero::zeroed(&mut fib).0 };
    fib.family = AF_INET;
    fib.__bindgen_anon_3.ipv4_src = client;
    fib.__bindgen_anon_4.ipv4_dst = backend;
    fib.ifindex = ctx.ingress_ifindex();
    // Frag-needed: tc checks the packet against the egress MTU once the route, and with it the
    // source, is found; that is the forwarding's business, not the source's.
    let source = match fib_lookup(ctx, fib, BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH) {
        // SAFETY: with BPF_FIB_LOOKUP_SRC the FIB wrote the route's IPv4 source into ipv4_src.
        Some(BPF_FIB_LKUP_RET_SUCCESS | BPF_FIB_LKUP_RET_FRAG_NEEDED) => unsafe {
            fib.__bindgen_anon_3.ipv4_src
        },
        _ => 0,
    };
    if source == 0 {
        config.node_addr
    } else {
        source
    }
}

/// `source` for IPv6: the source address the route from `client` to `backend` selects, else the
/// IPv6 `--node-ip`.
#[inline(never)]
pub fn source6<P: PacketAccess>(
    ctx: &P,
    config6: &Config6,
    client: &Addr6,
    backend: &Addr6,
) -> Addr6 {
    let mut fib = MaybeUninit::<FibParams>::uninit();
    // SAFETY: bpf_fib_lookup is plain old data; all-zero is its "no options" state.
    let fib = unsafe { &mut zero::zeroed(&mut fib).0 };
    fib.family = AF_INET6;
    fib.__bindgen_anon_3.ipv6_src = [client.w0, client.w1, client.w2, client.w3];
    fib.__bindgen_anon_4.ipv6_dst = [backend.w0, backend.w1, backend.w2, backend.w3];
    fib.ifindex = ctx.ingress_ifindex();
    let source = match fib_lookup(ctx, fib, BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH) {
        // SAFETY: with BPF_FIB_LOOKUP_SRC the FIB wrote the route's IPv6 source into ipv6_src.
        Some(BPF_FIB_LKUP_RET_SUCCESS | BPF_FIB_LKUP_RET_FRAG_NEEDED) => {
            let [w0, w1, w2, w3] = unsafe { fib.__bindgen_anon_3.ipv6_src };
            Addr6 { w0, w1, w2, w3 }
        }
        _ => Addr6::default(),
    };
    if source == Addr6::default() {
        config6.node_addr
    } else {
        source
    }
}

/// Tracks the reply direction of `connection` from `src_addr` and a port of the configured range
/// no live connection uses with it, which makes the translated tuple unique: the masquerade
/// address (`source`) for a masqueraded connection, the client's own for one whose translated
/// tuple is another connection's (as Linux's NAT remaps a clashing source port). Starts at a
/// random point of the range so that concurrent connections rarely contend for the same port.
/// When every port tried is held and an unconfirmed connection holds one of them, that one is
/// dropped for it (`early_drop`). `Ok(None)`: no free port found.
///
/// The tries run as a `bpf_loop` callback: the verifier follows its body once rather than each
/// try, and what comes after the search (the intermediate claim, the original entry) once per
/// outcome rather than per try.
#[inline(always)]
pub fn claim_source(
    config: &Config,
    connection: &Connection,
    src_addr: u32,
) -> Result<Option<ConntrackKey>, Counter> {
    let Some(ports) = PortSearch::new(config.snat_port_min, config.snat_port_max, maps::random())
    else {
        return Ok(None);
    };
    let mut search = Search {
        connection,
        src_addr,
        ports,
        port: 0,
        victim: 0,
        conntrack_full: false,
    };
    // SAFETY: `try_port` is a bpf_loop callback, and `search` outlives the loop.
    unsafe {
        bpf_loop(
            ports.tries(),
            try_port as *const () as *mut c_void,
            (&raw mut search).cast(),
            0,
        );
    }
    if search.conntrack_full {
        return Err(Counter::DropConntrackFull);
    }
    Ok((search.port != 0).then(|| connection.translated(src_addr, search.port)))
}

/// The state of `claim_source`'s search, shared with each try. Its outcome is kept small, a
/// port rather than a tuple: it is on the stack of the programs' deepest path.
struct Search<'a> {
    connection: &'a Connection,
    src_addr: u32,
    ports: PortSearch,
    /// The port claimed (network byte order); 0: none yet (the range starts above 0).
    port: u16,
    /// The first port tried that an unconfirmed connection holds (network byte order); 0: none.
    victim: u16,
    /// A try found the conntrack table full.
    conntrack_full: bool,
}

/// Try `index` of a `Search` (`search`): 1 (stop) once it has an outcome.
extern "C" fn try_port(index: u64, search: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes claim_source's `search`, live and not otherwise borrowed.
    let search = unsafe { &mut *search.cast::<Search>() };
    let port = search.ports.port(index as u32).to_be();
    match search.connection.claim_reply(search.src_addr, port, false) {
        Ok(Claim::Held) => early_drop(search, index),
        Ok(Claim::HeldUnconfirmed) => {
            if search.victim == 0 {
                search.victim = port;
            }
            early_drop(search, index)
        }
        Ok(Claim::Claimed) => {
            search.port = port;
            1
        }
        Err(_) => {
            search.conntrack_full = true;
            1
        }
    }
}

/// After try `index` found its port held: on the last try, with every port held, an unconfirmed
/// holder (a flood's half-open connection, most likely) gives way rather than the new
/// connection, as Linux's early_drop. In the callback rather than after the loop: a call from
/// the programs' own frame would deepen their stack. 1 (stop) once it has an outcome.
fn early_drop(search: &mut Search, index: u64) -> i64 {
    if search.victim == 0 || !search.ports.is_last(index as u32) {
        return 0;
    }
    match search
        .connection
        .claim_reply(search.src_addr, search.victim, true)
    {
        Ok(Claim::Claimed) => search.port = search.victim,
        Ok(_) => {}
        Err(_) => search.conntrack_full = true,
    }
    1
}
