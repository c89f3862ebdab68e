// What the CPU kernels (avx2_linear.cpp, decode_attention.cpp) share: how a kernel spreads its work over
// torch's threads. Built into each (models/avx2_linear.py's ``build`` rebuilds them when this changes).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {
// Spreads [0, n) over torch's threads in runs of ``grab``, each run handed to whichever thread asks next:
// each thread calls ``body(take)`` once (its buffers set up there) and loops ``while (take(begin, end))``.
// A thread the OS preempts mid-region (the replica, the HTTP ingress and the draft share these cores) then
// holds up only the run it is on, where a fixed share per thread held the region until it came back; the
// region still ends when every thread of the team has arrived, one that was never scheduled included.
// Which thread computes a run never changes what the run computes.
template <class Body>
void share(int64_t n, int64_t grab, const Body& body) {
  std::atomic<int64_t> next{0};
  auto take = [&](int64_t& begin, int64_t& end) {
    begin = next.fetch_add(grab, std::memory_order_relaxed);
    end = std::min(n, begin + grab);
    return begin < n;
  };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), (n + grab - 1) / grab), 1,
                   [&](int64_t, int64_t) { body(take); });
}
}  // namespace
