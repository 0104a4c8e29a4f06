//! BPF_MAP_UPDATE_BATCH and BPF_MAP_DELETE_BATCH (Linux ≥ 5.6), which aya 0.14 does not expose:
//! one syscall writes or deletes many hash or array map entries, in order, instead of one
//! syscall each (a 50k-Service sync is 150k entries and 500k counter slots).
use std::io;
use std::os::fd::{AsRawFd as _, BorrowedFd};

use bytemuck::Pod;
use nix::libc;

const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// The `batch` member of union bpf_attr.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// The `key`/`next_key` member of union bpf_attr.
#[repr(C)]
struct NextKeyAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    next_key: u64,
}

/// How many keys a hash map (or LPM trie) holds, by walking them with BPF_MAP_GET_NEXT_KEY
/// (aya walks keys only of a map typed by its key and value): a map of any layout, by its key
/// size. Entries added or removed meanwhile may be missed or counted, as in any walk.
pub fn count_keys(map: BorrowedFd<'_>, key_size: usize) -> io::Result<usize> {
    let (mut key, mut next) = (vec![0u8; key_size], vec![0u8; key_size]);
    let mut attr = NextKeyAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        // No key first: the kernel answers with the first one.
        key: 0,
        next_key: next.as_mut_ptr() as u64,
    };
    let mut count = 0;
    loop {
        // SAFETY: `attr` is the key member of union bpf_attr, valid for its size; `key` and
        // `next` are live buffers of the map's key size for the call.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_GET_NEXT_KEY,
                &mut attr as *mut NextKeyAttr,
                std::mem::size_of::<NextKeyAttr>() as libc::c_uint,
            )
        };
        if ret < 0 {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::ENOENT) => Ok(count),
                _ => Err(err),
            };
        }
        count += 1;
        std::mem::swap(&mut key, &mut next);
        attr.key = key.as_ptr() as u64;
        attr.next_key = next.as_mut_ptr() as u64;
    }
}

/// An entry the kernel refused, by its index in the batch; the entries before it are done.
#[derive(Debug, thiserror::Error)]
#[error("entry {index} of the batch: {source}")]
pub struct BatchError {
    pub index: usize,
    pub source: io::Error,
}

/// Writes `keys[i]` → `values[i]` (BPF_ANY) in order, stopping at the first entry refused.
pub fn update<K: Pod, V: Pod>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), BatchError> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    batch(
        BPF_MAP_UPDATE_BATCH,
        map,
        keys,
        values.as_ptr() as u64,
        keys.len(),
    )
}

/// [`update`] of a per-CPU map: `values` holds each key's value on every possible CPU in a row,
/// `cpus` of them (the values' size must be a multiple of 8, as the kernel lays them out).
pub fn update_per_cpu<K: Pod, V: Pod>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
    cpus: usize,
) -> Result<(), BatchError> {
    assert_eq!(keys.len() * cpus, values.len(), "one value per key and CPU");
    assert_eq!(
        std::mem::size_of::<V>() % 8,
        0,
        "per-CPU values are 8-byte aligned"
    );
    batch(
        BPF_MAP_UPDATE_BATCH,
        map,
        keys,
        values.as_ptr() as u64,
        keys.len(),
    )
}

/// Deletes `keys` in order, stopping at the first one refused (ENOENT for a missing key).
pub fn delete<K: Pod>(map: BorrowedFd<'_>, keys: &[K]) -> Result<(), BatchError> {
    batch(BPF_MAP_DELETE_BATCH, map, keys, 0, keys.len())
}

/// [`update`] of every entry: an entry the kernel refuses ends a batch and is returned with its
/// index, and the next batch starts after it.
pub fn update_all<K: Pod, V: Pod>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Vec<(usize, io::Error)> {
    in_batches(keys.len(), |from| {
        update(map, &keys[from..], &values[from..])
    })
}

/// [`update_per_cpu`] of every entry, as [`update_all`].
pub fn update_all_per_cpu<K: Pod, V: Pod>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
    cpus: usize,
) -> Vec<(usize, io::Error)> {
    in_batches(keys.len(), |from| {
        update_per_cpu(map, &keys[from..], &values[from * cpus..], cpus)
    })
}

/// [`delete`] of every key, as [`update_all`]; a key that is not there is no failure.
pub fn delete_all<K: Pod>(map: BorrowedFd<'_>, keys: &[K]) -> Vec<(usize, io::Error)> {
    in_batches(keys.len(), |from| delete(map, &keys[from..]))
        .into_iter()
        .filter(|(_, err)| err.raw_os_error() != Some(libc::ENOENT))
        .collect()
}

fn in_batches(
    len: usize,
    mut batch: impl FnMut(usize) -> Result<(), BatchError>,
) -> Vec<(usize, io::Error)> {
    let mut failed = Vec::new();
    let mut from = 0;
    while from < len {
        match batch(from) {
            Ok(()) => break,
            Err(err) => {
                failed.push((from + err.index, err.source));
                from += err.index + 1;
            }
        }
    }
    failed
}

fn batch<K: Pod>(
    cmd: libc::c_long,
    map: BorrowedFd<'_>,
    keys: &[K],
    values: u64,
    count: usize,
) -> Result<(), BatchError> {
    if count == 0 {
        return Ok(());
    }
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values,
        count: u32::try_from(count).expect("batches are smaller than 4G entries"),
        map_fd: map.as_raw_fd() as u32,
        ..Default::default()
    };
    // SAFETY: `attr` is the `batch` member of union bpf_attr, valid for its size; `keys` (and
    // `values`, of the same length) are live arrays of `count` Pod entries for the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            &mut attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>() as libc::c_uint,
        )
    };
    if ret < 0 {
        // The kernel left in `count` how many entries it processed before the one that failed.
        return Err(BatchError {
            index: attr.count as usize,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}
