//! The device's clocks, as completion timestamps and `ibv_query_rt_values_ex` report them.
//!
//! The "HCA core clock" is the host's `CLOCK_MONOTONIC` counted in nanoseconds: a 1 GHz
//! free-running counter (`hca_core_clock` = 1,000,000 kHz), so a raw completion timestamp
//! converts to nanoseconds by itself and compares directly with `clock_gettime`. The wall
//! clock (`IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK`) is `CLOCK_REALTIME` in nanoseconds
//! since the Unix epoch.

use nix::time::{ClockId, clock_gettime};

/// `hca_core_clock` in kHz: one tick per nanosecond.
pub const HCA_CORE_CLOCK_KHZ: u64 = 1_000_000;
/// Every bit of the raw timestamp is valid (`completion_timestamp_mask`).
pub const COMPLETION_TIMESTAMP_MASK: u64 = u64::MAX;

fn nanos(clock: ClockId) -> u64 {
    match clock_gettime(clock) {
        Ok(t) => (t.tv_sec() as u64)
            .wrapping_mul(1_000_000_000)
            .wrapping_add(t.tv_nsec() as u64),
        // Never fails for these clocks on Linux; a zero stamp rather than a panic.
        Err(_) => 0,
    }
}

/// The raw device clock now (ticks of [`HCA_CORE_CLOCK_KHZ`]).
pub fn raw_clock() -> u64 {
    nanos(ClockId::CLOCK_MONOTONIC)
}

/// The wall clock now, in nanoseconds since the Unix epoch.
pub fn wallclock_ns() -> u64 {
    nanos(ClockId::CLOCK_REALTIME)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks_advance_and_agree_with_std() {
        let a = raw_clock();
        let b = raw_clock();
        assert!(b >= a);
        let wall = wallclock_ns();
        let std_wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        assert!(std_wall.abs_diff(wall) < 1_000_000_000);
    }
}
