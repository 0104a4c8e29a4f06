//! B4: NodePort packet rate. A live-frames generator in the external client's namespace (an
//! XDP_TX program run by BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES: the kernel transmits
//! each frame from its page pool, no skb, no socket) sends 64-byte UDP frames out of the client's
//! eth0 into the node's external interface, to the node address and the measured Service's UDP
//! NodePort. Where the kernel refuses live frames (EPERM: some hardened or sandboxed kernels do),
//! an AF_PACKET socket that bypasses the qdisc sends the same frame with sendmmsg, as trafgen
//! does; it costs the generator more per frame, and the result names the generator used. Forwarded packets are counted and dropped by a sink at the backend pod's eth0 ingress
//! (`Sink`); softirq CPU is the machine's /proc/stat `softirq` time over the run (all CPUs:
//! the node's forwarding and the backend's receive both run in softirq).
use std::{
    fs, io, mem,
    net::SocketAddrV4,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use lb_tests::{
    netns::Netns,
    topology::{CLIENT_IP, EXTERNAL_INTERFACE, NODE_IP},
};
use nix::libc;
use serde::Serialize;

use crate::{
    Plan, Progress, bpf, interrupt,
    packet::{ETH_HLEN, Frame, IPV4_HLEN, UDP_HLEN},
    services::{NODE_PORT, ServiceSet, UDP_TARGET_PORT},
    traffic::{CLIENT_CPU, pin},
    variants::{Deployment, Variant},
};

/// The variants B4 compares: kube-proxy's iptables (nf_tables backend), this agent's tc datapath
/// in both forwarding modes, and the agent with its XDP program (`--xdp`).
pub const VARIANTS: [Variant; 4] = [
    Variant::IptablesNft,
    Variant::Tc,
    Variant::TcRedirect,
    Variant::Xdp,
];
/// Ethernet frame without FCS.
const FRAME_BYTES: usize = 64;
/// What the generator rewrites in every frame: Ethernet, IPv4 and UDP headers, padded to 4 bytes.
const HEADER_BYTES: usize = 44;
/// Frames per BPF_PROG_TEST_RUN call, and per batch of the kernel's transmit loop. Each call
/// swaps the generator into the kernel's XDP dispatcher and out again, an RCU grace period each
/// (the CPU idles ~25 ms per call here): at 2^16 frames a call that left the CPU idle a third of
/// the time at xdp's rate, less at the slower variants' (measured with perf sched_switch).
const FRAMES_PER_RUN: u32 = 1 << 20;
const LIVE_BATCH: u32 = 64;
/// Bound of one flood, whatever its duration: far above what this box can do.
const MAX_FRAMES: u64 = 500_000_000;
/// The client's end of the node's external link.
const CLIENT_INTERFACE: &str = "eth0";
/// Time for the last frames to cross the node before the counters are read.
const DRAIN: Duration = Duration::from_millis(100);
/// Frames per sendmmsg call of the AF_PACKET generator.
const PACKET_BATCH: usize = 64;

/// How the flood's frames were sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Generator {
    /// BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES: no skb, no socket.
    XdpLiveFrames,
    /// sendmmsg on an AF_PACKET socket with PACKET_QDISC_BYPASS, where live frames are refused.
    AfPacket,
}

#[derive(Debug, Serialize)]
pub struct Flood {
    pub variant: Variant,
    pub services: usize,
    pub seconds: f64,
    pub sent: u64,
    /// Frames that reached the backend pod (its sink).
    pub forwarded: u64,
    pub forwarded_pps: f64,
    /// Softirq time over the run per second of it, summed over CPUs (1.0 = one CPU busy).
    pub softirq_cpus: f64,
    pub generator: Option<Generator>,
    pub error: Option<String>,
}

pub fn run(plan: &Plan, deployments: &mut [Deployment], progress: Progress) -> Result<Vec<Flood>> {
    let mut floods = Vec::new();
    for deployment in deployments
        .iter_mut()
        .filter(|d| VARIANTS.contains(&d.variant))
    {
        interrupt::check()?;
        let set = ServiceSet::new(plan.flood_services, 1, deployment.topology.backend().ip);
        let mut flood = Flood {
            variant: deployment.variant,
            services: set.count,
            seconds: 0.0,
            sent: 0,
            forwarded: 0,
            forwarded_pps: 0.0,
            softirq_cpus: 0.0,
            generator: None,
            error: None,
        };
        let result = deployment
            .program(&set)
            .and_then(|_| measure(deployment, plan.flood_duration, &mut flood));
        if let Err(err) = result {
            flood.error = Some(format!("{err:#}"));
        }
        progress(&format!(
            "  {:<16} {:>6} services: {:>9.0} pps ({} of {} frames forwarded, {}), softirq {:.2} CPUs{}",
            flood.variant.name(),
            flood.services,
            flood.forwarded_pps,
            flood.forwarded,
            flood.sent,
            flood.generator.map_or("-", Generator::name),
            flood.softirq_cpus,
            flood
                .error
                .as_deref()
                .map(|e| format!(" ERROR {e}"))
                .unwrap_or_default()
        ));
        floods.push(flood);
    }
    Ok(floods)
}

fn measure(deployment: &Deployment, duration: Duration, flood: &mut Flood) -> Result<()> {
    let topology = &deployment.topology;
    let client = &topology.inner.client;
    let frame = Frame::udp(
        mac(client, CLIENT_INTERFACE)?,
        mac(topology.node(), EXTERNAL_INTERFACE)?,
        SocketAddrV4::new(CLIENT_IP, 40_000),
        SocketAddrV4::new(NODE_IP, NODE_PORT),
        FRAME_BYTES - ETH_HLEN - IPV4_HLEN - UDP_HLEN,
    );
    let sink = Sink::install(&topology.backend().ns)?;
    let softirq_before = softirq_ticks()?;
    let started = Instant::now();
    let (generator, sent) = client.run(move || generate(&frame.bytes, duration))??;
    flood.generator = Some(generator);
    flood.sent = sent;
    flood.seconds = started.elapsed().as_secs_f64();
    std::thread::sleep(DRAIN);
    let softirq = softirq_ticks()? - softirq_before;
    flood.forwarded = sink.received()?;
    flood.forwarded_pps = flood.forwarded as f64 / flood.seconds;
    flood.softirq_cpus = softirq as f64 / ticks_per_second() / flood.seconds;
    if flood.forwarded == 0 {
        bail!("no frame reached the backend ({} sent)", flood.sent);
    }
    Ok(())
}

impl Generator {
    pub fn name(self) -> &'static str {
        match self {
            Generator::XdpLiveFrames => "xdp live frames",
            Generator::AfPacket => "af_packet",
        }
    }
}

/// Runs on a thread in the client namespace (live frames are sent in the caller's namespace,
/// where the ingress ifindex is looked up) and sends `frame` out of its eth0, to its peer, the
/// node's external interface. Returns the generator used and the frames sent.
fn generate(frame: &[u8], duration: Duration) -> Result<(Generator, u64)> {
    pin(CLIENT_CPU)?;
    let ifindex = nix::net::if_::if_nametoindex(CLIENT_INTERFACE)
        .with_context(|| format!("{CLIENT_INTERFACE} in the client namespace"))?;
    match generate_live_frames(frame, ifindex, duration) {
        Err(err) if err.kind() == io::ErrorKind::PermissionDenied => {
            let sent = generate_af_packet(frame, ifindex, duration)
                .context("the AF_PACKET generator (live frames were refused: EPERM)")?;
            Ok((Generator::AfPacket, sent))
        }
        result => Ok((
            Generator::XdpLiveFrames,
            result.context("BPF_PROG_TEST_RUN with live frames (kernel ≥ 5.18)")?,
        )),
    }
}

/// XDP_TX from eth0 in BPF_PROG_TEST_RUN's live-frames mode.
fn generate_live_frames(frame: &[u8], ifindex: u32, duration: Duration) -> io::Result<u64> {
    let header = &frame[..HEADER_BYTES];
    let program = bpf::load_xdp_generator(header)?;
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
    let ctx: Vec<u8> = [0, frame.len() as u32, 0, ifindex, 0, 0]
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    let started = Instant::now();
    let mut sent = 0;
    while sent < MAX_FRAMES && started.elapsed() < duration {
        bpf::test_run(
            program.as_fd(),
            &bpf::TestRun {
                data: frame,
                ctx: Some(&ctx),
                repeat: FRAMES_PER_RUN,
                flags: bpf::BPF_F_TEST_XDP_LIVE_FRAMES,
                batch_size: LIVE_BATCH,
            },
        )?;
        sent += u64::from(FRAMES_PER_RUN);
    }
    Ok(sent)
}

/// sendmmsg of `frame` on an AF_PACKET socket of eth0 that bypasses its qdisc. The socket has
/// protocol 0, so it receives nothing.
fn generate_af_packet(frame: &[u8], ifindex: u32, duration: Duration) -> io::Result<u64> {
    // SAFETY: socket(2) with constant arguments; the result is checked before it is owned.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let bypass: libc::c_int = 1;
    // SAFETY: the option value is a c_int that outlives the call.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_QDISC_BYPASS,
            (&bypass as *const libc::c_int).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if set < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
    let mut address: libc::sockaddr_ll = unsafe { mem::zeroed() };
    address.sll_family = libc::AF_PACKET as u16;
    address.sll_protocol = (libc::ETH_P_IP as u16).to_be();
    address.sll_ifindex = ifindex as i32;
    let mut iov = libc::iovec {
        iov_base: frame.as_ptr() as *mut libc::c_void,
        iov_len: frame.len(),
    };
    // SAFETY: mmsghdr is plain data; all-zero is a valid value, filled in below.
    let mut message: libc::mmsghdr = unsafe { mem::zeroed() };
    message.msg_hdr.msg_name = (&mut address as *mut libc::sockaddr_ll).cast();
    message.msg_hdr.msg_namelen = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
    message.msg_hdr.msg_iov = &mut iov;
    message.msg_hdr.msg_iovlen = 1;
    let mut messages = [message; PACKET_BATCH];
    let started = Instant::now();
    let mut sent = 0;
    while sent < MAX_FRAMES && started.elapsed() < duration {
        // SAFETY: every message points at `address` and `iov`, which outlive the call; the
        // kernel only reads them and writes msg_len.
        let n = unsafe {
            libc::sendmmsg(
                socket.as_raw_fd(),
                messages.as_mut_ptr(),
                PACKET_BATCH as libc::c_uint,
                0,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOBUFS) {
                continue;
            }
            return Err(err);
        }
        sent += n as u64;
    }
    Ok(sent)
}

fn mac(ns: &Netns, interface: &str) -> Result<[u8; 6]> {
    let out = ns.exec("cat", &[&format!("/sys/class/net/{interface}/address")])?;
    let text = String::from_utf8(out.stdout)?;
    let bytes: Vec<u8> = text
        .trim()
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("MAC of {interface}: {text:?}"))?;
    bytes
        .try_into()
        .map_err(|_| anyhow::anyhow!("MAC of {interface}: {text:?}"))
}

/// B4's sink in a backend pod: the flood's frames are counted and dropped at the ingress hook of
/// its eth0 (nftables, netdev family), before the pod's IP and UDP stack. That stack's cost is the
/// same for every variant but runs on the CPU the generator and the node share, so it would dilute
/// the node's; a packet generator's sink does no more.
struct Sink<'a> {
    ns: &'a Netns,
}

const SINK_TABLE: &str = "lbbench_sink";

impl<'a> Sink<'a> {
    fn install(ns: &'a Netns) -> Result<Self> {
        let rules = format!(
            "add table netdev {SINK_TABLE} ; \
             add chain netdev {SINK_TABLE} ingress {{ type filter hook ingress device eth0 \
             priority 0 ; }} ; \
             add rule netdev {SINK_TABLE} ingress udp dport {UDP_TARGET_PORT} counter drop"
        );
        ns.exec("nft", &[&rules])
            .context("nft: the sink in the backend pod")?;
        Ok(Sink { ns })
    }

    /// Frames counted so far.
    fn received(&self) -> Result<u64> {
        let out = self
            .ns
            .exec("nft", &["-j", "list", "table", "netdev", SINK_TABLE])?;
        let listing: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        listing["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|item| item["rule"]["expr"].as_array())
            .flatten()
            .find_map(|expr| expr["counter"]["packets"].as_u64())
            .context("no counter in the sink's nft listing")
    }
}

impl Drop for Sink<'_> {
    fn drop(&mut self) {
        let _ = self
            .ns
            .exec("nft", &["delete", "table", "netdev", SINK_TABLE]);
    }
}

/// Softirq time of all CPUs so far, in clock ticks (the `cpu` line of /proc/stat).
fn softirq_ticks() -> Result<u64> {
    let stat = fs::read_to_string("/proc/stat")?;
    let cpu = stat.lines().next().context("empty /proc/stat")?;
    // cpu user nice system idle iowait irq softirq ...
    cpu.split_whitespace()
        .nth(7)
        .context("no softirq in /proc/stat")?
        .parse()
        .context("softirq in /proc/stat")
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a constant of the system.
    (unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) }) as f64
}
