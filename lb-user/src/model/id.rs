//! What names a service and a service port across syncs: the keys of the model, of the nodePort
//! allocator and of the reconciler's records. A leaf, so that all of them can use it.
use std::fmt;
use std::sync::Arc;

use lb_common::{IPPROTO_TCP, IPPROTO_UDP};

/// `namespace/name` of a Service. Shared, not copied: the specs, the model, the change tracker
/// and the reconciler each key a map by it (ten copies of each string per Service otherwise).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceName {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub const fn ipproto(self) -> u8 {
        match self {
            Protocol::Tcp => IPPROTO_TCP,
            Protocol::Udp => IPPROTO_UDP,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

/// A ServicePort's name ("" when unnamed): one allocation per port, shared by the spec, the
/// model and the reconciler's ids and records, which each hold the name of every port (four
/// copies of each string per port otherwise).
pub type PortName = Arc<str>;

/// One port of one service: the identity that keeps its service id (and allocated nodePort)
/// stable across syncs.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortId {
    pub service: ServiceName,
    /// The ServicePort name; "" when unnamed (only allowed for single-port services).
    pub port_name: PortName,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.service, self.port_name, self.protocol)
    }
}
