// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `detail::collective_call`: what one collective call asked for (kind, size, dtype, op,
 *         root), the unit of the collective-sequence checks of the in-process and MPI
 *         communicators: every rank's i-th call must describe the same.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

namespace chunkstar::detail {

enum class collective_kind : std::uint8_t {
  allreduce,
  allreduce_f64,
  allgather,
  reduce_scatter,
  reduce,  // rooted: the root is part of the call
  broadcast,
  ring_shift,
  barrier
};

/** @brief What one collective call asked for; every rank's k-th call must describe the same. */
struct collective_call {
  collective_kind kind = collective_kind::barrier;
  std::size_t count = 0;  // elements for reductions, bytes otherwise
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  int root = 0;

  friend bool operator==(const collective_call&, const collective_call&) = default;

  [[nodiscard]] std::string to_string() const {
    const std::string n = std::to_string(count);
    const std::string o(reduce_op_name(op));
    switch (kind) {
      case collective_kind::allreduce: return "allreduce(" + n + " x " + std::string(dtype_name(type)) + ", " + o + ")";
      case collective_kind::allreduce_f64: return "allreduce(" + n + " x f64, " + o + ")";
      case collective_kind::allgather: return "allgather(" + n + " bytes per rank)";
      case collective_kind::reduce_scatter:
        return "reduce_scatter(" + n + " x " + std::string(dtype_name(type)) + " per rank, " + o + ")";
      case collective_kind::reduce:
        return "reduce(" + n + " x " + std::string(dtype_name(type)) + ", " + o + ", to root " + std::to_string(root) +
               ")";
      case collective_kind::broadcast: return "broadcast(" + n + " bytes from root " + std::to_string(root) + ")";
      case collective_kind::ring_shift: return "ring_shift(" + n + " bytes)";
      case collective_kind::barrier: return "barrier()";
    }
    return "?";
  }
};

}  // namespace chunkstar::detail
