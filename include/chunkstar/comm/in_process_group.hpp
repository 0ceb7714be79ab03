// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `in_process_group`: N ranks as threads of one process, each with an
 *         `in_process_communicator`; for tests and for simulating multi-rank runs without MPI.
 */
#pragma once

#include <chunkstar/comm/blocking_collectives.hpp>
#include <chunkstar/comm/collective_call.hpp>
#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace chunkstar {

class in_process_group;

/** @brief One rank of an `in_process_group`. Obtained from `in_process_group::communicator(rank)`;
 *  use it from one thread at a time (that rank's thread).
 *
 *  Every collective, synchronous or not, is queued to this rank's worker thread and runs there in
 *  issue order, so asynchronous calls overlap with the caller's work and every rank meets its
 *  peers in the same sequence however it waits on its handles. A synchronous call is its async
 *  form followed by `wait()`. Collectives are real rendezvous: each rank publishes its buffers,
 *  then reads its peers' directly (no copies through the group), then waits until every peer has
 *  finished reading before the call completes.
 */
class in_process_communicator : public blocking_collectives<in_process_communicator> {
 public:
  in_process_communicator(const in_process_communicator&) = delete;
  in_process_communicator& operator=(const in_process_communicator&) = delete;
  ~in_process_communicator() { stop(); }

  /** @brief This rank, in `[0, size())`. */
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /** @brief Ranks in the group. */
  [[nodiscard]] int size() const noexcept;

  void barrier() { barrier_async().wait(); }

  comm_handle allreduce_async(void* inout, std::size_t count, dtype t, reduce_op op);
  comm_handle allreduce_async(std::span<double> inout, reduce_op op);
  comm_handle allgather_async(const void* send, void* recv, std::size_t bytes);
  comm_handle reduce_scatter_async(const void* send, void* recv, std::size_t count, dtype t, reduce_op op);
  comm_handle reduce_async(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, int root);
  comm_handle broadcast_async(void* buf, std::size_t bytes, int root);
  comm_handle ring_shift_async(const void* send, void* recv, std::size_t bytes);
  /** @brief The barrier as an asynchronous collective (not required by `Communicator`). */
  comm_handle barrier_async();
  /** @brief Bytes this rank moved and collectives it issued (see comm_stats). */
  [[nodiscard]] const comm_stats& stats() const noexcept { return counter_.stats; }

 private:
  friend class in_process_group;
  in_process_communicator(in_process_group& group, int rank) : group_(&group), rank_(rank) {}

  struct job {
    std::function<void()> run;
    std::shared_ptr<detail::completion_state> done;
  };

  comm_handle submit(std::function<void()> work);
  void drain();
  void stop() noexcept;
  void worker_loop();
  void run_allreduce(std::uint64_t index, const detail::collective_call& call, void* inout, std::size_t count,
                     std::size_t elem_bytes);

  in_process_group* group_;
  int rank_;
  detail::comm_counter counter_;  // only touched by the rank's own thread
  std::uint64_t next_index_ = 0;  // only touched by the rank's own thread
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<job> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread worker_;
};

/** @brief N ranks as threads of one process.
 *
 *  @code
 *  chunkstar::run_ranks(4, [](chunkstar::in_process_communicator& comm) {
 *    float x = float(comm.rank());
 *    comm.allreduce(&x, 1, chunkstar::dtype::f32, chunkstar::reduce_op::sum);  // x == 6 on every rank
 *  });
 *  @endcode
 *
 *  Failure handling, so that a broken rank never leaves its peers hanging:
 *  - `fail(rank, why)` (called by `run` when a rank function throws) poisons the group: every
 *    collective blocked or issued afterwards throws `communication_error("rank R failed: why")`.
 *  - `leave(rank)` (called by `run` when a rank function returns) marks the rank as done; a peer
 *    waiting in, or entering, a collective the departed rank will never join gets a
 *    `communication_error` naming both ranks and the call.
 *  - The collective sequence is checked on every call: rank k's i-th call must match rank 0's
 *    i-th call in kind, size, dtype, op and root; otherwise every rank gets a
 *    `communication_error` naming the call index and both descriptions. Any such error poisons the
 *    group for good (the ranks' sequences no longer line up).
 */
class in_process_group {
 public:
  /** @brief A group of `size` ranks (>= 1). Worker threads start on first use. */
  explicit in_process_group(int size) : size_(size) {
    if (size < 1)
      throw config_error("in_process_group: size " + std::to_string(size) + " is not a valid rank count; pass >= 1");
    slots_.resize(static_cast<std::size_t>(size));
    entered_.assign(static_cast<std::size_t>(size), 0);
    left_.assign(static_cast<std::size_t>(size), false);
    comms_.reserve(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) comms_.emplace_back(new in_process_communicator(*this, r));
  }

  in_process_group(const in_process_group&) = delete;
  in_process_group& operator=(const in_process_group&) = delete;

  /** @brief Poisons the group (waking any rank still blocked), then stops the workers. */
  ~in_process_group() {
    {
      std::lock_guard lock(mutex_);
      if (!poisoned_) {
        poisoned_ = true;
        reason_ =
            "in_process_group destroyed while a collective was still pending; keep the group alive until every "
            "rank has waited for its collectives";
      }
    }
    cv_.notify_all();
    comms_.clear();
  }

  /** @brief Ranks in the group. */
  [[nodiscard]] int size() const noexcept { return size_; }

  /** @brief Rank `rank`'s communicator (owned by the group; one thread per rank uses it). */
  [[nodiscard]] in_process_communicator& communicator(int rank) {
    if (rank < 0 || rank >= size_)
      throw config_error("in_process_group::communicator: rank " + std::to_string(rank) + " is not in [0, " +
                         std::to_string(size_) + ")");
    return *comms_[static_cast<std::size_t>(rank)];
  }

  /** @brief Runs `f(communicator(r))` on one new thread per rank and joins them. A rank function
   *  that throws poisons the group (see `fail`); one that returns leaves it (see `leave`). Rethrows
   *  the first exception thrown by any rank (the root cause, not a peer's resulting error).
   *  A group runs once; make a new group for another run. */
  template <class F>
  void run(F&& f) {
    {
      std::lock_guard lock(mutex_);
      if (started_) throw state_error("in_process_group::run: this group already ran; create a new group per run");
      started_ = true;
    }
    std::mutex first_mutex;
    std::exception_ptr first;
    auto body = [&](int r) {
      try {
        f(communicator(r));
        leave(r);
      } catch (...) {
        {
          std::lock_guard lock(first_mutex);
          if (!first) first = std::current_exception();
        }
        fail(r, describe(std::current_exception()));
      }
    };
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_));
    try {
      for (int r = 0; r < size_; ++r) threads.emplace_back(body, r);
    } catch (const std::exception& e) {
      fail(static_cast<int>(threads.size()), std::string("could not start its thread: ") + e.what());
      for (auto& t : threads) t.join();
      throw;
    }
    for (auto& t : threads) t.join();
    if (first) std::rethrow_exception(first);
  }

  /** @brief Poisons the group: rank `rank` failed for reason `why`. Idempotent (the first reason
   *  is kept). Use it when driving ranks from your own threads. */
  void fail(int rank, std::string_view why) {
    {
      std::lock_guard lock(mutex_);
      if (poisoned_) return;
      poisoned_ = true;
      reason_ = "rank " + std::to_string(rank) + " failed: " + std::string(why);
    }
    cv_.notify_all();
  }

  /** @brief Rank `rank` will issue no more collectives: waits for its queued ones to finish, then
   *  marks it departed. Use it when driving ranks from your own threads. */
  void leave(int rank) {
    communicator(rank).drain();
    {
      std::lock_guard lock(mutex_);
      left_[static_cast<std::size_t>(rank)] = true;
      any_left_ = true;
    }
    cv_.notify_all();
  }

  /** @brief True once a rank failed, a mismatch was found, or a rank left while peers waited. */
  [[nodiscard]] bool poisoned() const {
    std::lock_guard lock(mutex_);
    return poisoned_;
  }

 private:
  friend class in_process_communicator;

  /** @brief What a rank publishes for its peers in the first phase of a call. */
  struct slot {
    detail::collective_call call;
    std::uint64_t index = 0;
    const void* in = nullptr;
    void* scratch = nullptr;
  };

  static std::string describe(const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      return x.what();
    } catch (...) {
      return "a non-standard exception";
    }
  }

  [[noreturn]] void poison_and_throw(std::unique_lock<std::mutex>& lock, std::string message) {
    if (!poisoned_) {
      poisoned_ = true;
      reason_ = std::move(message);
    }
    std::string reason = reason_;
    lock.unlock();
    cv_.notify_all();
    throw communication_error(reason);
  }

  std::string departure_message(int waiting_rank) const {
    for (int q = 0; q < size_; ++q) {
      if (!left_[static_cast<std::size_t>(q)]) continue;
      const auto& mine = slots_[static_cast<std::size_t>(waiting_rank)];
      return "rank " + std::to_string(q) + " left the collective sequence after " +
             std::to_string(entered_[static_cast<std::size_t>(q)]) + " calls, but rank " +
             std::to_string(waiting_rank) + " is in call #" + std::to_string(mine.index) + ": " +
             mine.call.to_string() +
             "; every rank must make the same collective calls (did a rank function return early?)";
    }
    return "a rank left the collective sequence";
  }

  /** @brief The rendezvous. With `publish`, it is a call's first phase: the rank's slot is set
   *  and, once all have arrived, the calls are compared. Throws `communication_error` when the
   *  group is (or becomes) poisoned, a rank has left, or the calls differ. */
  void sync(int rank, const slot* publish) {
    std::unique_lock lock(mutex_);
    if (publish) {
      slots_[static_cast<std::size_t>(rank)] = *publish;
      entered_[static_cast<std::size_t>(rank)] = publish->index + 1;
    }
    if (poisoned_) throw communication_error(reason_);
    if (any_left_) poison_and_throw(lock, departure_message(rank));
    const std::uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      if (publish) {
        const slot& first = slots_[0];
        for (int q = 1; q < size_; ++q) {
          const slot& other = slots_[static_cast<std::size_t>(q)];
          if (other.call != first.call)
            poison_and_throw(lock, "collective mismatch at call #" + std::to_string(first.index) + ": rank 0 called " +
                                       first.call.to_string() + " but rank " + std::to_string(q) + " called " +
                                       other.call.to_string() +
                                       "; every rank must issue the same collectives, with the same sizes, types, "
                                       "ops and roots, in the same order");
        }
      }
      ++generation_;
      lock.unlock();
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation || poisoned_ || any_left_; });
    if (generation_ != generation) return;  // completed before any failure: success wins
    if (poisoned_) throw communication_error(reason_);
    poison_and_throw(lock, departure_message(rank));
  }

  [[nodiscard]] const slot& peer(int rank) const noexcept { return slots_[static_cast<std::size_t>(rank)]; }

  int size_;
  std::vector<std::unique_ptr<in_process_communicator>> comms_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  std::vector<slot> slots_;             // written under mutex_ before a phase, read by peers after it
  std::vector<std::uint64_t> entered_;  // calls each rank has entered, for messages
  std::vector<bool> left_;
  bool any_left_ = false;
  bool poisoned_ = false;
  bool started_ = false;
  std::string reason_;
};

/** @brief Runs `f(comm)` on `n` threads, one per rank of a fresh `in_process_group`, joins them
 *  and rethrows the first exception any rank threw. */
template <class F>
void run_ranks(int n, F&& f) {
  in_process_group group(n);
  group.run(std::forward<F>(f));
}

// ---------------------------------------------------------------------------------------------

inline int in_process_communicator::size() const noexcept { return group_->size(); }

inline comm_handle in_process_communicator::submit(std::function<void()> work) {
  auto done = std::make_shared<detail::completion_state>();
  {
    std::lock_guard lock(mutex_);
    if (stop_) throw state_error("in_process_communicator: its group is being destroyed; no collectives may start");
    if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
    queue_.push_back(job{std::move(work), done});
  }
  cv_.notify_all();
  return comm_handle(std::move(done));
}

inline void in_process_communicator::worker_loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    job j = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr failure;
    try {
      j.run();
    } catch (...) {
      failure = std::current_exception();
    }
    j.done->complete(failure);
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

inline void in_process_communicator::drain() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

inline void in_process_communicator::stop() noexcept {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

inline void in_process_communicator::run_allreduce(std::uint64_t index, const detail::collective_call& call,
                                                   void* inout, std::size_t count, std::size_t elem_bytes) {
  // Each rank reduces one slice into its scratch, then every rank copies all slices: N times less
  // arithmetic than every rank reducing everything, and inout is only written once all have read.
  in_process_group& g = *group_;
  const auto n = static_cast<std::size_t>(g.size());
  const std::size_t slice = (count + n - 1) / n;
  auto range = [&](std::size_t k) {
    const std::size_t lo = std::min(count, k * slice);
    return std::pair{lo, std::min(count, lo + slice)};
  };
  const auto [lo, hi] = range(static_cast<std::size_t>(rank_));
  std::vector<std::byte> scratch((hi - lo) * elem_bytes);
  const in_process_group::slot mine{call, index, inout, scratch.data()};
  g.sync(rank_, &mine);
  if (n == 1) return;  // one rank: the input is the result
  std::vector<const void*> srcs(n);
  for (std::size_t k = 0; k < n; ++k)
    srcs[k] = static_cast<const std::byte*>(g.peer(static_cast<int>(k)).in) + lo * elem_bytes;
  if (call.kind == detail::collective_kind::allreduce_f64)
    detail::fold_ranks_f64(reinterpret_cast<double*>(scratch.data()), srcs.data(), static_cast<int>(n), hi - lo,
                           call.op);
  else detail::fold_ranks(scratch.data(), srcs.data(), static_cast<int>(n), hi - lo, call.type, call.op);
  g.sync(rank_, nullptr);
  for (std::size_t k = 0; k < n; ++k) {
    const auto [klo, khi] = range(k);
    if (khi > klo)
      std::memcpy(static_cast<std::byte*>(inout) + klo * elem_bytes, g.peer(static_cast<int>(k)).scratch,
                  (khi - klo) * elem_bytes);
  }
  g.sync(rank_, nullptr);
}

inline comm_handle in_process_communicator::allreduce_async(void* inout, std::size_t count, dtype t, reduce_op op) {
  detail::check_buffer(inout, count * dtype_size(t), "allreduce", "inout");
  const detail::collective_call call{detail::collective_kind::allreduce, count, t, op, 0};
  const std::uint64_t index = next_index_++;
  counter_.gather_like(count * dtype_size(t), size());
  return submit([=, this] { run_allreduce(index, call, inout, count, dtype_size(t)); });
}

inline comm_handle in_process_communicator::allreduce_async(std::span<double> inout, reduce_op op) {
  const detail::collective_call call{detail::collective_kind::allreduce_f64, inout.size(), dtype::f32, op, 0};
  const std::uint64_t index = next_index_++;
  counter_.gather_like(inout.size_bytes(), size());
  return submit([=, this] { run_allreduce(index, call, inout.data(), inout.size(), sizeof(double)); });
}

inline comm_handle in_process_communicator::allgather_async(const void* send, void* recv, std::size_t bytes) {
  detail::check_allgather(send, recv, bytes, rank_, size());
  const detail::collective_call call{detail::collective_kind::allgather, bytes, dtype::f32, reduce_op::sum, 0};
  const std::uint64_t index = next_index_++;
  counter_.gather_like(bytes, size());
  return submit([=, this] {
    in_process_group& g = *group_;
    const in_process_group::slot mine{call, index, send, nullptr};
    g.sync(rank_, &mine);
    for (int k = 0; k < g.size(); ++k) {
      auto* dst = static_cast<std::byte*>(recv) + static_cast<std::size_t>(k) * bytes;
      const void* src = g.peer(k).in;
      if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
    }
    g.sync(rank_, nullptr);
  });
}

inline comm_handle in_process_communicator::reduce_scatter_async(const void* send, void* recv, std::size_t count,
                                                                 dtype t, reduce_op op) {
  detail::check_reduce_scatter(send, recv, count, t, rank_, size());
  const detail::collective_call call{detail::collective_kind::reduce_scatter, count, t, op, 0};
  const std::uint64_t index = next_index_++;
  counter_.gather_like(count * dtype_size(t), size());
  return submit([=, this] {
    in_process_group& g = *group_;
    const in_process_group::slot mine{call, index, send, nullptr};
    g.sync(rank_, &mine);
    const auto n = static_cast<std::size_t>(g.size());
    const std::size_t offset = static_cast<std::size_t>(rank_) * count * dtype_size(t);
    std::vector<const void*> srcs(n);
    for (std::size_t k = 0; k < n; ++k)
      srcs[k] = static_cast<const std::byte*>(g.peer(static_cast<int>(k)).in) + offset;
    // Element-wise, so the in-place case (recv is this rank's block of send) is safe: no peer
    // reads that block.
    detail::fold_ranks(recv, srcs.data(), static_cast<int>(n), count, t, op);
    g.sync(rank_, nullptr);
  });
}

inline comm_handle in_process_communicator::reduce_async(const void* send, void* recv, std::size_t count, dtype t,
                                                         reduce_op op, int root) {
  detail::check_reduce(send, recv, count, t, root, rank_, size());
  const detail::collective_call call{detail::collective_kind::reduce, count, t, op, root};
  const std::uint64_t index = next_index_++;
  counter_.reduce(count * dtype_size(t), root, rank_, size());
  return submit([=, this] {
    in_process_group& g = *group_;
    const in_process_group::slot mine{call, index, send, nullptr};
    g.sync(rank_, &mine);
    if (rank_ == root) {
      // Only the root reads (its peers' inputs and its own) and only the root writes; element-wise,
      // so the in-place case (recv == send) is safe.
      const auto n = static_cast<std::size_t>(g.size());
      std::vector<const void*> srcs(n);
      for (std::size_t k = 0; k < n; ++k) srcs[k] = g.peer(static_cast<int>(k)).in;
      detail::fold_ranks(recv, srcs.data(), static_cast<int>(n), count, t, op);
    }
    g.sync(rank_, nullptr);  // the peers' inputs stay untouched until the root has read them
  });
}

inline comm_handle in_process_communicator::broadcast_async(void* buf, std::size_t bytes, int root) {
  detail::check_buffer(buf, bytes, "broadcast", "buf");
  detail::check_root(root, size(), "broadcast");
  const detail::collective_call call{detail::collective_kind::broadcast, bytes, dtype::f32, reduce_op::sum, root};
  const std::uint64_t index = next_index_++;
  counter_.broadcast(bytes, root, rank_, size());
  return submit([=, this] {
    in_process_group& g = *group_;
    const in_process_group::slot mine{call, index, buf, nullptr};
    g.sync(rank_, &mine);
    if (rank_ != root && bytes != 0) std::memcpy(buf, g.peer(root).in, bytes);
    g.sync(rank_, nullptr);
  });
}

inline comm_handle in_process_communicator::ring_shift_async(const void* send, void* recv, std::size_t bytes) {
  detail::check_ring_shift(send, recv, bytes);
  const detail::collective_call call{detail::collective_kind::ring_shift, bytes, dtype::f32, reduce_op::sum, 0};
  const std::uint64_t index = next_index_++;
  counter_.ring_shift(bytes, size());
  return submit([=, this] {
    in_process_group& g = *group_;
    const in_process_group::slot mine{call, index, send, nullptr};
    g.sync(rank_, &mine);
    const int prev = (rank_ - 1 + g.size()) % g.size();
    if (bytes != 0) std::memcpy(recv, g.peer(prev).in, bytes);
    g.sync(rank_, nullptr);
  });
}

inline comm_handle in_process_communicator::barrier_async() {
  const detail::collective_call call{detail::collective_kind::barrier, 0, dtype::f32, reduce_op::sum, 0};
  const std::uint64_t index = next_index_++;
  return submit([=, this] {
    const in_process_group::slot mine{call, index, nullptr, nullptr};
    group_->sync(rank_, &mine);
  });
}

static_assert(Communicator<in_process_communicator>);

}  // namespace chunkstar
