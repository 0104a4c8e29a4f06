//! Which interfaces can take `lb_xdp`'s redirects: the kernel's XDP features of each interface
//! (netdev generic netlink, `NETDEV_XDP_ACT_NDO_XMIT`), read when an interface is attached and
//! followed through the family's "mgmt" notifications. A redirect into an interface without
//! that feature is dropped by the kernel, silently: a veth has it only while its peer has GRO or
//! an XDP program on, which the agent cannot set on a pod's end.
use std::io;

use futures::StreamExt as _;
use futures::channel::mpsc::UnboundedReceiver;
use genetlink::GenetlinkHandle;
use genetlink::message::RawGenlMessage;
use netlink_packet_core::{
    DecodeError, DefaultNla, Emitable, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload, NlasIterator,
    ParseableParametrized,
};
use netlink_packet_generic::{GenlFamily, GenlHeader, GenlMessage};
use netlink_sys::AsyncSocket as _;

/// From the kernel's netdev family (include/uapi/linux/netdev.h).
const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_CMD_DEV_CHANGE_NTF: u8 = 4;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
const NETDEV_XDP_ACT_NDO_XMIT: u64 = 1 << 2;
const MGMT_GROUP: &str = "mgmt";

#[derive(Debug, thiserror::Error)]
pub enum XdpTargetError {
    #[error("netlink socket: {0}")]
    Socket(#[source] io::Error),
    #[error("netdev generic netlink family: {0}")]
    Family(#[from] genetlink::GenetlinkError),
    #[error("netdev family has no {MGMT_GROUP:?} multicast group")]
    NoGroup,
    #[error("netdev dev-get for interface {ifindex}: {message}")]
    Query { ifindex: u32, message: String },
}

/// One netdev message: a dev-get request or its answer, or a change notification.
#[derive(Debug, Clone)]
struct NetdevMessage {
    cmd: u8,
    ifindex: Option<u32>,
    xdp_features: Option<u64>,
}

impl GenlFamily for NetdevMessage {
    fn family_name() -> &'static str {
        "netdev"
    }

    fn command(&self) -> u8 {
        self.cmd
    }

    fn version(&self) -> u8 {
        1
    }
}

impl NetdevMessage {
    fn attributes(&self) -> Vec<DefaultNla> {
        self.ifindex
            .map(|i| DefaultNla::new(NETDEV_A_DEV_IFINDEX, i.to_ne_bytes().to_vec()))
            .into_iter()
            .collect()
    }

    /// `(ifindex, accepts redirects)` of an answer or notification.
    fn redirect_target(&self) -> Option<(u32, bool)> {
        Some((
            self.ifindex?,
            self.xdp_features? & NETDEV_XDP_ACT_NDO_XMIT != 0,
        ))
    }
}

impl Emitable for NetdevMessage {
    fn buffer_len(&self) -> usize {
        self.attributes().as_slice().buffer_len()
    }

    fn emit(&self, buffer: &mut [u8]) {
        self.attributes().as_slice().emit(buffer)
    }
}

impl ParseableParametrized<[u8], GenlHeader> for NetdevMessage {
    fn parse_with_param(buf: &[u8], header: GenlHeader) -> Result<Self, DecodeError> {
        let mut message = NetdevMessage {
            cmd: header.cmd,
            ifindex: None,
            xdp_features: None,
        };
        for nla in NlasIterator::new(buf) {
            let nla = nla?;
            let value = nla.value();
            match nla.kind() {
                NETDEV_A_DEV_IFINDEX => {
                    message.ifindex = value.try_into().ok().map(u32::from_ne_bytes);
                }
                NETDEV_A_DEV_XDP_FEATURES => {
                    message.xdp_features = value.try_into().ok().map(u64::from_ne_bytes);
                }
                _ => {}
            }
        }
        Ok(message)
    }
}

/// Queries interfaces' XDP features and reports their changes.
pub struct XdpTargets {
    handle: GenetlinkHandle,
    notifications: UnboundedReceiver<(NetlinkMessage<RawGenlMessage>, netlink_sys::SocketAddr)>,
}

impl XdpTargets {
    /// Subscribes to the netdev family's notifications (before any query, so no change in
    /// between is missed). Needs a tokio runtime.
    pub async fn start() -> Result<Self, XdpTargetError> {
        let (connection, handle, _) =
            genetlink::new_connection().map_err(XdpTargetError::Socket)?;
        tokio::spawn(connection);
        let family = handle.resolve_family::<NetdevMessage>().await?;
        let group = *family
            .multicast_groups
            .get(MGMT_GROUP)
            .ok_or(XdpTargetError::NoGroup)?;
        let (mut listener, _, notifications) =
            genetlink::new_connection().map_err(XdpTargetError::Socket)?;
        // Bound first, for a port id: a kernel broadcast skips sockets with port id 0, its own.
        let socket = listener.socket_mut().socket_mut();
        socket
            .bind(&netlink_sys::SocketAddr::new(0, 0))
            .and_then(|()| socket.add_membership(group))
            .map_err(XdpTargetError::Socket)?;
        tokio::spawn(listener);
        Ok(Self {
            handle,
            notifications,
        })
    }

    /// Whether interface `ifindex` takes XDP redirects now.
    pub async fn accepts_redirects(&mut self, ifindex: u32) -> Result<bool, XdpTargetError> {
        let query_error = |message: String| XdpTargetError::Query { ifindex, message };
        let request = NetdevMessage {
            cmd: NETDEV_CMD_DEV_GET,
            ifindex: Some(ifindex),
            xdp_features: None,
        };
        let mut message = NetlinkMessage::from(GenlMessage::from_payload(request));
        message.header.flags = NLM_F_REQUEST;
        let mut answers = self.handle.request(message).await?;
        while let Some(answer) = answers.next().await {
            match answer.map_err(|e| query_error(e.to_string()))?.payload {
                NetlinkPayload::InnerMessage(genl) => {
                    if let Some((_, accepts)) = genl.payload.redirect_target() {
                        return Ok(accepts);
                    }
                }
                NetlinkPayload::Error(err) => return Err(query_error(err.to_string())),
                _ => {}
            }
        }
        Err(query_error("no answer".into()))
    }

    /// The next change: `(ifindex, accepts redirects)`; None when the socket is gone.
    pub async fn next(&mut self) -> Option<(u32, bool)> {
        loop {
            let (message, _) = self.notifications.next().await?;
            let NetlinkPayload::InnerMessage(raw) = message.payload else {
                continue;
            };
            let Ok(genl) = raw.parse_into_genlmsg::<NetdevMessage>() else {
                continue;
            };
            if genl.payload.cmd == NETDEV_CMD_DEV_CHANGE_NTF
                && let Some(change) = genl.payload.redirect_target()
            {
                return Some(change);
            }
        }
    }
}
