// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `blocking_collectives`: the seven blocking collectives of `Communicator`, written once
 *         from a model's asynchronous ones, so a model writes only what is its own.
 *
 *  A model derives from `blocking_collectives<Model>` (CRTP) and writes `rank()`, `size()`,
 *  `barrier()` and the seven `*_async` forms; each blocking form is then `X_async(...).wait()`,
 *  with the same errors at the same points (argument errors from the call, transport errors from
 *  `wait()`). A model whose blocking forms differ — native blocking calls (MPI), plain copies
 *  (one process) — writes them itself and need not derive. A model that declares an overload of
 *  one of these names hides the base's: bring them back with `using`.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/dtype.hpp>

#include <cstddef>
#include <span>

namespace chunkstar {

template <class Model>
class blocking_collectives {
 public:
  void allreduce(void* inout, std::size_t count, dtype t, reduce_op op) {
    self().allreduce_async(inout, count, t, op).wait();
  }
  void allreduce(std::span<double> inout, reduce_op op) { self().allreduce_async(inout, op).wait(); }
  void allgather(const void* send, void* recv, std::size_t bytes) { self().allgather_async(send, recv, bytes).wait(); }
  void reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    self().reduce_scatter_async(send, recv, count, t, op).wait();
  }
  void reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op op, int root) {
    self().reduce_async(send, recv, count, t, op, root).wait();
  }
  void broadcast(void* buf, std::size_t bytes, int root) { self().broadcast_async(buf, bytes, root).wait(); }
  void ring_shift(const void* send, void* recv, std::size_t bytes) {
    self().ring_shift_async(send, recv, bytes).wait();
  }

 protected:
  blocking_collectives() = default;
  ~blocking_collectives() = default;

 private:
  Model& self() noexcept { return static_cast<Model&>(*this); }
};

}  // namespace chunkstar
