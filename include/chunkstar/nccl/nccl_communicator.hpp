// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `nccl::nccl_communicator`: the `Communicator` over NCCL, on device buffers (Tier 1:
 *         host compiler + nccl.h + cudart; target chunkstar::nccl).
 */
#pragma once

#include <chunkstar/comm/blocking_collectives.hpp>
#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/error.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace chunkstar::nccl {

namespace detail {

inline void nccl_check(ncclResult_t rc, std::string_view call) {
  if (rc != ncclSuccess)
    throw communication_error(std::string(call) + " failed: " + ncclGetErrorString(rc) +
                              " (set NCCL_DEBUG=WARN for NCCL's own diagnosis)");
}

inline void cuda_check(cudaError_t rc, std::string_view call) {
  if (rc != cudaSuccess) throw communication_error(std::string(call) + " failed: " + cudaGetErrorString(rc));
}

inline ncclDataType_t to_nccl(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f16: return ncclFloat16;
    case dtype::bf16: return ncclBfloat16;
  }
  return ncclFloat32;
}

inline ncclRedOp_t to_nccl(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::max: return ncclMax;
    case reduce_op::min: return ncclMin;
  }
  return ncclSum;
}

/** @brief Makes `device` current for a scope, restoring the previous one. */
class device_guard {
 public:
  explicit device_guard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

/** @brief Completion of work enqueued on the communicator's stream: a CUDA event recorded after
 *  it, plus NCCL's asynchronous error state once it has finished. */
struct event_state {
  cudaEvent_t event = nullptr;
  ncclComm_t comm = nullptr;

  event_state() = default;
  event_state(const event_state&) = delete;
  event_state& operator=(const event_state&) = delete;
  ~event_state() {
    if (event) cudaEventDestroy(event);
  }
  void wait() {
    cuda_check(cudaEventSynchronize(event), "cudaEventSynchronize");
    check_async();
  }
  bool ready() {
    const cudaError_t rc = cudaEventQuery(event);
    if (rc == cudaErrorNotReady) return false;
    cuda_check(rc, "cudaEventQuery");
    return true;
  }
  void check_async() const {
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError");
    nccl_check(async, "NCCL collective (asynchronous error)");
  }
};

}  // namespace detail

/** @brief `Communicator` over NCCL. Every buffer is device memory of this communicator's device,
 *  except the `span<double>` overloads, which take host or device memory (copied through a
 *  stream-ordered device scratch; with pageable host memory the copy back makes even the async
 *  form complete before it returns).
 *
 *  Collectives are enqueued on the communicator's own non-blocking stream in issue order; a
 *  handle is a CUDA event recorded after the operation, and `wait()` also checks NCCL's
 *  asynchronous error state. Synchronous calls are the async form plus `wait()`. `barrier()` is a
 *  one-float allreduce that is waited for. `ring_shift` is ncclSend/ncclRecv in
 *  one ncclGroupStart/ncclGroupEnd. In-place allgather/reduce_scatter/reduce follow NCCL's own
 *  in-place rules, which are the concept's. The rooted `reduce` is ncclReduce: `recv` is used on
 *  the root only (NCCL ignores it elsewhere, so it may be null there); comm_stats counts it as the
 *  other models do ((N-1)·b into the root, b out of every other rank), not NCCL's ring or tree
 *  traffic.
 *
 *  Determinism differs from the other models (allreduce, reduce_scatter and reduce alike): NCCL
 *  chooses its own reduction order (rings, trees, per-channel splits) and accumulates f16/bf16 in
 *  its own way, so results are NOT the rank-order fold of `Communicator`. They are identical on
 *  every rank of one NCCL run (a reduce's root holds what an allreduce would have given it only to
 *  the same tolerance: the two may take different orders), but "N ranks = 1 rank" holds only to reduction-order
 *  tolerance on NCCL, not bitwise; NaN handling of max/min is
 *  NCCL's. With one rank the reduction is a copy, so the single-rank case is exact.
 *
 *  Construction is collective over the `size` ranks (ncclCommInitRank). Bootstrap the unique id
 *  over any host `Communicator` (MPI in production, see `bootstrap`), so this header needs no MPI.
 */
class nccl_communicator : public blocking_collectives<nccl_communicator> {
 public:
  static constexpr bool takes_device_memory = true;  ///< its void* collectives take device memory

  /** @brief Joins the NCCL clique `id` as `rank` of `size` on CUDA device `device` (-1: the
   *  current device). */
  nccl_communicator(ncclUniqueId id, int rank, int size, int device = -1) : rank_(rank), size_(size) {
    if (size < 1 || rank < 0 || rank >= size)
      throw config_error("nccl_communicator: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                         " is not a valid rank; pass 0 <= rank < size");
    if (device < 0) detail::cuda_check(cudaGetDevice(&device), "cudaGetDevice");
    device_ = device;
    detail::device_guard guard(device_);
    detail::cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    try {
      detail::cuda_check(cudaMalloc(&barrier_word_, sizeof(float)), "cudaMalloc");
      detail::cuda_check(cudaMemset(barrier_word_, 0, sizeof(float)), "cudaMemset");
      detail::nccl_check(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
    } catch (...) {
      release();
      throw;
    }
  }

  /** @brief Rank 0 makes an NCCL unique id and broadcasts it over `host` (any host-memory
   *  `Communicator`, typically `mpi_communicator`); every rank then joins with `host`'s rank and
   *  size. Collective over `host`. */
  template <Communicator Host>
  static nccl_communicator bootstrap(Host& host, int device = -1) {
    ncclUniqueId id{};
    if (host.rank() == 0) detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    host.broadcast(&id, sizeof(id), 0);
    return nccl_communicator(id, host.rank(), host.size(), device);
  }

  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  nccl_communicator(nccl_communicator&& other) noexcept
      : comm_(std::exchange(other.comm_, nullptr)),
        stream_(std::exchange(other.stream_, nullptr)),
        barrier_word_(std::exchange(other.barrier_word_, nullptr)),
        rank_(other.rank_),
        size_(other.size_),
        device_(other.device_) {}
  nccl_communicator& operator=(nccl_communicator&& other) noexcept {
    if (this != &other) {
      release();
      comm_ = std::exchange(other.comm_, nullptr);
      stream_ = std::exchange(other.stream_, nullptr);
      barrier_word_ = std::exchange(other.barrier_word_, nullptr);
      rank_ = other.rank_;
      size_ = other.size_;
      device_ = other.device_;
    }
    return *this;
  }
  ~nccl_communicator() { release(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /** @brief The CUDA device of every buffer. */
  [[nodiscard]] int device() const noexcept { return device_; }
  /** @brief The stream collectives are enqueued on (owned). */
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  /** @brief The NCCL communicator (owned). */
  [[nodiscard]] ncclComm_t native() const noexcept { return comm_; }
  /** @brief Bytes this rank moved and collectives it issued (see comm_stats; ring volumes). */
  [[nodiscard]] const comm_stats& stats() const noexcept { return counter_.stats; }

  void barrier() {
    detail::device_guard guard(device_);
    detail::nccl_check(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, stream_),
                       "ncclAllReduce (barrier)");
    record().wait();
  }

  comm_handle allreduce_async(void* inout, std::size_t count, dtype t, reduce_op op) {
    chunkstar::detail::check_buffer(inout, count * dtype_size(t), "allreduce", "inout");
    counter_.ring_allreduce(count * dtype_size(t), size_);
    if (count == 0) return {};
    detail::device_guard guard(device_);
    detail::nccl_check(ncclAllReduce(inout, inout, count, detail::to_nccl(t), detail::to_nccl(op), comm_, stream_),
                       "ncclAllReduce");
    return record();
  }

  comm_handle allreduce_async(std::span<double> inout, reduce_op op) {
    counter_.ring_allreduce(inout.size_bytes(), size_);
    if (inout.empty()) return {};
    detail::device_guard guard(device_);
    void* scratch = nullptr;
    detail::cuda_check(cudaMallocAsync(&scratch, inout.size_bytes(), stream_), "cudaMallocAsync");
    detail::cuda_check(cudaMemcpyAsync(scratch, inout.data(), inout.size_bytes(), cudaMemcpyDefault, stream_),
                       "cudaMemcpyAsync");
    detail::nccl_check(ncclAllReduce(scratch, scratch, inout.size(), ncclFloat64, detail::to_nccl(op), comm_, stream_),
                       "ncclAllReduce (f64)");
    detail::cuda_check(cudaMemcpyAsync(inout.data(), scratch, inout.size_bytes(), cudaMemcpyDefault, stream_),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaFreeAsync(scratch, stream_), "cudaFreeAsync");
    return record();
  }

  comm_handle allgather_async(const void* send, void* recv, std::size_t bytes) {
    chunkstar::detail::check_allgather(send, recv, bytes, rank_, size_);
    counter_.gather_like(bytes, size_);
    if (bytes == 0) return {};
    detail::device_guard guard(device_);
    detail::nccl_check(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_), "ncclAllGather");
    return record();
  }

  comm_handle reduce_scatter_async(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    chunkstar::detail::check_reduce_scatter(send, recv, count, t, rank_, size_);
    counter_.gather_like(count * dtype_size(t), size_);
    if (count == 0) return {};
    detail::device_guard guard(device_);
    detail::nccl_check(ncclReduceScatter(send, recv, count, detail::to_nccl(t), detail::to_nccl(op), comm_, stream_),
                       "ncclReduceScatter");
    return record();
  }

  comm_handle reduce_async(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, int root) {
    chunkstar::detail::check_reduce(send, recv, count, t, root, rank_, size_);
    counter_.reduce(count * dtype_size(t), root, rank_, size_);
    if (count == 0) return {};
    detail::device_guard guard(device_);
    detail::nccl_check(ncclReduce(send, recv, count, detail::to_nccl(t), detail::to_nccl(op), root, comm_, stream_),
                       "ncclReduce");
    return record();
  }

  comm_handle broadcast_async(void* buf, std::size_t bytes, int root) {
    chunkstar::detail::check_buffer(buf, bytes, "broadcast", "buf");
    chunkstar::detail::check_root(root, size_, "broadcast");
    counter_.broadcast(bytes, root, rank_, size_);
    if (bytes == 0) return {};
    detail::device_guard guard(device_);
    detail::nccl_check(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_), "ncclBroadcast");
    return record();
  }

  comm_handle ring_shift_async(const void* send, void* recv, std::size_t bytes) {
    chunkstar::detail::check_ring_shift(send, recv, bytes);
    counter_.ring_shift(bytes, size_);
    if (bytes == 0) return {};
    detail::device_guard guard(device_);
    const int next = (rank_ + 1) % size_;
    const int prev = (rank_ - 1 + size_) % size_;
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    const ncclResult_t sent = ncclSend(send, bytes, ncclUint8, next, comm_, stream_);
    const ncclResult_t received = ncclRecv(recv, bytes, ncclUint8, prev, comm_, stream_);
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    detail::nccl_check(sent, "ncclSend");
    detail::nccl_check(received, "ncclRecv");
    return record();
  }

 private:
  comm_handle record() {
    auto state = std::make_shared<detail::event_state>();
    state->comm = comm_;
    detail::cuda_check(cudaEventCreateWithFlags(&state->event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    detail::cuda_check(cudaEventRecord(state->event, stream_), "cudaEventRecord");
    return comm_handle(std::move(state));
  }

  void release() noexcept {
    if (comm_) ncclCommDestroy(comm_);
    if (barrier_word_) cudaFree(barrier_word_);
    if (stream_) cudaStreamDestroy(stream_);
    comm_ = nullptr;
    barrier_word_ = nullptr;
    stream_ = nullptr;
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* barrier_word_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  chunkstar::detail::comm_counter counter_;
  int device_ = 0;
};

static_assert(Communicator<nccl_communicator>);

}  // namespace chunkstar::nccl
