// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `staged_communicator`: a `Communicator` on device memory built from one that takes host
 *         memory only (MPI without CUDA support, in-process rank groups), by staging every `void*`
 *         buffer through host memory; and the `Stager` concept that moves the bytes.
 *
 *  Why: NCCL puts one rank of a communicator per GPU, and an MPI built without CUDA support
 *  cannot read device pointers. With a staged communicator over MPI, ZeRO runs on machines with
 *  more ranks than GPUs (two ranks sharing one GPU) or without NCCL, at the cost of two host copies
 *  per collective. The fast path stays NCCL (nccl_communicator.hpp).
 *
 *  Each collective copies its device input into a pinned host buffer (`Stager::to_host`), starts
 *  the inner collective on it in place, and returns a handle whose `wait()` waits for the inner one
 *  and copies the result back (`Stager::to_device`); so the inner communicator's overlap (MPI's
 *  progress while the runtime computes) is kept. Argument errors are judged on the caller's
 *  buffers, as the concept states them, before anything is copied. Host buffers come from a small
 *  pool, reused across calls. Reductions are the inner communicator's, so they keep its bits (the
 *  rank-order fold for MPI and in-process groups). Buffers must be ready when a collective is
 *  called: the runtime waits for their copies and for the user's work first (zero/shard_manager.hpp), as it
 *  does for NCCL. Handles must not outlive the communicator.
 */
#pragma once

#include <chunkstar/comm/blocking_collectives.hpp>
#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief Moves bytes between device memory and the host buffers it allocates.
 *  `allocate_host(n)` → n bytes of host memory (pinned on CUDA) or throws; `free_host(p, n)` never
 *  throws; `to_host(host, device, n)` and `to_device(device, host, n)` copy and have finished when
 *  they return. */
template <class S>
concept Stager = requires(S& s, void* p, const void* cp, std::size_t n) {
  { s.allocate_host(n) } -> std::same_as<void*>;
  { s.free_host(p, n) }
  noexcept;
  s.to_host(p, cp, n);
  s.to_device(p, cp, n);
};

/** @brief A `Stager` for devices the host can read (the simulated device) and for tests: memcpy
 *  into 4 KiB-aligned host memory. */
struct memcpy_stager {
  static constexpr std::align_val_t alignment{4096};
  void* allocate_host(std::size_t n) { return ::operator new(std::max<std::size_t>(n, 1), alignment); }
  void free_host(void* p, std::size_t) noexcept { ::operator delete(p, alignment); }
  void to_host(void* host, const void* device, std::size_t n) {
    if (n != 0) std::memcpy(host, device, n);
  }
  void to_device(void* device, const void* host, std::size_t n) {
    if (n != 0) std::memcpy(device, host, n);
  }
};

static_assert(Stager<memcpy_stager>);

/** @brief `Inner`'s collectives on device memory, staged through host buffers (see the file
 *  comment). Holds @p inner by reference; non-copyable (it owns the staging pool). */
template <Communicator Inner, Stager S = memcpy_stager>
class staged_communicator : public blocking_collectives<staged_communicator<Inner, S>> {
 public:
  static constexpr bool takes_device_memory = true;  ///< its void* collectives take device memory

  explicit staged_communicator(Inner& inner, S stager = S{}) : inner_(inner), stager_(std::move(stager)) {}
  staged_communicator(const staged_communicator&) = delete;
  staged_communicator& operator=(const staged_communicator&) = delete;
  ~staged_communicator() {
    for (auto& b : pool_->free) stager_.free_host(b.p, b.bytes);
  }

  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  [[nodiscard]] Inner& inner() noexcept { return inner_; }
  [[nodiscard]] S& stager() noexcept { return stager_; }
  /** @brief The inner communicator's byte counts (the volumes of its algorithm; staging copies are
   *  not network bytes). */
  [[nodiscard]] comm_stats stats() const {
    if constexpr (requires(const Inner& c) { c.stats(); }) return inner_.stats();
    else return {};
  }
  /** @brief Bytes copied device → host and host → device so far. */
  [[nodiscard]] std::pair<std::uint64_t, std::uint64_t> staged_bytes() const noexcept {
    return {to_host_bytes_, to_device_bytes_};
  }

  void barrier() { inner_.barrier(); }

  comm_handle allreduce_async(void* p, std::size_t n, dtype t, reduce_op op) {
    const std::size_t b = n * dtype_size(t);
    require("allreduce", "in/out", p, b);
    staging h = stage(b);
    copy_in(h.data(), p, b);
    comm_handle done = inner_.allreduce_async(h.data(), n, t, op);
    return finish(std::move(done), std::move(h), p, 0, b);
  }
  comm_handle allreduce_async(std::span<double> d, reduce_op op) { return inner_.allreduce_async(d, op); }

  comm_handle allgather_async(const void* s, void* r, std::size_t n) {
    const std::size_t all = n * ranks(), mine = n * static_cast<std::size_t>(rank());
    require("allgather", "send", s, n);
    require("allgather", "receive", r, all);
    if (detail::overlaps(s, n, r, all) && s != static_cast<const std::byte*>(r) + mine)
      throw config_error(
          "staged_communicator::allgather: the send buffer overlaps the receive buffer but is not its block " +
          std::to_string(rank()) + " (in place means send == recv + rank * n)");
    staging h = stage(all);
    copy_in(h.data() + mine, s, n);
    comm_handle done = inner_.allgather_async(h.data() + mine, h.data(), n);
    return finish(std::move(done), std::move(h), r, 0, all);
  }

  comm_handle reduce_scatter_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    const std::size_t b = n * dtype_size(t), all = b * ranks(), mine = b * static_cast<std::size_t>(rank());
    require("reduce_scatter", "send", s, all);
    require("reduce_scatter", "receive", r, b);
    if (detail::overlaps(s, all, r, b) && r != static_cast<const std::byte*>(s) + mine)
      throw config_error(
          "staged_communicator::reduce_scatter: the receive buffer overlaps the send buffer but is not its block " +
          std::to_string(rank()) + " (in place means recv == send + rank * n)");
    staging h = stage(all);
    copy_in(h.data(), s, all);
    comm_handle done = inner_.reduce_scatter_async(h.data(), h.data() + mine, n, t, op);
    return finish(std::move(done), std::move(h), r, mine, b);
  }

  comm_handle reduce_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    const std::size_t b = n * dtype_size(t);
    const bool at_root = rank() == root;
    require_root("reduce", root);
    require("reduce", "send", s, b);
    if (at_root) require("reduce", "receive", r, b);
    if (at_root && s != r && detail::overlaps(s, b, r, b))
      throw config_error(
          "staged_communicator::reduce: at the root the send and receive buffers overlap without being the same "
          "(in place means send == recv)");
    staging h = stage(b);
    copy_in(h.data(), s, b);
    comm_handle done = inner_.reduce_async(h.data(), h.data(), n, t, op, root);
    return finish(std::move(done), std::move(h), at_root ? r : nullptr, 0, b);
  }

  comm_handle broadcast_async(void* p, std::size_t n, int root) {
    require_root("broadcast", root);
    require("broadcast", "", p, n);
    staging h = stage(n);
    if (rank() == root) copy_in(h.data(), p, n);
    comm_handle done = inner_.broadcast_async(h.data(), n, root);
    return finish(std::move(done), std::move(h), rank() == root ? nullptr : p, 0, n);
  }

  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) {
    require("ring_shift", "send", s, n);
    require("ring_shift", "receive", r, n);
    if (detail::overlaps(s, n, r, n))
      throw config_error("staged_communicator::ring_shift: the send and receive buffers overlap");
    staging h = stage(2 * n);
    copy_in(h.data(), s, n);
    comm_handle done = inner_.ring_shift_async(h.data(), h.data() + n, n);
    return finish(std::move(done), std::move(h), r, n, n);
  }

 private:
  struct block {
    void* p = nullptr;
    std::size_t bytes = 0;
  };
  /** Free host buffers, shared with the handles in flight (they return theirs when done). */
  struct pool_state {
    std::mutex mutex;
    std::vector<block> free;
  };
  static constexpr std::size_t pool_blocks = 8;  // the most free buffers kept for reuse

  /** One host buffer, back to the pool when destroyed. */
  class staging {
   public:
    staging(staged_communicator* owner, block b) noexcept : owner_(owner), b_(b) {}
    staging(staging&& o) noexcept : owner_(std::exchange(o.owner_, nullptr)), b_(o.b_) {}
    staging& operator=(staging&&) = delete;
    ~staging() {
      if (owner_) owner_->give_back(b_);
    }
    [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(b_.p); }

   private:
    staged_communicator* owner_;
    block b_;
  };

  /** The inner collective's completion, then the copy of the result back to the device. */
  struct completion {
    comm_handle inner;
    staging host;
    staged_communicator* owner;
    void* device;  // null: nothing to copy back
    std::size_t offset, bytes;
    bool copied = false;
    void wait() {
      inner.wait();
      if (device != nullptr && !copied) {
        copied = true;
        owner->copy_out(device, host.data() + offset, bytes);
      }
    }
    [[nodiscard]] bool ready() const { return inner.ready(); }
  };

  [[nodiscard]] std::size_t ranks() const { return static_cast<std::size_t>(size()); }
  static void require(const char* call, const char* which, const void* p, std::size_t bytes) {
    if (p == nullptr && bytes != 0)
      throw config_error(std::string("staged_communicator::") + call + ": the " + which + (*which ? " " : "") +
                         "buffer of " + std::to_string(bytes) + " bytes is null");
  }
  void require_root(const char* call, int root) const {
    if (root < 0 || root >= size())
      throw config_error(std::string("staged_communicator::") + call + ": root " + std::to_string(root) +
                         " is not a rank in [0, " + std::to_string(size()) + ")");
  }

  staging stage(std::size_t bytes) {
    {
      std::lock_guard lock(pool_->mutex);
      auto& f = pool_->free;
      auto best = f.end();
      for (auto it = f.begin(); it != f.end(); ++it)
        if (it->bytes >= bytes && (best == f.end() || it->bytes < best->bytes)) best = it;
      if (best != f.end()) {
        const block b = *best;
        f.erase(best);
        return staging(this, b);
      }
    }
    const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 4095) / 4096 * 4096;
    return staging(this, block{stager_.allocate_host(rounded), rounded});
  }
  void give_back(block b) noexcept {
    std::unique_lock lock(pool_->mutex);
    auto& f = pool_->free;
    if (f.size() < pool_blocks) {
      try {
        f.push_back(b);
        return;
      } catch (...) {  // no room to remember it: free it below
      }
    }
    lock.unlock();
    stager_.free_host(b.p, b.bytes);
  }
  void copy_in(std::byte* host, const void* device, std::size_t n) {
    stager_.to_host(host, device, n);
    to_host_bytes_ += n;
  }
  void copy_out(void* device, const std::byte* host, std::size_t n) {
    stager_.to_device(device, host, n);
    to_device_bytes_ += n;
  }
  comm_handle finish(comm_handle done, staging host, void* device, std::size_t offset, std::size_t bytes) {
    return comm_handle(
        std::make_shared<completion>(completion{std::move(done), std::move(host), this, device, offset, bytes}));
  }

  Inner& inner_;
  S stager_;
  std::unique_ptr<pool_state> pool_ = std::make_unique<pool_state>();
  std::uint64_t to_host_bytes_ = 0, to_device_bytes_ = 0;
};

}  // namespace chunkstar
