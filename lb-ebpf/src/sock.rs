//! Traffic from the node itself (host processes, hostNetwork pods), as kube-proxy's OUTPUT
//! chain serves it: cgroup socket-address hooks point a socket at a backend when it connects
//! (TCP, connected UDP) or sends (unconnected UDP, each datagram of a flow to the same backend)
//! to a service, and show the service address back to the application (getpeername, recvmsg).
//! IPv6 sockets have hooks of their own (sock6.rs). No packet of these flows is translated: the
//! kernel routes them to the backend and picks their source, which is what kube-proxy's
//! masquerade of node-local traffic gives.
use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use lb_common::{
    Backend, CT_UDP_STREAM, Config, ConntrackKey, Counter, Frontend, IPPROTO_TCP, IPPROTO_UDP,
    SockRevNat, SockRevNatKey, conntrack_timeout_ns, ipv4_be, sticky::Sticky,
};

use crate::{
    affinity,
    family::{Family, Ipv4},
    maps,
    service::{self, Backends},
};

/// The syscall goes on (with the address as the hook left it).
pub const PROCEED: i32 = 1;
/// The syscall fails: EPERM, or the error set with `bpf_set_retval`.
const FAIL: i32 = 0;
const ECONNREFUSED: i32 = 111;
const LOOPBACK_NET: u32 = ipv4_be([127, 0, 0, 0]);
const LOOPBACK_MASK: u32 = ipv4_be([255, 0, 0, 0]);

/// Why a socket's address is left as it is.
pub enum Untouched {
    /// Not ours: another namespace, not TCP/UDP, not a service address.
    NotService,
    /// The service refuses or drops new connections; counted, and the syscall fails.
    Refused(Counter),
}

impl Untouched {
    /// Why a frontend lookup (service::frontend, translate6::frontend) found none to use.
    pub fn of_frontend_lookup(reason: Counter) -> Self {
        match reason {
            Counter::Passed => Untouched::NotService,
            refused => Untouched::Refused(refused),
        }
    }
}

/// connect4 and sendmsg4: a service address becomes a backend of that service.
pub fn translate(ctx: &SockAddrContext) -> i32 {
    verdict(try_translate(ctx))
}

/// What a translating hook returns for the outcome of its translation.
pub fn verdict(translated: Result<(), Untouched>) -> i32 {
    match translated {
        Ok(()) => PROCEED,
        Err(Untouched::NotService) => PROCEED,
        Err(Untouched::Refused(reason)) => {
            maps::count(reason);
            // kube-proxy REJECTs a service without endpoints (the client sees ECONNREFUSED);
            // traffic policy Local without a local endpoint is dropped, here EPERM at once.
            if reason == Counter::Rejected {
                // SAFETY: the helper only sets this syscall's return value.
                unsafe { bpf_set_retval(-ECONNREFUSED) };
            }
            FAIL
        }
    }
}

fn try_translate(ctx: &SockAddrContext) -> Result<(), Untouched> {
    let (config, proto) = node_socket(ctx)?;
    // SAFETY: the kernel hands the program a valid bpf_sock_addr for its whole run.
    let addr = unsafe { &mut *ctx.sock_addr };
    let backend = ipv4_backend(ctx, config, proto, addr.user_ip4, addr.user_port as u16)?;
    addr.user_ip4 = backend.addr;
    addr.user_port = u32::from(backend.port);
    Ok(())
}

/// The configuration and the protocol of the context's socket if it is a TCP or UDP socket of
/// the agent's network namespace.
pub fn node_socket(ctx: &SockAddrContext) -> Result<(&'static Config, u8), Untouched> {
    let config = maps::config()
        .filter(|config| config.netns_cookie != 0)
        .ok_or(Untouched::NotService)?;
    // SAFETY: the helper reads the namespace of the context's socket.
    if unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } != config.netns_cookie {
        return Err(Untouched::NotService);
    }
    // SAFETY: as in `try_translate`.
    let protocol = unsafe { (*ctx.sock_addr).protocol };
    match protocol {
        p if p == u32::from(IPPROTO_TCP) => Ok((config, IPPROTO_TCP)),
        p if p == u32::from(IPPROTO_UDP) => Ok((config, IPPROTO_UDP)),
        _ => Err(Untouched::NotService),
    }
}

/// The backend the socket's connect or send to IPv4 address `dst_addr:dst_port` goes to, if
/// that is a service address; remembered for [`ipv4_service`].
// Inlined: a BPF function call takes at most five arguments, the result's pointer among them.
#[inline(always)]
pub fn ipv4_backend(
    ctx: &SockAddrContext,
    config: &Config,
    proto: u8,
    dst_addr: u32,
    dst_port: u16,
) -> Result<Backend, Untouched> {
    let cookie = socket_cookie(ctx);
    let tuple = ConntrackKey {
        // The source is not chosen yet: the node's address stands for it (sessionAffinity and
        // source hashing key on it), and the socket for its port (flow hashing).
        src_addr: config.node_addr,
        dst_addr: frontend_addr(config, dst_addr),
        src_port: cookie as u16,
        dst_port,
        proto,
        _pad0: 0,
        _pad1: 0,
    };
    let frontend = service::frontend(&tuple).map_err(Untouched::of_frontend_lookup)?;
    let backend = node_backend::<Ipv4>(cookie, &frontend, &tuple, maps::now_ns(config))?;
    // The endpoint alone: the reverse hooks look it up by the address they see.
    let key = SockRevNatKey {
        cookie,
        backend: backend.endpoint(),
    };
    let service = SockRevNat {
        addr: dst_addr,
        port: dst_port,
        _pad: 0,
    };
    // A failed insert only leaves the application seeing the backend as its peer.
    maps::sock_revnat_insert(&key, &service);
    maps::count(Counter::NewConnection);
    Ok(backend)
}

/// recvmsg4 and getpeername4: a backend this socket was pointed to shows as the service
/// address it used. Only sockets translated above have entries, so no namespace check.
pub fn reverse(ctx: &SockAddrContext) -> i32 {
    // SAFETY: as in `try_translate`.
    let addr = unsafe { &mut *ctx.sock_addr };
    if let Some(service) = ipv4_service(ctx, addr.user_ip4, addr.user_port as u16) {
        addr.user_ip4 = service.addr;
        addr.user_port = u32::from(service.port);
    }
    PROCEED
}

/// The service address the socket used where it reaches IPv4 backend `addr:port`.
pub fn ipv4_service(ctx: &SockAddrContext, addr: u32, port: u16) -> Option<SockRevNat> {
    maps::sock_revnat(&SockRevNatKey {
        cookie: socket_cookie(ctx),
        backend: Backend {
            addr,
            port,
            stats_slot: 0,
        },
    })
}

/// The backend a node socket's new flow `tuple` (either family) to service port `frontend`
/// goes to: for UDP the one of the socket's flow ([`udp_flow_backend`]), else a fresh choice,
/// both by the service's scheduler and sessionAffinity over the list of node-local traffic.
// Inlined: a BPF function call takes at most five arguments, the result's pointer among them.
#[inline(always)]
pub fn node_backend<F: Family>(
    cookie: u64,
    frontend: &Frontend,
    tuple: &F::Tuple,
    now: u64,
) -> Result<F::Backend, Untouched> {
    let backends = Backends::<F>::of_node(frontend);
    if backends.count == 0 {
        return Err(Untouched::Refused(if frontend.backend_count != 0 {
            Counter::DropNoLocalBackend
        } else {
            Counter::Rejected
        }));
    }
    if F::proto(tuple) == IPPROTO_UDP {
        udp_flow_backend(cookie, frontend, &backends, tuple, now)
    } else {
        service::select_backend(frontend, &backends, tuple, now).map(|(_, backend)| backend)
    }
    .map_err(Untouched::Refused)
}

/// The backend of a UDP socket's datagram to a service port: the one its previous datagrams went
/// to while that flow is in use (an unconnected socket passes through sendmsg on every send),
/// as conntrack keeps a UDP 5-tuple on one endpoint for kube-proxy.
// Inlined: a BPF function call takes at most five arguments, the result's pointer among them.
#[inline(always)]
fn udp_flow_backend<F: Family>(
    cookie: u64,
    frontend: &Frontend,
    backends: &Backends<F>,
    tuple: &F::Tuple,
    now: u64,
) -> Result<F::Backend, Counter> {
    let key = F::sock_flow(cookie, tuple);
    // As long as conntrack keeps a UDP stream: the socket's sends alone tell nothing of replies.
    let timeout = maps::config().map_or(0, |config| {
        conntrack_timeout_ns(IPPROTO_UDP, CT_UDP_STREAM, &config.timeouts)
    });
    let previous =
        F::sock_backend(&key).and_then(|entry| affinity::reuse(entry, backends, timeout, now));
    if let Some((_, backend)) = previous {
        return Ok(backend);
    }
    let (slot, backend) = service::select_backend(frontend, backends, tuple, now)?;
    F::sock_backend_insert(&key, &F::Sticky::new(slot, backend, now));
    Ok(backend)
}

pub fn socket_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: the helper reads the cookie of the context's socket.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

/// Localhost NodePorts (127.0.0.1:nodePort), which kube-proxy's iptables mode serves: the
/// frontend is the node address's NodePort.
fn frontend_addr(config: &Config, dst_addr: u32) -> u32 {
    if dst_addr & LOOPBACK_MASK == LOOPBACK_NET {
        config.node_addr
    } else {
        dst_addr
    }
}
