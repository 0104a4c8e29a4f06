//! All-zero values without memset calls: LLVM turns a zeroed struct (or a run of zero stores)
//! into a call to the BPF target's byte-loop memset, a cost on every packet that makes one.

use core::mem::{self, MaybeUninit};

/// Zeroes `slot` word by word, volatile (so that LLVM cannot merge the stores back into a
/// memset), and returns it initialized.
///
/// # Safety
/// All-zero must be a valid `T` (plain old data).
pub unsafe fn zeroed<T>(slot: &mut MaybeUninit<T>) -> &mut T {
    const { assert!(mem::align_of::<T>() >= 8 && mem::size_of::<T>().is_multiple_of(8)) };
    let words = slot.as_mut_ptr().cast::<u64>();
    for i in 0..mem::size_of::<T>() / 8 {
        // SAFETY: within `slot`, whose size is a multiple of 8 and alignment at least 8.
        unsafe { words.add(i).write_volatile(0) };
    }
    // SAFETY: all-zero is a valid T (the caller's promise), and every byte is now written.
    unsafe { slot.assume_init_mut() }
}
