//! Interfaces where traffic enters the node: the external one and the pod-side ones matching the
//! globs, those present at start and those created later (netlink RTM_NEWLINK), each with
//! `lb_ingress` attached at tc ingress and `lb_egress` at tc egress; with `--xdp`, the external one also with `lb_xdp` in
//! native mode. Also the node's IPv4 addresses, which NodePorts answer on, and their changes.
use std::collections::BTreeMap;
use std::io;
use std::net::IpAddr;

use std::marker::PhantomData;
use std::os::fd::{AsFd as _, BorrowedFd};

use aya::programs::links::FdLink;
use aya::programs::tc::{
    self, NlOptions, SchedClassifierLink, TcAttachOptions, TcAttachType, TcHandle,
};
use aya::programs::{ProgramError, SchedClassifier, Xdp, XdpMode};
use aya::util::KernelVersion;
use futures::channel::mpsc::UnboundedReceiver;
use futures::{StreamExt as _, TryStreamExt as _};
use lb_common::program_name;
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::link::{LinkAttribute, LinkLayerType, LinkMessage};
use rtnetlink::{Handle, MulticastGroup};
use tracing::{info, warn};

use crate::datapath::bpf_link::LinkTarget;
use crate::datapath::link_pins::{LinkPinError, LinkPins};
use crate::error_chain;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("invalid interface pattern {pattern:?}: {source}")]
    Pattern {
        pattern: String,
        source: glob::PatternError,
    },
    #[error("netlink socket: {0}")]
    Socket(#[source] io::Error),
    #[error("listing interfaces: {0}")]
    Dump(#[from] rtnetlink::Error),
}

/// Which interface names get the program.
#[derive(Debug)]
pub struct InterfaceFilter {
    external: String,
    pods: Vec<glob::Pattern>,
}

impl InterfaceFilter {
    pub fn new(external: &str, pod_globs: &[String]) -> Result<Self, LinkError> {
        let pods = pod_globs
            .iter()
            .map(|p| {
                glob::Pattern::new(p).map_err(|source| LinkError::Pattern {
                    pattern: p.clone(),
                    source,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            external: external.to_owned(),
            pods,
        })
    }

    pub fn matches(&self, name: &str) -> bool {
        name == self.external || self.pods.iter().any(|p| p.matches(name))
    }
}

/// A change in the namespace's interfaces.
#[derive(Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// Created, or changed (renamed, up/down).
    Present(Link),
    Gone(u32),
    /// An IPv4 address was added or removed: the addresses NodePorts answer on may change.
    Addresses,
    /// The kernel dropped notifications (socket buffer overrun): list the interfaces again.
    Lost,
}

/// Netlink link notifications, and listing the current interfaces.
pub struct LinkWatcher {
    handle: Handle,
    messages: UnboundedReceiver<(
        NetlinkMessage<RouteNetlinkMessage>,
        rtnetlink::sys::SocketAddr,
    )>,
}

impl LinkWatcher {
    /// Subscribes to link and IPv4 address notifications; call [`LinkWatcher::list`] and
    /// [`LinkWatcher::addresses`] afterwards, so no change in between is missed. Needs a
    /// tokio runtime.
    pub fn start() -> Result<Self, LinkError> {
        let (connection, handle, messages) = rtnetlink::new_multicast_connection(&[
            MulticastGroup::Link,
            MulticastGroup::Ipv4Ifaddr,
            MulticastGroup::Ipv6Ifaddr,
        ])
        .map_err(LinkError::Socket)?;
        tokio::spawn(connection);
        Ok(Self { handle, messages })
    }

    /// The interfaces there are now.
    pub async fn list(&self) -> Result<Vec<Link>, LinkError> {
        let links: Vec<LinkMessage> = self.handle.link().get().execute().try_collect().await?;
        Ok(links.iter().filter_map(Link::of_message).collect())
    }

    /// The addresses of the namespace's interfaces, of both families.
    pub async fn addresses(&self) -> Result<Vec<IpAddr>, LinkError> {
        let messages: Vec<AddressMessage> =
            self.handle.address().get().execute().try_collect().await?;
        Ok(messages
            .iter()
            .filter_map(|m| {
                // IPv4 gives its own address as Local (Address is the peer's of a point-to-point
                // link); IPv6 only as Address.
                let local = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Local(ip) => Some(*ip),
                    _ => None,
                });
                local.or_else(|| {
                    m.attributes.iter().find_map(|a| match a {
                        AddressAttribute::Address(ip @ IpAddr::V6(_)) => Some(*ip),
                        _ => None,
                    })
                })
            })
            .collect())
    }

    /// The next event; None when the netlink connection is gone.
    pub async fn next(&mut self) -> Option<LinkEvent> {
        loop {
            let (message, _) = self.messages.next().await?;
            match message.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => {
                    if let Some(link) = Link::of_message(&link) {
                        return Some(LinkEvent::Present(link));
                    }
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(link)) => {
                    return Some(LinkEvent::Gone(link.header.index));
                }
                NetlinkPayload::InnerMessage(
                    RouteNetlinkMessage::NewAddress(_) | RouteNetlinkMessage::DelAddress(_),
                ) => return Some(LinkEvent::Addresses),
                NetlinkPayload::Overrun(_) => return Some(LinkEvent::Lost),
                _ => {}
            }
        }
    }
}

/// An interface of the namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// Its ARPHRD_* type: the programs parse an Ethernet header, which only `Ether` links have
    /// (not WireGuard, tun or IPIP devices, whose packets start at the IP header).
    pub link_type: LinkLayerType,
    /// The bridge (or bond) it is a port of.
    pub master: Option<u32>,
}

impl Link {
    fn of_message(link: &LinkMessage) -> Option<Self> {
        let name = link.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(name) => Some(name.clone()),
            _ => None,
        })?;
        let master = link.attributes.iter().find_map(|a| match a {
            LinkAttribute::Controller(index) => Some(*index),
            _ => None,
        });
        Some(Self {
            index: link.header.index,
            name,
            link_type: link.header.link_layer_type,
            master,
        })
    }

    pub fn is_ethernet(&self) -> bool {
        self.link_type == LinkLayerType::Ether
    }
}

/// tc filters before TCX (Linux 6.6) are netlink objects, not links, so they cannot be pinned:
/// the agent's filter keeps this priority and handle, and a restart replaces it by them.
const TC_NETLINK_PRIORITY: u16 = 0x4c42;
const TC_NETLINK_HANDLE: TcHandle = TcHandle::new(0, 0x4c42);

/// A hook on an interface: its program type, and how the program is attached there.
pub trait Attach {
    type Program;
    /// Where it runs, for the logs.
    const HOOK: &'static str;
    /// The name its link on interface `index` is pinned as.
    fn pin_name(index: u32) -> String;
    fn program_fd(program: &Self::Program) -> Result<BorrowedFd<'_>, ProgramError>;
    /// Attaches to interface `name`; the link, if the kernel made one.
    fn attach_new(program: &mut Self::Program, name: &str) -> Result<Option<FdLink>, LinkPinError>;
}

/// Whether tc programs attach as TCX links (Linux 6.6+) rather than netlink filters.
fn tcx() -> bool {
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0))
}

/// A tc program at one side of an interface: `lb_ingress` at ingress, `lb_egress` at egress.
pub struct Tc<const INGRESS: bool>;

/// `lb_ingress` at tc ingress.
pub type TcIngress = Tc<true>;
/// `lb_egress` at tc egress.
pub type TcEgress = Tc<false>;

impl<const INGRESS: bool> Attach for Tc<INGRESS> {
    type Program = SchedClassifier;
    const HOOK: &'static str = if INGRESS {
        "lb_ingress at tc ingress"
    } else {
        "lb_egress at tc egress"
    };

    fn pin_name(index: u32) -> String {
        let side = if INGRESS { "ingress" } else { "egress" };
        format!("tc_{side}_{index}")
    }

    fn program_fd(program: &SchedClassifier) -> Result<BorrowedFd<'_>, ProgramError> {
        Ok(program.fd()?.as_fd())
    }

    fn attach_new(
        program: &mut SchedClassifier,
        name: &str,
    ) -> Result<Option<FdLink>, LinkPinError> {
        let side = if INGRESS {
            TcAttachType::Ingress
        } else {
            TcAttachType::Egress
        };
        attach_tc(program, name, side)
    }
}

fn attach_tc(
    program: &mut SchedClassifier,
    name: &str,
    direction: TcAttachType,
) -> Result<Option<FdLink>, LinkPinError> {
    if tcx() {
        let id = program.attach(name, direction)?;
        let link = program.take_link(id)?;
        return Ok(Some(FdLink::try_from(link)?));
    }
    attach_netlink_filter(program, name, direction)?;
    Ok(None)
}

/// Puts the program on `name`'s tc hook `direction` as a netlink filter (kernels before TCX):
/// replacing the filter a previous agent left, by its priority and handle, else adding it. The
/// filter is left attached when the agent exits, as a pinned link would be; `lb cleanup` removes
/// it.
pub fn attach_netlink_filter(
    program: &mut SchedClassifier,
    name: &str,
    direction: TcAttachType,
) -> Result<(), ProgramError> {
    match tc::qdisc_add_clsact(name) {
        Err(tc::TcError::NetlinkError(err)) if err.raw_os_error() == Some(nix::libc::EEXIST) => {}
        other => other?,
    }
    let previous = SchedClassifierLink::attached(
        name,
        direction,
        TC_NETLINK_PRIORITY,
        TC_NETLINK_HANDLE,
        None,
    )
    .map_err(|err| ProgramError::from(tc::TcError::IoError(err)))?;
    let id = match program.attach_to_link(previous) {
        Ok(id) => id,
        Err(_) => program.attach_with_options(
            name,
            direction,
            TcAttachOptions::Netlink(NlOptions {
                priority: TC_NETLINK_PRIORITY,
                handle: TC_NETLINK_HANDLE,
                ..NlOptions::default()
            }),
        )?,
    };
    // Dropping the link would delete the filter: it must outlive the agent.
    std::mem::forget(program.take_link(id)?);
    Ok(())
}

/// Removes `lb_ingress` and `lb_egress` tc filters from every interface of this network
/// namespace: kernels before TCX have them as netlink filters, not pinned links. The interfaces
/// and programs removed.
pub fn detach_netlink_filters() -> Result<Vec<(String, &'static str)>, LinkError> {
    let interfaces = nix::net::if_::if_nameindex().map_err(|e| LinkError::Socket(e.into()))?;
    let mut detached = Vec::new();
    let hooks = [
        (TcAttachType::Ingress, program_name::INGRESS),
        (TcAttachType::Egress, program_name::EGRESS),
    ];
    for interface in interfaces.iter() {
        let name = interface.name().to_string_lossy();
        for (direction, program) in hooks {
            // An error is no such filter, or no clsact qdisc at all.
            if tc::qdisc_detach_program(&name, direction, program).is_ok() {
                detached.push((name.clone().into_owned(), program));
            }
        }
    }
    Ok(detached)
}

/// `lb_xdp` in native mode.
pub struct XdpNative;

impl Attach for XdpNative {
    type Program = Xdp;
    const HOOK: &'static str = "lb_xdp in native (driver) mode";

    fn pin_name(index: u32) -> String {
        format!("xdp_{index}")
    }

    fn program_fd(program: &Xdp) -> Result<BorrowedFd<'_>, ProgramError> {
        Ok(program.fd()?.as_fd())
    }

    /// Native mode only: generic (skb) XDP runs after the skb is built, where it saves nothing
    /// over tc.
    fn attach_new(program: &mut Xdp, name: &str) -> Result<Option<FdLink>, LinkPinError> {
        let id = program.attach(name, XdpMode::Driver)?;
        let link = program.take_link(id)?;
        Ok(Some(FdLink::try_from(link)?))
    }
}

/// The interfaces a program is on, by index, with their links pinned.
pub struct Attachments<P: Attach> {
    attached: BTreeMap<u32, String>,
    _program: PhantomData<P>,
}

impl<P: Attach> Default for Attachments<P> {
    fn default() -> Self {
        Self {
            attached: BTreeMap::new(),
            _program: PhantomData,
        }
    }
}

impl<P: Attach> Attachments<P> {
    pub fn len(&self) -> usize {
        self.attached.len()
    }

    pub fn is_empty(&self) -> bool {
        self.attached.is_empty()
    }

    /// The pin names of the links this agent holds.
    pub fn pin_names(&self) -> impl Iterator<Item = String> + '_ {
        self.attached.keys().map(|&index| P::pin_name(index))
    }

    /// Whether interface `index` has the program.
    pub fn holds(&self, index: u32) -> bool {
        self.attached.contains_key(&index)
    }

    /// Puts the program on interface `index` named `name` if it is `wanted` and does not have
    /// it yet. A failure is logged, not returned: the interface may already be gone again.
    pub fn add(
        &mut self,
        program: &mut P::Program,
        pins: &LinkPins,
        wanted: bool,
        index: u32,
        name: &str,
    ) {
        if let Err(err) = self.try_add(program, pins, wanted, index, name) {
            warn!(interface = name, index, hook = P::HOOK, error = %error_chain(&err), "attach failed");
        }
    }

    /// [`Attachments::add`], returning the failure.
    pub fn try_add(
        &mut self,
        program: &mut P::Program,
        pins: &LinkPins,
        wanted: bool,
        index: u32,
        name: &str,
    ) -> Result<(), LinkPinError> {
        if self.attached.contains_key(&index) || !wanted {
            return Ok(());
        }
        let pin = P::pin_name(index);
        if pins.replace(&pin, LinkTarget::Interface(index), P::program_fd(program)?)? {
            info!(interface = name, index, "replaced {} in place", P::HOOK);
        } else {
            pins.pin(&pin, P::attach_new(program, name)?)?;
            info!(interface = name, index, "attached {}", P::HOOK);
        }
        self.attached.insert(index, name.to_owned());
        Ok(())
    }

    /// Forgets a vanished interface and unpins its link, which the kernel detached with it.
    pub fn remove(&mut self, pins: &LinkPins, index: u32) {
        if let Some(name) = self.attached.remove(&index) {
            pins.remove(&P::pin_name(index));
            info!(interface = %name, index, hook = P::HOOK, "interface gone");
        }
    }

    /// Indexes we hold that are not in `present` (after lost notifications).
    pub fn missing_from(&self, present: &[Link]) -> Vec<u32> {
        self.attached
            .keys()
            .filter(|i| !present.iter().any(|link| link.index == **i))
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_matches_external_and_globs() {
        let f = InterfaceFilter::new("eth0", &["lbp*".into(), "veth?x".into()]).unwrap();
        assert!(f.matches("eth0"));
        assert!(f.matches("lbpa"));
        assert!(f.matches("veth1x"));
        assert!(!f.matches("eth1"));
        assert!(!f.matches("lo"));
        assert!(InterfaceFilter::new("eth0", &["[".into()]).is_err());
    }
}
