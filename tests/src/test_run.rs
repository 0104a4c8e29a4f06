//! BPF_PROG_TEST_RUN of one of the datapath's programs on a crafted packet.
use aya::{
    Ebpf, Pod,
    maps::{HashMap, MapData},
    programs::{TestRun, TestRunOptions, TestRunResult},
};

/// Room for a program to grow the packet into (a REJECT's ICMP error is longer than the packet).
const ROOM: usize = 256;

/// Runs `program` once on `packet`, with `ctx_in` as its context (`__sk_buff`, `xdp_md`) when
/// given; returns its return value and the packet as it left.
pub fn run_program<P>(program: &P, packet: &[u8], ctx_in: Option<&[u8]>) -> (u32, Vec<u8>)
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = TestRunResult>,
{
    let mut out = vec![0; packet.len() + ROOM];
    let result = program
        .test_run(TestRunOptions {
            data_in: Some(packet),
            data_out: Some(&mut out),
            ctx_in,
            ..Default::default()
        })
        .unwrap();
    out.truncate(result.data_size_out as usize);
    (result.return_value, out)
}

/// How many entries the hash maps `names` of `ebpf` hold together (e.g. a family's conntrack
/// tables, main and unconfirmed), their keys `K` and values `V`.
pub fn entries<K: Pod, V: Pod>(ebpf: &Ebpf, names: &[&str]) -> usize {
    names
        .iter()
        .map(|name| {
            let map: HashMap<&MapData, K, V> = ebpf.map(name).unwrap().try_into().unwrap();
            map.keys().count()
        })
        .sum()
}
