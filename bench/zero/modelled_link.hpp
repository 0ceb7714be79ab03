// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `modelled_link<Comm>`: a Communicator adaptor that gives an in-process (or any) rank group
 *         the timing of a network link: every collective takes at least latency + bytes / bandwidth.
 *
 *  Every call is forwarded to the wrapped communicator (held by reference), which does the real
 *  work and counts the bytes (comm_stats). The bytes of one call are the wrapped communicator's
 *  comm_stats delta across the call: max(sent, received), since a rank's link is full duplex (for
 *  allgather, reduce-scatter and allreduce both are (N-1) x the per-rank bytes, so this is the sent
 *  bytes; for a rooted reduce of b bytes it is (N-1)·b received on the root and b sent elsewhere,
 *  so the root's link carries N-1 times what each other rank's does). The call then sleeps until
 *  its modelled duration has passed since it began (bench/modelled_wait.hpp: a plain sleep wakes about
 *  100 us late, which would count as link time). The link is one resource per rank: a
 *  collective issued while an earlier one still occupies it starts when that one ends
 *  (asynchronous calls queue behind each other, as on one NIC).
 *
 *  Asynchronous calls return at once; their handle's wait() waits for the wrapped operation and
 *  then for the modelled end, so work done between issue and wait overlaps with the link (the
 *  chunk runtime's reduce-scatters are asynchronous, its allgathers synchronous).
 *
 *  Bytes of an asynchronous call are read right after it is issued: correct for communicators that
 *  count at issue (in_process_communicator, communicator_ref over it).
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>

#include "../modelled_wait.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <thread>
#include <utility>

namespace bench_zero {

using chunkstar::comm_handle;
using chunkstar::comm_stats;
using chunkstar::dtype;
using chunkstar::reduce_op;

/** @brief The link's model: duration(bytes) = latency + bytes / bandwidth. */
struct link_model {
  double bandwidth_bytes_per_s = std::numeric_limits<double>::infinity();  ///< infinity: bytes take no time
  double latency_s = 0;                                                    ///< fixed cost per collective
  bool sleep = true;  ///< false: only account the modelled seconds, never wait for them (compute-only runs)
  [[nodiscard]] double seconds(std::uint64_t bytes) const noexcept {
    const double transfer =
        std::isinf(bandwidth_bytes_per_s) ? 0.0 : static_cast<double>(bytes) / bandwidth_bytes_per_s;
    return latency_s + transfer;
  }
};

/** @brief A communicator that keeps stats() (every chunkstar model does; not part of the concept). */
template <class C>
concept CountingCommunicator = chunkstar::Communicator<C> && requires(const C& c) {
  { c.stats() } -> std::convertible_to<comm_stats>;
};

template <CountingCommunicator Comm>
class modelled_link {
 public:
  using clock = std::chrono::steady_clock;

  modelled_link(Comm& inner, link_model link) noexcept : inner_(inner), link_(link) {}
  modelled_link(const modelled_link&) = delete;
  modelled_link& operator=(const modelled_link&) = delete;

  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }

  void allreduce(void* p, std::size_t n, dtype t, reduce_op op) {
    sync([&] { inner_.allreduce(p, n, t, op); });
  }
  void allreduce(std::span<double> d, reduce_op op) {
    sync([&] { inner_.allreduce(d, op); });
  }
  void allgather(const void* s, void* r, std::size_t n) {
    sync([&] { inner_.allgather(s, r, n); });
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    sync([&] { inner_.reduce_scatter(s, r, n, t, op); });
  }
  void reduce(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    sync([&] { inner_.reduce(s, r, n, t, op, root); });
  }
  void broadcast(void* p, std::size_t n, int root) {
    sync([&] { inner_.broadcast(p, n, root); });
  }
  void ring_shift(const void* s, void* r, std::size_t n) {
    sync([&] { inner_.ring_shift(s, r, n); });
  }
  void barrier() {
    sync([&] { inner_.barrier(); });
  }

  comm_handle allreduce_async(void* p, std::size_t n, dtype t, reduce_op op) {
    return async([&] { return inner_.allreduce_async(p, n, t, op); });
  }
  comm_handle allreduce_async(std::span<double> d, reduce_op op) {
    return async([&] { return inner_.allreduce_async(d, op); });
  }
  comm_handle allgather_async(const void* s, void* r, std::size_t n) {
    return async([&] { return inner_.allgather_async(s, r, n); });
  }
  comm_handle reduce_scatter_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    return async([&] { return inner_.reduce_scatter_async(s, r, n, t, op); });
  }
  comm_handle reduce_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    return async([&] { return inner_.reduce_async(s, r, n, t, op, root); });
  }
  comm_handle broadcast_async(void* p, std::size_t n, int root) {
    return async([&] { return inner_.broadcast_async(p, n, root); });
  }
  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) {
    return async([&] { return inner_.ring_shift_async(s, r, n); });
  }

  /** @brief The wrapped communicator's byte counts (this adaptor moves nothing of its own). */
  [[nodiscard]] comm_stats stats() const { return inner_.stats(); }
  /** @brief Sum of the modelled durations of every collective so far (slept or not). */
  [[nodiscard]] double modelled_seconds() const noexcept { return modelled_s_; }
  /** @brief Wall seconds this rank spent inside synchronous calls and their sleeps. */
  [[nodiscard]] double wall_seconds() const noexcept { return wall_s_; }
  [[nodiscard]] const link_model& link() const noexcept { return link_; }
  [[nodiscard]] Comm& inner() noexcept { return inner_; }

 private:
  /** Completion of an asynchronous call: the wrapped operation, then the modelled end. */
  struct pending {
    comm_handle inner;
    clock::time_point end;
    bool sleep;
    void wait() {
      inner.wait();
      if (sleep) chunkstar::bench::wait_until(end);
    }
    bool ready() { return inner.ready() && (!sleep || clock::now() >= end); }
  };

  [[nodiscard]] std::uint64_t moved_since(const comm_stats& before) const {
    const comm_stats now = inner_.stats();
    return std::max(now.bytes_sent - before.bytes_sent, now.bytes_received - before.bytes_received);
  }
  /** The modelled end of a call that began at @p begin and moves @p bytes (after any earlier one). */
  clock::time_point schedule(clock::time_point begin, std::uint64_t bytes) {
    const double s = link_.seconds(bytes);
    modelled_s_ += s;
    const clock::time_point start = std::max(begin, link_free_);
    link_free_ = start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
    return link_free_;
  }

  template <class F>
  void sync(F&& call) {
    const comm_stats before = inner_.stats();
    const auto begin = clock::now();
    call();
    const auto end = schedule(begin, moved_since(before));
    if (link_.sleep) chunkstar::bench::wait_until(end);
    wall_s_ += std::chrono::duration<double>(clock::now() - begin).count();
  }
  template <class F>
  comm_handle async(F&& issue) {
    const comm_stats before = inner_.stats();
    const auto begin = clock::now();
    comm_handle h = issue();
    const auto end = schedule(begin, moved_since(before));
    return comm_handle(std::make_shared<pending>(pending{std::move(h), end, link_.sleep}));
  }

  Comm& inner_;
  link_model link_;
  clock::time_point link_free_{};
  double modelled_s_ = 0, wall_s_ = 0;
};

}  // namespace bench_zero
