// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `mpi_communicator`: the `Communicator` over an MPI communicator (target chunkstar::mpi),
 *         and `mpi_session`, an RAII MPI_Init/MPI_Finalize.
 */
#pragma once

#include <chunkstar/comm/collective_call.hpp>
#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/error.hpp>

// Only MPI's C API is used; the deprecated C++ bindings (removed in MPI-3) do not compile warning-free.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace chunkstar {

namespace detail {

inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

inline void mpi_check(int rc, std::string_view call) {
  if (rc != MPI_SUCCESS) throw communication_error(std::string(call) + " failed: " + mpi_error_string(rc));
}

/** @brief MPI counts are `int`: refuse what does not fit rather than truncate. */
inline int mpi_count(std::size_t bytes, std::string_view what) {
  if (bytes > static_cast<std::size_t>(INT_MAX))
    throw config_error(std::string(what) + ": " + std::to_string(bytes) +
                       " bytes per rank exceed MPI's int count limit (2 GiB - 1); split the buffer into smaller "
                       "collectives (e.g. smaller chunks)");
  return static_cast<int>(bytes);
}

/** @brief Completion of MPI nonblocking operations plus an optional local step (the rank-order
 *  fold) that runs once they are done, in `wait()` or the `ready()` that sees them finish. */
struct mpi_request_state {
  std::vector<MPI_Request> requests;
  std::vector<std::byte> buffer;                 // what the transfer received, owned until done
  std::function<void(const std::byte*)> finish;  // runs once, after every request completed
  std::string what;
  std::exception_ptr failure;
  bool done = false;

  void complete(int rc) {
    done = true;
    if (rc != MPI_SUCCESS) {
      failure = std::make_exception_ptr(communication_error(what + " failed: " + mpi_error_string(rc)));
      return;
    }
    if (finish) {
      try {
        finish(buffer.data());
      } catch (...) {
        failure = std::current_exception();
      }
    }
  }
  void wait() {
    if (!done) complete(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
    if (failure) std::rethrow_exception(failure);
  }
  bool ready() {
    if (!done) {
      int flag = 0;
      const int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS || flag) complete(rc);
    }
    return done;
  }
};

}  // namespace detail

/** @brief Initialises MPI if nobody has, and finalises it on destruction if it did.
 *
 *  Requests `MPI_THREAD_SERIALIZED` by default: `mpi_communicator` calls MPI only from the
 *  thread that issues a collective or waits on its handle, one thread at a time.
 */
class mpi_session {
 public:
  mpi_session() : mpi_session(nullptr, nullptr) {}
  mpi_session(int* argc, char*** argv, int required_thread_level = MPI_THREAD_SERIALIZED) {
    int initialized = 0;
    detail::mpi_check(MPI_Initialized(&initialized), "MPI_Initialized");
    if (!initialized) {
      detail::mpi_check(MPI_Init_thread(argc, argv, required_thread_level, &provided_), "MPI_Init_thread");
      owns_ = true;
    } else {
      detail::mpi_check(MPI_Query_thread(&provided_), "MPI_Query_thread");
    }
  }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
  ~mpi_session() {
    if (!owns_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }

  /** @brief The thread support MPI provides (MPI_THREAD_*). */
  [[nodiscard]] int thread_level() const noexcept { return provided_; }
  /** @brief True when this session initialised MPI (and will finalise it). */
  [[nodiscard]] bool owns_mpi() const noexcept { return owns_; }

 private:
  int provided_ = MPI_THREAD_SINGLE;
  bool owns_ = false;
};

/** @brief Options of an `mpi_communicator`. */
struct mpi_options {
  /** Check the collective sequence: before each collective, the ranks exchange what they are
   *  about to call (a small MPI_Allgather on a private communicator) and a difference in kind,
   *  size, dtype, op or root is a `communication_error` on every rank naming the call and both
   *  descriptions, instead of a hang, a crash inside MPI or a corrupted buffer. Every rank must
   *  give the same value (the constructor checks). Its own latency is under a microsecond per
   *  collective; what it costs a training step (about 1% on train_gpt's ZeRO run, most likely a
   *  rank that is ahead waiting at the check rather than inside the transfer) is measured by
   *  bench/zero/bench_sequence_check.py, and `sequence_check()` reports its calls and time. */
  bool check_sequence = true;
};

/** @brief What the collective-sequence check cost so far: calls checked and seconds spent in the
 *  check's own exchange (waiting for a slower rank included, so an upper bound). */
struct sequence_check_stats {
  std::uint64_t calls = 0;
  double seconds = 0.0;
};

/** @brief `Communicator` over MPI.
 *
 *  The constructor duplicates the given communicator (collective: every rank must construct it),
 *  so chunkstar's traffic never matches the application's, and sets `MPI_ERRORS_RETURN` on the
 *  duplicate: every MPI failure becomes a `communication_error` carrying MPI's error string. MPI
 *  must be initialised (see `mpi_session`) and outlive the communicator and its handles. Host
 *  memory only (MPI_BYTE transfers). Per-rank sizes above 2 GiB - 1 bytes are a `config_error`.
 *
 *  Determinism: MPI_Allreduce/MPI_Reduce_scatter may combine in any order, so reductions are never
 *  left to MPI. Data is moved with MPI_Alltoall/MPI_Allgather and combined locally in rank order
 *  (`detail::fold_ranks`), giving the same bits as every other model. Costs:
 *  - `allreduce`: Alltoall of 1/N blocks, local fold, Allgather of the reduced blocks: the same
 *    2(N-1)/N bytes per element as a ring allreduce, but unpipelined, plus ~2x the buffer in
 *    temporaries.
 *  - `reduce_scatter`: Alltoall then local fold: the ring's (N-1)/N volume, N blocks of temporaries.
 *  - `reduce` (rooted), sync and async: an MPI_Igather of every rank's buffer to the root, then
 *    the fold on the root in `wait()` (the sync form is the async one waited for): the root
 *    receives (N-1) times the buffer, every other rank sends it once (a reduce-scatter's volume),
 *    and the root holds N buffers of temporaries. One nonblocking collective, for the reason
 *    below.
 *  - `allreduce_async`: a single MPI_Iallgather of the whole buffer, then the fold in `wait()`:
 *    (N-1) times the buffer per rank (vs 2(N-1)/N) and N buffers of temporaries. It uses one
 *    nonblocking collective because a second stage started lazily in `wait()` could be started
 *    in a different order on different ranks relative to later collectives, which MPI forbids.
 *  Correctness over speed for now; NCCL is the fast path on GPUs.
 *
 *  Asynchronous forms use MPI_I* operations started at the call, in issue order; the local fold,
 *  where there is one, runs in `wait()` or in the `ready()` that sees the transfer finish. Progress
 *  of the transfer itself depends on the MPI library (most progress inside MPI calls).
 */
class mpi_communicator {
 public:
  /** @brief Duplicates `comm` (collective over `comm`). */
  explicit mpi_communicator(MPI_Comm comm = MPI_COMM_WORLD, mpi_options options = {}) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized)
      throw state_error(
          "mpi_communicator: MPI is not initialised; create a chunkstar::mpi_session (or call "
          "MPI_Init) before constructing a communicator");
    detail::mpi_check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    detail::mpi_check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    detail::mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    // Whether to check is itself agreed first: a rank checking alone would wait in its check's
    // exchange for ranks that never join it.
    const int mine = options.check_sequence ? 1 : 0;
    int on[2] = {mine, -mine};  // {min, -max} in one MIN reduction
    if (const int rc = MPI_Allreduce(MPI_IN_PLACE, on, 2, MPI_INT, MPI_MIN, comm_); rc != MPI_SUCCESS) {
      MPI_Comm_free(&comm_);
      detail::mpi_check(rc, "MPI_Allreduce (mpi_options agreement)");
    }
    if (on[0] != -on[1]) {
      MPI_Comm_free(&comm_);
      throw config_error("mpi_communicator: the ranks disagree on mpi_options::check_sequence (this rank (" +
                         std::to_string(rank_) + "): " + (mine ? "on" : "off") +
                         ", another rank: " + (mine ? "off" : "on") + "); give every rank the same options");
    }
    if (options.check_sequence) {
      detail::mpi_check(MPI_Comm_dup(comm_, &check_comm_), "MPI_Comm_dup");
      detail::mpi_check(MPI_Comm_set_errhandler(check_comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    }
  }

  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;
  mpi_communicator(mpi_communicator&& other) noexcept
      : comm_(std::exchange(other.comm_, MPI_COMM_NULL)),
        check_comm_(std::exchange(other.check_comm_, MPI_COMM_NULL)),
        rank_(other.rank_),
        size_(other.size_),
        calls_(other.calls_),
        check_seconds_(other.check_seconds_),
        poisoned_(std::move(other.poisoned_)),
        counter_(other.counter_) {}
  mpi_communicator& operator=(mpi_communicator&& other) noexcept {
    if (this != &other) {
      release();
      comm_ = std::exchange(other.comm_, MPI_COMM_NULL);
      check_comm_ = std::exchange(other.check_comm_, MPI_COMM_NULL);
      rank_ = other.rank_;
      size_ = other.size_;
      calls_ = other.calls_;
      check_seconds_ = other.check_seconds_;
      poisoned_ = std::move(other.poisoned_);
      counter_ = other.counter_;
    }
    return *this;
  }
  ~mpi_communicator() { release(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /** @brief The duplicated communicator (owned by this object). */
  [[nodiscard]] MPI_Comm native() const noexcept { return comm_; }
  /** @brief True when the collective sequence is checked (mpi_options::check_sequence). */
  [[nodiscard]] bool checks_sequence() const noexcept { return check_comm_ != MPI_COMM_NULL; }
  /** @brief The sequence check's calls and time so far (zeros when it is off). */
  [[nodiscard]] sequence_check_stats sequence_check() const noexcept {
    return checks_sequence() ? sequence_check_stats{calls_, check_seconds_} : sequence_check_stats{};
  }

  void allreduce(void* inout, std::size_t count, dtype t, reduce_op op) {
    detail::check_buffer(inout, count * dtype_size(t), "allreduce", "inout");
    check({detail::collective_kind::allreduce, count, t, op});
    counter_.gather_like(count * dtype_size(t), size_);
    allreduce_blocks(inout, count, dtype_size(t), [&](void* dst, const void* const* srcs, std::size_t n) {
      detail::fold_ranks(dst, srcs, size_, n, t, op);
    });
  }

  void allreduce(std::span<double> inout, reduce_op op) {
    check({detail::collective_kind::allreduce_f64, inout.size(), dtype::f32, op});
    counter_.gather_like(inout.size_bytes(), size_);
    allreduce_blocks(inout.data(), inout.size(), sizeof(double),
                     [&](void* dst, const void* const* srcs, std::size_t n) {
                       detail::fold_ranks_f64(static_cast<double*>(dst), srcs, size_, n, op);
                     });
  }

  void allgather(const void* send, void* recv, std::size_t bytes) {
    detail::check_allgather(send, recv, bytes, rank_, size_);
    check({detail::collective_kind::allgather, bytes});
    const int n = detail::mpi_count(bytes, "allgather");
    counter_.gather_like(bytes, size_);
    const bool in_place =
        bytes != 0 && send == static_cast<const std::byte*>(recv) + static_cast<std::size_t>(rank_) * bytes;
    detail::mpi_check(MPI_Allgather(in_place ? MPI_IN_PLACE : send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_),
                      "MPI_Allgather");
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    detail::check_reduce_scatter(send, recv, count, t, rank_, size_);
    check({detail::collective_kind::reduce_scatter, count, t, op});
    const std::size_t block = count * dtype_size(t);
    counter_.gather_like(block, size_);
    const int n = detail::mpi_count(block, "reduce_scatter");
    if (block == 0) return;
    if (size_ == 1) {
      if (recv != send) std::memmove(recv, send, block);
      return;
    }
    std::vector<std::byte> gathered(block * static_cast<std::size_t>(size_));
    detail::mpi_check(MPI_Alltoall(send, n, MPI_BYTE, gathered.data(), n, MPI_BYTE, comm_), "MPI_Alltoall");
    fold_gathered(size_, recv, gathered.data(), block, count, t, op);
  }

  void reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, int root) {
    reduce_async(send, recv, count, t, op, root).wait();
  }

  void broadcast(void* buf, std::size_t bytes, int root) {
    detail::check_buffer(buf, bytes, "broadcast", "buf");
    detail::check_root(root, size_, "broadcast");
    check({detail::collective_kind::broadcast, bytes, dtype::f32, reduce_op::sum, root});
    counter_.broadcast(bytes, root, rank_, size_);
    detail::mpi_check(MPI_Bcast(buf, detail::mpi_count(bytes, "broadcast"), MPI_BYTE, root, comm_), "MPI_Bcast");
  }

  void ring_shift(const void* send, void* recv, std::size_t bytes) {
    detail::check_ring_shift(send, recv, bytes);
    check({detail::collective_kind::ring_shift, bytes});
    const int n = detail::mpi_count(bytes, "ring_shift");
    counter_.ring_shift(bytes, size_);
    detail::mpi_check(MPI_Sendrecv(send, n, MPI_BYTE, next(), ring_tag, recv, n, MPI_BYTE, prev(), ring_tag, comm_,
                                   MPI_STATUS_IGNORE),
                      "MPI_Sendrecv");
  }

  void barrier() {
    check({detail::collective_kind::barrier});
    detail::mpi_check(MPI_Barrier(comm_), "MPI_Barrier");
  }

  /** @brief Bytes this rank moved and collectives it issued (see comm_stats). */
  [[nodiscard]] const comm_stats& stats() const noexcept { return counter_.stats; }

  comm_handle allreduce_async(void* inout, std::size_t count, dtype t, reduce_op op) {
    detail::check_buffer(inout, count * dtype_size(t), "allreduce", "inout");
    check({detail::collective_kind::allreduce, count, t, op});
    counter_.gather_like(count * dtype_size(t), size_);
    return allreduce_gather_async(inout, count * dtype_size(t), [=, nranks = size_](const std::byte* gathered) {
      fold_gathered(nranks, inout, gathered, count * dtype_size(t), count, t, op);
    });
  }

  comm_handle allreduce_async(std::span<double> inout, reduce_op op) {
    check({detail::collective_kind::allreduce_f64, inout.size(), dtype::f32, op});
    const std::size_t bytes = inout.size_bytes();
    counter_.gather_like(bytes, size_);
    return allreduce_gather_async(inout.data(), bytes, [=, nranks = size_](const std::byte* gathered) {
      std::vector<const void*> srcs(static_cast<std::size_t>(nranks));
      for (std::size_t k = 0; k < srcs.size(); ++k) srcs[k] = gathered + k * bytes;
      detail::fold_ranks_f64(inout.data(), srcs.data(), nranks, inout.size(), op);
    });
  }

  comm_handle allgather_async(const void* send, void* recv, std::size_t bytes) {
    detail::check_allgather(send, recv, bytes, rank_, size_);
    check({detail::collective_kind::allgather, bytes});
    const int n = detail::mpi_count(bytes, "allgather");
    counter_.gather_like(bytes, size_);
    const bool in_place =
        bytes != 0 && send == static_cast<const std::byte*>(recv) + static_cast<std::size_t>(rank_) * bytes;
    auto state = make_state("MPI_Iallgather", 1);
    detail::mpi_check(
        MPI_Iallgather(in_place ? MPI_IN_PLACE : send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &state->requests[0]),
        "MPI_Iallgather");
    return comm_handle(std::move(state));
  }

  comm_handle reduce_scatter_async(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    detail::check_reduce_scatter(send, recv, count, t, rank_, size_);
    check({detail::collective_kind::reduce_scatter, count, t, op});
    const std::size_t block = count * dtype_size(t);
    counter_.gather_like(block, size_);
    const int n = detail::mpi_count(block, "reduce_scatter");
    if (block == 0) return {};
    if (size_ == 1) {
      if (recv != send) std::memmove(recv, send, block);
      return {};
    }
    auto state = make_state("MPI_Ialltoall", 1);
    state->buffer.resize(block * static_cast<std::size_t>(size_));
    detail::mpi_check(MPI_Ialltoall(send, n, MPI_BYTE, state->buffer.data(), n, MPI_BYTE, comm_, &state->requests[0]),
                      "MPI_Ialltoall");
    state->finish = [=, nranks = size_](const std::byte* gathered) {
      fold_gathered(nranks, recv, gathered, block, count, t, op);
    };
    return comm_handle(std::move(state));
  }

  comm_handle reduce_async(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, int root) {
    detail::check_reduce(send, recv, count, t, root, rank_, size_);
    check({detail::collective_kind::reduce, count, t, op, root});
    const std::size_t bytes = count * dtype_size(t);
    const int n = detail::mpi_count(bytes, "reduce");
    counter_.reduce(bytes, root, rank_, size_);
    if (bytes == 0) return {};  // count is the same on every rank, so all skip together
    if (size_ == 1) {
      if (recv != send) std::memmove(recv, send, bytes);
      return {};
    }
    // Gathered to the root and folded there in rank order; MPI_Reduce would combine in its own.
    auto state = make_state("MPI_Igather (reduce)", 1);
    const bool is_root = rank_ == root;
    if (is_root) state->buffer.resize(bytes * static_cast<std::size_t>(size_));
    detail::mpi_check(MPI_Igather(send, n, MPI_BYTE, is_root ? state->buffer.data() : nullptr, n, MPI_BYTE, root, comm_,
                                  &state->requests[0]),
                      "MPI_Igather");
    if (is_root)
      state->finish = [=, nranks = size_](const std::byte* gathered) {
        fold_gathered(nranks, recv, gathered, bytes, count, t, op);  // recv may be send: the gather copied it
      };
    return comm_handle(std::move(state));
  }

  comm_handle broadcast_async(void* buf, std::size_t bytes, int root) {
    detail::check_buffer(buf, bytes, "broadcast", "buf");
    detail::check_root(root, size_, "broadcast");
    check({detail::collective_kind::broadcast, bytes, dtype::f32, reduce_op::sum, root});
    counter_.broadcast(bytes, root, rank_, size_);
    auto state = make_state("MPI_Ibcast", 1);
    detail::mpi_check(
        MPI_Ibcast(buf, detail::mpi_count(bytes, "broadcast"), MPI_BYTE, root, comm_, &state->requests[0]),
        "MPI_Ibcast");
    return comm_handle(std::move(state));
  }

  comm_handle ring_shift_async(const void* send, void* recv, std::size_t bytes) {
    detail::check_ring_shift(send, recv, bytes);
    check({detail::collective_kind::ring_shift, bytes});
    const int n = detail::mpi_count(bytes, "ring_shift");
    counter_.ring_shift(bytes, size_);
    auto state = make_state("ring_shift (MPI_Irecv/MPI_Isend)", 2);
    detail::mpi_check(MPI_Irecv(recv, n, MPI_BYTE, prev(), ring_tag, comm_, &state->requests[0]), "MPI_Irecv");
    const int rc = MPI_Isend(send, n, MPI_BYTE, next(), ring_tag, comm_, &state->requests[1]);
    if (rc != MPI_SUCCESS) {
      MPI_Cancel(&state->requests[0]);
      MPI_Request_free(&state->requests[0]);
      state->requests.clear();
      detail::mpi_check(rc, "MPI_Isend");
    }
    return comm_handle(std::move(state));
  }

 private:
  // Point-to-point traffic of ring_shift; MPI's non-overtaking rule keeps outstanding shifts in order.
  static constexpr int ring_tag = 0x5c5;

  [[nodiscard]] int next() const noexcept { return (rank_ + 1) % size_; }
  [[nodiscard]] int prev() const noexcept { return (rank_ - 1 + size_) % size_; }

  void release() noexcept {
    int finalized = 0;
    MPI_Finalized(&finalized);
    for (MPI_Comm* c : {&comm_, &check_comm_}) {
      if (*c != MPI_COMM_NULL && !finalized) MPI_Comm_free(c);
      *c = MPI_COMM_NULL;
    }
  }

  /** @brief The sequence check (when on): every rank's description of its next collective, to
   *  every rank; each compares them with rank 0's, so all ranks throw the same error, and every
   *  later call throws it too (the sequences no longer line up). */
  void check(const detail::collective_call& call) {
    if (!poisoned_.empty()) throw communication_error(poisoned_);
    if (check_comm_ == MPI_COMM_NULL) return;
    const std::uint64_t index = calls_++;
    const std::array<std::uint64_t, 4> mine = {index, call.count,
                                               static_cast<std::uint64_t>(call.kind) << 16 |
                                                   static_cast<std::uint64_t>(call.type) << 8 |
                                                   static_cast<std::uint64_t>(call.op),
                                               static_cast<std::uint64_t>(static_cast<std::int64_t>(call.root))};
    std::vector<std::array<std::uint64_t, 4>> all(static_cast<std::size_t>(size_));
    const auto t0 = std::chrono::steady_clock::now();
    detail::mpi_check(MPI_Allgather(mine.data(), sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, check_comm_),
                      "MPI_Allgather (collective-sequence check)");
    check_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    auto decode = [](const std::array<std::uint64_t, 4>& w) {
      return detail::collective_call{static_cast<detail::collective_kind>(w[2] >> 16 & 0xff),
                                     static_cast<std::size_t>(w[1]), static_cast<dtype>(w[2] >> 8 & 0xff),
                                     static_cast<reduce_op>(w[2] & 0xff),
                                     static_cast<int>(static_cast<std::int64_t>(w[3]))};
    };
    for (int q = 1; q < size_; ++q) {
      const auto& other = all[static_cast<std::size_t>(q)];
      if (other == all[0]) continue;
      poisoned_ =
          "collective mismatch at call #" + std::to_string(all[0][0]) + ": rank 0 called " +
          decode(all[0]).to_string() + " but rank " + std::to_string(q) + " called " + decode(other).to_string() +
          (other[0] != all[0][0] ? " as its call #" + std::to_string(other[0]) : std::string()) +
          "; every rank must issue the same collectives, with the same sizes, types, ops and roots, in the same order";
      throw communication_error(poisoned_);
    }
  }

  static std::shared_ptr<detail::mpi_request_state> make_state(std::string what, std::size_t requests) {
    auto state = std::make_shared<detail::mpi_request_state>();
    state->what = std::move(what);
    state->requests.assign(requests, MPI_REQUEST_NULL);
    return state;
  }

  /** @brief Folds `size_` consecutive blocks of `block_bytes` (rank k's at k * block_bytes). */
  static void fold_gathered(int nranks, void* dst, const std::byte* gathered, std::size_t block_bytes,
                            std::size_t count, dtype t, reduce_op op) {
    std::vector<const void*> srcs(static_cast<std::size_t>(nranks));
    for (std::size_t k = 0; k < srcs.size(); ++k) srcs[k] = gathered + k * block_bytes;
    detail::fold_ranks(dst, srcs.data(), nranks, count, t, op);
  }

  /** @brief Alltoall of 1/N blocks, local fold of this rank's block, Allgather of the results. */
  template <class Fold>
  void allreduce_blocks(void* inout, std::size_t count, std::size_t elem_bytes, Fold fold) {
    const auto n = static_cast<std::size_t>(size_);
    if (count == 0 || n == 1) return;               // count is the same on every rank, so all skip together
    const std::size_t block = (count + n - 1) / n;  // elements; the last blocks are zero-padded
    const int block_bytes = detail::mpi_count(block * elem_bytes, "allreduce");
    std::vector<std::byte> padded(n * block * elem_bytes);
    std::vector<std::byte> gathered(n * block * elem_bytes);
    std::vector<std::byte> mine(block * elem_bytes);
    std::memcpy(padded.data(), inout, count * elem_bytes);
    detail::mpi_check(MPI_Alltoall(padded.data(), block_bytes, MPI_BYTE, gathered.data(), block_bytes, MPI_BYTE, comm_),
                      "MPI_Alltoall");
    std::vector<const void*> srcs(n);
    for (std::size_t k = 0; k < n; ++k) srcs[k] = gathered.data() + k * block * elem_bytes;
    fold(mine.data(), srcs.data(), block);
    detail::mpi_check(MPI_Allgather(mine.data(), block_bytes, MPI_BYTE, padded.data(), block_bytes, MPI_BYTE, comm_),
                      "MPI_Allgather");
    std::memcpy(inout, padded.data(), count * elem_bytes);
  }

  /** @brief One MPI_Iallgather of the whole buffer, then `finish` folds it into `inout`. */
  comm_handle allreduce_gather_async(void* inout, std::size_t bytes, std::function<void(const std::byte*)> finish) {
    const int n = detail::mpi_count(bytes, "allreduce");
    if (bytes == 0 || size_ == 1) return {};
    auto state = make_state("MPI_Iallgather (allreduce)", 1);
    state->buffer.resize(bytes * static_cast<std::size_t>(size_));
    detail::mpi_check(MPI_Iallgather(inout, n, MPI_BYTE, state->buffer.data(), n, MPI_BYTE, comm_, &state->requests[0]),
                      "MPI_Iallgather");
    state->finish = std::move(finish);
    return comm_handle(std::move(state));
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm check_comm_ = MPI_COMM_NULL;  // the sequence check's own traffic (see mpi_options)
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t calls_ = 0;   // collectives checked so far
  double check_seconds_ = 0;  // time in the check's exchanges
  std::string poisoned_;      // the mismatch found, once found
  detail::comm_counter counter_;
};

static_assert(Communicator<mpi_communicator>);

}  // namespace chunkstar
