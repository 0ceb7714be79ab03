// SPDX-License-Identifier: Apache-2.0
// modelled_wait: how a thread that models a device or a DMA engine waits out modelled time. A
// plain sleep wakes late, about 100 us on these VMs, half of it Linux's default timer slack (50 us),
// and that lateness would count as the modelled resource's time: per scope of a millisecond or two
// it is several percent. So the waiting thread asks for a timer slack of 1 ns (about 50 us late
// then). It does not spin the rest: the cores are the host Adam's, which a spinning thread would
// slow (measured: 100% host share 1.40-1.52 with a 60-150 us spin, against 1.14-1.15 without).
#pragma once

#include <chrono>
#include <thread>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

namespace chunkstar::bench {

/** Sleeps until @p deadline, waking as close to it as the kernel allows. */
inline void wait_until(std::chrono::steady_clock::time_point deadline) {
#if defined(__linux__)
  thread_local const bool tight = prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL) == 0;  // per thread, once
  (void)tight;
#endif
  std::this_thread::sleep_until(deadline);
}

/** Sleeps @p seconds (wait_until from now); nothing for 0 or less. */
inline void wait_for(double seconds) {
  if (seconds > 0)
    wait_until(std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds)));
}

}  // namespace chunkstar::bench
