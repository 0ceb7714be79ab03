// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The `Communicator` concept, `reduce_op`, and `comm_handle`, the type-erased completion
 *         of an asynchronous collective.
 *
 *  Models: `single_process_communicator` (single_process.hpp), `in_process_communicator`
 *  (in_process_group.hpp: ranks as threads), `mpi_communicator` (chunkstar/mpi/, target
 *  chunkstar::mpi) and `nccl::nccl_communicator` (chunkstar/nccl/, Tier 1).
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace chunkstar {

/** @brief The element-wise operation of a reduction. */
enum class reduce_op : std::uint8_t { sum, max, min };

/** @brief Lower-case name ("sum", "max", "min"), for messages. */
constexpr std::string_view reduce_op_name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::max: return "max";
    case reduce_op::min: return "min";
  }
  return "?";
}

/** @brief Completion of an asynchronous collective, whatever the communicator.
 *
 *  A default-constructed handle is already complete. `wait()` blocks until the operation is done
 *  and rethrows its failure as `communication_error` (once: the handle is complete afterwards).
 *  `ready()` never blocks; it may make progress (an MPI test, a CUDA event query). Destroying or
 *  assigning over a handle that was not waited for first waits for it, because the operation may
 *  still be writing into the caller's buffers; a failure found that way is dropped, so call
 *  `wait()` to see it. Move-only.
 *
 *  A model builds one from `std::shared_ptr<State>` where `State` has `void wait()` (blocks,
 *  throws on failure) and `bool ready()` (non-blocking). Erasure happens here, at the edge, so the
 *  collectives themselves stay concrete.
 */
class comm_handle {
 public:
  /** @brief A completed handle. */
  comm_handle() noexcept = default;

  /** @brief Takes shared ownership of a model's completion state. */
  template <class State>
  requires requires(State& s) {
    s.wait();
    { s.ready() } -> std::convertible_to<bool>;
  }
  explicit comm_handle(std::shared_ptr<State> state) noexcept
      : state_(std::move(state)),
        wait_([](void* s) { static_cast<State*>(s)->wait(); }),
        ready_([](void* s) -> bool { return static_cast<State*>(s)->ready(); }) {}

  comm_handle(comm_handle&& other) noexcept
      : state_(std::move(other.state_)), wait_(other.wait_), ready_(other.ready_) {}

  comm_handle& operator=(comm_handle&& other) noexcept {
    if (this != &other) {
      wait_quietly();
      state_ = std::move(other.state_);
      wait_ = other.wait_;
      ready_ = other.ready_;
    }
    return *this;
  }

  comm_handle(const comm_handle&) = delete;
  comm_handle& operator=(const comm_handle&) = delete;

  ~comm_handle() { wait_quietly(); }

  /** @brief Blocks until complete; rethrows a failure as `communication_error`. */
  void wait() {
    if (!state_) return;
    auto state = std::move(state_);  // complete afterwards, whether it failed or not
    try {
      wait_(state.get());
    } catch (const communication_error&) {
      throw;
    } catch (const std::exception& e) {
      throw communication_error(std::string("asynchronous collective failed: ") + e.what());
    } catch (...) {
      throw communication_error("asynchronous collective failed with a non-standard exception");
    }
  }

  /** @brief True when the operation has completed (successfully or not); never blocks. */
  [[nodiscard]] bool ready() const {
    if (!state_) return true;
    try {
      return ready_(state_.get());
    } catch (...) {
      return true;  // failed: complete, and wait() will report it
    }
  }

 private:
  void wait_quietly() noexcept {
    if (!state_) return;
    try {
      wait_(state_.get());
    } catch (...) {  // NOLINT(bugprone-empty-catch): documented; wait() is how failures are seen
    }
    state_.reset();
  }

  std::shared_ptr<void> state_;
  void (*wait_)(void*) = nullptr;
  bool (*ready_)(void*) = nullptr;
};

/** @brief What a communicator moved for this rank: bytes sent and received, and collectives issued
 *  (`stats()` on every model; not part of the concept). Volumes are those of the model's algorithm:
 *  chunkstar's deterministic reductions gather every rank's contribution and fold them in rank
 *  order, so for N ranks an allgather or reduce-scatter of b bytes per rank moves (N-1)·b each way,
 *  an allreduce of b bytes (N-1)·b each way (NCCL's ring allreduce: 2(N-1)/N·b), a reduce of b
 *  bytes (N-1)·b into the root and b out of every other rank (NCCL's ncclReduce is counted the
 *  same), a broadcast (N-1)·b out of the root and b into every other rank, a ring shift b each way.
 *  One rank moves nothing. */
struct comm_stats {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t collectives = 0;
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_sent + bytes_received; }
};

namespace detail {
/** @brief Counts collectives into a comm_stats by the volumes comm_stats documents. */
struct comm_counter {
  comm_stats stats;
  void gather_like(std::size_t bytes_per_rank,
                   int size) noexcept {  // allgather, reduce-scatter, gather-based allreduce
    const auto v = static_cast<std::uint64_t>(bytes_per_rank) * static_cast<std::uint64_t>(size - 1);
    stats.bytes_sent += v;
    stats.bytes_received += v;
    ++stats.collectives;
  }
  void reduce(std::size_t bytes, int root, int rank, int size) noexcept {  // every rank's input gathered to the root
    if (size > 1)
      (rank == root ? stats.bytes_received += static_cast<std::uint64_t>(bytes) * static_cast<std::uint64_t>(size - 1)
                    : stats.bytes_sent += bytes);
    ++stats.collectives;
  }
  void broadcast(std::size_t bytes, int root, int rank, int size) noexcept {
    if (size > 1)
      (rank == root ? stats.bytes_sent += static_cast<std::uint64_t>(bytes) * static_cast<std::uint64_t>(size - 1)
                    : stats.bytes_received += bytes);
    ++stats.collectives;
  }
  void ring_allreduce(std::size_t bytes, int size) noexcept {  // NCCL's: reduce-scatter then allgather on a ring
    const auto v =
        2 * static_cast<std::uint64_t>(bytes) * static_cast<std::uint64_t>(size - 1) / static_cast<std::uint64_t>(size);
    stats.bytes_sent += v;
    stats.bytes_received += v;
    ++stats.collectives;
  }
  void ring_shift(std::size_t bytes, int size) noexcept {
    if (size > 1) {
      stats.bytes_sent += bytes;
      stats.bytes_received += bytes;
    }
    ++stats.collectives;
  }
};
}  // namespace detail

/** @brief The `Communicator` concept: collectives over a fixed group of ranks.
 *
 *  Required expressions, for `c` a `C&`, `cc` a `const C&`, `p` a `void*`, `cp` a `const void*`,
 *  `n` a `std::size_t`, `t` a `dtype`, `op` a `reduce_op`, `root` an `int`, `d` a
 *  `std::span<double>`. Buffers are memory the model can reach (host memory, device memory for
 *  NCCL). Every rank must issue the same collectives, with the same sizes, types, ops and roots,
 *  in the same order (a model may check this and throw `communication_error` naming the first
 *  divergent call).
 *  1. `cc.rank()` → `int` in `[0, size())`; `cc.size()` → `int` >= 1.
 *  2. `c.allreduce(p, n, t, op)` — in place over `n` elements of type `t`; afterwards every rank
 *     holds the reduction of all ranks' inputs.
 *  3. `c.allreduce(d, op)` — the same over doubles in host memory (norms, overflow flags).
 *  4. `c.allgather(cp, p, n)` — `p` receives `size() * n` bytes: rank k's `n` bytes at `k * n`.
 *     In place when `cp == p + rank() * n`; any other overlap is a `config_error`.
 *  5. `c.reduce_scatter(cp, p, n, t, op)` — `cp` holds `size() * n` elements; `p` receives the
 *     reduction over ranks of block `rank()` (elements `[rank()*n, (rank()+1)*n)`). In place when
 *     `p == cp + rank() * n * dtype_size(t)`; any other overlap is a `config_error`.
 *  6. `c.reduce(cp, p, n, t, op, root)` — the rooted reduce: `n` elements of type `t` from every
 *     rank's `cp`, reduced over ranks, into rank `root`'s `p`; on every other rank `p` is not
 *     written (and may be null). In place on the root when `cp == p`; any other overlap of `cp`
 *     and `p` on the root is a `config_error` (on other ranks `p` is not looked at). `root` outside
 *     `[0, size())` is a `config_error`. The root gets what `allreduce` would give it, but only the
 *     root receives: (N-1)·b, while every other rank sends b (b = n·dtype_size(t)); so N reduces
 *     of b bytes to N different roots move what one reduce-scatter of N blocks of b does.
 *  7. `c.broadcast(p, n, root)` — `n` bytes of rank `root`'s `p` into every rank's `p`;
 *     `root` outside `[0, size())` is a `config_error`.
 *  8. `c.ring_shift(cp, p, n)` — sends `n` bytes to `(rank()+1) % size()`, receives `n` bytes
 *     from `(rank()-1+size()) % size()`; with one rank it copies `cp` to `p`. `cp` and `p` must
 *     not overlap (`config_error`).
 *  9. `c.barrier()` — returns once every rank has entered it.
 *  10. `c.allreduce_async(p, n, t, op)`, `c.allreduce_async(d, op)`, `c.allgather_async(cp, p, n)`,
 *      `c.reduce_scatter_async(cp, p, n, t, op)`, `c.reduce_async(cp, p, n, t, op, root)`,
 *      `c.broadcast_async(p, n, root)`, `c.ring_shift_async(cp, p, n)` → `comm_handle`: the same
 *      operations, started in issue order and completed by the handle. Several may be
 *      outstanding; buffers stay the caller's to keep alive and untouched until `wait()`.
 *      Argument errors (`config_error`) are thrown at the call.
 *  11. Failures of the transport, a peer that failed or went away, or mismatched calls throw
 *      `communication_error` (from the call, or from `comm_handle::wait()`); never a hang where
 *      the model can detect the cause.
 *
 *  Determinism (2, 3, 5, 6): the result is bit-identical on every rank (for 6, it is only at the
 *  root, and equals what 2 would have given there) and equals the reduction in rank order 0..N-1:
 *  each element of rank 0 widened to float (double for 3), combined with ranks 1..N-1 in turn in
 *  float, then rounded once to `t`. `sum` adds; `max`/`min` keep the earlier
 *  value on ties and propagate the first NaN met in rank order. With one rank the result is the
 *  input unchanged (no widen/narrow round trip). So N ranks give the same bits whichever model
 *  runs them. Exception: `nccl_communicator` uses NCCL's own order (see its header).
 */
template <class C>
concept Communicator = requires(C& c, const C& cc, void* p, const void* cp, std::size_t n, dtype t, reduce_op op,
                                int root, std::span<double> d) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  { c.allreduce(p, n, t, op) } -> std::same_as<void>;
  { c.allreduce(d, op) } -> std::same_as<void>;
  { c.allgather(cp, p, n) } -> std::same_as<void>;
  { c.reduce_scatter(cp, p, n, t, op) } -> std::same_as<void>;
  { c.reduce(cp, p, n, t, op, root) } -> std::same_as<void>;
  { c.broadcast(p, n, root) } -> std::same_as<void>;
  { c.ring_shift(cp, p, n) } -> std::same_as<void>;
  { c.barrier() } -> std::same_as<void>;
  { c.allreduce_async(p, n, t, op) } -> std::same_as<comm_handle>;
  { c.allreduce_async(d, op) } -> std::same_as<comm_handle>;
  { c.allgather_async(cp, p, n) } -> std::same_as<comm_handle>;
  { c.reduce_scatter_async(cp, p, n, t, op) } -> std::same_as<comm_handle>;
  { c.reduce_async(cp, p, n, t, op, root) } -> std::same_as<comm_handle>;
  { c.broadcast_async(p, n, root) } -> std::same_as<comm_handle>;
  { c.ring_shift_async(cp, p, n) } -> std::same_as<comm_handle>;
};

/** @brief True for a communicator whose `void*` collectives take device memory (NCCL), which it
 *  declares with `static constexpr bool takes_device_memory = true;`; false (host memory)
 *  otherwise. The runtime then hands such a communicator chunks on the compute tier only, and its
 *  own control-plane data through `allreduce(span<double>)` (comm/host_scalars.hpp). */
template <class C>
inline constexpr bool takes_device_memory_v = [] {
  if constexpr (requires { C::takes_device_memory; }) return static_cast<bool>(C::takes_device_memory);
  else return false;
}();

namespace detail {

/** @brief One step of the normative reduction: `acc` (earlier ranks) combined with `x`. */
template <class F>
constexpr F combine(F acc, F x, reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return acc + x;
    case reduce_op::max:
      if (acc != acc) return acc;  // NOLINT(misc-redundant-expression): NaN test without <cmath> flags
      if (x != x) return x;        // NOLINT(misc-redundant-expression)
      return x > acc ? x : acc;
    case reduce_op::min:
      if (acc != acc) return acc;  // NOLINT(misc-redundant-expression)
      if (x != x) return x;        // NOLINT(misc-redundant-expression)
      return x < acc ? x : acc;
  }
  return acc;
}

template <class T>
void fold_ranks_typed(void* dst, const void* const* srcs, int nranks, std::size_t n, reduce_op op) {
  auto* out = static_cast<T*>(dst);
  if constexpr (std::is_same_v<T, double>) {
    for (std::size_t i = 0; i < n; ++i) {
      double acc = static_cast<const double*>(srcs[0])[i];
      for (int k = 1; k < nranks; ++k) acc = combine(acc, static_cast<const double*>(srcs[k])[i], op);
      out[i] = acc;
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      float acc = to_float(static_cast<const T*>(srcs[0])[i]);
      for (int k = 1; k < nranks; ++k) acc = combine(acc, to_float(static_cast<const T*>(srcs[k])[i]), op);
      out[i] = from_float<T>(acc);
    }
  }
}

/** @brief The normative rank-order reduction of `n` elements: `srcs[k]` points to rank k's
 *  elements, the result goes to `dst`. `dst` may alias any `srcs[k]` exactly (element i is written
 *  after every rank's element i was read). With one rank this is a copy. */
inline void fold_ranks(void* dst, const void* const* srcs, int nranks, std::size_t n, dtype t, reduce_op op) {
  if (n == 0) return;
  if (nranks == 1) {
    if (dst != srcs[0]) std::memmove(dst, srcs[0], n * dtype_size(t));
    return;
  }
  switch (t) {
    case dtype::f32: fold_ranks_typed<float>(dst, srcs, nranks, n, op); break;
    case dtype::f16: fold_ranks_typed<float16>(dst, srcs, nranks, n, op); break;
    case dtype::bf16: fold_ranks_typed<bfloat16>(dst, srcs, nranks, n, op); break;
  }
}

/** @brief `fold_ranks` over doubles (the `span<double>` overload). */
inline void fold_ranks_f64(double* dst, const void* const* srcs, int nranks, std::size_t n, reduce_op op) {
  if (n == 0) return;
  if (nranks == 1) {
    if (dst != srcs[0]) std::memmove(dst, srcs[0], n * sizeof(double));
    return;
  }
  fold_ranks_typed<double>(dst, srcs, nranks, n, op);
}

inline bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) noexcept {
  if (an == 0 || bn == 0) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

inline void check_buffer(const void* p, std::size_t bytes, std::string_view what, std::string_view arg) {
  if (p == nullptr && bytes != 0)
    throw config_error(std::string(what) + ": " + std::string(arg) + " is null but " + std::to_string(bytes) +
                       " bytes were requested; pass a buffer of at least that size");
}

/** @brief Argument checks shared by every model, so every model rejects the same calls. */
inline void check_allgather(const void* send, const void* recv, std::size_t bytes, int rank, int size) {
  check_buffer(send, bytes, "allgather", "send");
  check_buffer(recv, bytes, "allgather", "recv");
  const std::size_t total = bytes * static_cast<std::size_t>(size);
  const bool in_place =
      bytes != 0 && send == static_cast<const std::byte*>(recv) + static_cast<std::size_t>(rank) * bytes;
  if (!in_place && overlaps(send, bytes, recv, total))
    throw config_error(
        "allgather: send overlaps recv other than at this rank's block; use disjoint buffers or "
        "pass send = recv + rank() * bytes for an in-place allgather");
}

inline void check_reduce_scatter(const void* send, const void* recv, std::size_t count, dtype t, int rank, int size) {
  const std::size_t block = count * dtype_size(t);
  check_buffer(send, block * static_cast<std::size_t>(size), "reduce_scatter", "send");
  check_buffer(recv, block, "reduce_scatter", "recv");
  const bool in_place =
      block != 0 && recv == static_cast<const std::byte*>(send) + static_cast<std::size_t>(rank) * block;
  if (!in_place && overlaps(send, block * static_cast<std::size_t>(size), recv, block))
    throw config_error(
        "reduce_scatter: recv overlaps send other than at this rank's block; use disjoint buffers "
        "or pass recv = send + rank() * count * dtype_size(t) for an in-place reduce_scatter");
}

inline void check_ring_shift(const void* send, const void* recv, std::size_t bytes) {
  check_buffer(send, bytes, "ring_shift", "send");
  check_buffer(recv, bytes, "ring_shift", "recv");
  if (overlaps(send, bytes, recv, bytes))
    throw config_error("ring_shift: send and recv overlap (" + std::to_string(bytes) +
                       " bytes each); the ring needs two distinct buffers, e.g. double-buffer the shard");
}

inline void check_root(int root, int size, std::string_view what) {
  if (root < 0 || root >= size)
    throw config_error(std::string(what) + ": root " + std::to_string(root) + " is not a rank of this " +
                       std::to_string(size) + "-rank communicator; pass a root in [0, " + std::to_string(size) + ")");
}

/** @brief The rooted reduce's checks: `root` is a rank; `send` (every rank) and, on the root,
 *  `recv` hold `count` elements; on the root they are the same buffer (in place) or disjoint.
 *  Other ranks' `recv` is not looked at (it is not written, and may be null). */
inline void check_reduce(const void* send, const void* recv, std::size_t count, dtype t, int root, int rank, int size) {
  check_root(root, size, "reduce");
  const std::size_t bytes = count * dtype_size(t);
  check_buffer(send, bytes, "reduce", "send");
  if (rank != root) return;
  check_buffer(recv, bytes, "reduce", "recv (on the root)");
  if (send != recv && overlaps(send, bytes, recv, bytes))
    throw config_error("reduce: on the root (rank " + std::to_string(root) +
                       ") send and recv overlap without being equal (" + std::to_string(bytes) +
                       " bytes each); use disjoint buffers, or pass recv = send for an in-place "
                       "reduce");
}

/** @brief A one-shot completion flag with a stored failure, for models that finish work on
 *  another thread. */
class completion_state {
 public:
  void complete(std::exception_ptr failure = nullptr) {
    {
      std::lock_guard lock(mutex_);
      failure_ = std::move(failure);
      done_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    if (failure_) std::rethrow_exception(failure_);
  }
  bool ready() {
    std::lock_guard lock(mutex_);
    return done_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr failure_;
};

}  // namespace detail
}  // namespace chunkstar
