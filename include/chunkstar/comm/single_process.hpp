// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `single_process_communicator`: the `Communicator` of a run with one rank.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>

#include <cstddef>
#include <cstring>
#include <span>

namespace chunkstar {

/** @brief One rank, no peers: every collective is the identity or a copy, done at the call.
 *
 *  Exists so that code written against `Communicator` runs unchanged without MPI or threads, and
 *  so that "N ranks = 1 rank" has its 1-rank side. Async forms complete before they return. Host
 *  memory only (it uses `memcpy`).
 */
class single_process_communicator {
 public:
  /** @brief Always 0. */
  [[nodiscard]] int rank() const noexcept { return 0; }
  /** @brief Always 1. */
  [[nodiscard]] int size() const noexcept { return 1; }

  /** @brief The reduction of one rank is its input: nothing to do. */
  void allreduce(void* inout, std::size_t count, dtype t, reduce_op /*op*/) {
    detail::check_buffer(inout, count * dtype_size(t), "allreduce", "inout");
  }
  /** @brief As above, for doubles. */
  void allreduce(std::span<double> /*inout*/, reduce_op /*op*/) {}

  /** @brief Copies `bytes` from `send` to `recv` (in place when they are equal). */
  void allgather(const void* send, void* recv, std::size_t bytes) {
    detail::check_allgather(send, recv, bytes, 0, 1);
    copy(recv, send, bytes);
  }

  /** @brief Copies `count` elements: the only block is this rank's. */
  void reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op /*op*/) {
    detail::check_reduce_scatter(send, recv, count, t, 0, 1);
    copy(recv, send, count * dtype_size(t));
  }

  /** @brief Copies `count` elements to `recv` (nothing to do in place); checks `root` is 0. */
  void reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op /*op*/, int root) {
    detail::check_reduce(send, recv, count, t, root, 0, 1);
    copy(recv, send, count * dtype_size(t));
  }

  /** @brief Nothing to send; checks `root` is 0. */
  void broadcast(void* buf, std::size_t bytes, int root) {
    detail::check_buffer(buf, bytes, "broadcast", "buf");
    detail::check_root(root, 1, "broadcast");
  }

  /** @brief This rank is its own successor: copies `send` to `recv`. */
  void ring_shift(const void* send, void* recv, std::size_t bytes) {
    detail::check_ring_shift(send, recv, bytes);
    copy(recv, send, bytes);
  }

  /** @brief Nothing to wait for. */
  void barrier() noexcept {}
  /** @brief One rank moves nothing (collectives are still counted). */
  [[nodiscard]] comm_stats stats() const noexcept { return {}; }

  comm_handle allreduce_async(void* inout, std::size_t count, dtype t, reduce_op op) {
    allreduce(inout, count, t, op);
    return {};
  }
  comm_handle allreduce_async(std::span<double> inout, reduce_op op) {
    allreduce(inout, op);
    return {};
  }
  comm_handle allgather_async(const void* send, void* recv, std::size_t bytes) {
    allgather(send, recv, bytes);
    return {};
  }
  comm_handle reduce_scatter_async(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    reduce_scatter(send, recv, count, t, op);
    return {};
  }
  comm_handle reduce_async(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, int root) {
    reduce(send, recv, count, t, op, root);
    return {};
  }
  comm_handle broadcast_async(void* buf, std::size_t bytes, int root) {
    broadcast(buf, bytes, root);
    return {};
  }
  comm_handle ring_shift_async(const void* send, void* recv, std::size_t bytes) {
    ring_shift(send, recv, bytes);
    return {};
  }

 private:
  static void copy(void* dst, const void* src, std::size_t bytes) noexcept {
    if (bytes != 0 && dst != src)
      std::memmove(dst, src, bytes);  // arguments were checked; memmove keeps -Wrestrict quiet
  }
};

static_assert(Communicator<single_process_communicator>);

}  // namespace chunkstar
