//! Interfaces where traffic enters the node: the external one and the pod-side ones matching the
//! globs, those present at start and those created later (netlink RTM_NEWLINK), each with
//! `lb_ingress` attached at tc ingress; with `--xdp`, the external one also with `lb_xdp` in
//! native mode. Also the node's IPv4 addresses, which NodePorts answer on, and their changes.
use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr};

use aya::programs::tc::{self, SchedClassifierLinkId, TcAttachType};
use aya::programs::xdp::XdpLinkId;
use aya::programs::{ProgramError, SchedClassifier, Xdp, XdpMode};
use aya::util::KernelVersion;
use futures::channel::mpsc::UnboundedReceiver;
use futures::{StreamExt as _, TryStreamExt as _};
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::{Handle, MulticastGroup};
use tracing::{debug, info, warn};

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
    /// Created, or changed (renamed, up/down): (index, name).
    Present(u32, String),
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
    /// [`LinkWatcher::ipv4_addresses`] afterwards, so no change in between is missed. Needs a
    /// tokio runtime.
    pub fn start() -> Result<Self, LinkError> {
        let (connection, handle, messages) = rtnetlink::new_multicast_connection(&[
            MulticastGroup::Link,
            MulticastGroup::Ipv4Ifaddr,
        ])
        .map_err(LinkError::Socket)?;
        tokio::spawn(connection);
        Ok(Self { handle, messages })
    }

    /// The interfaces there are now: (index, name).
    pub async fn list(&self) -> Result<Vec<(u32, String)>, LinkError> {
        let links: Vec<LinkMessage> = self.handle.link().get().execute().try_collect().await?;
        Ok(links.iter().filter_map(index_and_name).collect())
    }

    /// The IPv4 addresses of the namespace's interfaces.
    pub async fn ipv4_addresses(&self) -> Result<Vec<Ipv4Addr>, LinkError> {
        let messages: Vec<AddressMessage> =
            self.handle.address().get().execute().try_collect().await?;
        Ok(messages
            .iter()
            .flat_map(|m| &m.attributes)
            .filter_map(|a| match a {
                AddressAttribute::Local(IpAddr::V4(ip)) => Some(*ip),
                _ => None,
            })
            .collect())
    }

    /// The next event; None when the netlink connection is gone.
    pub async fn next(&mut self) -> Option<LinkEvent> {
        loop {
            let (message, _) = self.messages.next().await?;
            match message.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => {
                    if let Some((index, name)) = index_and_name(&link) {
                        return Some(LinkEvent::Present(index, name));
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

fn index_and_name(link: &LinkMessage) -> Option<(u32, String)> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(name) => Some((link.header.index, name.clone())),
        _ => None,
    })
}

/// A program type and how it is attached to an interface.
pub trait Attach {
    type LinkId;
    /// Where it runs, for the logs.
    const HOOK: &'static str;
    fn attach_to(&mut self, name: &str) -> Result<Self::LinkId, ProgramError>;
    fn detach_from(&mut self, link: Self::LinkId) -> Result<(), ProgramError>;
}

impl Attach for SchedClassifier {
    type LinkId = SchedClassifierLinkId;
    const HOOK: &'static str = "lb_ingress at tc ingress";

    fn attach_to(&mut self, name: &str) -> Result<Self::LinkId, ProgramError> {
        // aya attaches with TCX links from 6.6 on; older kernels take a netlink filter, which
        // needs the clsact qdisc.
        let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
        if !tcx {
            match tc::qdisc_add_clsact(name) {
                Err(tc::TcError::NetlinkError(err))
                    if err.raw_os_error() == Some(nix::libc::EEXIST) => {}
                other => other?,
            }
        }
        self.attach(name, TcAttachType::Ingress)
    }

    fn detach_from(&mut self, link: Self::LinkId) -> Result<(), ProgramError> {
        self.detach(link)
    }
}

impl Attach for Xdp {
    type LinkId = XdpLinkId;
    const HOOK: &'static str = "lb_xdp in native (driver) mode";

    /// Native mode only: generic (skb) XDP runs after the skb is built, where it saves nothing
    /// over tc.
    fn attach_to(&mut self, name: &str) -> Result<Self::LinkId, ProgramError> {
        self.attach(name, XdpMode::Driver)
    }

    fn detach_from(&mut self, link: Self::LinkId) -> Result<(), ProgramError> {
        self.detach(link)
    }
}

/// The interfaces a program is attached to, by index.
pub struct Attachments<P: Attach> {
    attached: BTreeMap<u32, (String, P::LinkId)>,
}

impl<P: Attach> Default for Attachments<P> {
    fn default() -> Self {
        Self {
            attached: BTreeMap::new(),
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

    /// Attaches to interface `index` named `name` if it matches and is not attached yet.
    /// A failure is logged, not returned: the interface may already be gone again.
    pub fn add(&mut self, program: &mut P, filter: &InterfaceFilter, index: u32, name: &str) {
        if let Err(err) = self.try_add(program, filter, index, name) {
            warn!(interface = name, index, hook = P::HOOK, error = %error_chain(&err), "attach failed");
        }
    }

    /// [`Attachments::add`], returning the failure.
    pub fn try_add(
        &mut self,
        program: &mut P,
        filter: &InterfaceFilter,
        index: u32,
        name: &str,
    ) -> Result<(), ProgramError> {
        if self.attached.contains_key(&index) || !filter.matches(name) {
            return Ok(());
        }
        let link = program.attach_to(name)?;
        info!(interface = name, index, "attached {}", P::HOOK);
        self.attached.insert(index, (name.to_owned(), link));
        Ok(())
    }

    /// Forgets a vanished interface; the kernel dropped its attachment with it.
    pub fn remove(&mut self, program: &mut P, index: u32) {
        if let Some((name, link)) = self.attached.remove(&index) {
            // Only releases our handle: there is nothing left to detach.
            if let Err(err) = program.detach_from(link) {
                debug!(interface = %name, index, error = %error_chain(&err), "release after removal");
            }
            info!(interface = %name, index, hook = P::HOOK, "interface gone");
        }
    }

    /// Indexes we hold that are not in `present` (after lost notifications).
    pub fn missing_from(&self, present: &[(u32, String)]) -> Vec<u32> {
        self.attached
            .keys()
            .filter(|i| !present.iter().any(|(p, _)| p == *i))
            .copied()
            .collect()
    }

    pub fn detach_all(&mut self, program: &mut P) {
        for (index, (name, link)) in std::mem::take(&mut self.attached) {
            match program.detach_from(link) {
                Ok(()) => info!(interface = %name, index, hook = P::HOOK, "detached"),
                Err(err) => {
                    warn!(interface = %name, index, hook = P::HOOK, error = %error_chain(&err), "detach failed")
                }
            }
        }
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
