//! The node's sysctls the agent follows: the kernel's ICMP rate limit (for REJECT replies) and
//! the local port ranges the masquerade range should stay clear of. Read from /proc/sys in the
//! agent's network namespace, which is the node's.
use std::fmt;
use std::fs;
use std::ops::RangeInclusive;

use anyhow::{Context as _, Result, bail};

/// `net.ipv4.icmp_msgs_per_sec` and `net.ipv4.icmp_msgs_burst`: the kernel's limit on the ICMP
/// errors it sends, which its REJECT replies obey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcmpRateLimit {
    pub per_sec: u32,
    pub burst: u32,
}

impl IcmpRateLimit {
    pub fn read() -> Result<Self> {
        Ok(IcmpRateLimit {
            per_sec: read("net.ipv4.icmp_msgs_per_sec")?,
            burst: read("net.ipv4.icmp_msgs_burst")?,
        })
    }
}

/// A sysctl's value, parsed.
fn read<T: std::str::FromStr>(key: &str) -> Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    let text = read_text(key)?;
    text.trim()
        .parse()
        .with_context(|| format!("sysctl {key}: {text:?}"))
}

fn read_text(key: &str) -> Result<String> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    fs::read_to_string(&path).with_context(|| format!("reading {path}"))
}

/// `net.ipv4.ip_local_port_range`: "MIN<tab>MAX".
pub fn local_port_range() -> Result<RangeInclusive<u16>> {
    let key = "net.ipv4.ip_local_port_range";
    let text = read_text(key)?;
    let mut ports = text.split_whitespace().map(str::parse::<u16>);
    match (ports.next(), ports.next(), ports.next()) {
        (Some(Ok(min)), Some(Ok(max)), None) => Ok(min..=max),
        _ => bail!("sysctl {key}: {text:?}"),
    }
}

/// `net.ipv4.ip_local_reserved_ports`: "PORT" and "MIN-MAX" items, comma-separated, or empty.
pub fn local_reserved_ports() -> Result<Vec<RangeInclusive<u16>>> {
    let key = "net.ipv4.ip_local_reserved_ports";
    let text = read_text(key)?;
    parse_port_list(&text).with_context(|| format!("sysctl {key}: {text:?}"))
}

fn parse_port_list(text: &str) -> Result<Vec<RangeInclusive<u16>>> {
    text.trim()
        .split(',')
        .filter(|item| !item.is_empty())
        .map(|item| parse_port_item(item.trim()))
        .collect()
}

/// "PORT" or "MIN-MAX", MIN ≤ MAX.
fn parse_port_item(text: &str) -> Result<RangeInclusive<u16>> {
    let (min, max) = text.split_once('-').unwrap_or((text, text));
    let port = |s: &str| {
        s.trim()
            .parse::<u16>()
            .with_context(|| format!("{s:?} is not a port"))
    };
    let (min, max) = (port(min)?, port(max)?);
    if min > max {
        bail!("{min}-{max}: the first port is above the last");
    }
    Ok(min..=max)
}

/// Where the masquerade port range shares ports with the node's own sockets' ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortRangeOverlap {
    /// With `ip_local_port_range`: the node's outgoing connections and masquerade would pick the
    /// same source ports, and a masqueraded flow can clash with a local socket's.
    Ephemeral(RangeInclusive<u16>),
    /// With `ip_local_reserved_ports`: ports set aside for listeners the node runs.
    Reserved(RangeInclusive<u16>),
}

impl fmt::Display for PortRangeOverlap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortRangeOverlap::Ephemeral(ports) => write!(
                f,
                "ports {}-{} are also the node's net.ipv4.ip_local_port_range: its own \
                 connections and masquerade contend for them",
                ports.start(),
                ports.end()
            ),
            PortRangeOverlap::Reserved(ports) => write!(
                f,
                "ports {}-{} are in the node's net.ipv4.ip_local_reserved_ports",
                ports.start(),
                ports.end()
            ),
        }
    }
}

/// The overlaps of the masquerade range `masquerade` with the node's `local` ephemeral range
/// and `reserved` ports.
pub fn port_range_overlaps(
    masquerade: &RangeInclusive<u16>,
    local: &RangeInclusive<u16>,
    reserved: &[RangeInclusive<u16>],
) -> Vec<PortRangeOverlap> {
    let ephemeral = intersection(masquerade, local).map(PortRangeOverlap::Ephemeral);
    let reserved = reserved
        .iter()
        .filter_map(|ports| intersection(masquerade, ports))
        .map(PortRangeOverlap::Reserved);
    ephemeral.into_iter().chain(reserved).collect()
}

fn intersection(a: &RangeInclusive<u16>, b: &RangeInclusive<u16>) -> Option<RangeInclusive<u16>> {
    let (start, end) = (*a.start().max(b.start()), *a.end().min(b.end()));
    (start <= end).then_some(start..=end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_port_item("61000-65535").unwrap(), 61000..=65535);
        assert_eq!(parse_port_item("8080").unwrap(), 8080..=8080);
        assert!(parse_port_item("65535-61000").is_err());
        assert!(parse_port_item("61000-70000").is_err());
        assert!(parse_port_item("a-b").is_err());
        assert_eq!(parse_port_list("\n").unwrap(), vec![]);
        assert_eq!(
            parse_port_list("8080,9000-9100\n").unwrap(),
            vec![8080..=8080, 9000..=9100]
        );
    }

    #[test]
    fn the_default_range_is_clear_of_linuxs_defaults() {
        let masquerade = lb_common::SNAT_PORT_MIN..=lb_common::SNAT_PORT_MAX;
        assert_eq!(
            port_range_overlaps(&masquerade, &(32768..=60999), &[]),
            vec![]
        );
    }

    #[test]
    fn overlaps_name_the_shared_ports() {
        let masquerade = 50000..=65535;
        let overlaps = port_range_overlaps(
            &masquerade,
            &(32768..=60999),
            &[8080..=8080, 60000..=60010, 65535..=65535],
        );
        assert_eq!(
            overlaps,
            vec![
                PortRangeOverlap::Ephemeral(50000..=60999),
                PortRangeOverlap::Reserved(60000..=60010),
                PortRangeOverlap::Reserved(65535..=65535),
            ]
        );
        assert!(overlaps[0].to_string().contains("50000-60999"));
        // Touching ranges share nothing.
        assert_eq!(
            port_range_overlaps(&(61000..=65535), &(1024..=60999), &[]),
            vec![]
        );
    }
}
